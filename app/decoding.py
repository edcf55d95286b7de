"""Decoding against the model API (encode / step / state.select): greedy and beam search, written
once for every model family."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm import tqdm

from app.config import DecodeConfig
from app.data.batching import Batcher, make_batches, sorted_batches
from app.data.tokenizer import BOS, EOS, PAD
from app.errors import UserError
from app.utils import autocast


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
    return length_limits(src_mask.sum(-1), ratio, extra, getattr(model, "max_positions", None))


def length_limits(src_lengths: torch.Tensor, ratio: float, extra: int, max_positions: Optional[int]) -> torch.Tensor:
    """The output length limits of sources of ``src_lengths`` tokens (EOS included); every decoder's."""
    limits = (src_lengths.float() * ratio).long() + extra
    return limits if max_positions is None else limits.clamp(max=max_positions - 1)


def check_source_lengths(model, src: list[list[int]]) -> None:
    max_positions = getattr(model, "max_positions", None)
    if max_positions is None:
        return
    for i, sentence in enumerate(src):
        if len(sentence) + 1 > max_positions:  # + EOS
            raise UserError(
                f"input sentence {i + 1} has {len(sentence)} subword tokens; this model takes at most "
                f"{max_positions - 1} (model.max_len={max_positions}): split it"
            )


# How often the decoding loops ask a GPU whether every sentence is done. Asking is a host sync that
# drains its queue; steps run after the last sentence is done change no result. A CPU is asked every step.
CHECK_DONE_EVERY = 8


def done_check_interval(device: torch.device) -> int:
    return CHECK_DONE_EVERY if device.type == "cuda" else 1


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
    check_every = done_check_interval(src.device)
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
        if (t + 1) % check_every == 0 and bool(finished.all()):
            break
        prev = token
    out = torch.stack(steps, dim=1).tolist()
    tokens = [row[: row.index(EOS)] if EOS in row else row for row in out]
    if not need_attention or attention[0] is None:  # a model without attention has none to give
        return Hypotheses(tokens, kv_cache_bytes=cache_bytes(state))
    # (B, ..., T, S): every step's attention stacked on the target axis, trimmed per sentence
    stacked = torch.cat(attention, dim=-2).float().cpu()
    src_lens = src_mask.sum(-1).tolist()
    return Hypotheses(
        tokens,
        [stacked[i, ..., : len(tokens[i]) + 1, : src_lens[i]] for i in range(batch)],
        kv_cache_bytes=cache_bytes(state),
    )


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty (Wu et al. 2016, eq. 14): lp(Y) = ((5 + |Y|) / 6)^α."""
    return ((5 + length) / 6) ** alpha


@dataclass
class Ended:
    """The k best ended hypotheses of every sentence (best first; score -inf: an empty slot), kept on
    the device as where they ended: the step and the beam they came from."""

    scores: torch.Tensor  # (B, k) log p(Y|X) / lp(Y)
    steps: torch.Tensor  # (B, k) the step that chose EOS = the number of tokens before it
    rows: torch.Tensor  # (B, k) the beam, among the beams entering that step, that chose EOS

    def add(self, scores: torch.Tensor, step: int, rows: torch.Tensor) -> None:
        """Merge k candidates per sentence (-inf: not ended) and keep the k best. The sort is stable, so
        among equal scores the earlier hypothesis ranks first."""
        k = scores.size(1)
        keep = torch.cat([self.scores, scores], 1).sort(dim=1, descending=True, stable=True).indices[:, :k]
        merged = lambda old, new: torch.cat([old, new], 1).gather(1, keep)  # noqa: E731
        self.scores = merged(self.scores, scores)
        self.steps = merged(self.steps, torch.full_like(self.steps, step))
        self.rows = merged(self.rows, rows)


@dataclass
class BeamHistory:
    """Backpointers: after step t, beam j continues beam ``parents[t][j]`` of step t with token
    ``tokens[t][j]``. A hypothesis is read back once, at the end, by following them from where it ended
    (O(1) work per step instead of copying every beam's history)."""

    tokens: list = field(default_factory=list)  # per step (B·k,)
    parents: list = field(default_factory=list)  # per step (B·k,) rows of the beams entering that step
    attention: list = field(default_factory=list)  # per step (B·k, ..., 1, S), rows of the beams entering it

    def trace(
        self, steps: torch.Tensor, rows: torch.Tensor, with_attention: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens (N, max steps) of hypotheses that chose EOS at ``steps`` from beam ``rows`` (PAD after
        the end), and their attention (N, ..., max steps + 1, S): rows 0..steps are theirs, EOS row
        included; the rows after it are to be cut off."""
        n_steps = max(len(self.tokens), len(self.attention) if with_attention else 0)
        tokens = rows.new_full((rows.size(0), max(len(self.tokens), 1)), PAD)
        attention = [None] * n_steps
        cur = rows.clone()
        for s in reversed(range(n_steps)):
            if s < len(self.tokens):  # the hypotheses that were still going after step s step back
                back = s < steps
                tokens[:, s] = torch.where(back, self.tokens[s][cur], PAD)
                cur = torch.where(back, self.parents[s][cur], cur)
            if with_attention:
                attention[s] = self.attention[s][cur]
        return tokens, torch.cat(attention, dim=-2) if with_attention else None


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
    """Batched beam search: all sentences and beams of the batch advance together, on the device.

    Every step extends the live beams by every token, keeps the 2k best candidates per sentence, sets
    aside those ending in EOS among the first k (scored log p(Y|X) / lp(Y)), and continues with the k
    best others. A sentence is done when k hypotheses have ended and its best live beam, ended at the
    next step, would not rank among them; each beam ends at its length limit. With k = 1 and α = 0
    this is greedy search (with α > 0 one beam may go on past an EOS that a longer hypothesis beats).
    The host reads the results once, at the end.
    """
    device, batch, k = src.device, src.size(0), beam_size
    src_mask = src != PAD
    memory = model.encode(src, src_mask)
    memory = memory.select(torch.arange(batch, device=device).repeat_interleave(k))
    limits = max_output_lengths(model, src_mask, max_len_ratio, max_len_extra).repeat_interleave(k)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    scores = scores.view(-1)
    prev = torch.full((batch * k,), BOS, dtype=torch.long, device=device)
    empty = torch.full((batch, k), float("-inf"), device=device)
    ended = Ended(empty, empty.long().zero_(), empty.long().zero_())
    history = BeamHistory()
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    offsets = (torch.arange(batch, device=device) * k)[:, None]
    check_every = done_check_interval(device)
    state, with_attention = None, False
    for t in range(int(limits.max()) + 1):
        logits, attn, state = model.step(memory, prev, state, need_attention=need_attention)
        with_attention = need_attention and attn is not None
        if with_attention:
            history.attention.append(attn)
        logp = next_token_scores(logits)
        at_limit = t >= limits  # only EOS may follow a beam at its length limit
        eos = logp[:, EOS].masked_fill(at_limit, 0.0)
        logp = logp.masked_fill(at_limit[:, None], float("-inf"))
        logp[:, EOS] = eos
        vocab = logp.size(-1)
        top_scores, top_index = (scores[:, None] + logp).view(batch, k * vocab).topk(2 * k, dim=1)
        origin = top_index // vocab + offsets  # (batch, 2k) row in the flattened beams
        token = top_index % vocab
        is_eos = token == EOS

        # EOS among the k best candidates ends a hypothesis (of a sentence still searching)
        ending = is_eos[:, :k] & (top_scores[:, :k] > float("-inf")) & ~done[:, None]
        ended.add(
            top_scores[:, :k].masked_fill(~ending, float("-inf")) / length_penalty(t + 1, alpha), t, origin[:, :k]
        )

        alive_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)
        # Done when k hypotheses have ended and the best live beam, scored at its next possible end
        # (length t + 2 with EOS), no longer beats the k-th best of them.
        kth_best = ended.scores[:, k - 1]
        done |= (kth_best > float("-inf")) & (alive_scores[:, 0] / length_penalty(t + 2, alpha) <= kth_best)
        if (t + 1) % check_every == 0 and bool(done.all()):
            break
        rows = origin.gather(1, pick).view(-1)
        prev = token.gather(1, pick).view(-1)
        history.tokens.append(prev)
        history.parents.append(rows)
        scores = alive_scores.view(-1)
        state = state.select(rows)

    n = min(n_best, k)
    tokens, _ = history.trace(ended.steps[:, :n].reshape(-1), ended.rows[:, :n].reshape(-1), with_attention=False)
    tokens, lengths, norms = tokens.view(batch, n, -1).tolist(), ended.steps.tolist(), ended.scores.tolist()
    nbest = [
        [(tokens[b][i][: lengths[b][i]], norms[b][i]) for i in range(n) if norms[b][i] > float("-inf")]
        for b in range(batch)
    ]
    best_tokens = [hyps[0][0] for hyps in nbest]
    if not with_attention:
        return Hypotheses(best_tokens, None, nbest, cache_bytes(state))
    _, attention = history.trace(ended.steps[:, 0], ended.rows[:, 0], with_attention=True)
    attention = attention.float().cpu()
    src_lens = src_mask.sum(-1).tolist()
    return Hypotheses(
        best_tokens,
        [attention[b, ..., : lengths[b][0] + 1, : src_lens[b]] for b in range(batch)],
        nbest,
        cache_bytes(state),
    )


@torch.no_grad()
def decode_corpus(
    model,
    src: list[list[int]],
    device: torch.device,
    decode: DecodeConfig,
    amp_dtype: Optional[torch.dtype] = None,
    need_attention: bool = False,
    progress: bool = False,
) -> Hypotheses:
    """Decode many sentences in length-sorted batches as ``decode`` says (greedy when its beam_size is
    1, else beam search); results come back in input order."""
    check_source_lengths(model, src)
    was_training = model.training
    model.eval()
    tokens: list = [None] * len(src)
    attention: list = [None] * len(src)
    nbest: list = [None] * len(src)
    kv_cache_bytes = None
    beam_size = decode.beam_size
    batches = make_batches([len(s) for s in src], None, decode.batch_source_tokens)
    batcher = Batcher(src)
    for indices in tqdm(batches, desc="decoding", unit="batch", disable=not progress, leave=False):
        batch = batcher(indices).to(device)
        with autocast(device, amp_dtype):
            if beam_size == 1:
                hyps = greedy_decode(model, batch.src, decode.max_len_ratio, decode.max_len_extra, need_attention)
            else:
                hyps = beam_search(
                    model,
                    batch.src,
                    beam_size,
                    decode.length_penalty,
                    decode.max_len_ratio,
                    decode.max_len_extra,
                    decode.n_best,
                    need_attention,
                )
        for j, i in enumerate(indices):
            tokens[i] = hyps.tokens[j]
            if hyps.attention is not None:
                attention[i] = hyps.attention[j]
            if hyps.nbest is not None:
                nbest[i] = hyps.nbest[j]
        if hyps.kv_cache_bytes is not None:
            kv_cache_bytes = max(kv_cache_bytes or 0, hyps.kv_cache_bytes)
    model.train(was_training)
    return Hypotheses(
        tokens,
        attention if need_attention and attention[0] is not None else None,
        nbest if beam_size > 1 else None,
        kv_cache_bytes,
    )


@torch.no_grad()
def forced_attention(
    model,
    src: list[list[int]],
    tgt: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, attention) of every pair while the model is fed the target (teacher forcing), in
    length-sorted batches: (tgt, src) or (layers, heads, tgt, src) on the host, the rows of the target
    tokens and EOS, the columns of the source tokens and EOS. What reference alignments are scored
    against: they link source and *reference* words. None for a model without attention."""
    was_training = model.training
    model.eval()
    for batch in sorted_batches(src, tgt, batch_tokens):
        on_device = batch.to(device)
        with autocast(device, amp_dtype):
            _, attention = model.decode(model.encode(on_device.src), on_device.tgt_in, need_attention=True)
        if attention is None:
            model.train(was_training)
            return
        attention = attention.float().cpu()
        for j, i in enumerate(batch.index.tolist()):
            yield i, attention[j, ..., : len(tgt[i]) + 1, : len(src[i]) + 1]
    model.train(was_training)
