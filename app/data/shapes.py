"""A fixed set of padded batch shapes for training, so that CUDA graphs can replay the step.

Length-bucketed batches (app/data/batching.py) are padded to their own longest sentence: few pad tokens,
but nearly every batch a new (sentences, source length, target length) shape, and a captured CUDA graph
(``train.compile_mode=reduce-overhead``) replays only for the shape it was recorded with. With
``train.batch_shapes=K`` every training batch takes one of K shapes instead:

1. K (source, target) lengths are chosen from the training split, greedily, each the one that saves the
   most pad tokens given those already chosen; the first is the longest pair's box, so every pair fits one.
   With ``train.shape_padding=p`` the choice stops at the first count whose pairs pad at most that share of
   their tokens: the fewest graphs for the padding a user accepts, K at most.
2. Each pair goes to the cheapest shape it fits (fewest source + target tokens per row).
3. A shape's pairs are cut into the fewest batches the token budget allows, all with the same number of
   rows; the last batch of a shape fills its missing rows (fewer than the shape's batches) with empty
   sentences, which the loss ignores.

Shapes chosen from the data pad less than lengths rounded up to multiples of 8 (docs/benchmarking.md).
Which shape a pair takes depends on the data alone, so an epoch's batches follow from (seed, epoch,
budget), as unshaped ones do, and resume replays them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Union

import numpy as np

Lengths = Union[Sequence[int], np.ndarray]  # a length per pair: a list, or an array of ints
SUGGESTED_SHAPES = 16  # what make bench suggests (docs/benchmarking.md)
# a captured update (train.capture, app/train/capture.py) without train.batch_shapes: the fewest of at most
# CAPTURE_SHAPES shapes whose pairs pad at most CAPTURE_PADDING of their tokens (the default corpus: 23 shapes)
CAPTURE_SHAPES = 32
CAPTURE_PADDING = 0.08
MAX_CANDIDATES = 2048  # shapes considered per greedy choice; more distinct length pairs are coarsened


class ShapedBatch(list):
    """A batch's sentence indices, and the shape its tensors are padded to: ``rows`` sentences (the last
    ``rows - len(self)`` of them empty) of ``src_len`` source and ``tgt_len`` target positions."""

    def __init__(self, indices: Sequence[int], rows: int, src_len: int, tgt_len: int):
        super().__init__(indices)
        self.rows, self.src_len, self.tgt_len = rows, src_len, tgt_len

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.rows, self.src_len, self.tgt_len


def choose_shapes(src_len: np.ndarray, tgt_len: np.ndarray, k: int, max_padding: float = 0.0) -> list[tuple[int, int]]:
    """Up to ``k`` (source, target) padded lengths that every pair fits, chosen greedily to pad the fewest
    tokens; with ``max_padding`` the fewest of them whose pairs pad at most that share of their tokens.
    Lengths are as the tensors hold them (source with EOS, target with BOS or EOS)."""
    pairs, counts = np.unique(np.stack([src_len, tgt_len], 1), axis=0, return_counts=True)
    real = int((pairs.sum(1) * counts).sum())
    candidates, step = pairs, 1
    while len(candidates) > MAX_CANDIDATES:  # a very long-tailed corpus: consider coarser lengths
        step *= 2
        candidates = np.unique(-(-pairs // step) * step, axis=0)
    shapes = [(int(src_len.max()), int(tgt_len.max()))]
    cost = np.full(len(pairs), sum(shapes[0]))  # tokens per row of each pair's cheapest shape so far
    for _ in range(k - 1):
        if max_padding > 0 and 1 - real / int((cost * counts).sum()) <= max_padding:
            break
        chunks = np.array_split(candidates, max(1, len(candidates) * len(pairs) // 2**22))  # ~4 M cells each
        gains = np.concatenate([_gains(chunk, pairs, counts, cost) for chunk in chunks])
        best = int(gains.argmax())
        if gains[best] <= 0:
            break
        shape = candidates[best]
        shapes.append((int(shape[0]), int(shape[1])))
        fits = (pairs[:, 0] <= shape[0]) & (pairs[:, 1] <= shape[1])
        cost = np.where(fits, np.minimum(cost, shape.sum()), cost)
    return sorted(shapes, key=lambda s: (sum(s), s))


def _gains(candidates: np.ndarray, pairs: np.ndarray, counts: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Pad tokens each candidate shape would save: over the pairs it fits, what it costs less than now."""
    fits = (candidates[:, None, 0] >= pairs[None, :, 0]) & (candidates[:, None, 1] >= pairs[None, :, 1])
    saved = np.maximum(cost[None, :] - candidates.sum(1)[:, None], 0)
    return (saved * fits * counts[None, :]).sum(1)


class BatchShapes:
    """The training split's pairs, each assigned to one of a fixed set of padded shapes."""

    def __init__(self, src_lens: Lengths, tgt_lens: Lengths, k: int, max_padding: float = 0.0):
        src_len = np.asarray(src_lens, dtype=np.int64) + 1  # + EOS
        tgt_len = np.asarray(tgt_lens, dtype=np.int64) + 1  # + BOS / EOS
        self.shapes = choose_shapes(src_len, tgt_len, k, max_padding)
        lengths = np.asarray(self.shapes)
        fits = (lengths[:, None, 0] >= src_len[None, :]) & (lengths[:, None, 1] >= tgt_len[None, :])
        # shapes are sorted by tokens per row: the first that fits is the cheapest
        self.shape_of = fits.argmax(0)
        # the share of the padded tokens that is padding, before the empty rows of a shape's last batch
        self.pair_padding = 1 - float(src_len.sum() + tgt_len.sum()) / float(lengths.sum(1)[self.shape_of].sum())
        self.members = [np.flatnonzero(self.shape_of == j).tolist() for j in range(len(self.shapes))]

    def rows(self, budget: int) -> list[int]:
        """Sentences per batch of each shape under ``budget`` tokens: the fewest batches that hold its pairs,
        evenly filled (so a shape's last batch lacks fewer rows than it has batches)."""
        out = []
        for (src_len, tgt_len), members in zip(self.shapes, self.members):
            fit = max(budget // (src_len + tgt_len), 1)
            out.append(math.ceil(len(members) / math.ceil(len(members) / fit)) if members else fit)
        return out

    def batches(self, budget: int, shuffle: bool = False, seed: int = 0, epoch: int = 0) -> list[ShapedBatch]:
        """An epoch's batches: each shape's pairs (shuffled by seed and epoch) cut into batches of its row
        count, the batch order shuffled too."""
        rng = random.Random(seed * 100_003 + epoch)
        out = []
        for (src_len, tgt_len), members, rows in zip(self.shapes, self.members, self.rows(budget)):
            members = list(members)
            if shuffle:
                rng.shuffle(members)
            out += [ShapedBatch(members[i : i + rows], rows, src_len, tgt_len) for i in range(0, len(members), rows)]
        if shuffle:
            rng.shuffle(out)
        return out
