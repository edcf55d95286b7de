"""The training update recorded once per batch shape as a CUDA graph and replayed (``train.capture``, on CUDA).

An eager update of the default Transformer issues about a thousand operators; on an H100 the host needs 35 ms to
launch them and the GPU 10 to run them (docs/gpu/). A CUDA graph records the kernels of one update, forward,
backward, clipping, the fused AdamW step and the refresh of the bf16 weights from their fp32 masters, and a replay
launches all of them in one call (PyTorch's "whole-network capture", torch.cuda.CUDAGraph). With ``train.compile=true``
(a mode without CUDA graphs of its own) the graph records the compiled layers' fused kernels instead of the eager
ones: the compiler's fusion and the replay's single launch together.

A graph replays exactly what it recorded: the same kernels on the same memory. So

- every batch is padded to one of a few fixed shapes (``train.batch_shapes``; under capture by default the fewest
  of at most 32 whose pairs pad at most 8 % of their tokens: app/data/shapes.py),
  and each shape gets its graph, with static input tensors an update's batches are copied into;
- what changes between updates lives on the device: the token count the loss is divided by (a device scalar
  filled before each replay), the learning rate (a device tensor the scheduler fills in place), Adam's step count
  (capturable state), the dropout RNG (PyTorch's graph-safe Philox offsets: a replay draws what the eager update
  would have drawn); nothing in the update waits for the host, so nothing is baked in;
- the first update of each shape runs eagerly (on a side stream, as capture wants: it makes the optimizer's
  state, the gradients' buffers and the libraries' workspaces), the second is recorded and replayed;
- the graphs share one memory pool (they never run at once), so K graphs cost about one update's activations.

The learning-rate schedule and the moving average of the weights stay on the host's side of a replay (each one
launch). A batch of a shape beyond ``MAX_GRAPHS``, or one whose capture fails (an out-of-memory, an operation
that cannot be recorded), runs eagerly, with one log line per shape: never a wrong update.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from app.config.schema import CUDA_GRAPH_MODES, Config
from app.data.batching import Batch
from app.models.transformer import Transformer
from app.run import distributed
from app.train.master_weights import MasterWeights
from app.train.update import StepResult, device_update

log = logging.getLogger(__name__)

MAX_GRAPHS = 64  # graphs kept at most (an out-of-memory halving makes new shapes); later shapes run eagerly
EAGER_FIRST = 1  # eager updates of a shape before it is recorded

ShapeKey = tuple  # per micro-batch: the shapes of its device tensors (source, targets, guided alignment targets)


def capture_refusal(cfg: Config, device: torch.device, launched: bool, model: torch.nn.Module) -> Optional[str]:
    """Why this run's update cannot be captured (None: it is); ``launched``: under torchrun (DDP, one rank too).
    Capture is a CUDA feature: a CPU run is unchanged."""
    t = cfg.train
    if not t.capture or device.type != "cuda":
        return "train.capture=false" if not t.capture else "not on CUDA"
    if launched:
        return "under torchrun the update is not captured (DDP's all-reduce runs eagerly)"
    if t.compile and t.compile_mode in CUDA_GRAPH_MODES:
        return f"train.compile_mode={t.compile_mode} replays torch.compile's own CUDA graphs"
    if not t.fused_optimizer:
        return "train.fused_optimizer=false skips a non-finite update by asking the host"
    if t.subword_alpha > 0:
        return "train.subword_alpha samples new lengths each epoch: no fixed batch shapes"
    if not isinstance(model, Transformer):
        return "the RNN families' update is not captured (their decoders loop in Python over cuDNN calls)"
    return None


def capture_in_force(cfg: Config, device: torch.device, model: torch.nn.Module) -> bool:
    """Whether this run's update is captured (where it was asked for on CUDA but cannot be, the log says why): the
    one decision that the batch shapes and the Trainer's update follow."""
    refusal = capture_refusal(cfg, device, distributed.launched(), model)
    if refusal is not None and device.type == "cuda" and cfg.train.capture:
        log.info("train.capture: the update runs eagerly: %s", refusal)
    return refusal is None


def shape_key(batches: list[Batch]) -> ShapeKey:
    return tuple(tuple(tuple(t.shape) for t in device_tensors(b)) for b in batches)


def learning_rate_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Each parameter group's learning rate as a device scalar, which the scheduler fills in place and a replayed
    fused AdamW reads, and its state capturable (Adam's step count on the device)."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        group["capturable"] = True


def learning_rate_on_host(optimizer: torch.optim.Optimizer) -> None:
    """The reverse of ``learning_rate_on_device``, for a state restored from a captured run's checkpoint (a
    captured run turns it back on device)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])
            group["capturable"] = False


@dataclass
class Recorded:
    """One shape's graph, the static inputs it reads and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    batches: list[Batch]
    n_tokens: torch.Tensor
    result: StepResult

    def load(self, batches: list[Batch], n_tokens: int) -> None:
        for static, batch in zip(self.batches, batches):
            for into, values in zip(device_tensors(static), device_tensors(batch)):
                into.copy_(values)
        self.n_tokens.fill_(float(n_tokens))


def device_tensors(batch: Batch) -> list[torch.Tensor]:
    """What the update reads of a batch on the device (the host's source lengths, which the Transformer ignores,
    stay out)."""
    return [t for t in (batch.src, batch.tgt_in, batch.tgt_out, batch.align) if t is not None]


def static_copy(batch: Batch) -> Batch:
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return Batch(
        batch.src.clone(), batch.index, clone(batch.tgt_in), clone(batch.tgt_out), batch.src_lengths, clone(batch.align)
    )


class CapturedUpdates:
    """``train_step`` (app/train/update.py), with the same arguments, replayed from a graph per batch shape."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
        self.graphs: dict[ShapeKey, Recorded] = {}
        self.seen: Counter[ShapeKey] = Counter()  # eager updates per shape not recorded yet
        self.eager_only: set[ShapeKey] = set()  # shapes whose capture failed, or beyond MAX_GRAPHS
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)
        self.capture_seconds, self.replays, self.eager_updates = 0.0, 0, 0
        learning_rate_on_device(optimizer, device)
        # a capturable optimizer warns when it steps uncaptured: here the first update of each shape does
        warnings.filterwarnings("ignore", message=".*capturable=True.*", category=UserWarning)

    def __call__(self, model, batches, n_tokens, optimizer, scheduler, cfg, dtype, ranks=1, master=None) -> StepResult:
        key = shape_key(batches)
        recorded = self.graphs.get(key)
        if recorded is None and self.seen[key] >= EAGER_FIRST and key not in self.eager_only:
            recorded = self.record(key, model, batches, n_tokens, optimizer, cfg, dtype, ranks, master)
        if recorded is None:
            try:
                result = self.eager(model, batches, n_tokens, optimizer, cfg, dtype, ranks, master, key)
            except torch.OutOfMemoryError:  # the Trainer halves the budget (train.oom_retry): new shapes come
                self.reset()
                raise
        else:
            recorded.load(batches, n_tokens)
            recorded.graph.replay()
            self.replays += 1
            result = recorded.result
        scheduler.step()
        return result

    def eager(self, model, batches, n_tokens, optimizer, cfg, dtype, ranks, master, key: ShapeKey) -> StepResult:
        """The update run eagerly on the side stream (capture's warm-up: its allocations stay off the default
        stream's), which the default stream then waits for."""
        self.seen[key] += 1
        self.eager_updates += 1
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            result = device_update(model, batches, n_tokens, optimizer, cfg, dtype, ranks, master)
        current.wait_stream(self.side)
        for tensor in (t for t in result if t is not None):  # made on the side stream, read on the default one
            tensor.record_stream(current)
        return result

    def record(
        self, key: ShapeKey, model, batches, n_tokens, optimizer, cfg, dtype, ranks, master: Optional[MasterWeights]
    ) -> Optional[Recorded]:
        """The graph of ``key``'s update, recorded on ``batches``' static copies (not run: the caller replays it);
        None when it cannot be, said once, and the shape runs eagerly from then on."""
        if len(self.graphs) >= MAX_GRAPHS:
            self.eager_only.add(key)
            log.warning("train.capture: %d graphs recorded already; batches of %s run eagerly", MAX_GRAPHS, key)
            return None
        start = time.perf_counter()
        static = [static_copy(batch) for batch in batches]
        count = torch.full((), float(n_tokens), dtype=torch.float32, device=self.device)
        graph = torch.cuda.CUDAGraph()
        generator = torch.cuda.default_generators[self.device.index or torch.cuda.current_device()]
        rng = generator.clone_state()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                result = device_update(model, static, count, optimizer, cfg, dtype, ranks, master)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            # A failed capture ends before PyTorch takes the dropout RNG out of capture mode (seen on an H100 with
            # PyTorch 2.11: the next eager dropout raised "Offset increment outside graph capture"): its state
            # from before the capture goes back. Nothing recorded ran: the weights, the optimizer's state and the
            # masters' gradients are as they were.
            generator.graphsafe_set_state(rng)
            model.zero_grad(set_to_none=True)
            self.eager_only.add(key)
            del graph, static
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            first = err.__context__ or err  # the capture's own error, before the one ending the capture says
            log.warning(
                "train.capture: the update of a batch of %s could not be recorded (%s); it runs eagerly",
                key,
                (str(first).splitlines() or [type(first).__name__])[0][:200],
            )
            return None
        self.graphs[key] = recorded = Recorded(graph, static, count, result)
        self.capture_seconds += time.perf_counter() - start
        log.debug("train.capture: graph %d for %s in %.2f s", len(self.graphs), key, time.perf_counter() - start)
        return recorded

    def reset(self) -> None:
        """Drops every graph and its memory (after an out-of-memory, the budget halved: new shapes come)."""
        self.graphs.clear()
        self.seen.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def log_summary(self) -> None:
        c = self.describe()
        log.info(
            "train.capture: %d graph(s) recorded in %.1f s, %d updates replayed, %d eager (each shape's first%s)",
            c["graphs"],
            c["capture_seconds"],
            c["replays"],
            c["eager_updates"],
            f"; {c['eager_shapes']} shape(s) not recorded" if c["eager_shapes"] else "",
        )

    def describe(self) -> dict:
        return {
            "graphs": len(self.graphs),
            "capture_seconds": round(self.capture_seconds, 2),
            "replays": self.replays,
            "eager_updates": self.eager_updates,
            "eager_shapes": len(self.eager_only),
        }
