"""A Transformer's decoding state (``Transformer.start`` / ``step``): the key/value cache allocated once and written
in place, the source's cross-attention keys and values shared by a sentence's beams, and the projections a
step multiplies by (through oneDNN on a CPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


class Projection:
    """act(x Wᵀ + b) (+ a residual) for decoding steps, act relu, gelu or none.

    With ``onednn`` on a CPU it runs through oneDNN, W packed once for the whole decoding (the layout its kernels
    read) and the activation or the residual addition done by the same kernel: faster than PyTorch's MKL path
    on AMD processors, where MKL takes a generic code path and oneDNN picks its instruction set from the CPU's
    flags (docs/benchmarking.md#measurements-behind-the-code). Its sums run in another order, so results agree with
    ``F.linear`` to float rounding (the activation and the addition are exactly those done apart). Otherwise,
    and wherever oneDNN is not available, ``F.linear`` and separate operations."""

    ACTIVATIONS = {"none": lambda y: y, "relu": F.relu, "gelu": F.gelu}

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        onednn: bool = False,
        dtype: Optional[torch.dtype] = None,
        activation: str = "none",
    ):
        if dtype is not None:  # autocast's: cast once for the whole decoding, not at every step
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        self.weight, self.bias, self.activation, self.packed = weight, bias, activation, None
        if onednn and onednn_available(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """act(x Wᵀ + b), or with ``residual`` (and no activation) residual + x Wᵀ + b."""
        if self.packed is None:
            y = self.ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))
            return y if residual is None else residual + y
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.activation, [], "none")


def onednn_available(weight: torch.Tensor) -> bool:
    """Whether ``Projection`` can run ``weight`` through oneDNN: float32 on a CPU, not under autocast, with the
    oneDNN linear ops of this PyTorch build (the ones its compiler uses for CPU linear layers)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn._linear_pointwise, "binary")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@dataclass
class StepWeights:
    """A decoder layer's projections for decoding steps (``DecoderLayer.step_weights``)."""

    qkv: Projection  # self-attention's query, key and value projections as one: one matrix multiply per step
    self_out: Projection
    cross_q: Projection
    cross_out: Projection
    ff_in: Projection
    ff_out: Projection


class DecoderState:
    """What decoding keeps between steps, for ``beam`` consecutive rows per sentence:

    cache   (2 · layers, rows, kv_heads, capacity, d_head): each layer's self-attention keys (RoPE-rotated), then
            values, of the positions decoded so far, each step's written in place at ``position``;
    cross   (layers, 2, sentences, kv_heads, S, d_head): each layer's cross-attention keys, then values, of each
            sentence, computed once and read by all its beams. Keys and values each contiguous: a step that
            keeps the attention weights multiplies by them as one batch of (sentence, head) matrices, with no
            copy of the source's keys and values at every step.

    The cache is a view of ``storage``, allocated once for the rows and steps of the whole decoding. A reorder
    (``select``) gathers the rows into the ``spare`` storage and the two swap. With ``exact`` (beam search,
    which reorders after every step) it lays them out with room for one more position only, so that a step
    attends over whole, contiguous keys and values (on a CPU, SDPA reads those twice as fast as a window
    into a larger cache); otherwise the capacity stays that of the whole decoding.
    """

    def __init__(
        self,
        layers: int,
        rows: int,
        capacity: int,
        cross: torch.Tensor,
        key_mask: torch.Tensor,
        beam: int,
        weights: list,
        embedding: torch.Tensor,
        output: Projection,
        exact: bool = False,
        source: Optional[torch.Tensor] = None,
    ):
        self.cross, self.key_mask = cross, key_mask  # key_mask (sentences, 1, 1, S): True at real source tokens
        self.source = source  # (sentences, S) the source pieces, where the model copies them (model.copy_attention)
        self.layer_count, self.d_head = layers, cross.size(-1)
        self.beam = beam
        self.weights = weights  # per layer its projections (DecoderLayer.step_weights)
        self.embedding = embedding  # the target embedding table scaled by √d_model
        self.output = output  # the projection to the vocabulary
        self.position = torch.zeros(1, dtype=torch.long, device=cross.device)  # where the next step writes
        self.length = 0  # positions written (= position, on the host)
        self.exact = exact
        size = layers * 2 * rows * self.kv_heads * capacity * self.d_head
        self.storage, self.spare = cross.new_empty(size), cross.new_empty(size)
        self.rows, self.capacity = rows, 1 if exact else capacity
        self.lay_out()

    @property
    def kv_heads(self) -> int:
        return self.cross.size(3)

    def layout(self, storage: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
        """The first elements of ``storage`` as a contiguous (2 · layers, rows, kv_heads, capacity, d_head) cache."""
        shape = (2 * self.layer_count, rows, self.kv_heads, capacity, self.d_head)
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        return storage.as_strided(shape, strides)

    def lay_out(self, cache: Optional[torch.Tensor] = None) -> None:
        """The cache over the storage (``cache``: that view, made already), and its per-layer (keys, values)."""
        self.cache = self.layout(self.storage, self.rows, self.capacity) if cache is None else cache
        views = self.cache.unbind(0)
        self.layers = list(zip(views[::2], views[1::2]))

    def cross_views(self) -> None:
        self.cross_layers = [(layer[0], layer[1]) for layer in self.cross.unbind(0)]

    @property
    def self_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the cached (keys, values), (rows, kv_heads, length, d_head) each."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self.layers]

    @property
    def cross_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the source's (keys, values), (sentences, kv_heads, S, d_head) each."""
        return self.cross_layers

    def select(self, index: torch.Tensor) -> DecoderState:
        """Rows ``index`` of the batch, in place: beam search's surviving beams, and, with fewer rows than now,
        the sentences still decoding (``index`` then holds ``beam`` rows of each kept sentence, in order;
        what they hold is the same for all beams of a sentence)."""
        rows, written = index.size(0), self.length
        compacted = rows != self.rows
        capacity = written + 1 if self.exact else self.capacity
        size = self.layer_count * 2 * rows * self.kv_heads * capacity * self.d_head
        if self.spare.numel() < size:  # exact, past the steps said: beam search reorders after its last step too
            self.spare = self.spare.new_empty(size)
        # the positions not written yet hold nothing to keep: gather the written ones only
        gathered = self.layout(self.spare, rows, capacity)
        cache = self.cache if written == self.capacity else self.cache[..., :written, :]
        torch.index_select(cache, 1, index, out=gathered[..., :written, :])
        self.rows, self.capacity = rows, capacity
        self.storage, self.spare = self.spare, self.storage
        self.lay_out(gathered)
        if compacted:
            sentences = index[:: self.beam] // self.beam
            self.cross, self.key_mask = self.cross.index_select(2, sentences), self.key_mask.index_select(0, sentences)
            if self.source is not None:
                self.source = self.source.index_select(0, sentences)
            self.cross_views()
        return self

    def make_room(self) -> None:
        """Room for one more position: a step with no reorder before it (exact layout), or past the steps said
        (``Transformer.start`` without ``steps``): twice the capacity."""
        capacity = self.capacity + 1 if self.exact else 2 * self.capacity
        size = self.layer_count * 2 * self.rows * self.kv_heads * capacity * self.d_head
        storage = self.spare if self.spare.numel() >= size else self.spare.new_empty(size)
        self.layout(storage, self.rows, capacity)[..., : self.length, :] = self.cache[..., : self.length, :]
        self.spare = self.storage if self.storage.numel() >= size else storage.new_empty(size)
        self.storage, self.capacity = storage, capacity
        self.lay_out()

    def cache_bytes(self) -> int:
        """Bytes of the key/value cache: the storage of every row's keys and values, and the source's (the
        reorder's twin storage not counted). Tensor metadata: no device sync."""
        return self.storage.nbytes + self.cross.nbytes


def grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, heads, T, d) -> (B, kv_heads, group · T, d): the query heads that share a key/value head (h = kv
    head · group + g) become more queries of it, so that no key or value is repeated."""
    return q if q.size(1) == kv_heads else q.reshape(q.size(0), kv_heads, -1, q.size(-1))


def beam_queries(q: torch.Tensor, beam: int, kv_heads: int, d_head: int) -> torch.Tensor:
    """Queries (sentences · beam, heads · d) -> (sentences, kv_heads, beam · group, d): the beams (and grouped
    heads) of a sentence are queries of its one copy of the source's keys and values."""
    rows, width = q.shape
    group = width // kv_heads // d_head
    if group == 1 or kv_heads == 1:  # a strided view of the projection: beam b, head h at b · width + h · d
        query_stride = width if group == 1 else d_head
        return q.as_strided((rows // beam, kv_heads, beam * group, d_head), (beam * width, d_head, query_stride, 1))
    q = q.view(-1, beam, kv_heads, group * d_head).transpose(1, 2)  # (n, kv_heads, beam, group · d)
    return q.reshape(q.size(0), kv_heads, -1, d_head)


def beam_rows(x: torch.Tensor, beam: int, kv_heads: int) -> torch.Tensor:
    """``beam_queries``' inverse: (sentences, kv_heads, beam · group, e) -> (sentences · beam, heads · e)."""
    n, _, queries, e = x.shape
    if queries == beam and x.stride() == (beam * kv_heads * e, e, kv_heads * e, 1):
        # laid out (sentences, beam, heads, e) already, as the CPU's attention kernels write their output
        return x.as_strided((n * beam, kv_heads * e), (kv_heads * e, 1))
    if queries != beam:  # grouped heads
        x = x.reshape(n, kv_heads, beam, queries // beam * e)
    return x.transpose(1, 2).reshape(n * beam, -1)  # (n, beam, kv_heads, group · e) -> rows
