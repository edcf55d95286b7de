"""What greedy and beam search share, written once for every model family against the model API (encode /
start / step / state.select), and greedy search.

A batch decodes in steps: every row (a sentence, or a beam of one) gets its next token from one
``model.step``. The host looks at the results only now and then (``done_check_interval``): then the
sentences that are done leave the batch (``state.select`` compacts it), so that the steps that remain
cost only what is still decoding. Hypotheses are read back once, at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Generic, Optional

import torch

from app.config.commands import MBR_UTILITIES, DecodeConfig
from app.data.tokenizer import BOS, EOS, PAD
from app.decode.constraints import PhraseConstraints
from app.models.api import AnySeq2Seq, DecodingState, KVCached, MemoryT, Seq2Seq, StateT
from app.run.errors import UserError


@dataclass
class Hypotheses:
    tokens: list[list[int]]  # per sentence, the best hypothesis, without BOS/EOS
    attention: Optional[list[torch.Tensor]] = None  # per sentence: (..., len(tokens) + 1, src_len), EOS row included
    nbest: Optional[list[list[tuple[list[int], float]]]] = None  # beam search: per sentence, (tokens, score) best first
    kv_cache_bytes: Optional[int] = None  # largest key/value cache of a decoding batch; None: the model has none
    mbr: Optional[dict] = None  # minimum Bayes risk decoding's figures (app/decode/mbr.py); None: none


def cache_bytes(state: DecodingState) -> Optional[int]:
    """Size of a decoder state's key/value cache (Transformers), None for states without one (RNNs). The
    cache is allocated whole at the start of a batch, so its size then is its peak."""
    return state.cache_bytes() if isinstance(state, KVCached) else None


def describe(decode: DecodeConfig) -> str:
    """How ``decode`` (a DecodeConfig) decodes, in words: what make eval's report and metrics.json and make
    translate's first line say ("beam 5, length penalty 1.0, no repeated 4-grams", "sampling top-k 10, seed 0")."""
    d = decode
    search = "greedy" if d.beam_size == 1 else f"beam {d.beam_size}, length penalty {d.length_penalty}"
    if d.beam_size > 1 and d.coverage_penalty:
        search += f", coverage penalty {d.coverage_penalty}"
    if d.sampling:
        cuts = [("top-k", d.sampling_topk, d.sampling_topk > 0), ("top-p", d.sampling_topp, d.sampling_topp < 1)]
        cuts += [("temperature", d.sampling_temperature, d.sampling_temperature != 1)]
        cuts += [("epsilon", d.sampling_epsilon, d.sampling_epsilon > 0)]
        narrowed = [f"{name} {value}" for name, value, used in cuts if used]
        search = f"sampling {', '.join(narrowed) or 'the whole distribution'}, seed {d.sampling_seed}"
    search += f", no repeated {d.no_repeat_ngram_size}-grams" if d.no_repeat_ngram_size else ""
    if d.min_len != 1:  # the default (no empty translation) goes unsaid
        search += ", empty translations allowed" if not d.min_len else f", at least {d.min_len} pieces"
    if d.mbr_candidates:
        drawn = "samples" if d.sampling else "best of the beam"
        utility = MBR_UTILITIES[d.mbr_utility]
        search = f"minimum Bayes risk ({utility}) of {d.mbr_candidates} candidates, the {drawn}: {search}"
    return search


def never_outputs(device: torch.device) -> torch.Tensor:
    """The tokens no hypothesis may contain: padding and BOS."""
    return torch.tensor([PAD, BOS], device=device)


def next_token_scores(logits: torch.Tensor, never: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the next token; the tokens of ``never`` (``never_outputs``) are never outputs."""
    logp = torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
    return logp.index_fill_(-1, never, float("-inf"))


def block_repeated_ngrams(logp: torch.Tensor, history: torch.Tensor, n: int) -> torch.Tensor:
    """No n-gram twice in a hypothesis (``decode.no_repeat_ngram_size``, as fairseq's --no-repeat-ngram-size and
    CTranslate2's no_repeat_ngram_size): a row's next token gets log p = -inf where, after the row's last n - 1
    tokens of ``history`` (rows, t: its tokens so far), it would end an n-gram the row holds already. In place
    on ``logp`` (rows, vocab), on the device (one index_add: a token that several n-grams ban sums their -inf)."""
    rows, t = history.shape
    if t < n:
        return logp
    ngrams = history.unfold(1, n, 1)  # (rows, t - n + 1, n), every n-gram so far
    seen = (ngrams[..., :-1] == history[:, None, t - n + 1 :]).all(-1)  # its first n - 1 tokens are the last ones
    ban = torch.where(seen, float("-inf"), 0.0).to(logp.dtype)
    index = ngrams[..., -1] + torch.arange(rows, device=logp.device)[:, None] * logp.size(-1)
    logp.view(-1).index_add_(0, index.view(-1), ban.view(-1))
    return logp


def max_output_lengths(
    model: AnySeq2Seq, src_mask: torch.Tensor, ratio: float, extra: int, prefix_lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """ratio × source length + extra, within the positions the model has (``max_positions``, if any)."""
    return length_limits(src_mask.sum(-1), ratio, extra, getattr(model, "max_positions", None), prefix_lengths)


def length_limits(
    src_lengths: torch.Tensor,
    ratio: float,
    extra: int,
    max_positions: Optional[int],
    prefix_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The output length limits of sources of ``src_lengths`` tokens (EOS included); every decoder's. A forced
    target prefix of ``prefix_lengths`` pieces (with the pieces of the sentence's constraints, app/decode/
    constraints.py) leaves room for ``extra`` more after it."""
    limits = (src_lengths.float() * ratio).long() + extra
    if prefix_lengths is not None:
        limits = torch.maximum(limits, prefix_lengths.to(limits.device) + extra)
    return limits if max_positions is None else limits.clamp(max=max_positions - 1)


def prefix_tensor(prefixes: list[list[int]], device: torch.device) -> Optional[torch.Tensor]:
    """Target prefixes as (sentences, longest) token ids, PAD after each one's end; None when all are empty."""
    longest = max((len(p) for p in prefixes), default=0)
    if not longest:
        return None
    return torch.tensor([p + [PAD] * (longest - len(p)) for p in prefixes], dtype=torch.long, device=device)


def check_lengths(
    max_positions: Optional[int], sequences: Sequence[Sized], what: str = "input sentence", start: int = 0
) -> None:
    """Every sequence with its EOS within the model's positions; the first that is not is a UserError naming it
    (``what`` and its number, counted from ``start`` + 1)."""
    if max_positions is None:
        return
    for i, sequence in enumerate(sequences, start=start + 1):
        if len(sequence) + 1 > max_positions:  # + EOS
            raise UserError(
                f"{what} {i} has {len(sequence)} subword tokens; this model takes at most "
                f"{max_positions - 1} (model.max_len={max_positions}): split it"
            )


# How often the decoding loops ask a GPU whether sentences are done. Asking is a host sync that drains its
# queue; steps run after a sentence is done change no result (it only rides along until the next check). A
# CPU is asked every step, and its finished sentences leave the batch at once.
CHECK_DONE_EVERY = 8


def done_check_interval(device: torch.device) -> int:
    return CHECK_DONE_EVERY if device.type == "cuda" else 1


# Greedy search drops its finished sentences once they are at least 1 / COMPACT_SHARE of the batch: dropping copies
# the others' key/value caches. Beam search drops them at every check, in the reorder it does anyway.
COMPACT_SHARE = 8


def by_step(attention: list[torch.Tensor]) -> torch.Tensor:
    """Steps' attention, each (rows, ..., 1, S), as one (rows, steps, S, ...) tensor: what ``attention_to_host``
    gathers from."""
    return torch.cat([a.movedim(-2, 1).movedim(-1, 2) for a in attention], dim=1)


def attention_to_host(attention: torch.Tensor, steps: list[int], sources: list[int]) -> list[torch.Tensor]:
    """Per row of ``attention`` (rows, T, S, ...), its first ``steps`` target positions over its first ``sources``
    source positions, in float32 on the host: (steps, sources, ...) each. One gather on the device and one copy
    to the host of what the sentences hold, not of the batch's padding: a batch of a whole split would
    otherwise copy every sentence at the longest output by the longest source."""
    device, length, width = attention.device, attention.size(1), attention.size(2)
    want_steps = torch.tensor(steps, device=device)[:, None, None]
    want_sources = torch.tensor(sources, device=device)[:, None, None]
    keep = (torch.arange(length, device=device)[None, :, None] < want_steps) & (
        torch.arange(width, device=device)[None, None, :] < want_sources
    )
    kept = attention[keep].float().cpu()  # (Σ steps · sources, ...), row by row
    blocks = kept.split([t * s for t, s in zip(steps, sources)])
    return [block.view(t, s, *attention.shape[3:]) for block, t, s in zip(blocks, steps, sources)]


def sentence_attention(blocks: list[torch.Tensor]) -> torch.Tensor:
    """A sentence's (steps, sources, ...) blocks, in step order, as its (..., steps, sources) attention."""
    joined = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return joined.movedim((0, 1), (-2, -1))


class Search(Generic[MemoryT, StateT]):
    """What greedy and beam search share: a batch of sentences decoding ``beam`` rows each; which of them
    are still in the batch (``ids``, their places in it, and their length ``limits``); the model's state;
    results written per segment of steps between two compactions, into tensors of the whole batch. A target
    ``prefix`` forces each sentence's first pieces, each at its log p (CTranslate2's ``target_prefix``): the
    hypotheses begin with it. Terminology ``constraints`` (app/decode/constraints.py): every hypothesis contains
    each of its sentence's phrases. A search's ``step`` and ``result`` are its own."""

    prev: torch.Tensor  # each row's last token: the next step's input

    def __init__(
        self,
        model: Seq2Seq[MemoryT, StateT],
        src: torch.Tensor,
        beam: int,
        max_len_ratio: float,
        max_len_extra: int,
        need_attention: bool,
        onednn: bool,
        no_repeat_ngram_size: int = 0,
        prefix: Optional[torch.Tensor] = None,
        constraints: Optional[PhraseConstraints] = None,
        min_len: int = 0,
    ):
        self.model, self.beam, self.need_attention, self.device = model, beam, need_attention, src.device
        self.step_attention = need_attention  # asked of every model step (beam search's coverage needs it too)
        src_mask = src != PAD
        self.src_lengths = src_mask.sum(-1).tolist()
        # no EOS before min_len pieces (decode.min_len), but for an empty source (its EOS alone): nothing to translate
        self.min_len = min_len
        self.min_lengths = torch.where(src_mask.sum(-1) > 1, min_len, 0) if min_len else None
        self.memory = model.encode(src, src_mask)
        # each sentence's forced first pieces (prefix_tensor: PAD where free), or None
        self.prefix = prefix
        prefix_lengths = None if prefix is None else (prefix != PAD).sum(-1)
        self.constraints = constraints
        if constraints is not None:  # room for the constraints' pieces too
            prefix_lengths = constraints.total if prefix_lengths is None else prefix_lengths + constraints.total
        self.limits = max_output_lengths(model, src_mask, max_len_ratio, max_len_extra, prefix_lengths)
        self.host_limits = self.limits.tolist()
        self.steps = max(self.host_limits) + 1  # the last step can only end every hypothesis
        self.state = model.start(self.memory, beam, self.steps, onednn=onednn)
        self.kv_cache_bytes = cache_bytes(self.state)
        self.batch = src.size(0)
        self.ids = torch.arange(self.batch, device=self.device)
        self.kept = list(range(self.batch))  # ids on the host
        self.min_limit = min(self.host_limits)
        self.t = 0  # steps taken
        self.segment_start = 0  # the step the current segment of results began at
        self.never: Optional[torch.Tensor] = None
        self.check_every = done_check_interval(self.device)
        self.compact_share = 0.0  # compact once this share of the sentences in the batch is done
        # each row's tokens so far, for block_repeated_ngrams (kept only when asked for)
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.history = src.new_empty((self.batch * beam, 0)) if no_repeat_ngram_size else None

    def model_step(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Next-token logits for every row (and the attention, when asked for)."""
        logits, attention, self.state = self.model.step(self.memory, self.prev, self.state, self.step_attention)
        return logits, attention

    def compacts(self, done: int) -> bool:
        """Whether ``done`` finished sentences of those in the batch are enough to drop them now."""
        return done > 0 and done >= self.compact_share * len(self.kept)

    def next_token_scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.never is None:
            self.never = never_outputs(logits.device)
        logp = next_token_scores(logits, self.never)
        forced = None
        if self.prefix is not None and self.t < self.prefix.size(1):  # a prefix's piece, kept at its log p
            forced = self.prefix[:, self.t].repeat_interleave(self.beam)[:, None]
            forced_logp = logp.gather(1, forced)
        if self.constraints is not None:
            pieces = self.constraints.next_pieces()
            pieces_logp = logp.gather(1, pieces)
        if self.history is not None:
            block_repeated_ngrams(logp, self.history, self.no_repeat_ngram_size)
            if self.constraints is not None:  # a constraint's next piece is never banned
                logp.scatter_(1, pieces, pieces_logp)
        if self.constraints is not None:
            logp = self.constraints.mask(logp, pieces, self.t, self.limits_of_rows())
        if self.min_lengths is not None and self.t < self.min_len:  # too short to end (after the constraints, whose
            # rows that would end take a phrase's piece)
            early = (self.min_lengths > self.t).repeat_interleave(self.beam)
            # ...unless nothing but EOS is left (no_repeat_ngram_size can ban every other piece): then it ends short
            others = torch.isfinite(logp)
            others[:, EOS] = False
            logp[:, EOS].masked_fill_(early & others.any(-1), float("-inf"))
        if forced is not None:
            only = torch.full_like(logp, float("-inf")).scatter_(1, forced, forced_logp)
            logp = torch.where(forced != PAD, only, logp)
        return logp

    def keep(self, kept: list[bool]) -> Optional[torch.Tensor]:
        """After a check: the sentences still decoding (``kept``, per sentence in the batch now), as an index,
        with the results of the steps so far written out; None when all are; the others' ids and limits."""
        if all(kept):
            return None
        self.write_segment()
        index = torch.tensor([i for i, keep in enumerate(kept) if keep], dtype=torch.long, device=self.device)
        self.kept = [i for i, keep in zip(self.kept, kept) if keep]
        self.ids, self.limits = self.ids[index], self.limits[index]
        if self.min_lengths is not None:
            self.min_lengths = self.min_lengths[index]
        if self.prefix is not None:
            self.prefix = self.prefix[index]
        if self.constraints is not None:
            self.constraints.select_sentences(index)
        self.min_limit = min(self.host_limits[i] for i in self.kept) if self.kept else 0
        return index

    def limits_of_rows(self) -> torch.Tensor:
        """The length limit of every row."""
        return self.limits

    def write_segment(self) -> None:
        self.segment_start = self.t

    def step(self, check: bool) -> bool:
        """One token per row; with ``check`` (a host sync), the sentences that are done leave. True: all done."""
        raise NotImplementedError

    def result(self) -> Hypotheses:
        raise NotImplementedError

    def run(self) -> Hypotheses:
        """Steps until every sentence is done (checked every ``check_every`` steps) or the last step."""
        while self.t < self.steps:
            if self.step(check=(self.t + 1) % self.check_every == 0):
                break
        self.write_segment()
        return self.result()


class GreedySearch(Search[MemoryT, StateT]):
    """Picks the most probable token at every step until EOS or the length limit, for a whole batch; with a
    ``sampler`` (app/decode/sampling.py) it draws the token instead."""

    def __init__(
        self,
        model: Seq2Seq[MemoryT, StateT],
        src: torch.Tensor,
        max_len_ratio: float = 1.5,
        max_len_extra: int = 10,
        need_attention: bool = False,
        onednn: bool = True,
        no_repeat_ngram_size: int = 0,
        sampler: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        prefix: Optional[torch.Tensor] = None,
        constraints: Optional[PhraseConstraints] = None,
        min_len: int = 0,
    ):
        settings = (max_len_ratio, max_len_extra, need_attention, onednn, no_repeat_ngram_size, prefix, constraints)
        super().__init__(model, src, 1, *settings, min_len)
        self.choose: Callable[[torch.Tensor], torch.Tensor] = (
            sampler if sampler is not None else lambda logp: logp.argmax(-1)
        )
        self.compact_share = 1 / COMPACT_SHARE  # leaving copies the others' caches: worth it once enough are done
        self.prev = torch.full((self.batch,), BOS, dtype=torch.long, device=self.device)
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        self.tokens = torch.full((self.batch, self.steps), PAD, dtype=torch.long, device=self.device)
        # per segment: the ids of its rows, their attention (rows, steps, S, ...) on the device, its first step
        self.attention: list[tuple[list[int], torch.Tensor, int]] = []
        self.segment_tokens: list[torch.Tensor] = []
        self.segment_attention: list[torch.Tensor] = []

    def step(self, check: bool) -> bool:
        """One token per sentence; with ``check`` (a host sync), the finished ones leave. True: all finished."""
        logits, attn = self.model_step()
        token = self.choose(self.next_token_scores(logits))
        if self.t >= self.min_limit:  # force an end at the limit
            token = torch.where(self.t >= self.limits, EOS, token)
        token = token.masked_fill(self.finished, PAD)
        if self.constraints is not None:
            self.constraints.step(token)
        self.segment_tokens.append(token)
        if self.history is not None:
            self.history = torch.cat([self.history, token[:, None]], 1)
        if self.need_attention and attn is not None:
            self.segment_attention.append(attn)
        self.finished |= token == EOS
        self.prev = token
        self.t += 1
        if not check:
            return False
        finished = self.finished.tolist()
        if all(finished):
            self.keep([False] * len(finished))
            return True
        if not self.compacts(sum(finished)):
            return False
        index = self.keep([not done for done in finished])
        assert index is not None  # some are done
        self.state = self.state.select(index)
        self.prev, self.finished = self.prev[index], self.finished[index]
        if self.constraints is not None:
            self.constraints.select_rows(index)
        if self.history is not None:
            self.history = self.history[index]
        return False

    def write_segment(self) -> None:
        if self.segment_tokens:
            start, end = self.segment_start, self.t
            self.tokens[:, start:end].index_copy_(0, self.ids, torch.stack(self.segment_tokens, 1))
            if self.segment_attention:
                self.attention.append((list(self.kept), by_step(self.segment_attention), start))
        self.segment_tokens, self.segment_attention = [], []
        super().write_segment()

    def result(self) -> Hypotheses:
        out = self.tokens.tolist()
        tokens = [row[: row.index(EOS)] if EOS in row else row for row in out]
        if not self.attention:  # not asked for, or a model without attention
            return Hypotheses(tokens, kv_cache_bytes=self.kv_cache_bytes)
        blocks: list[list[torch.Tensor]] = [[] for _ in range(self.batch)]
        for ids, attention, start in self.attention:  # each sentence's steps in this segment, up to its EOS
            steps = [min(max(len(tokens[i]) + 1 - start, 0), attention.size(1)) for i in ids]
            for i, block in zip(ids, attention_to_host(attention, steps, [self.src_lengths[i] for i in ids])):
                blocks[i].append(block)
        return Hypotheses(tokens, [sentence_attention(b) for b in blocks], kv_cache_bytes=self.kv_cache_bytes)
