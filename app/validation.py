"""Validation during training: dev loss and perplexity (teacher forcing), dev BLEU/chrF of greedy
translations, and the alignment heatmaps of a few dev sentences, all logged to TensorBoard."""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from app.alignment import align_scope, attention_shape, score_alignments
from app.board import add_alignment_figures, sample_table, tensorboard_sentences
from app.config import Config
from app.data.batching import sorted_batches
from app.data.corpus import ParallelData
from app.data.tokenizer import PAD, Tokenizer
from app.decoding import decode_corpus
from app.scoring import score, sentence_bleu
from app.update import sequence_loss
from app.utils import amp_dtype, autocast


@torch.no_grad()
def dev_scores(
    model, dev: ParallelData, tokenizer: Tokenizer, cfg: Config, device, dtype, progress: bool = False
) -> dict:
    """Dev perplexity (teacher forcing, no smoothing) and dev BLEU/chrF of greedy translations."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in sorted_batches(dev.src, dev.tgt, cfg.decode.batch_tokens):
        batch = batch.to(device)
        with autocast(device, dtype):
            logits = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths)
        loss_sum += sequence_loss(logits.float(), batch.tgt_out).item()
        tokens += int((batch.tgt_out != PAD).sum())
    hyps = decode_corpus(model, dev.src, device, cfg.decode.greedy(), amp_dtype=dtype, progress=progress)
    metrics = score(tokenizer.decode_tgt(hyps.tokens), dev.tgt_texts, ter=False)
    model.train()
    return {"loss": loss_sum / tokens, "ppl": math.exp(min(loss_sum / tokens, 50)), **metrics}


@torch.no_grad()
def log_samples(writer, model, dev: ParallelData, tokenizer: Tokenizer, cfg: Config, device, dtype, step: int) -> None:
    """The same ``viz.sentences`` dev sentences at every validation, greedily translated: a text table
    (source, reference, hypothesis, sentence BLEU) and their heatmaps, sized for TensorBoard's IMAGES
    tab (sentences short enough for readable labels), and two scalars over them: mean attention
    entropy and monotonicity (the step slider shows alignment emerging)."""
    chosen = tensorboard_sentences(dev.src, min(cfg.viz.sentences, len(dev)))
    if not chosen:
        return
    src = [dev.src[i] for i in chosen]
    hyps = decode_corpus(model, src, device, cfg.decode.greedy(), amp_dtype=dtype, need_attention=True)
    texts, refs = tokenizer.decode_tgt(hyps.tokens), [dev.tgt_texts[i] for i in chosen]
    table = sample_table(
        [dev.ids[i] for i in chosen], [dev.src_texts[i] for i in chosen], refs, texts, sentence_bleu(texts, refs)
    )
    writer.add_text("dev/samples", table, step)
    if hyps.attention is None:  # a model without attention
        return
    pairs = list(zip(src, hyps.tokens, hyps.attention))
    add_alignment_figures(writer, "alignment", pairs, tokenizer, cfg.viz.layer, step)
    shape = attention_shape(hyps.attention, cfg.viz.layer)
    writer.add_scalar("dev/attention_entropy", shape["entropy"], step)
    writer.add_scalar("dev/attention_monotonicity", shape["monotonicity"], step)


def validate(
    model, dev: ParallelData, dev_links, tokenizer: Tokenizer, cfg: Config, writer, progress, closing: bool = False
) -> dict:
    """One validation at ``progress.step``: scores and heatmaps to TensorBoard, recorded in ``progress``
    (best dev BLEU, early stopping), a line on the console; returns the scores and whether they are
    the best so far. With the dev split's reference links (``dev_links``), also the AER of the best
    view of the attention (``dev/aer``). ``closing``: the validation after the last step, with a progress bar
    (nothing else is on screen then)."""
    device = next(model.parameters()).device
    dtype = amp_dtype(cfg.train.amp, device)
    start, step = time.time(), progress.step
    if closing:
        tqdm.write(f"step {step}: closing validation on {len(dev)} dev sentences")
    metrics = dev_scores(model, dev, tokenizer, cfg, device, dtype, progress=closing)
    log_samples(writer, model, dev, tokenizer, cfg, device, dtype, step)
    aer = ""
    if dev_links is not None:
        scope = align_scope(cfg.eval.align_scope, gold_file=False)  # the corpus's own links, as make eval scores them
        batch_tokens = cfg.decode.batch_tokens
        score, _ = score_alignments(model, dev, dev_links, tokenizer, device, dtype, batch_tokens, scope=scope)
        if score is not None:
            view = score.best()
            metrics["aer"], metrics["aer_view"] = score.result(view)["aer"], view
            aer = f" AER {metrics['aer']:.3f} ({view})"
    for key in ("loss", "ppl", "bleu", "chrf", "aer"):
        if key in metrics:
            writer.add_scalar(f"dev/{key}", metrics[key], step)
    seconds = time.time() - start
    metrics["improved"] = progress.record_validation(metrics["bleu"], seconds)
    tqdm.write(
        f"step {step}: dev loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} BLEU {metrics['bleu']:.2f} "
        f"chrF {metrics['chrf']:.2f}{aer} ({seconds:.0f}s){' *best*' if metrics['improved'] else ''}"
    )
    return metrics
