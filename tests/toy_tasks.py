"""A toy translation task for tests: reverse a sequence of symbols.

Its true alignment is the anti-diagonal, so it checks that attention learns where to look."""

from __future__ import annotations

import random

import torch

from app.data.batching import Batcher
from app.data.tokenizer import PAD
from app.decode.passes import greedy_decode
from app.models import sequence_loss
from app.train.guided_alignment import guided_alignment_loss

FIRST_SYMBOL, SYMBOLS = 4, 12


def reversal_data(n: int, seed: int, min_len: int = 3, max_len: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    src = [
        [rng.randrange(FIRST_SYMBOL, FIRST_SYMBOL + SYMBOLS) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(n)
    ]
    return src, [list(reversed(s)) for s in src]


def train_on_reversal(
    model: torch.nn.Module, steps: int, batch_size: int = 64, lr: float = 3e-3, seed: int = 0, align=None
) -> None:
    """``align``: (AlignmentTargets over this data, weight) to add guided alignment's loss."""
    torch.manual_seed(seed)
    src, tgt = reversal_data(steps * batch_size, seed)
    batcher = Batcher(src, tgt)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # linear decay to zero: the last updates are small, so the final model does not depend on luck
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    for step in range(steps):
        indices = list(range(step * batch_size, (step + 1) * batch_size))
        batch = batcher(indices)
        if align is None:
            logits = model(batch.src, batch.tgt_in)
        else:
            logits, attention = model(batch.src, batch.tgt_in, alignment=True)
        loss = sequence_loss(logits, batch.tgt_out) / (batch.tgt_out != PAD).sum()
        if align is not None:
            targets, weight = align
            loss = loss + weight * guided_alignment_loss(attention, targets(indices, batch.src, batch.tgt_out))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()


def evaluate_reversal(model: torch.nn.Module, n: int = 200, seed: int = 12345) -> tuple[float, float]:
    """Exact-match rate, and the share of target tokens whose attention argmax is the mirrored source position."""
    src, tgt = reversal_data(n, seed)
    batch = Batcher(src, tgt)(list(range(n)))
    hyps = greedy_decode(model, batch.src, max_len_ratio=1.0, max_len_extra=2, need_attention=True)
    exact = sum(h == t for h, t in zip(hyps.tokens, tgt)) / n
    on_diagonal = total = 0
    for i, s in enumerate(src):
        weights = hyps.attention[i] if hyps.attention is not None else None
        if weights is None:
            continue
        weights = weights.reshape(-1, *weights.shape[-2:]).mean(0)  # average any layer/head axes
        for t in range(min(len(hyps.tokens[i]), len(s))):
            on_diagonal += int(weights[t].argmax()) == len(s) - 1 - t
            total += 1
    return exact, (on_diagonal / total if total else 0.0)


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, n: int = 200, seed: int = 777) -> float:
    """Teacher-forced cross-entropy per target token on reversal pairs not trained on."""
    src, tgt = reversal_data(n, seed)
    batch = Batcher(src, tgt)(list(range(n)))
    model.eval()
    return float(sequence_loss(model(batch.src, batch.tgt_in), batch.tgt_out) / (batch.tgt_out != PAD).sum())
