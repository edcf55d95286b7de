"""``make eval``: a split decoded by a run's checkpoint (or its CTranslate2 export), scored with sacrebleu,
its attention measured against reference links where the corpus has them, and what a person reads written
beside it: ``hyp.txt``, ``metrics.json``, the alignment files and heatmaps, the explorer, TensorBoard.
Each stage is timed: the command prints where its seconds went and ``metrics.json`` records it."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from app.alignment import (
    align_scope,
    alignment_view,
    attention_shape,
    attention_views,
    layer_views,
    piece_links,
    read_pharaoh,
    score_alignments,
)
from app.board import log_eval
from app.checkpoint import checkpoint_path
from app.config import Config, VizConfig
from app.data.corpus import ParallelData, load_split
from app.data.tokenizer import EOS, Tokenizer
from app.decoding import Hypotheses
from app.errors import UserError
from app.explorer import evaluation_records, write_explorer
from app.models import count_parameters
from app.plots import alignment_figure, figures, png_bytes
from app.scoring import sentence_bleu, split_scores
from app.trained import TrainedModel, check_engine, load_ct2, load_trained
from app.utils import Stopwatch, atomic_write, atomic_write_text, resolve_device


def evaluated(cfg: Config) -> bool:
    """Whether eval/<split>/metrics.json is newer than the checkpoint it would evaluate."""
    metrics = os.path.join(cfg.run_dir, "eval", cfg.eval.split, "metrics.json")
    checkpoint = checkpoint_path(cfg.run_dir, cfg.eval.checkpoint)
    return all(map(os.path.exists, (metrics, checkpoint))) and os.path.getmtime(metrics) >= os.path.getmtime(checkpoint)


def evaluate_run(cfg: Config) -> dict:
    """Decode ``eval.split`` with the run's ``eval.checkpoint``, score it, write ``eval/<split>/``."""
    check_engine("eval.engine", cfg.eval.engine)
    clock = Stopwatch()
    with clock("load"):
        trained = load_trained(cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device))
        data = load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
        ct2 = load_ct2(cfg, trained, "eval.engine") if cfg.eval.engine == "ct2" else None
    with clock("decode"):
        if ct2:
            hyps = ct2.translate(data.src, cfg.decode, need_attention=True)
        else:
            hyps = trained.translate(data.src, cfg.decode, progress=True, need_attention=True)
    texts = trained.tokenizer.decode_tgt(hyps.tokens)
    with clock("score"):
        metrics = split_scores(texts, data.tgt_texts, data.src_texts, list(cfg.eval.length_buckets))
        bleu = sentence_bleu(texts, data.tgt_texts)
    metrics.update(decoding_figures(cfg, trained, ct2, hyps, clock.seconds["decode"]))
    if hyps.attention is not None:  # of the hypotheses' attention, the map plots show (viz.layer)
        metrics["attention"] = attention_shape(hyps.attention, cfg.viz.layer)
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.split)
    gold_path = cfg.eval.gold_align or reference_links(trained.config.data.dir, cfg.eval.split)
    forced = None
    if gold_path:
        with clock("alignment"):
            forced = evaluate_alignment(trained, data, gold_path, cfg)
        if forced:
            metrics["alignment"] = forced.result
    with clock("files"):
        atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in texts))
        if hyps.attention is not None:
            write_alignments(out_dir, data, hyps, trained.tokenizer, cfg.viz, metrics.get("alignment"))
    if hyps.attention is not None:
        with clock("figures"):
            write_heatmaps(out_dir, data, hyps, trained.tokenizer, cfg.viz, forced)
        with clock("explorer"):
            records = evaluation_records(data, hyps, texts, bleu, trained.tokenizer, forced)
            meta = explorer_meta(cfg, trained, metrics)
            write_explorer(os.path.join(out_dir, "alignments.html"), records, f"{cfg.name}: {cfg.eval.split}", meta)
    with clock("tensorboard"):
        tb = log_eval(cfg, trained.config, trained.step, data, texts, bleu, hyps, metrics, trained.tokenizer)
    metrics["seconds"] = clock.rounded()
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    print_report(cfg, metrics, out_dir, tb, trained.step, ct2, hyps.attention is not None, clock)
    return metrics


def decoding_figures(cfg: Config, trained: TrainedModel, ct2, hyps: Hypotheses, seconds: float) -> dict:
    """How the split was decoded, on what, and how fast."""
    return {
        "split": cfg.eval.split,
        "checkpoint": cfg.eval.checkpoint,
        "decoding": "greedy"
        if cfg.decode.beam_size == 1
        else f"beam {cfg.decode.beam_size}, length penalty {cfg.decode.length_penalty}",
        "decode_seconds": round(seconds, 2),
        "sentences_per_s": round(len(hyps.tokens) / seconds, 1),
        "tokens_per_s": round(sum(len(h) + 1 for h in hyps.tokens) / seconds),
        # the largest cache of one decoding batch (decode.batch_tokens, beam size): compare runs decoded alike
        "kv_cache_mib": None if hyps.kv_cache_bytes is None else round(hyps.kv_cache_bytes / 2**20, 3),
        "device": torch.cuda.get_device_name(trained.device) if trained.device.type == "cuda" else "cpu",
        "engine": f"ctranslate2 {ct2.info['ctranslate2_version']}, {ct2.info['quantization']}" if ct2 else "torch",
    }


def print_report(
    cfg: Config, metrics: dict, out_dir: str, tb: str, step: int, ct2, has_attention: bool, clock: Stopwatch
) -> None:
    print(
        f"{cfg.eval.split} ({metrics['decoding']}): BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
        f"TER {metrics['ter']:.2f}  ({metrics['sentences']} sentences, {metrics['sentences_per_s']} sent/s "
        f"on {metrics['device']})"
    )
    if "alignment" in metrics:
        a = metrics["alignment"]
        print(
            f"  alignment vs {a['gold']}: AER {a['aer']:.4f}  precision {a['precision']:.4f}  "
            f"recall {a['recall']:.4f}  ({alignment_view(a)})"
        )
    if ct2:
        print(
            f"  decoded by CTranslate2 ({ct2.model_dir}, {ct2.info['quantization']}): its attention is the mean of the "
            f"heads of decoder layer {ct2.info['alignment_layer']}, so alignments.jsonl and the explorer have no "
            "per-head maps (eval.engine=torch has them); AER reads our model's attention, forced"
        )
    print(f"  {metrics['bleu_signature']}\n  {metrics['chrf_signature']}\n  {metrics['ter_signature']}")
    print(
        f"  wrote {out_dir}/hyp.txt, metrics.json"
        + (
            ", alignments.html (open it in a browser), alignments.jsonl and alignments/*.png"
            if has_attention
            else " (this model has no attention to plot)"
        )
        + f"; TensorBoard: {tb} at step {step}"
    )
    print(f"  time: {clock.line()}")


def explorer_meta(cfg: Config, trained: TrainedModel, metrics: dict) -> dict:
    """The explorer's header: what was evaluated, how, and how well."""
    model = trained.config.model
    family = model.arch if model.arch == "transformer" else f"rnn {model.attention}"
    meta = {
        "run": cfg.name,
        "model": f"{family} ({count_parameters(trained.model) / 1e6:.1f} M parameters)",
        "checkpoint": f"{cfg.eval.checkpoint} (step {trained.step})",
        "split": cfg.eval.split,
        "decoding": metrics["decoding"],
        "BLEU": f"{metrics['bleu']:.2f}",
        "chrF": f"{metrics['chrf']:.2f}",
    }
    if a := metrics.get("alignment"):
        meta["AER"] = f"{a['aer']:.3f} ({alignment_view(a)})"
    return meta


def write_alignments(
    out_dir: str, data: ParallelData, hyps: Hypotheses, tokenizer: Tokenizer, viz: VizConfig, alignment: Optional[dict]
) -> None:
    """``alignments.jsonl``: every sentence's tokens and the attention rows of the decoding that produced
    the hypothesis; with reference links, the view of the attention AER was scored on."""
    lines = []
    for i, attention in enumerate(hyps.attention):
        views = layer_views(attention, viz.layer)
        row = {
            "id": data.ids[i],
            "src_tokens": tokenizer.src_pieces(data.src[i] + [EOS]),
            "hyp_tokens": tokenizer.tgt_pieces(hyps.tokens[i] + [EOS]),
            "weights": views["weights"].round(decimals=4).tolist(),
        }
        if "head_weights" in views:
            row["layer"] = views["layer"]
            row["head_weights"] = views["head_weights"].round(decimals=4).tolist()
        if alignment:
            row["alignment_view"] = {"view": alignment["view"], "chosen_on": alignment["chosen_on"]}
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(os.path.join(out_dir, "alignments.jsonl"), "".join(line + "\n" for line in lines))


def write_heatmaps(
    out_dir: str,
    data: ParallelData,
    hyps: Hypotheses,
    tokenizer: Tokenizer,
    viz: VizConfig,
    forced: Optional[ForcedAlignment],
) -> None:
    """``alignments/NNNN*.png`` for the first ``viz.eval_plots`` sentences: the attention that produced the
    hypothesis and, with reference links, the forced attention of the view AER chose, the links over it."""
    plot_dir = os.path.join(out_dir, "alignments")
    shutil.rmtree(plot_dir, ignore_errors=True)  # plots of an earlier evaluation must not mix with these

    def save(name: str, fig) -> None:
        png = png_bytes(fig)
        atomic_write(os.path.join(plot_dir, name), lambda f: f.write(png))

    for i in range(min(viz.eval_plots, len(data))):
        src_tokens = tokenizer.src_pieces(data.src[i] + [EOS])
        hyp_tokens = tokenizer.tgt_pieces(hyps.tokens[i] + [EOS])
        for name, fig in figures(hyps.attention[i], src_tokens, hyp_tokens, viz.layer).items():
            save(f"{i:04d}{'' if name == 'alignment' else f'_{name}'}.png", fig)
        if forced is not None:
            ref_tokens = tokenizer.tgt_pieces(data.tgt[i] + [EOS])
            names, maps = attention_views(forced.attention[i])
            sure, possible = forced.links[i]
            links = [piece_links(cells, src_tokens, ref_tokens) for cells in (sure, possible - sure)]
            view = forced.result["view"]
            fig = alignment_figure(maps[names.index(view)], src_tokens, ref_tokens, f"{view}, reference forced", links)
            save(f"{i:04d}_reference.png", fig)


def reference_links(data_dir: str, split: str) -> Optional[str]:
    """``<data_dir>/<split>.align`` when the corpus has reference links for the split (app/data/prepare.py)."""
    path = os.path.join(data_dir, f"{split}.align")
    return path if os.path.exists(path) else None


@dataclass
class ForcedAlignment:
    """What ``evaluate_alignment`` measured: the scores (metrics.json's ``alignment``), and per sentence the
    teacher-forced attention (float16) and the reference links (sure, possible) it was scored against."""

    result: dict
    attention: dict[int, torch.Tensor]
    links: list[tuple[set, set]]


def evaluate_alignment(
    trained: TrainedModel, data: ParallelData, gold_path: str, cfg: Config
) -> Optional[ForcedAlignment]:
    """AER of every view of the teacher-forced attention (each head of each layer, each layer's mean;
    an RNN's one map) against ``gold_path``. The view reported is the best on dev when the corpus has
    dev links (and the gold is its own), else the best on this split (said so: an optimistic choice).
    None for a model without attention."""
    tok = trained.tokenizer
    scope = align_scope(cfg.eval.align_scope, gold_file=bool(cfg.eval.gold_align))
    run = lambda split_data, gold, keep=0: score_alignments(  # noqa: E731
        trained.model, split_data, gold, tok, trained.device, trained.dtype, cfg.decode.batch_tokens, keep, scope
    )
    gold = read_pharaoh(gold_path)
    score, kept = run(data, gold, len(data))
    if score is None:
        if cfg.eval.gold_align:
            raise UserError("eval.gold_align: this model has no attention to align with")
        return None
    view, chosen_on = score.best(), cfg.eval.split
    dev_path = reference_links(trained.config.data.dir, "dev")
    if cfg.eval.split != "dev" and dev_path and not cfg.eval.gold_align:
        dev = load_split(trained.config.data.dir, "dev", tok)
        view, chosen_on = run(dev, read_pharaoh(dev_path))[0].best(), "dev"
    views = {name: score.result(name)["aer"] for name in score.views}
    result = {**score.result(view), "view": view, "chosen_on": chosen_on, "gold": gold_path, "scope": scope}
    result["aer_by_view"] = views
    return ForcedAlignment(result, kept, gold)
