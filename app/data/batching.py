"""Length-bucketed batches under a token budget, and padding into tensors.

A batch's cost is what the GPU computes: padded source plus padded target tokens. Sorting by length
before cutting batches keeps padding low; the batch order is shuffled per epoch from (seed, epoch)
alone, so an epoch's batches can be rebuilt exactly on resume.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import torch

from app.data.shapes import Lengths, ShapedBatch
from app.data.tokenizer import BOS, EOS, PAD


@dataclass
class Batch:
    src: torch.Tensor  # (batch, src_len) token ids, PAD-padded, ending in EOS
    index: torch.Tensor  # (batch,) positions of these sentences in the dataset
    tgt_in: Optional[torch.Tensor] = None  # (batch, tgt_len) BOS y_1 .. y_n
    tgt_out: Optional[torch.Tensor] = None  # (batch, tgt_len) y_1 .. y_n EOS
    # (batch,) source lengths with EOS, kept on the host: RNN encoders pack by them, and reading them
    # back from the device would make every training step wait for the GPU
    src_lengths: Optional[torch.Tensor] = None
    align: Optional[torch.Tensor] = None  # (batch, tgt_len, src_len) guided alignment targets, when trained on

    def to(self, device: torch.device, pin: bool = True) -> Batch:
        """Copies to ``device``. To a GPU they go through pinned host memory, so the copy is a DMA the
        host does not wait for: it queues behind the previous step's kernels while the host pads the
        next batch (``pin=False``: plain pageable copies, for comparison)."""
        pin = pin and device.type == "cuda"
        move = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=True)  # noqa: E731
        maybe = lambda t: None if t is None else move(t)  # noqa: E731
        return Batch(
            move(self.src), self.index, maybe(self.tgt_in), maybe(self.tgt_out), self.src_lengths, maybe(self.align)
        )

    @property
    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tgt_in, tgt_out) of a batch of pairs (a batch of sources alone has none)."""
        if self.tgt_in is None or self.tgt_out is None:
            raise ValueError("a batch of sources alone has no target")
        return self.tgt_in, self.tgt_out


def make_batches(
    src_lens: Sequence[int],
    tgt_lens: Optional[Sequence[int]],
    batch_tokens: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    by_length: bool = True,
) -> list[list[int]]:
    """Group sentence indices so that padded (src + tgt) tokens per batch stay within ``batch_tokens``.

    A sentence pair longer than the budget on its own still gets a batch of one. ``by_length=False``
    cuts the (shuffled) order as it is: what batches cost without length bucketing (make bench).
    """
    order = list(range(len(src_lens)))
    rng = random.Random(seed * 100_003 + epoch)
    if shuffle:
        rng.shuffle(order)  # random tie-breaking among equal lengths
    # Sorting by the longer side first bounds both sides of a batch: sorted by target length alone, a large
    # batch spans every source length that goes with its targets (docs/benchmarking.md#measurements-behind-the-code).
    if by_length and tgt_lens is not None:
        order.sort(key=lambda i: (max(src_lens[i], tgt_lens[i]), src_lens[i] + tgt_lens[i]))
    elif by_length:
        order.sort(key=lambda i: src_lens[i])

    batches: list[list[int]] = []
    current: list[int] = []
    max_src, max_tgt = 0, 0
    for i in order:
        # +1: EOS on the source; BOS/EOS on the target
        src_len, tgt_len = src_lens[i] + 1, (tgt_lens[i] + 1 if tgt_lens is not None else 0)
        new_src, new_tgt = max(max_src, src_len), max(max_tgt, tgt_len)
        if current and (len(current) + 1) * (new_src + new_tgt) > batch_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], src_len, tgt_len
        current.append(i)
        max_src, max_tgt = new_src, new_tgt
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


class Batcher:
    """Padded id tensors of any subset of sentences, with EOS (and BOS on the decoder input) added.

    Sentences are held as Arrow list columns: a memory-mapped training split as it is, Python lists
    converted once (4 bytes a token instead of a Python int object each). Arrow arrays are made and read
    through their buffers: ``pa.array`` and ``Array.to_numpy`` import pandas (0.4-0.6 s on a CPU), which a
    translation or a server, reading no table, would pay at its first batch.
    """

    def __init__(self, src, tgt=None):
        self.src = _as_arrow(src)
        self.tgt = None if tgt is None else _as_arrow(tgt)

    def __call__(self, indices: list[int]) -> Batch:
        """The batch of ``indices``, padded to its longest sentence, or to the shape of a ``ShapedBatch``
        (app/data/shapes.py): its width, and its row count with empty sentences (EOS alone on the
        source; no target tokens, so the loss ignores them). ``index`` lists the real sentences only."""
        rows, src_len, tgt_len = indices.shape if isinstance(indices, ShapedBatch) else (None, None, None)
        take = _arrow(np.asarray(indices, dtype=np.int64))
        src = _pad(self.src.take(take), bos=False, width=src_len, rows=rows)
        batch = Batch(src, torch.tensor(indices, dtype=torch.long), src_lengths=(src != PAD).sum(-1))
        if self.tgt is not None:
            pairs = self.tgt.take(take)
            batch.tgt_in = _pad(pairs, bos=True, width=tgt_len, rows=rows)
            batch.tgt_out = _pad(pairs, bos=False, width=tgt_len, rows=rows, empty=PAD)
        return batch


def _as_arrow(seqs) -> pa.ChunkedArray:
    if isinstance(seqs, pa.ChunkedArray):
        return seqs
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, seqs), dtype=np.int32, count=len(seqs)), out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1]))
    return pa.chunked_array([pa.ListArray.from_arrays(_arrow(offsets), _arrow(values))])


def _arrow(values: np.ndarray) -> pa.Array:
    """A numpy integer vector as an Arrow array over the same memory."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _numpy(array: pa.Array) -> np.ndarray:
    """A null-free Arrow integer array as a read-only numpy vector over the same memory."""
    assert array.null_count == 0, "token ids are never null"
    dtype = np.dtype(array.type.to_pandas_dtype())  # a numpy type: pandas is not imported for it
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _pad(
    seqs: pa.ChunkedArray, bos: bool, width: Optional[int] = None, rows: Optional[int] = None, empty: int = EOS
) -> torch.Tensor:
    """(n, longest + 1) ids: BOS y_1 .. y_n (bos=True) or y_1 .. y_n EOS, PAD after; or (rows, width),
    the rows after the n sentences empty: BOS (bos=True) or ``empty``, PAD after."""
    seqs = seqs.combine_chunks()
    offsets = _numpy(seqs.offsets)
    values = _numpy(seqs.values)[offsets[0] : offsets[-1]]
    lengths = np.diff(offsets)
    n = len(lengths)
    out = np.full((rows or n, width or int(lengths.max(initial=0)) + 1), PAD, dtype=np.int64)
    start = 1 if bos else 0
    token_mask = np.arange(out.shape[1] - 1)[None, :] < lengths[:, None]
    out[:n, start : start + out.shape[1] - 1][token_mask] = values
    out[np.arange(n), 0 if bos else lengths] = BOS if bos else EOS
    out[n:, 0] = BOS if bos else empty
    return torch.from_numpy(out)


def padded_tokens(indices: Sequence[int] | np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray) -> int:
    """Source + target positions the batch's tensors hold (lengths with EOS / BOS): its rows times its longest
    pair, or the fixed shape of a ``ShapedBatch``."""
    if isinstance(indices, ShapedBatch):
        return indices.rows * (indices.src_len + indices.tgt_len)
    return len(indices) * int(src_len[indices].max() + tgt_len[indices].max())


def batch_shape(indices: list[int], src_len: np.ndarray, tgt_len: np.ndarray) -> tuple[int, int, int]:
    """(sentences, source length, target length) of the batch's tensors: what a CUDA graph is recorded for."""
    if isinstance(indices, ShapedBatch):
        return indices.shape
    return len(indices), int(src_len[indices].max()), int(tgt_len[indices].max())


def sorted_batches(src: Sequence[list[int]], tgt: Sequence[list[int]], batch_tokens: int) -> Iterator[Batch]:
    """Every pair once, in length-sorted batches (no shuffling): for teacher-forced passes over a split."""
    batcher = Batcher(src, tgt)
    for indices in make_batches([len(s) for s in src], [len(t) for t in tgt], batch_tokens):
        yield batcher(indices)


def split_batch(indices: list[int], src_lens: Lengths, tgt_lens: Lengths, budget: int) -> list[list[int]]:
    """Cut a batch into pieces within ``budget`` tokens; always at least two pieces when it has two
    sentences (a batch that ran out of memory must shrink). Deterministic, so resume replays it."""
    pieces = [
        [indices[i] for i in piece]
        for piece in make_batches([src_lens[i] for i in indices], [tgt_lens[i] for i in indices], budget)
    ]
    if len(pieces) == 1 and len(indices) > 1:
        half = len(indices) // 2
        pieces = [indices[:half], indices[half:]]
    return pieces
