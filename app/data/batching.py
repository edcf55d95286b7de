"""Length-bucketed batches under a token budget, and padding into tensors.

A batch's cost is what the GPU computes: padded source plus padded target tokens. Sorting by length
before cutting batches keeps padding low; the batch order is shuffled per epoch from (seed, epoch)
alone, so an epoch's batches can be rebuilt exactly on resume.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from app.data.tokenizer import BOS, EOS, PAD


@dataclass
class Batch:
    src: torch.Tensor  # (batch, src_len) token ids, PAD-padded, ending in EOS
    index: torch.Tensor  # (batch,) positions of these sentences in the dataset
    tgt_in: Optional[torch.Tensor] = None  # (batch, tgt_len) BOS y_1 .. y_n
    tgt_out: Optional[torch.Tensor] = None  # (batch, tgt_len) y_1 .. y_n EOS

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.src), self.index, move(self.tgt_in), move(self.tgt_out))


def make_batches(
    src_lens: Sequence[int],
    tgt_lens: Optional[Sequence[int]],
    batch_tokens: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
) -> list[list[int]]:
    """Group sentence indices so that padded (src + tgt) tokens per batch stay within ``batch_tokens``.

    A sentence pair longer than the budget on its own still gets a batch of one.
    """
    has_tgt = tgt_lens is not None
    order = list(range(len(src_lens)))
    rng = random.Random(seed * 100_003 + epoch)
    if shuffle:
        rng.shuffle(order)  # random tie-breaking among equal lengths
    order.sort(key=lambda i: (tgt_lens[i] if has_tgt else 0, src_lens[i]))

    batches, current, max_src, max_tgt = [], [], 0, 0
    for i in order:
        # +1: EOS on the source; BOS/EOS on the target
        src_len, tgt_len = src_lens[i] + 1, (tgt_lens[i] + 1 if has_tgt else 0)
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
    """Per-sentence id tensors built once (EOS / BOS added); a batch is a padded stack of them."""

    def __init__(self, src: Sequence[list[int]], tgt: Optional[Sequence[list[int]]] = None):
        self.src = [torch.tensor([*s, EOS], dtype=torch.long) for s in src]
        self.tgt_in = None if tgt is None else [torch.tensor([BOS, *t], dtype=torch.long) for t in tgt]
        self.tgt_out = None if tgt is None else [torch.tensor([*t, EOS], dtype=torch.long) for t in tgt]

    def __call__(self, indices: list[int]) -> Batch:
        stack = lambda seqs: pad_sequence([seqs[i] for i in indices], batch_first=True, padding_value=PAD)  # noqa: E731
        batch = Batch(stack(self.src), torch.tensor(indices, dtype=torch.long))
        if self.tgt_in is not None:
            batch.tgt_in, batch.tgt_out = stack(self.tgt_in), stack(self.tgt_out)
        return batch


def sorted_batches(src: Sequence[list[int]], tgt: Sequence[list[int]], batch_tokens: int) -> Iterator[Batch]:
    """Every pair once, in length-sorted batches (no shuffling): for teacher-forced passes over a split."""
    batcher = Batcher(src, tgt)
    for indices in make_batches([len(s) for s in src], [len(t) for t in tgt], batch_tokens):
        yield batcher(indices)
