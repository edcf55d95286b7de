"""A trained run at work: loading it, evaluating it on a split, translating with it."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from app.alignment import align_scope, alignment_view, attention_shape, attention_views
from app.board import log_eval, sentence_bleu
from app.checkpoint import checkpoint_path, load_checkpoint, snapshot_step
from app.config import Config, DecodeConfig, VizConfig, config_from_dict
from app.data.corpus import load_split, load_tokenizer
from app.data.tokenizer import EOS, Tokenizer
from app.decoding import Hypotheses, decode_corpus
from app.errors import UserError
from app.evaluation import bleu_by_length, bleu_of_longest, score
from app.explorer import evaluation_records, write_explorer
from app.models import build_model, count_parameters
from app.step import amp_dtype
from app.utils import atomic_write, atomic_write_text, resolve_device


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Config  # the configuration the model was trained with
    device: torch.device
    dtype: torch.dtype | None
    step: int = 0  # the training step of the checkpoint (of the newest averaged snapshot)

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
    step = (
        state["progress"]["step"]
        if "progress" in state
        else max(map(snapshot_step, state.get("averaged", [])), default=0)
    )
    return TrainedModel(model, tokenizer, trained, device, amp_dtype(trained.train.amp, device), step)


def evaluated(cfg: Config) -> bool:
    """Whether eval/<split>/metrics.json is newer than the checkpoint it would evaluate."""
    metrics = os.path.join(cfg.run_dir, "eval", cfg.eval.split, "metrics.json")
    checkpoint = checkpoint_path(cfg.run_dir, cfg.eval.checkpoint)
    return all(map(os.path.exists, (metrics, checkpoint))) and os.path.getmtime(metrics) >= os.path.getmtime(checkpoint)


def evaluate_run(cfg: Config) -> dict:
    """Decode a split with a run's checkpoint, score it, write ``eval/<split>/{hyp.txt,metrics.json}``."""
    check_engine("eval.engine", cfg.eval.engine)
    trained = load_trained(cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device))
    data = load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
    ct2 = load_ct2(cfg, trained, "eval.engine") if cfg.eval.engine == "ct2" else None
    start = time.time()
    if ct2:
        hyps = ct2.translate(data.src, cfg.decode, need_attention=True)
    else:
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
        engine=f"ctranslate2 {ct2.info['ctranslate2_version']}, {ct2.info['quantization']}" if ct2 else "torch",
    )
    if hyps.attention is not None:  # of the hypotheses' attention, the map plots show (viz.layer)
        metrics["attention"] = attention_shape(hyps.attention, cfg.viz.layer)
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.split)
    gold_path = cfg.eval.gold_align or reference_links(trained.config.data.dir, cfg.eval.split)
    forced = None
    if gold_path:
        forced = evaluate_alignment(trained, data, gold_path, cfg, out_dir)
        if forced:
            metrics["alignment"] = forced.result
    atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in texts))
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    bleu = sentence_bleu(texts, data.tgt_texts)
    if hyps.attention is not None:
        write_alignments(out_dir, data, hyps, trained.tokenizer, cfg.viz, metrics.get("alignment"))
        meta = explorer_meta(cfg, trained, metrics)
        records = evaluation_records(data, hyps, texts, bleu, trained.tokenizer, forced)
        write_explorer(os.path.join(out_dir, "alignments.html"), records, f"{cfg.name}: {cfg.eval.split}", meta)
    tb = log_eval(cfg, trained.config, trained.step, data, texts, bleu, hyps, metrics, trained.tokenizer)
    print(
        f"{cfg.eval.split} ({metrics['decoding']}): BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
        f"TER {metrics['ter']:.2f}  ({len(texts)} sentences, {metrics['sentences_per_s']} sent/s "
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
            if hyps.attention is not None
            else " (this model has no attention to plot)"
        )
        + f"; TensorBoard: {tb} at step {trained.step}"
    )
    return metrics


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
    out_dir: str, data, hyps: Hypotheses, tokenizer: Tokenizer, viz: VizConfig, alignment: Optional[dict] = None
) -> None:
    """``alignments.jsonl`` (every sentence: tokens and attention rows of the decoding that produced
    the hypothesis; with reference links, the view of the attention AER was scored on) and
    ``alignments/NNNN.png`` heatmaps for the first ``viz.eval_plots`` sentences."""
    from app.alignment import layer_views
    from app.plots import figures, png_bytes

    plot_dir = os.path.join(out_dir, "alignments")
    if not alignment:  # else evaluate_alignment cleared the folder and drew the reference plots in it
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
        if alignment:
            row["alignment_view"] = {"view": alignment["view"], "chosen_on": alignment["chosen_on"]}
        lines.append(json.dumps(row, ensure_ascii=False))
        if i < viz.eval_plots:
            for name, fig in figures(attention, src_tokens, hyp_tokens, viz.layer).items():
                suffix = "" if name == "alignment" else f"_{name}"
                png = png_bytes(fig)
                atomic_write(os.path.join(plot_dir, f"{i:04d}{suffix}.png"), lambda f, png=png: f.write(png))
    atomic_write_text(os.path.join(out_dir, "alignments.jsonl"), "".join(line + "\n" for line in lines))


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
    trained: TrainedModel, data, gold_path: str, cfg: Config, out_dir: str
) -> Optional[ForcedAlignment]:
    """AER of every view of the teacher-forced attention (each head of each layer, each layer's mean;
    an RNN's one map) against ``gold_path``. The view reported is the best on dev when the corpus has
    dev links (and the gold is its own), else the best on this split (said so: an optimistic choice).
    Writes ``alignments/NNNN_reference.png``, the forced attention of that view with the links drawn
    over it, for the first ``viz.eval_plots`` sentences. None for a model without attention."""
    from app.alignment import piece_links, read_pharaoh, score_alignments
    from app.plots import alignment_figure, png_bytes

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
    plot_dir = os.path.join(out_dir, "alignments")
    shutil.rmtree(plot_dir, ignore_errors=True)  # plots of an earlier evaluation must not mix with these
    for i in range(min(cfg.viz.eval_plots, len(data))):
        attention = kept[i]
        src, ref = tok.src_pieces(data.src[i] + [EOS]), tok.tgt_pieces(data.tgt[i] + [EOS])
        names, maps = attention_views(attention)
        links = [piece_links(links, src, ref) for links in (gold[i][0], gold[i][1] - gold[i][0])]
        fig = alignment_figure(maps[names.index(view)], src, ref, f"{view}, reference forced", links)
        png = png_bytes(fig)
        atomic_write(os.path.join(plot_dir, f"{i:04d}_reference.png"), lambda f, png=png: f.write(png))
    views = {name: score.result(name)["aer"] for name in score.views}
    result = {**score.result(view), "view": view, "chosen_on": chosen_on, "gold": gold_path, "scope": scope}
    result["aer_by_view"] = views
    return ForcedAlignment(result, kept, gold)


def translate_lines(cfg: Config) -> None:
    """``make translate``: lines from translate.input (or stdin) to translate.output (or stdout); with
    decode.n_best > 1 in the Moses n-best format ``index ||| hypothesis ||| score``."""
    check_engine("translate.engine", cfg.translate.engine)
    lines = read_translate_input(cfg.translate.input)  # bad input fails before the model loads
    if cfg.translate.engine == "ct2":  # the export alone: no checkpoint, no training code
        engine = load_ct2(cfg, None, "translate.engine")
        tokenizer = engine.tokenizer()
    else:
        engine = load_trained(cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device))
        tokenizer = engine.tokenizer
    hyps = engine.translate(tokenizer.encode_src(lines), cfg.decode)
    if cfg.decode.n_best > 1:
        text = "".join(
            f"{i} ||| {tokenizer.decode_tgt([tokens])[0]} ||| {score:.4f}\n"
            for i, hypotheses in enumerate(hyps.nbest)
            for tokens, score in hypotheses
        )
    else:
        text = "".join(t + "\n" for t in tokenizer.decode_tgt(hyps.tokens))
    if cfg.translate.output:
        atomic_write_text(cfg.translate.output, text)
    else:
        sys.stdout.write(text)


def check_engine(setting: str, engine: str) -> None:
    if engine not in ("torch", "ct2"):
        raise UserError(f"{setting}={engine!r}: choose torch (this package) or ct2 (the run's CTranslate2 export)")


def load_ct2(cfg: Config, trained: Optional[TrainedModel], setting: str):
    """The run's CTranslate2 export (``make export``) on ``cfg.device``; with ``trained``, it must be an
    export of that same checkpoint (an export left from an earlier checkpoint would be scored as this one)."""
    from app.ct2_engine import CT2Translator
    from app.export import EXPORT_INFO, export_dir

    path = export_dir(cfg)
    if not os.path.exists(os.path.join(path, EXPORT_INFO)):
        raise UserError(f'{setting}=ct2: no CTranslate2 export in {path}; make export ARGS="name={cfg.name}" writes it')
    device = trained.device if trained else resolve_device(cfg.device)
    engine = CT2Translator(path, device=device.type, device_index=device.index or 0)
    exported = engine.info.get("run", {})
    if trained and exported.get("step") != trained.step:
        raise UserError(
            f"{setting}=ct2: {path} holds step {exported.get('step')} ({exported.get('checkpoint')}), "
            f"eval.checkpoint={cfg.eval.checkpoint} is step {trained.step}: make export again "
            f'(make export ARGS="name={cfg.name} export.checkpoint={cfg.eval.checkpoint}")'
        )
    return engine


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
