"""Decoding against the model API (encode / step / state.select): greedy and beam search, written
once for every model family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from app.data.tokenizer import BOS, EOS, PAD
from app.errors import UserError


@dataclass
class Hypotheses:
    tokens: list[list[int]]  # per sentence, the best hypothesis, without BOS/EOS
    attention: Optional[list[torch.Tensor]] = None  # per sentence: (..., len(tokens) + 1, src_len), EOS row included
    nbest: Optional[list[list[tuple[list[int], float]]]] = None  # beam search: per sentence, (tokens, score) best first
    kv_cache_bytes: Optional[int] = None  # largest key/value cache of a decoding batch; None: the model has none


def cache_bytes(state) -> Optional[int]:
    """Size of a decoder state's key/value cache (Transformers), None for states without one (RNNs).
    The cache only grows during a decoding (beam search reorders it, same size), so its size at the
    last step is its peak."""
    measure = getattr(state, "cache_bytes", None)
    return measure() if measure is not None else None


def next_token_scores(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the next token; padding and BOS are never outputs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    logp[:, PAD] = float("-inf")
    logp[:, BOS] = float("-inf")
    return logp


def max_output_lengths(model, src_mask: torch.Tensor, ratio: float, extra: int) -> torch.Tensor:
    """ratio × source length + extra, within the positions the model has (``max_positions``, if any)."""
    limits = (src_mask.sum(-1).float() * ratio).long() + extra
    max_positions = getattr(model, "max_positions", None)
    return limits if max_positions is None else limits.clamp(max=max_positions - 1)


def check_source_lengths(model, src: list[list[int]]) -> None:
    max_positions = getattr(model, "max_positions", None)
    if max_positions is None:
        return
    for i, sentence in enumerate(src):
        if len(sentence) + 1 > max_positions:  # + EOS
            raise UserError(f"input sentence {i + 1} has {len(sentence)} subword tokens; this model takes at most "
                            f"{max_positions - 1} (model.max_len={max_positions}): split it")


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
    limits = max_output_lengths(model, src_mask, max_len_ratio, max_len_extra)
    batch = src.size(0)
    prev = torch.full((batch,), BOS, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    state, steps, attention = None, [], []
    for t in range(int(limits.max()) + 1):
        logits, attn, state = model.step(memory, prev, state, need_attention=need_attention)
        token = next_token_scores(logits).argmax(-1)
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
    tokens = [row[: row.index(EOS)] if EOS in row else row for row in out]
    if not need_attention or attention[0] is None:  # a model without attention has none to give
        return Hypotheses(tokens, kv_cache_bytes=cache_bytes(state))
    # (B, ..., T, S): every step's attention stacked on the target axis, trimmed per sentence
    stacked = torch.cat(attention, dim=-2).float().cpu()
    src_lens = src_mask.sum(-1).tolist()
    return Hypotheses(tokens, [stacked[i, ..., : len(tokens[i]) + 1, : src_lens[i]] for i in range(batch)],
                      kv_cache_bytes=cache_bytes(state))


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty (Wu et al. 2016, eq. 14): lp(Y) = ((5 + |Y|) / 6)^α."""
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def beam_search(
    model,
    src: torch.Tensor,
    beam_size: int = 5,
    alpha: float = 1.0,
    max_len_ratio: float = 1.5,
    max_len_extra: int = 10,
    n_best: int = 1,
    need_attention: bool = False,
) -> Hypotheses:
    """Batched beam search: all sentences and beams of the batch advance together.

    Every step extends the live beams by every token, keeps the 2k best candidates per sentence, sets
    aside those ending in EOS among the first k (scored log p(Y|X) / lp(Y)), and continues with the k
    best others. A sentence is done when k hypotheses have ended and its best live beam, ended at the
    next step, would not rank among them; each beam ends at its length limit. With k = 1 this is
    greedy search.
    """
    device, batch, k = src.device, src.size(0), beam_size
    src_mask = src != PAD
    memory = model.encode(src, src_mask)
    per_beam = torch.arange(batch, device=device).repeat_interleave(k)
    memory = memory.select(per_beam)
    limits = max_output_lengths(model, src_mask, max_len_ratio, max_len_extra).repeat_interleave(k)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    scores = scores.view(-1)
    history = torch.empty(batch * k, 0, dtype=torch.long, device=device)
    attn_history = None
    prev = torch.full((batch * k,), BOS, dtype=torch.long, device=device)
    finished: list[list[tuple[float, float, list[int], Optional[torch.Tensor]]]] = [[] for _ in range(batch)]
    done = [False] * batch
    offsets = (torch.arange(batch, device=device) * k)[:, None]
    state = None
    for t in range(int(limits.max()) + 1):
        logits, attn, state = model.step(memory, prev, state, need_attention=need_attention)
        logp = next_token_scores(logits)
        at_limit = t >= limits
        if bool(at_limit.any()):  # only EOS may follow a beam at its length limit
            forced = torch.full_like(logp, float("-inf"))
            forced[:, EOS] = 0.0
            logp = torch.where(at_limit[:, None], forced, logp)
        vocab = logp.size(-1)
        top_scores, top_index = (scores[:, None] + logp).view(batch, k * vocab).topk(2 * k, dim=1)
        origin = top_index // vocab + offsets  # (batch, 2k) row in the flattened beams
        token = top_index % vocab
        is_eos = token == EOS
        if need_attention and attn is not None:
            steps_so_far = attn if attn_history is None else torch.cat([attn_history, attn], dim=-2)
        ended = (is_eos[:, :k] & (top_scores[:, :k] > float("-inf"))).nonzero().tolist()
        ended = [(b, rank) for b, rank in ended if not done[b]]
        if ended:  # one copy to the host per step, not one per hypothesis
            origin_host, scores_host, history_host = origin.tolist(), top_scores.tolist(), history.tolist()
        for b, rank in ended:
            row, score = origin_host[b][rank], scores_host[b][rank]
            tokens = history_host[row]
            weights = steps_so_far[row].float().cpu() if need_attention and attn is not None else None
            finished[b].append((score / length_penalty(len(tokens) + 1, alpha), score, tokens, weights))
        alive_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)
        # Done when k hypotheses have ended and the best live beam, scored at its next possible end
        # (length t + 2 with EOS), no longer beats the k-th best of them.
        best_alive = alive_scores[:, 0].tolist()
        for b in range(batch):
            if not done[b] and len(finished[b]) >= k:
                kth_best = sorted((h[0] for h in finished[b]), reverse=True)[k - 1]
                done[b] = best_alive[b] / length_penalty(t + 2, alpha) <= kth_best
        if all(done):
            break
        rows = origin.gather(1, pick).view(-1)
        prev = token.gather(1, pick).view(-1)
        history = torch.cat([history.index_select(0, rows), prev[:, None]], dim=1)
        if need_attention and attn is not None:
            attn_history = steps_so_far.index_select(0, rows)
        scores = alive_scores.view(-1)
        state = state.select(rows)

    src_lens = src_mask.sum(-1).tolist()
    best_tokens, best_attention, nbest = [], [], []
    for b in range(batch):
        ranked = sorted(finished[b], key=lambda h: h[0], reverse=True)
        nbest.append([(tokens, norm) for norm, _, tokens, _ in ranked[:n_best]])
        best_tokens.append(ranked[0][2])
        weights = ranked[0][3]
        best_attention.append(None if weights is None else weights[..., : src_lens[b]])
    has_attention = need_attention and best_attention[0] is not None
    return Hypotheses(best_tokens, best_attention if has_attention else None, nbest, cache_bytes(state))


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
    beam_size: int = 1,
    alpha: float = 1.0,
    n_best: int = 1,
) -> Hypotheses:
    """Decode many sentences in length-sorted batches (greedy when beam_size is 1, else beam search);
    results come back in input order."""
    from tqdm import tqdm

    from app.data.batching import Batcher, make_batches
    from app.utils import autocast

    check_source_lengths(model, src)
    was_training = model.training
    model.eval()
    tokens: list = [None] * len(src)
    attention: list = [None] * len(src)
    nbest: list = [None] * len(src)
    kv_cache_bytes = None
    # a beam search batch holds beam_size copies of every sentence
    batches = make_batches([len(s) for s in src], None, max(batch_tokens // beam_size, 1))
    batcher = Batcher(src)
    for indices in tqdm(batches, desc="decoding", unit="batch", disable=not progress, leave=False):
        batch = batcher(indices).to(device)
        with autocast(device, amp_dtype):
            if beam_size == 1:
                hyps = greedy_decode(model, batch.src, max_len_ratio, max_len_extra, need_attention)
            else:
                hyps = beam_search(model, batch.src, beam_size, alpha, max_len_ratio, max_len_extra, n_best, need_attention)
        for j, i in enumerate(indices):
            tokens[i] = hyps.tokens[j]
            if hyps.attention is not None:
                attention[i] = hyps.attention[j]
            if hyps.nbest is not None:
                nbest[i] = hyps.nbest[j]
        if hyps.kv_cache_bytes is not None:
            kv_cache_bytes = max(kv_cache_bytes or 0, hyps.kv_cache_bytes)
    model.train(was_training)
    return Hypotheses(tokens, attention if need_attention and attention[0] is not None else None,
                      nbest if beam_size > 1 else None, kv_cache_bytes)
