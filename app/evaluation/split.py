"""One evaluation of a split, for every caller: the hypotheses of its sources scored with sacrebleu, each
sentence's record with the views of the attention that wrote it, the teacher-forced passes that read attention
(AER against reference links; the self-attention and what each head does), and the teacher-forced loss.
Validation (app/train/validation.py) and ``make eval`` (app/evaluation/eval_run.py) differ only in what they ask
for (``Asked``) and in where they write the result (TensorBoard; app/report/evaluation_files.py).

Host work runs beside the model's passes in the host worker (app/run/host_worker.py) where one is given: the
scores of a validation, a share of ``make eval``'s TER (collected by ``SplitResult.finish``, after the caller
wrote its files), and whatever the caller sends it from ``Asked.on_records``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from tqdm import tqdm

from app.data.batching import sorted_batches
from app.data.corpus import ParallelData
from app.data.symmetrization import AGREEMENT, agreement, symmetrize
from app.data.tokenizer import PAD, Tokenizer
from app.decode.ensemble import Ensemble
from app.decode.search import Hypotheses
from app.decode.trained import TrainedModel
from app.evaluation.alignment import LinkCandidates, link_candidates, links_view, read_direction
from app.evaluation.extraction import Method, has_reading, read_links, read_probabilities
from app.evaluation.head_roles import HeadRoles
from app.evaluation.metrics import score, split_scores, ter_of_statistics, ter_statistics
from app.evaluation.records import SentenceRecord, add_copy_shares, add_self_attention, sentence_records
from app.evaluation.views import attention_shape
from app.models import Family, sequence_loss
from app.models.api import AnySeq2Seq, Copying, SelfAttending
from app.run.device import autocast
from app.run.host_worker import HostWorker, Job, submit
from app.run.stopwatch import Stopwatch

# a search: (sources, whether each hypothesis' attention is wanted, progress bar or not) -> hypotheses
Search = Callable[[list[list[int]], bool, bool], Hypotheses]


@dataclass
class Alignment:
    """What AER is scored against: per pair of the split, its reference links (sure, possible), counted over
    ``scope``'s target words; the view reported is the best on ``dev`` (a split and its links) where given, else
    on the split itself (said by ``chosen_on``). The forced attention of the first ``keep`` pairs is kept."""

    links: list[tuple[set, set]]
    scope: str
    split: str  # the split's name: where the view is chosen without ``dev``
    gold: Optional[str] = None  # the file the links came from, named in the result
    dev: Optional[tuple[ParallelData, list[tuple[set, set]]]] = None
    dev_name: str = "dev"  # where the view was chosen when ``dev`` is given ("dev (first 80 of 1,019 sentences)")
    keep: int = 0
    reverse: Optional[TrainedModel] = None  # a run of the other direction (align.reverse): symmetrized methods too
    method: str = "auto"  # align.method: the methods the choice is made among (app/evaluation/extraction.py)


@dataclass
class Asked:
    """What an evaluation of a split computes, beyond its hypotheses.

    ``scores``: "corpus" (BLEU and chrF, in the worker beside the model's passes: validation) or "split" (BLEU,
    chrF, TER, BLEU by source length (``length_buckets``) and of the longest 10 %, each sentence's BLEU: make eval;
    TER's ``ter_share`` in the worker). ``records``: the sentences that get a record of their attention: None for every
    one, from the hypotheses' own decoding; a list for those sentences only, decoded again with their attention
    (validation's TensorBoard sentences). ``keep`` and ``layer``: the views a record stores (eval.attention,
    viz.layer); ``references``: the reference's pieces in each record; ``links``: each record's word links
    (hyp.align). ``self_attention``: a Transformer's, into the records, with what each head does. ``copy_shares``: a
    copying model's share of each hypothesis piece that came through copying, into the records. ``loss``: the
    teacher-forced loss and perplexity. ``on_records``: called with the records once they exist. ``bleu_tokenize``:
    the words BLEU counts (app/evaluation/metrics.py's bleu_tokenizer). ``more_references``: further reference
    translations of the split's sentences, a list a line per sentence each (eval.references): every score counts
    them beside the split's own."""

    bleu_tokenize: str
    scores: str = "corpus"
    length_buckets: Sequence[int] = (10, 20, 30, 40, 50)
    ter_share: float = 0.0
    records: Optional[Sequence[int]] = ()
    keep: Optional[str] = None
    layer: int = -1
    references: bool = False
    links: bool = False
    self_attention: bool = False
    copy_shares: bool = False
    alignment: Optional[Alignment] = None
    loss: bool = False
    progress: bool = False
    on_records: Optional[Callable[[list[SentenceRecord]], Any]] = None
    more_references: Sequence[list[str]] = ()


@dataclass
class SplitResult:
    """An evaluated split: the hypotheses and their texts; the scores (``metrics``, complete after ``finish``: with
    the loss where asked); each sentence's BLEU (scores "split"); the records and the hypotheses they were read from
    (``samples``), the entropy and monotonicity of their attention (``attention``) and the view their word links
    were read from (``links_view``); AER's result (``alignment``) with the forced attention kept for plots
    (``forced``, by pair index) and the method AER chose (``method``, what hyp.align reads too); what each
    self-attention head does (``heads``); how much of the hypotheses a copying model copied (``copy``)."""

    hypotheses: Hypotheses
    texts: list[str]
    references: list[str]
    metrics: dict = field(default_factory=dict)
    sentence_bleu: Optional[list[float]] = None
    records: list[SentenceRecord] = field(default_factory=list)
    samples: Optional[Hypotheses] = None
    attention: Optional[dict] = None
    links_view: Optional[str] = None
    alignment: Optional[dict] = None
    method: Optional[Method] = None
    forced: dict[int, torch.Tensor] = field(default_factory=dict)
    heads: dict[str, HeadRoles] = field(default_factory=dict)
    copy: Optional[dict] = None
    pending: Optional[Job] = None  # scores in the worker
    in_worker: bool = False  # whether a worker process took its share
    ter_from: int = 0  # where this process's share of TER begins (the worker counts the sentences before)
    ter_seconds: float = 0.0  # how long the worker's share took
    bleu_tokenize: str = "13a"  # the words BLEU counts, and so TER's (app.evaluation.metrics.ter_metric)
    more_references: Sequence[list[str]] = ()  # Asked's: further reference streams

    def finish(self) -> dict:
        """The scores with what the worker computed: a validation's BLEU and chrF, or the worker's share of TER
        (with the rest counted here). Call it once, after the work that runs beside it."""
        if self.pending is None:
            return self.metrics
        done, self.pending = self.pending.result(), None
        if "ter" not in self.metrics and isinstance(done, dict):  # corpus scores
            self.metrics.update(done)
            return self.metrics
        shared, shared_signature, self.ter_seconds = done
        tail = (self.texts[self.ter_from :], self.references[self.ter_from :])
        more = [stream[self.ter_from :] for stream in self.more_references]
        rest, signature, _ = ter_statistics(*tail, self.bleu_tokenize, more)
        self.metrics = with_ter(self.metrics, ter_of_statistics(shared + rest, shared_signature or signature))
        return self.metrics


def evaluate_split(
    model: Family | Ensemble,
    data: ParallelData,
    tokenizer: Tokenizer,
    search: Search,
    asked: Asked,
    batch_tokens: int,
    dtype: Optional[torch.dtype] = None,
    worker: Optional[HostWorker] = None,
    clock: Optional[Stopwatch] = None,
    plan: Optional[Callable[[Hypotheses], None]] = None,
) -> SplitResult:
    """Evaluate ``data`` as ``asked``: hypotheses from ``search``; ``model`` (the torch model, even where another
    engine searched) for the forced passes, batched by ``batch_tokens``; ``worker`` for the host work beside them;
    ``clock`` times the parts (decode, score, alignment, files, self-attention, forward); ``plan`` is told the
    hypotheses once they exist (make eval says what is left)."""
    clock = clock if clock is not None else Stopwatch()
    device = next(model.parameters()).device
    every = asked.records is None
    with clock("decode"):
        hyps = search(data.src, every, asked.progress)
    texts = tokenizer.decode_tgt(hyps.tokens)
    more = asked.more_references
    tokenize, in_worker = asked.bleu_tokenize, worker is not None
    result = SplitResult(hyps, texts, data.tgt_texts, in_worker=in_worker, bleu_tokenize=tokenize, more_references=more)
    with clock("score"):
        if asked.scores == "corpus":
            result.pending = submit(worker, score, texts, data.tgt_texts, tokenize, False, more)
        else:  # TER of a share of the sentences in the worker, on another core, while the rest is done here
            result.ter_from = round(asked.ter_share * len(texts)) if worker else 0
            cut = result.ter_from
            head = [stream[:cut] for stream in more]
            result.pending = submit(worker, ter_statistics, texts[:cut], data.tgt_texts[:cut], tokenize, head)
    if plan is not None:
        plan(hyps)
    if asked.scores == "split":
        with clock("score"):
            buckets = list(asked.length_buckets)
            result.metrics, result.sentence_bleu = split_scores(
                texts, data.tgt_texts, data.src_texts, buckets, tokenize, False, more
            )
    records_of(result, model, data, tokenizer, search, asked, device, dtype, batch_tokens, clock)
    if asked.loss:
        with clock("forward"):
            result.metrics.update(teacher_forced_loss(model, data, batch_tokens, device, dtype))
    if asked.alignment is not None:
        with clock("alignment"):
            align(result, model, data, tokenizer, asked.alignment, device, dtype, batch_tokens, asked.progress)
    if asked.links and result.records:
        with clock("files"):
            reverse = asked.alignment.reverse if asked.alignment is not None else None
            read_hypothesis_links(result, data, asked.layer, reverse, batch_tokens)
    return result


def read_hypothesis_links(
    result: SplitResult, data: ParallelData, layer: int, reverse: Optional[TrainedModel], batch_tokens: int
) -> None:
    """Each record's word links (hyp.align's, and the explorer outlines them on the hypothesis' map), read by the
    method AER chose where its view is among the attention's (an export has one map), else from the view plots show
    (``layer``'s mean of heads); a symmetrized method reads the reverse run's attention over the hypotheses too."""
    records, method = result.records, result.method
    if method is None or not has_reading(records[0].attention, method.forward):
        method = Method(links_view(records[0].attention, layer))
    result.links_view = method.name
    turned = None
    if method.symmetrization is not None and reverse is not None:
        rsrc = reverse.tokenizer.encode_src([result.texts[r.index] for r in records])
        rtgt = reverse.tokenizer.encode_tgt([data.src_texts[r.index] for r in records])
        texts = ([result.texts[r.index] for r in records], [data.src_texts[r.index] for r in records])
        passes = (reverse.model, reverse.tokenizer, rsrc, rtgt, texts, reverse.device, reverse.dtype, batch_tokens)
        agreeing = [str(method.reverse)] if method.symmetrization == AGREEMENT else []
        turned, _ = read_direction(*passes, [str(method.reverse)], soft=agreeing)
    for n, r in enumerate(records):
        if turned is not None and method.symmetrization == AGREEMENT and method.threshold is not None:
            p_fwd = read_probabilities(r.attention, r.src_words, r.hyp_words, [method.forward])[0]
            p_rev = turned.probabilities.get((n, str(method.reverse)))
            r.hyp_links = set() if p_rev is None else agreement(p_fwd, p_rev, method.threshold)
            continue
        r.hyp_links = read_links(r.attention, r.src_words, r.hyp_words, method.forward)
        if turned is not None and method.symmetrization is not None:
            r.hyp_links = symmetrize(method.symmetrization, r.hyp_links, turned.links(n, str(method.reverse), True))


def records_of(
    result: SplitResult,
    model: AnySeq2Seq,
    data: ParallelData,
    tokenizer: Tokenizer,
    search: Search,
    asked: Asked,
    device,
    dtype,
    batch_tokens: int,
    clock: Stopwatch,
) -> None:
    """The records ``asked`` for, with their views and self-attention, handed to ``asked.on_records``."""
    if asked.records is None:
        sampled, indices = result.hypotheses, None
    elif asked.records:
        with clock("decode"):
            indices = list(asked.records)
            sampled = search([data.src[i] for i in indices], True, False)
    else:
        return
    result.samples = sampled
    if sampled.attention is None:  # a model without attention
        return
    with clock("files"):
        progress = "attention views" if asked.progress else ""
        records = sentence_records(
            data, sampled, tokenizer, indices, asked.keep, asked.layer, asked.references, progress
        )
        result.attention = attention_shape(sampled.attention, asked.layer)
    if asked.self_attention and isinstance(model, SelfAttending):
        with clock("self-attention"):  # one teacher-forced pass of every hypothesis, without logits
            hypotheses = sampled.tokens
            passes = (model, data.src, hypotheses, device, batch_tokens, dtype)
            progress = "self-attention" if asked.progress else ""
            keep = asked.keep or "layer"
            result.heads = add_self_attention(records, *passes, keep=keep, layer=asked.layer, progress=progress)
    if asked.copy_shares and isinstance(model, Copying):
        with clock("copy shares"):  # one teacher-forced pass of every hypothesis
            result.copy = add_copy_shares(records, model, data.src, sampled.tokens, device, batch_tokens, dtype)
    result.records = records
    if asked.on_records is not None:
        asked.on_records(records)


def align(
    result: SplitResult,
    model,
    data: ParallelData,
    tokenizer: Tokenizer,
    asked: Alignment,
    device,
    dtype,
    batch_tokens: int,
    progress: bool = False,
) -> None:
    """AER of every method of reading links from the teacher-forced attention (each head of each layer, each layer's
    mean, an RNN's one map; each as it is and shift-att; with a run of the other direction, its reading that joins
    this run's best, symmetrized and agreeing) against ``asked.links``, the method reported chosen on ``asked.dev``
    where given (an optimistic choice on the split itself otherwise, said so). None for a model without attention."""

    def read(split: ParallelData, keep: int = 0, title: str = "", only=None, soft=None):
        """Every reading of each direction over ``split`` (or ``only`` those two), and the word probabilities of
        the readings ``soft`` (each direction's: what agreement multiplies)."""
        pairs, texts = (split.src, split.tgt), (split.src_texts, split.tgt_texts)
        readings = (None, None) if only is None else ([only[0]], [only[1]])
        probabilities = ((), ()) if soft is None else ([soft[0]], [soft[1]])
        passes = (device, dtype, batch_tokens, asked.reverse, readings, keep, title if progress else "", probabilities)
        return link_candidates(model, tokenizer, pairs, texts, *passes)

    if asked.dev is not None:  # chosen on dev; the split is read after the choice, once
        chooser, _ = read(asked.dev[0], title="AER on dev")
        gold, chosen_on, choice = asked.dev[1], asked.dev_name, asked.dev[0]
    else:  # chosen on the split itself (an optimistic choice, said so)
        chooser, result.forced = read(data, asked.keep, f"AER on {asked.split}")
        gold, chosen_on, choice = asked.links, asked.split, data
    if chooser is None:  # a model without attention
        return
    two = lambda directions: read(choice, only=directions, soft=directions)[0]  # noqa: E731
    method, directions, chosen_by = chooser.choose(gold, asked.scope, asked.method, two)
    on_split = chooser
    if asked.dev is not None:
        soft = directions if chooser.agreeing(directions) else None
        found, result.forced = read(data, asked.keep, f"AER on {asked.split}", soft=soft)
        on_split = cast(LinkCandidates, found)
    methods = on_split.methods(directions)
    score = on_split.score(asked.links, asked.scope, methods)
    result.method = method
    best_of_kind = {}  # each kind of method (align.method) at its best reading, chosen as the reported one is
    for kind in dict.fromkeys(m.kind for m in methods):
        of_kind = chosen_by.best([m.name for m in methods if m.kind == kind])
        best_of_kind[kind] = {"method": of_kind, **score.result(of_kind)}
    result.alignment = {
        **score.result(method.name),
        "view": method.view,
        "method": method.name,
        "chosen_on": chosen_on,
        "gold": asked.gold,
        "scope": asked.scope,
        "aer_by_view": {name: score.result(name)["aer"] for name in score.views},
        "by_method": best_of_kind,
    }


def teacher_forced_loss(model: torch.nn.Module, data: ParallelData, batch_tokens: int, device, dtype) -> dict:
    """The split's loss and perplexity under teacher forcing, without label smoothing."""
    was_training = model.training
    model.eval()
    try:
        loss = mean_loss(model, data, batch_tokens, device, dtype)
    finally:
        model.train(was_training)
    return {"loss": loss, "ppl": math.exp(min(loss, 50))}


def mean_loss(
    model: torch.nn.Module, data: ParallelData, batch_tokens: int, device, dtype, grads=None, progress: str = ""
) -> float:
    """The loss of ``data`` teacher forced, in nats per target token, in the model's mode as it is; with ``grads``
    (tensors requiring grad: make heads' gates) each batch's |∂ loss sum / ∂ tensor| is added to the tensor's
    ``.grad``. ``progress``: a bar's title (none: no bar)."""
    loss_sum, tokens = 0.0, 0
    batches = sorted_batches(data.src, data.tgt, batch_tokens)
    for batch in tqdm(batches, desc=progress, unit="batch", disable=not progress, leave=False):
        batch = batch.to(device)
        tgt_in, tgt_out = batch.targets
        with torch.set_grad_enabled(grads is not None), autocast(device, dtype):
            logits = model(batch.src, tgt_in, src_lengths=batch.src_lengths)
        loss = sequence_loss(logits.float(), tgt_out)
        if grads is not None:
            for tensor, grad in zip(grads, torch.autograd.grad(loss, grads)):
                tensor.grad = grad.abs() if tensor.grad is None else tensor.grad + grad.abs()
        loss_sum += loss.item()
        tokens += int((tgt_out != PAD).sum())
    return loss_sum / max(tokens, 1)


def with_ter(metrics: dict, ter: dict) -> dict:
    """``metrics`` with TER and its signature after chrF's, where ``score`` puts them."""
    keys = list(metrics)
    at = keys.index("chrf_signature") + 1
    return {**{k: metrics[k] for k in keys[:at]}, **ter, **{k: metrics[k] for k in keys[at:]}}
