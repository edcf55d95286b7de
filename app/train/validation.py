"""Validation during training: dev loss and perplexity (teacher forcing), dev BLEU/chrF of greedy
translations, and the alignment heatmaps, sample table and attention scalars of a few dev sentences, all
logged to TensorBoard at the validation's step.

Host work off the training process: scoring the dev translations and drawing the heatmaps run in a worker
process (app/host_worker.py; ``viz.worker``) while this one does the dev loss's forward passes, and are
collected before the validation returns. Each validation is timed by part: the forward passes and
decoding it cannot do without, and the host work around them; the console line and the scalars
``dev/validation_seconds`` and ``dev/host_seconds`` say how long each took."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
from tqdm import tqdm

from app.config import Config
from app.data.batching import sorted_batches
from app.data.corpus import ParallelData
from app.data.tokenizer import PAD, Tokenizer
from app.decode.corpus import decode_corpus
from app.host_worker import HostWorker, host_worker, submit
from app.report.aer import align_scope, score_alignments
from app.report.attention_views import attention_shape
from app.report.board import alignment_figures, sample_table, tensorboard_sentences, write_pngs
from app.report.plots import draw_pngs
from app.report.scores import score, sentence_bleu
from app.report.split_pass import add_self_attention, sentence_records
from app.train.stop_rules import abortable
from app.train.update import sequence_loss
from app.utils import Stopwatch, amp_dtype, autocast

# the parts of a validation that run the model; the rest of its time is host work
MODEL_PARTS = ("forward", "decode", "aer")


@torch.no_grad()
def dev_loss(model, dev: ParallelData, cfg: Config, device, dtype) -> dict:
    """Dev loss and perplexity: teacher forcing, no label smoothing."""
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in sorted_batches(dev.src, dev.tgt, cfg.decode.batch_tokens):
        batch = batch.to(device)
        with autocast(device, dtype):
            logits = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths)
        loss_sum += sequence_loss(logits.float(), batch.tgt_out).item()
        tokens += int((batch.tgt_out != PAD).sum())
    model.train(was_training)
    return {"loss": loss_sum / tokens, "ppl": math.exp(min(loss_sum / tokens, 50))}


def validation_worker(cfg: Config) -> Optional[HostWorker]:
    """The process validation sends its scoring and drawing to (None with viz.worker=false), started on the
    first call. Training calls it before it loads its data: the worker's start-up (a fresh interpreter
    importing numpy, matplotlib and sacrebleu, half a CPU second) then runs beside that, not beside the first
    validation's decoding, whose threads it slowed (a tiny CLI run's first validation: 0.6 s more on 2 cores)."""
    return host_worker(preload=(score.__module__, draw_pngs.__module__)) if cfg.viz.worker else None


def validate(
    model, dev: ParallelData, dev_links, tokenizer: Tokenizer, cfg: Config, writer, progress, closing: bool = False
) -> dict:
    """One validation at ``progress.step``: scores and heatmaps to TensorBoard, recorded in ``progress``
    (best dev BLEU, early stopping), a line on the console; returns the scores, whether they are the best
    so far, and the seconds of each part (``seconds``; ``host``: all but the forward passes and decoding).

    The same ``viz.sentences`` dev sentences every time, greedily translated: a text table (source,
    reference, hypothesis, sentence BLEU), their heatmaps sized for TensorBoard's IMAGES tab (sentences
    short enough for readable labels), and two scalars over them, mean attention entropy and monotonicity
    (the step slider shows alignment emerging). With the dev split's reference links (``dev_links``), also
    the AER of the best view of the attention (``dev/aer``). ``closing``: the validation after the last
    step, with a progress bar (nothing else is on screen then). During training a signal stops its model work
    and its wait for the worker at once (``abortable``, app/train/stop_rules.py): nothing of it is recorded."""
    device = next(model.parameters()).device
    dtype = amp_dtype(cfg.train.amp, device)
    start, step, clock = time.perf_counter(), progress.step, Stopwatch()
    worker = validation_worker(cfg)
    if closing:
        tqdm.write(f"step {step}: closing validation on {len(dev)} dev sentences")
    with abortable():  # the model's work and the worker's: a signal during training stops it at once
        greedy = cfg.decode.greedy()
        with clock("decode"):
            hyps = decode_corpus(model, dev.src, device, greedy, amp_dtype=dtype, progress=closing)
        scoring = submit(worker, score, tokenizer.decode_tgt(hyps.tokens), dev.tgt_texts, False)
        chosen = tensorboard_sentences(dev.src, min(cfg.viz.sentences, len(dev)))
        samples = drawing = None
        if chosen:
            with clock("decode"):
                src = [dev.src[i] for i in chosen]
                samples = decode_corpus(model, src, device, greedy, amp_dtype=dtype, need_attention=True)
            if samples.attention is not None:  # a model with attention: the one pass's records, only for TensorBoard
                records = sentence_records(dev, samples, tokenizer, chosen)
                if cfg.viz.self_attention and hasattr(model, "self_attention"):  # a Transformer's, of these sentences
                    with clock("forward"):
                        batch = (model, dev.src, samples.tokens, device, cfg.decode.batch_tokens, dtype)
                        add_self_attention(records, *batch, keep="layer", layer=cfg.viz.layer)
                drawing = submit(worker, draw_pngs, alignment_figures("alignment", records, cfg.viz.layer))
        with clock("forward"):
            metrics = dev_loss(model, dev, cfg, device, dtype)
        aer = ""
        if dev_links is not None:
            # the corpus's own links, as make eval scores them
            scope = align_scope(cfg.eval.align_scope, gold_file=False)
            with clock("aer"):  # forced attention (forward passes) and each view's hard alignments
                result, _ = score_alignments(
                    model, dev, dev_links, tokenizer, device, dtype, cfg.decode.batch_tokens, scope=scope
                )
            if result is not None:
                view = result.best()
                metrics["aer"], metrics["aer_view"] = result.result(view)["aer"], view
                aer = f" AER {metrics['aer']:.3f} ({view})"
        with clock("wait"):  # for the worker, where it took longer than the forward passes
            metrics.update(scoring.result())
            pngs = drawing.result() if drawing is not None else {}
    if samples is not None:
        texts, refs = tokenizer.decode_tgt(samples.tokens), [dev.tgt_texts[i] for i in chosen]
        ids, sources = [dev.ids[i] for i in chosen], [dev.src_texts[i] for i in chosen]
        writer.add_text("dev/samples", sample_table(ids, sources, refs, texts, sentence_bleu(texts, refs)), step)
        write_pngs(writer, pngs, step)
        if samples.attention is not None:
            shape = attention_shape(samples.attention, cfg.viz.layer)
            writer.add_scalar("dev/attention_entropy", shape["entropy"], step)
            writer.add_scalar("dev/attention_monotonicity", shape["monotonicity"], step)
            metrics.update(attention_entropy=shape["entropy"], attention_monotonicity=shape["monotonicity"])
    for key in ("loss", "ppl", "bleu", "chrf", "aer"):
        if key in metrics:
            writer.add_scalar(f"dev/{key}", metrics[key], step)
    seconds = time.perf_counter() - start
    host = seconds - sum(clock.seconds.get(part, 0.0) for part in MODEL_PARTS)
    writer.add_scalar("dev/validation_seconds", seconds, step)
    writer.add_scalar("dev/host_seconds", host, step)
    metrics["seconds"] = {**clock.rounded(), "host": round(host, 2), "total": round(seconds, 2)}
    metrics["improved"] = progress.record_validation(metrics["bleu"], seconds)
    parts = ", ".join(f"{part} {clock.seconds[part]:.1f}s" for part in MODEL_PARTS if part in clock.seconds)
    tqdm.write(
        f"step {step}: dev loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} BLEU {metrics['bleu']:.2f} "
        f"chrF {metrics['chrf']:.2f}{aer} ({seconds:.0f}s: {parts}, host {host:.1f}s)"
        f"{' *best*' if metrics['improved'] else ''}"
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
    dev_loss(model, sample, cfg, device, dtype)
    forward = time.perf_counter() - decoded
    decode = decoded - start
    return (decode + forward * (1 + with_links)) * len(dev) / len(picks) + decode * bool(cfg.viz.sentences)
