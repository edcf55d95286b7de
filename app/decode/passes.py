"""Decoding a corpus: greedy or beam search (app/decode/search.py, app/decode/beam.py) in length-sorted
batches sized for the device, results in input order; and the attention of a model fed the reference
(teacher forcing)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Optional

import torch
from tqdm import tqdm

from app.config.commands import DecodeConfig
from app.data.batching import Batch, Batcher, make_batches, sorted_batches
from app.decode.beam import BeamSearch
from app.decode.constraints import forced_lengths, phrase_constraints
from app.decode.sampling import Sampler, make_sampler
from app.decode.search import GreedySearch, Hypotheses, Search, check_lengths, prefix_tensor
from app.models.api import AnySeq2Seq, Copying, SelfAttending
from app.run.device import autocast

log = logging.getLogger(__name__)


@torch.no_grad()
def greedy_decode(
    model: AnySeq2Seq,
    src: torch.Tensor,
    max_len_ratio: float = 1.5,
    max_len_extra: int = 10,
    need_attention: bool = False,
    onednn: bool = True,
    no_repeat_ngram_size: int = 0,
    min_len: int = 0,
) -> Hypotheses:
    """Pick the most probable token at every step until EOS or the length limit, for a whole batch. ``onednn``:
    on a CPU, a Transformer's step multiplies through oneDNN (``decode.cpu_onednn``); ``no_repeat_ngram_size``:
    no n-gram of that size twice in a hypothesis (0: any); ``min_len``: no EOS before that many pieces (but for an
    empty source)."""
    search = GreedySearch(
        model, src, max_len_ratio, max_len_extra, need_attention, onednn, no_repeat_ngram_size, min_len=min_len
    )
    return search.run()


@torch.no_grad()
def beam_search(
    model: AnySeq2Seq,
    src: torch.Tensor,
    beam_size: int = 5,
    alpha: float = 1.0,
    max_len_ratio: float = 1.5,
    max_len_extra: int = 10,
    n_best: int = 1,
    need_attention: bool = False,
    onednn: bool = True,
    no_repeat_ngram_size: int = 0,
    min_len: int = 0,
    coverage_penalty: float = 0.0,
) -> Hypotheses:
    """Batched beam search (``BeamSearch``) of a batch of sources; the host reads the results once, at the end.
    ``onednn``, ``no_repeat_ngram_size`` and ``min_len``: as ``greedy_decode``'s; ``coverage_penalty``: GNMT's β
    (app.decode.penalties.coverage_penalty)."""
    search = BeamSearch(
        model,
        src,
        beam_size,
        alpha,
        max_len_ratio,
        max_len_extra,
        n_best,
        need_attention,
        onednn,
        no_repeat_ngram_size,
        min_len=min_len,
        coverage_penalty=coverage_penalty,
    )
    return search.run()


def searcher(
    model: AnySeq2Seq,
    src: torch.Tensor,
    decode: DecodeConfig,
    need_attention: bool = False,
    sampler: Optional[Sampler] = None,
    prefix: Optional[torch.Tensor] = None,
    constraints: Optional[list[list[list[int]]]] = None,
) -> Search[Any, Any]:
    """The search ``decode`` asks for over a batch of sources: greedy when its beam_size is 1 (drawing each token
    with ``sampler`` when ``decode.sampling``: one sampler, one seeded generator, for all of a corpus' batches),
    else beam search; each hypothesis begins with its sentence's ``prefix`` (app.decode.search.prefix_tensor) and
    contains each of its sentence's ``constraints`` (target phrases' pieces: app/decode/constraints.py)."""
    d = decode
    phrases = phrase_constraints(constraints, d.beam_size, src.device)
    if d.beam_size == 1:
        if d.sampling and sampler is None:
            sampler = make_sampler(d, src.device)
        return GreedySearch(
            model,
            src,
            d.max_len_ratio,
            d.max_len_extra,
            need_attention,
            d.cpu_onednn,
            d.no_repeat_ngram_size,
            sampler,
            prefix,
            phrases,
            d.min_len,
        )
    return BeamSearch(
        model,
        src,
        d.beam_size,
        d.length_penalty,
        d.max_len_ratio,
        d.max_len_extra,
        d.n_best,
        need_attention,
        d.cpu_onednn,
        d.no_repeat_ngram_size,
        prefix,
        phrases,
        d.min_len,
        d.coverage_penalty,
    )


@torch.no_grad()
def decode_corpus(
    model: AnySeq2Seq,
    src: list[list[int]],
    device: torch.device,
    decode: DecodeConfig,
    amp_dtype: Optional[torch.dtype] = None,
    need_attention: bool = False,
    progress: bool = False,
    prefix: Optional[list[list[int]]] = None,
    constraints: Optional[list[list[list[int]]]] = None,
) -> Hypotheses:
    """Decode many sentences in length-sorted batches as ``decode`` says (greedy when its beam_size is
    1, else beam search); results come back in input order. A batch holds up to ``decode.batch_tokens``
    (``cuda_batch_tokens`` on CUDA) tokens after the beam: sentences × beam × padded source length. ``prefix``:
    per sentence, the target pieces its hypotheses begin with (empty: none); ``constraints``: per sentence, the
    target phrases (their pieces) each of its hypotheses contains (empty: none)."""
    positions = getattr(model, "max_positions", None)
    check_lengths(positions, src)
    if prefix is not None:
        check_lengths(positions, prefix, "translation prefix")
    if constraints is not None:  # the pieces forced, prefix and phrases, within the model's positions
        check_lengths(positions, forced_lengths(constraints, prefix), "constrained translation")
    was_training = model.training
    model.eval()
    tokens: list = [None] * len(src)
    attention: list = [None] * len(src)
    nbest: list = [None] * len(src)
    kv_cache_bytes = None
    beam_size = decode.beam_size
    budget = decode.cuda_batch_tokens if device.type == "cuda" else decode.batch_tokens
    batches = make_batches([len(s) for s in src], None, max(budget // beam_size, 1))
    batcher = Batcher(src)
    pending, split = batches[::-1], False  # popped from the end: in order
    bar = tqdm(total=len(src), desc="decoding", unit="sentence", disable=not progress, leave=False)
    sampler = make_sampler(decode, device)
    while pending:
        indices = pending.pop()
        try:
            with autocast(device, amp_dtype):
                begin = None if prefix is None else prefix_tensor([prefix[i] for i in indices], device)
                phrases = None if constraints is None else [constraints[i] for i in indices]
                batch = batcher(indices).to(device).src
                hyps = searcher(model, batch, decode, need_attention, sampler, begin, phrases).run()
        except torch.OutOfMemoryError:
            if len(indices) == 1:
                raise
            # a budget too large for this device's memory: the batch in halves, said once
            if not split:
                split = True
                log.warning(
                    "decoding: out of memory on a batch of %d sentences, decoding it in halves (a smaller "
                    "decode.%s avoids this)",
                    len(indices),
                    "cuda_batch_tokens" if device.type == "cuda" else "batch_tokens",
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(indices) // 2
            pending += [indices[half:], indices[:half]]
            continue
        for j, i in enumerate(indices):
            tokens[i] = hyps.tokens[j]
            if hyps.attention is not None:
                attention[i] = hyps.attention[j]
            if hyps.nbest is not None:
                nbest[i] = hyps.nbest[j]
        if hyps.kv_cache_bytes is not None:
            kv_cache_bytes = max(kv_cache_bytes or 0, hyps.kv_cache_bytes)
        bar.update(len(indices))
    bar.close()
    model.train(was_training)
    return Hypotheses(
        tokens,
        attention if need_attention and attention[0] is not None else None,
        nbest if beam_size > 1 else None,
        kv_cache_bytes,
    )


@torch.no_grad()
def forced_pass(
    model: AnySeq2Seq,
    src: list[list[int]],
    tgt: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
    log_probs: bool = True,
    attention: bool = False,
) -> Iterator[tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """(index, log p, attention) of every pair while the model is fed the target (teacher forcing), in length-sorted
    batches, on the host in float32. ``log_probs``: log p(y_t | y_<t, x) of each target token and of the EOS after
    them, over the whole vocabulary (the terms of the search's scores, which beam search adds, and of the dev loss);
    ``attention``: the cross-attention, (tgt, src) or (layers, heads, tgt, src), the rows of the target tokens and
    EOS, the columns of the source tokens and EOS (None for a model without attention). None where not asked."""
    for batch, on_device in teacher_forced(model, src, tgt, device, batch_tokens):
        tgt_in, tgt_out = on_device.targets
        with autocast(device, amp_dtype):
            memory = model.encode(on_device.src)
            logits, weights = model.decode(memory, tgt_in, need_attention=attention, need_logits=log_probs)
        picked = None
        if log_probs:
            assert logits is not None  # asked for
            picked = logits.float().log_softmax(-1).gather(-1, tgt_out[..., None]).squeeze(-1).cpu()
        weights = weights.float().cpu() if attention and weights is not None else None
        for j, i in enumerate(batch.index.tolist()):
            rows, columns = len(tgt[i]) + 1, len(src[i]) + 1
            yield (
                i,
                None if picked is None else picked[j, :rows],
                None if weights is None else weights[j, ..., :rows, :columns],
            )


def forced_attention(
    model: AnySeq2Seq,
    src: list[list[int]],
    tgt: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, attention) of every pair, the model fed the target (``forced_pass``'s attention alone, without the
    output layer); nothing for a model without attention. What reference alignments are scored against: they link
    source and *reference* words."""
    for i, _, weights in forced_pass(model, src, tgt, device, batch_tokens, amp_dtype, log_probs=False, attention=True):
        if weights is None:
            return
        yield i, weights


@torch.no_grad()
def forced_self_attention(
    model: SelfAttending,
    src: list[list[int]],
    tgt: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(index, encoder, decoder) self-attention of every pair, the target fed (a model with self-attention:
    ``model.self_attention``), on the host: encoder (layers, heads, src, src) over the source tokens and EOS;
    decoder (layers, heads, tgt, tgt), its rows the positions that write the target tokens and EOS, its columns
    the inputs they read (BOS and the target tokens)."""
    for batch, on_device in teacher_forced(model, src, tgt, device, batch_tokens):
        with autocast(device, amp_dtype):
            weights = model.self_attention(on_device.src, on_device.targets[0])
        encoder, decoder = weights.encoder.float().cpu(), weights.decoder.float().cpu()
        for j, i in enumerate(batch.index.tolist()):
            s, t = len(src[i]) + 1, len(tgt[i]) + 1
            yield i, encoder[j, ..., :s, :s], decoder[j, ..., :t, :t]


def forced_copy_shares(
    model: Copying,
    src: list[list[int]],
    tgt: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, shares) of every pair whose model copies (``model.copy_shares``), the target fed: per target token
    and EOS the share of its probability that came through copying, on the host (model.copy_attention)."""
    for batch, on_device in teacher_forced(model, src, tgt, device, batch_tokens):
        with autocast(device, amp_dtype):
            memory = model.encode(on_device.src)
            shares = model.copy_shares(memory, *on_device.targets)
        if shares is None:  # built without model.copy_attention
            return
        shares = shares.float().cpu()
        for j, i in enumerate(batch.index.tolist()):
            yield i, shares[j, : len(tgt[i]) + 1]


def teacher_forced(
    model: AnySeq2Seq, src: list[list[int]], tgt: list[list[int]], device: torch.device, batch_tokens: int
) -> Iterator[tuple[Batch, Batch]]:
    """(batch, its tensors on ``device``) of the pairs in length-sorted batches, the model in evaluation mode
    meanwhile (its mode restored after)."""
    was_training = model.training
    model.eval()
    try:
        for batch in sorted_batches(src, tgt, batch_tokens):
            yield batch, batch.to(device)
    finally:
        model.train(was_training)
