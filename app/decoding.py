"""Decoding against the model API (encode / step). Greedy search; every model family uses this code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from app.data.tokenizer import BOS, EOS, PAD


@dataclass
class Hypotheses:
    tokens: list[list[int]]  # per sentence, without BOS/EOS
    attention: Optional[list[torch.Tensor]] = None  # per sentence: (..., len(tokens) + 1, src_len), EOS row included


def max_output_lengths(src_mask: torch.Tensor, ratio: float, extra: int) -> torch.Tensor:
    return (src_mask.sum(-1).float() * ratio).long() + extra


@torch.no_grad()
def greedy_decode(
    model,
    src: torch.Tensor,
    max_len_ratio: float = 1.5,
    max_len_extra: int = 10,
    need_attention: bool = False,
) -> Hypotheses:
    """Pick the most probable token at every step until EOS or the length limit, for a whole batch."""
    src_mask = src != PAD
    memory = model.encode(src, src_mask)
    limits = max_output_lengths(src_mask, max_len_ratio, max_len_extra)
    batch = src.size(0)
    prev = torch.full((batch,), BOS, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    state, steps, attention = None, [], []
    for t in range(int(limits.max()) + 1):
        logits, attn, state = model.step(memory, prev, state, need_attention=need_attention)
        token = logits.argmax(-1)
        token = torch.where(t >= limits, torch.full_like(token, EOS), token)  # force an end at the limit
        token = token.masked_fill(finished, PAD)
        steps.append(token)
        if need_attention:
            attention.append(attn)
        finished |= token == EOS
        if bool(finished.all()):
            break
        prev = token
    out = torch.stack(steps, dim=1).tolist()
    tokens = [[tok for tok in row if tok not in (PAD, EOS)] for row in out]
    if not need_attention or attention[0] is None:  # a model without attention has none to give
        return Hypotheses(tokens)
    # (B, ..., T, S): every step's attention stacked on the target axis, trimmed per sentence
    stacked = torch.cat(attention, dim=-2).float().cpu()
    src_lens = src_mask.sum(-1).tolist()
    return Hypotheses(tokens, [stacked[i, ..., : len(tokens[i]) + 1, : src_lens[i]] for i in range(batch)])


@torch.no_grad()
def decode_corpus(
    model,
    src: list[list[int]],
    device: torch.device,
    batch_tokens: int = 16000,
    max_len_ratio: float = 1.5,
    max_len_extra: int = 10,
    need_attention: bool = False,
    amp_dtype: Optional[torch.dtype] = None,
    progress: bool = False,
) -> Hypotheses:
    """Decode many sentences in length-sorted batches; results come back in input order."""
    from tqdm import tqdm

    from app.data.batching import Batcher, make_batches

    was_training = model.training
    model.eval()
    tokens: list = [None] * len(src)
    attention: list = [None] * len(src)
    batches = make_batches([len(s) for s in src], None, batch_tokens)
    batcher = Batcher(src)
    for indices in tqdm(batches, desc="decoding", unit="batch", disable=not progress, leave=False):
        batch = batcher(indices).to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            hyps = greedy_decode(model, batch.src, max_len_ratio, max_len_extra, need_attention)
        for j, i in enumerate(indices):
            tokens[i] = hyps.tokens[j]
            if hyps.attention is not None:
                attention[i] = hyps.attention[j]
    model.train(was_training)
    return Hypotheses(tokens, attention if need_attention and attention[0] is not None else None)
