"""Validation during training: the one evaluation of a split (app/evaluation/split.py) of the dev split, asked
for its teacher-forced loss and perplexity, the BLEU/chrF of greedy translations, AER where the corpus has dev
links, and the records of a few dev sentences; written to TensorBoard at the validation's step (heatmaps,
sample table, attention scalars).

Host work off the training process: scoring the dev translations and drawing the heatmaps run in a worker
process (app/run/host_worker.py; ``viz.worker``) while this one does the dev loss's forward passes, and are
collected before the validation returns. Each validation is timed by part: the forward passes and
decoding it cannot do without, and the host work around them; the console line and the scalars
``dev/validation_seconds`` and ``dev/host_seconds`` say how long each took."""

from __future__ import annotations

import logging
import time
from typing import Optional

from app.config.schema import Config, target_language
from app.data.corpus import ParallelData
from app.data.tokenizer import Tokenizer
from app.decode.passes import decode_corpus
from app.evaluation.alignment import align_scope
from app.evaluation.metrics import bleu_tokenizer, score, sentence_bleu
from app.evaluation.split import Alignment, Asked, evaluate_split, teacher_forced_loss
from app.report.board import alignment_figures, sample_table, tensorboard_sentences, write_pngs
from app.report.plots import draw_pngs
from app.run.console import announce
from app.run.device import amp_dtype
from app.run.host_worker import HostWorker, host_worker, submit
from app.run.stopwatch import Stopwatch
from app.train.state import ranking_score
from app.train.stop_rules import abortable

# the parts of a validation that run the model; the rest of its time is host work
MODEL_PARTS = ("forward", "decode", "alignment", "self-attention")

log = logging.getLogger(__name__)


def validation_worker(cfg: Config) -> Optional[HostWorker]:
    """The process validation sends its scoring and drawing to (None with viz.worker=false), started on the
    first call. Training calls it before it loads its data: the worker's start-up (a fresh interpreter
    importing numpy, matplotlib and sacrebleu) then runs beside that, not beside the first validation's
    decoding, whose threads it slowed (docs/benchmarking.md)."""
    return host_worker(preload=(score.__module__, draw_pngs.__module__)) if cfg.viz.worker else None


def validate(
    model, dev: ParallelData, dev_links, tokenizer: Tokenizer, cfg: Config, writer, progress, closing: bool = False
) -> dict:
    """One validation at ``progress.step``: the one evaluation of a split (app/evaluation/split.py) asked for the
    dev loss, greedy BLEU and chrF, the records of a few dev sentences and, with the dev split's reference links
    (``dev_links``), AER; written to TensorBoard, recorded in ``progress`` (best dev BLEU, early stopping), a line
    on the console. Returns the scores, whether they are the best so far, and the seconds of each part
    (``seconds``; ``host``: all but the model's passes).

    The same ``viz.sentences`` dev sentences every time, greedily translated: a text table (source,
    reference, hypothesis, sentence BLEU), their heatmaps sized for TensorBoard's IMAGES tab (drawn in the worker
    while the dev loss is computed), and two scalars over them, mean attention entropy and monotonicity (the step
    slider shows alignment emerging). ``closing``: the validation after the last step, with a progress bar
    (nothing else is on screen then). During training a signal stops its model work and its wait for the worker
    at once (``abortable``, app/train/stop_rules.py): nothing of it is recorded."""
    device = next(model.parameters()).device
    dtype = amp_dtype(cfg.train.amp, device)
    start, step, clock = time.perf_counter(), progress.step, Stopwatch()
    worker = validation_worker(cfg)
    if closing:
        announce(f"step {step}: closing validation on {len(dev)} dev sentences", log)
    greedy = cfg.decode.greedy()
    search = lambda src, attention, bar: decode_corpus(  # noqa: E731
        model, src, device, greedy, amp_dtype=dtype, need_attention=attention, progress=bar
    )
    drawing = []
    draw = lambda records: drawing.append(  # noqa: E731
        submit(worker, draw_pngs, alignment_figures("alignment", records, cfg.viz.layer))
    )
    chosen = tensorboard_sentences(dev.src, min(cfg.viz.sentences, len(dev)))
    scope = align_scope(cfg.eval.align_scope, gold_file=False)  # the corpus's own links, as make eval scores them
    tokenize = bleu_tokenizer(cfg.eval.bleu_tokenize, target_language(cfg.data))
    asked = Asked(
        tokenize,
        scores="corpus",
        records=chosen,
        layer=cfg.viz.layer,
        self_attention=cfg.viz.self_attention,
        alignment=None if dev_links is None else Alignment(dev_links, scope, "dev"),
        loss=True,
        progress=closing,
        on_records=draw,
    )
    with abortable():  # the model's work and the worker's: a signal during training stops it at once
        result = evaluate_split(model, dev, tokenizer, search, asked, cfg.decode.batch_tokens, dtype, worker, clock)
        with clock("wait"):  # for the worker, where it took longer than the model's passes
            metrics = result.finish()
            pngs = drawing[0].result() if drawing else {}
    aer = ""
    if result.alignment is not None:
        metrics["aer"], metrics["aer_view"] = result.alignment["aer"], result.alignment["method"]
        aer = f" AER {metrics['aer']:.3f} ({metrics['aer_view']})"
    if result.samples is not None:
        texts, refs = tokenizer.decode_tgt(result.samples.tokens), [dev.tgt_texts[i] for i in chosen]
        ids, sources = [dev.ids[i] for i in chosen], [dev.src_texts[i] for i in chosen]
        table = sample_table(ids, sources, refs, texts, sentence_bleu(texts, refs, tokenize))
        writer.add_text("dev/samples", table, step)
        write_pngs(writer, pngs, step)
        if result.attention is not None:
            shape = result.attention
            writer.add_scalar("dev/attention_entropy", shape["entropy"], step)
            writer.add_scalar("dev/attention_monotonicity", shape["monotonicity"], step)
            writer.add_scalar("dev/attention_reattention", shape["reattention"], step)
            metrics.update(
                attention_entropy=shape["entropy"],
                attention_monotonicity=shape["monotonicity"],
                attention_reattention=shape["reattention"],
            )
    for key in ("loss", "ppl", "bleu", "chrf", "aer"):
        if key in metrics:
            writer.add_scalar(f"dev/{key}", metrics[key], step)
    seconds = time.perf_counter() - start
    host = seconds - sum(clock.seconds.get(part, 0.0) for part in MODEL_PARTS)
    writer.add_scalar("dev/validation_seconds", seconds, step)
    writer.add_scalar("dev/host_seconds", host, step)
    metrics["seconds"] = {**clock.rounded(), "host": round(host, 2), "total": round(seconds, 2)}
    score = ranking_score(metrics, cfg.train.best_metric)
    metrics["improved"] = progress.record_validation(score, metrics["bleu"], seconds)
    parts = ", ".join(f"{part} {clock.seconds[part]:.1f}s" for part in MODEL_PARTS if part in clock.seconds)
    announce(
        f"step {step}: dev loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} BLEU {metrics['bleu']:.2f} "
        f"chrF {metrics['chrf']:.2f}{aer} ({seconds:.0f}s: {parts}, host {host:.1f}s)"
        f"{' *best*' if metrics['improved'] else ''}",
        log,
    )
    return metrics


def sampled_seconds(model, dev: ParallelData, cfg: Config, with_links: bool, share: int = 8) -> float:
    """What a validation of ``dev`` is expected to take, before any has run: one in ``share`` of its sentences
    (every ``share``-th by source length from the longest, so that greedy decoding runs as many steps as on
    the whole split) decoded greedily and teacher-forced as a validation does (twice with reference links: AER
    forces the reference again), the seconds scaled to the whole split; and as long again for the TensorBoard
    sentences decoded with their attention (``viz.sentences``: fewer than the sample, as many steps). Scaling
    by the number of sentences errs long where a batch's steps cost about the same whatever its size (a small
    model, a GPU). The host work (scores, heatmaps) is left out."""
    device = next(model.parameters()).device
    dtype = amp_dtype(cfg.train.amp, device)
    picks = sorted(range(len(dev)), key=lambda i: -len(dev.src[i]))[::share]
    if not picks:
        return 0.0
    sample = dev.select(picks)
    start = time.perf_counter()
    decode_corpus(model, sample.src, device, cfg.decode.greedy(), amp_dtype=dtype)
    decoded = time.perf_counter()
    teacher_forced_loss(model, sample, cfg.decode.batch_tokens, device, dtype)
    forward = time.perf_counter() - decoded
    decode = decoded - start
    return (decode + forward * (1 + with_links)) * len(dev) / len(picks) + decode * bool(cfg.viz.sentences)
