"""A trained run at work: loading it, evaluating it on a split, translating with it."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

from app.checkpoint import checkpoint_path, load_checkpoint
from app.config import Config, DecodeConfig, VizConfig, config_from_dict
from app.data.corpus import load_split, load_tokenizer
from app.data.tokenizer import EOS, Tokenizer
from app.decoding import Hypotheses, decode_corpus
from app.errors import UserError
from app.evaluation import bleu_by_length, bleu_of_longest, score
from app.models import build_model
from app.step import amp_dtype
from app.utils import atomic_write, atomic_write_text, autocast, resolve_device


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Config  # the configuration the model was trained with
    device: torch.device
    dtype: torch.dtype | None

    def translate(
        self, src: list[list[int]], decode: DecodeConfig, progress: bool = False, need_attention: bool = False
    ) -> Hypotheses:
        return decode_corpus(
            self.model, src, self.device, decode, amp_dtype=self.dtype, need_attention=need_attention, progress=progress
        )


def load_trained(run_dir: str, which: str, device: torch.device) -> TrainedModel:
    path = checkpoint_path(run_dir, which)
    state = load_checkpoint(path, device)
    trained = config_from_dict(state["config"])
    tokenizer = load_tokenizer(trained.data.dir, trained.tokenizer)
    if tokenizer.fingerprint() != state["vocab"]:
        raise UserError(f"{path}: the tokenizer {tokenizer.src_path} is not the one this model was trained with")
    model = build_model(trained.model, tokenizer)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return TrainedModel(model, tokenizer, trained, device, amp_dtype(trained.train.amp, device))


def evaluate_run(cfg: Config) -> dict:
    """Decode a split with a run's checkpoint, score it, write ``eval/<split>/{hyp.txt,metrics.json}``."""
    trained = load_trained(cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device))
    data = load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
    start = time.time()
    hyps = trained.translate(data.src, cfg.decode, progress=True, need_attention=True)
    seconds = time.time() - start
    texts = trained.tokenizer.decode_tgt(hyps.tokens)
    metrics = score(texts, data.tgt_texts)
    metrics["bleu_by_source_length"] = bleu_by_length(
        texts, data.tgt_texts, data.src_texts, list(cfg.eval.length_buckets)
    )
    metrics["bleu_longest_10pct"], metrics["longest_10pct_sentences"] = bleu_of_longest(
        texts, data.tgt_texts, data.src_texts, 0.1
    )
    # the largest cache of one decoding batch (decode.batch_tokens, beam size): compare runs decoded alike
    metrics["kv_cache_mib"] = None if hyps.kv_cache_bytes is None else round(hyps.kv_cache_bytes / 2**20, 3)
    metrics.update(
        split=cfg.eval.split,
        checkpoint=cfg.eval.checkpoint,
        decoding="greedy"
        if cfg.decode.beam_size == 1
        else f"beam {cfg.decode.beam_size}, length penalty {cfg.decode.length_penalty}",
        decode_seconds=round(seconds, 2),
        sentences_per_s=round(len(texts) / seconds, 1),
        tokens_per_s=round(sum(len(h) + 1 for h in hyps.tokens) / seconds),
        device=torch.cuda.get_device_name(trained.device) if trained.device.type == "cuda" else "cpu",
    )
    if cfg.eval.gold_align:
        from app.alignment import alignment_error_rate, read_pharaoh

        gold = read_pharaoh(cfg.eval.gold_align)
        metrics["alignment"] = {
            **alignment_error_rate(forced_alignments(trained, data, cfg), gold),
            "gold": cfg.eval.gold_align,
        }
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.split)
    atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in texts))
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    if hyps.attention is not None:
        write_alignments(out_dir, data, hyps, trained.tokenizer, cfg.viz)
    print(
        f"{cfg.eval.split} ({metrics['decoding']}): BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
        f"TER {metrics['ter']:.2f}  ({len(texts)} sentences, {metrics['sentences_per_s']} sent/s "
        f"on {metrics['device']})"
    )
    if "alignment" in metrics:
        a = metrics["alignment"]
        print(
            f"  alignment vs {a['gold']}: AER {a['aer']:.4f}  precision {a['precision']:.4f}  recall {a['recall']:.4f}"
        )
    print(f"  {metrics['bleu_signature']}\n  {metrics['chrf_signature']}\n  {metrics['ter_signature']}")
    print(
        f"  wrote {out_dir}/hyp.txt, metrics.json"
        + (
            ", alignments.jsonl and alignments/*.png"
            if hyps.attention is not None
            else " (this model has no attention to plot)"
        )
    )
    return metrics


def write_alignments(out_dir: str, data, hyps: Hypotheses, tokenizer: Tokenizer, viz: VizConfig) -> None:
    """``alignments.jsonl`` (every sentence: tokens and attention rows of the decoding that produced
    the hypothesis) and ``alignments/NNNN.png`` heatmaps for the first ``viz.eval_plots`` sentences."""
    from app.alignment import layer_views
    from app.plots import figures, png_bytes

    plot_dir = os.path.join(out_dir, "alignments")
    shutil.rmtree(plot_dir, ignore_errors=True)  # plots of an earlier evaluation must not mix with these
    lines = []
    for i, attention in enumerate(hyps.attention):
        src_tokens = tokenizer.src_pieces(data.src[i] + [EOS])
        hyp_tokens = tokenizer.tgt_pieces(hyps.tokens[i] + [EOS])
        views = layer_views(attention, viz.layer)
        row = {
            "id": data.ids[i],
            "src_tokens": src_tokens,
            "hyp_tokens": hyp_tokens,
            "weights": views["weights"].round(decimals=4).tolist(),
        }
        if "head_weights" in views:
            row["layer"] = views["layer"]
            row["head_weights"] = views["head_weights"].round(decimals=4).tolist()
        lines.append(json.dumps(row, ensure_ascii=False))
        if i < viz.eval_plots:
            for name, fig in figures(attention, src_tokens, hyp_tokens, viz.layer).items():
                suffix = "" if name == "alignment" else f"_{name}"
                png = png_bytes(fig)
                atomic_write(os.path.join(plot_dir, f"{i:04d}{suffix}.png"), lambda f, png=png: f.write(png))
    atomic_write_text(os.path.join(out_dir, "alignments.jsonl"), "".join(line + "\n" for line in lines))


@torch.no_grad()
def forced_alignments(trained: TrainedModel, data, cfg: Config) -> list[set]:
    """Hard word alignments of every (source, reference) pair from teacher-forced attention: gold
    alignments link source and *reference* words, so the attention is read while forcing the reference."""
    from app.alignment import hard_alignment, layer_views
    from app.data.batching import sorted_batches

    model, links = trained.model, [None] * len(data.src)
    for batch in sorted_batches(data.src, data.tgt, cfg.decode.batch_tokens):
        gpu_batch = batch.to(trained.device)
        with autocast(trained.device, trained.dtype):
            _, attention = model.decode(model.encode(gpu_batch.src), gpu_batch.tgt_in, need_attention=True)
        if attention is None:
            raise UserError("eval.gold_align: this model has no attention to align with")
        for j, i in enumerate(batch.index.tolist()):
            src_len, tgt_len = len(data.src[i]) + 1, len(data.tgt[i]) + 1
            weights = layer_views(attention[j].float().cpu(), cfg.viz.layer)["weights"][..., :tgt_len, :src_len]
            links[i] = hard_alignment(
                weights,
                trained.tokenizer.src_pieces(data.src[i] + [EOS]),
                trained.tokenizer.tgt_pieces(data.tgt[i] + [EOS]),
            )
    return links


def translate_lines(cfg: Config) -> None:
    """``make translate``: lines from translate.input (or stdin) to translate.output (or stdout); with
    decode.n_best > 1 in the Moses n-best format ``index ||| hypothesis ||| score``."""
    lines = read_translate_input(cfg.translate.input)  # bad input fails before the model loads
    trained = load_trained(cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device))
    hyps = trained.translate(trained.tokenizer.encode_src(lines), cfg.decode)
    if cfg.decode.n_best > 1:
        text = "".join(
            f"{i} ||| {trained.tokenizer.decode_tgt([tokens])[0]} ||| {score:.4f}\n"
            for i, hypotheses in enumerate(hyps.nbest)
            for tokens, score in hypotheses
        )
    else:
        text = "".join(t + "\n" for t in trained.tokenizer.decode_tgt(hyps.tokens))
    if cfg.translate.output:
        atomic_write_text(cfg.translate.output, text)
    else:
        sys.stdout.write(text)


def read_translate_input(path: str | None) -> list[str]:
    """Lines to translate from a file or stdin; an empty input or undecodable bytes is an error."""
    where = path or "standard input"
    if path and not os.path.isfile(path):
        raise UserError(f"translate.input={path!r}: file not found")
    source = open(path, "rb") if path else sys.stdin.buffer
    lines = []
    with source:
        for line_no, raw in enumerate(source, start=1):
            try:
                lines.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                raise UserError(f"{where}:{line_no}: not valid UTF-8") from None
    if not lines:
        raise UserError(f"{where}: nothing to translate (no input lines)")
    return lines
