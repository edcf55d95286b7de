"""Decoding steps of fixed shapes captured in CUDA graphs (``decode.cuda_graphs``): a step replays one graph
instead of launching a few hundred kernels."""

from __future__ import annotations

import torch

SPAN_MIN = 16  # captured steps attend over 16, 32, 64, ... positions: one graph per span and batch shape


class StaticSteps:
    """Decoding steps of fixed shapes (``DecoderState.make_static``), each captured once in a CUDA graph per
    (rows, span) and replayed: a step then launches one graph instead of a few hundred kernels. A span is the
    power of two, at least SPAN_MIN, that holds the positions written so far and the next; the keys past the
    next position are masked. ``capture=False`` runs the same fixed-shape steps eagerly (what a CPU can test).

    A graph replays the kernels it recorded on the tensors it recorded: the step's input is copied into the
    graph's own, its logits are read before the next replay, and a reorder copies the cache back into its
    storage. Graphs of a larger batch are dropped once the batch shrinks (compaction)."""

    def __init__(self, model, memory, state, capture: bool):
        self.model, self.memory, self.state, self.capture = model, memory, state, capture
        state.make_static()
        self.graphs: dict = {}  # (rows, span) -> (graph, its input tokens, its logits)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured = 0

    def span(self) -> int:
        span = SPAN_MIN
        while span < self.state.length + 1:
            span *= 2
        return min(span, self.state.capacity)

    def __call__(self, prev: torch.Tensor) -> torch.Tensor:
        state, key = self.state, (prev.size(0), self.span())
        state.static = key[1]
        if not self.capture:
            return self.model.step(self.memory, prev, state)[0]
        if key not in self.graphs:
            self.graphs = {k: g for k, g in self.graphs.items() if k[0] == key[0]}
            self.graphs[key] = self.record(prev)
        graph, tokens, logits = self.graphs[key]
        tokens.copy_(prev)
        graph.replay()
        state.length += 1  # the host's part of the step (the device's position moved in the graph)
        return logits

    def record(self, prev: torch.Tensor) -> tuple:
        state, tokens = self.state, prev.clone()
        length, position = state.length, state.position.clone()
        # warm up on a side stream (lazy initializations must not happen while capturing); the step it takes
        # writes what the replay will write again, and its moves of the position are taken back
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model.step(self.memory, tokens, state)
        torch.cuda.current_stream().wait_stream(stream)
        state.position.copy_(position)
        state.length = length
        graph = torch.cuda.CUDAGraph()
        # autocast's cache of cast weights would be freed after the capture, under the graph's feet
        amp = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if amp else None
        with torch.autocast("cuda", dtype=dtype, enabled=amp, cache_enabled=False):
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.step(self.memory, tokens, state)[0]
        state.length = length  # capturing ran no kernel: the replay takes the step
        self.captured += 1
        return graph, tokens, logits
