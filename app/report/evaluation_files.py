"""What ``make eval`` writes of an evaluated split (app/evaluation/eval_run.py): ``hyp.txt``, ``hyp.align``,
``metrics.json``, the attention files (``alignments.npz`` and its index ``alignments.jsonl``) and heatmaps, the
explorer, TensorBoard, and the report on the console, which says where the command's seconds went."""

from __future__ import annotations

import json
import os
import shutil

from tqdm import tqdm

from app.config.commands import VizConfig
from app.config.schema import Config
from app.data.links import pharaoh_line, piece_links
from app.evaluation.alignment import alignment_view
from app.evaluation.eval_run import EvaluatedRun
from app.evaluation.head_roles import summary as head_summary
from app.evaluation.records import SentenceRecord
from app.evaluation.significance import interval
from app.evaluation.views import figure_views, named_view
from app.report.attention_files import write_attention_files
from app.report.board import log_eval
from app.report.explorer import evaluation_records, write_explorer
from app.report.plots import alignment_figure, figures, png_bytes
from app.run.errors import required
from app.run.files import atomic_write, atomic_write_text

METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}


def write_evaluation(run: EvaluatedRun) -> dict:
    """Every file of ``eval/<split>/``, TensorBoard's records, and the report; returns metrics.json's content."""
    cfg, result, clock, data = run.cfg, run.result, run.clock, run.data
    bleu = required(result.sentence_bleu, "sentence BLEU")  # make eval scores the split
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.set_name())
    with clock("files"):
        atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in result.texts))
        if result.records:  # hyp.align: per hypothesis, its word links read from the attention that wrote it
            links = (required(r.hyp_links, "a record's hypothesis links") for r in result.records)
            lines = "".join(pharaoh_line(hyp_links) + "\n" for hyp_links in links)
            atomic_write_text(os.path.join(out_dir, "hyp.align"), lines)
            write_alignments(out_dir, result.records, cfg, result.alignment)
    if run.has_attention:
        with clock("heatmaps"):
            write_heatmaps(out_dir, result.records[: cfg.viz.eval_plots], cfg.viz, run)
        with clock("explorer"):
            explored = evaluation_records(
                data, result.records, result.texts, bleu, result.forced, run.links, result.more_references, run.baseline
            )
            explored = tqdm(explored, "explorer", len(data), leave=False, unit="sentence")
            metrics = run.metrics
            title = f"{cfg.name}: {cfg.eval.set_name()}" + (f" ({metrics['subset']})" if metrics["subset"] else "")
            path = os.path.join(out_dir, "alignments.html")
            write_explorer(path, explored, title, explorer_meta(run), cfg.viz.layer, cfg.eval.attention)
    metrics = run.finish()  # TER of the other sentences here, then the worker's share, if it is not there yet
    with clock("tensorboard"):
        trained, name = run.trained, tensorboard_name(cfg, metrics)
        tb = log_eval(cfg, trained.config, trained.step, data, result.texts, bleu, result.records, metrics, name)
    metrics["seconds"] = clock.rounded()
    if result.in_worker:  # its share of TER, alongside the stages above, on another core
        metrics.update(ter_worker_share=round(result.ter_from / len(result.texts), 3))
        metrics.update(ter_worker_seconds=round(result.ter_seconds, 2))
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    print_report(run, metrics, out_dir, tb)
    return metrics


def tensorboard_name(cfg: Config, metrics: dict) -> str:
    """What TensorBoard files the evaluation under: a subset's scores go to ``eval/<split>_first<N>/``, not the
    split's tags, and are not the test split's HPARAMS (log_eval writes those for split "test")."""
    name = cfg.eval.set_name()
    return f"{name}_first{metrics['sentences']}" if metrics["subset"] else name


def print_report(run: EvaluatedRun, metrics: dict, out_dir: str, tb: str) -> None:
    step, ct2 = run.trained.step, run.ct2
    scored = f"{metrics['sentences']} sentences"
    if metrics["subset"]:  # eval.max_sentences
        scored = f"{metrics['subset']}: a subset, not the split's score"
    if metrics.get("references", 1) > 1:  # eval.references
        scored += f", {metrics['references']} references each"
    which = run.checkpoint_name()
    print(
        f"{metrics['split']} ({metrics['decoding']}; {which}): "
        f"BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
        f"TER {metrics['ter']:.2f}  ({scored}; {metrics['sentences_per_s']} sent/s on {metrics['device']})"
    )
    if "alignment" in metrics:
        a = metrics["alignment"]
        print(
            f"  alignment vs {a['gold']}: AER {a['aer']:.4f}  precision {a['precision']:.4f}  "
            f"recall {a['recall']:.4f}  ({alignment_view(a)})"
        )
        if len(a.get("by_method", {})) > 1:  # each kind of method at its best reading, chosen the same way
            kinds = ", ".join(f"{kind} {m['aer']:.4f}" for kind, m in a["by_method"].items())
            print(f"    AER by method: {kinds}")
    for kind, heads in metrics.get("self_attention_heads", {}).items():  # confidence: the mean of largest weights
        print(f"  {kind} self-attention heads: {head_summary(heads)}")
    if significance := metrics.get("significance"):
        print(f"  against eval.baseline ({significance['baseline']}), paired bootstrap and approximate randomization:")
        for system in significance["systems"]:
            print(f"    {system['name']}: BLEU {interval(system['BLEU'])}  chrF {interval(system['chrF2'])}")
        for line in significance["in_words"]:
            print(f"    {line}")
        wins = significance["sentences"]
        print(
            f"    sentence BLEU against {significance['systems'][0]['name']}'s: higher on {wins['better']} sentences, "
            f"lower on {wins['worse']}, the same on {wins['same']}"
        )
    if ct2:
        print(
            f"  decoded by CTranslate2 ({ct2.model_dir}, {ct2.info['quantization']}): its attention is the mean of the "
            f"heads of decoder layer {ct2.info['alignment_layer']}, so alignments.npz and the explorer have no "
            "per-head maps (eval.engine=torch has them); AER reads our model's attention, forced"
        )
    print("  sacrebleu signatures (how each score was computed):")
    for name in ("bleu", "chrf", "ter"):
        print(f"    {METRIC_NAMES[name]:<5}{metrics[f'{name}_signature']}")
    print(
        f"  wrote {out_dir}/hyp.txt, metrics.json"
        + (
            f", hyp.align (word links, {metrics['hyp_align_view']})"
            ", alignments.html (open it in a browser), alignments.npz with its index alignments.jsonl, alignments/*.png"
            if run.has_attention
            else " (this model has no attention to plot)"
        )
        + f"; TensorBoard: {tb} at step {step}"
    )
    shared = ""
    if (alongside := metrics.get("ter_worker_seconds")) is not None:
        share = metrics["ter_worker_share"]
        shared = f"; TER of {share:.0%} of the sentences took {alongside:.1f} s in a worker process beside"
    print(f"  time: {run.clock.line()}{shared}")


def explorer_meta(run: EvaluatedRun) -> dict:
    """The explorer's header: what was evaluated, how, and how well."""
    cfg, metrics = run.cfg, run.metrics
    meta = {
        "run": cfg.name,
        "model": run.model_name(),
        "checkpoint": run.checkpoint_name("{checkpoint} (step {step})"),
        "split": cfg.eval.set_name(),
        "sentences": metrics["subset"] or metrics["sentences"],
        "decoding": metrics["decoding"],
        "BLEU": f"{metrics['bleu']:.2f}",
        "chrF": f"{metrics['chrf']:.2f}",
    }
    if significance := metrics.get("significance"):
        meta["baseline"] = significance["systems"][0]["name"]
    if a := metrics.get("alignment"):
        meta["AER"] = f"{a['aer']:.3f} ({alignment_view(a)})"
    if view := metrics.get("hyp_align_view"):
        meta["hyp.align"] = f"links read from {view}"
    for kind, heads in metrics.get("self_attention_heads", {}).items():
        meta[f"{kind} heads"] = head_summary(heads)
    return meta


def write_alignments(out_dir: str, records: list[SentenceRecord], cfg: Config, alignment: dict | None) -> None:
    """The attention files (``alignments.npz`` and its index ``alignments.jsonl``; app.report.attention_files):
    per sentence its tokens and the views ``eval.attention`` keeps of the attention of the decoding that produced
    the hypothesis; with reference links, the view of the attention AER was scored on."""

    def sentences():
        for r in records:
            entry = {"index": r.index, "id": r.id, "src_tokens": r.src_pieces, "hyp_tokens": r.hyp_pieces}
            entry |= {"src_words": r.src_words, "hyp_words": r.hyp_words}  # what hyp.align's links number
            stored = required(r.stored, "a record's views")  # eval.attention keeps them
            if stored.layers:
                entry["layer"] = cfg.viz.layer % stored.layers  # the layer the plots show
            if alignment:
                entry["alignment_view"] = {"view": alignment["view"], "chosen_on": alignment["chosen_on"]}
            yield entry, stored, r.self_attention or {}

    write_attention_files(out_dir, sentences())


def write_heatmaps(out_dir: str, records: list[SentenceRecord], viz: VizConfig, run: EvaluatedRun) -> None:
    """``alignments/NNNN*.png`` for ``records`` (the first ``viz.eval_plots`` sentences): the attention that
    produced the hypothesis and, with reference links, the forced attention of the view AER chose, the links
    over it."""
    plot_dir = os.path.join(out_dir, "alignments")
    shutil.rmtree(plot_dir, ignore_errors=True)  # plots of an earlier evaluation must not mix with these

    def save(name: str, fig) -> None:
        png = png_bytes(fig)
        atomic_write(os.path.join(plot_dir, name), lambda f: f.write(png))

    alignment = run.result.alignment
    for r in records:
        i = r.index
        for name, fig in figures(figure_views(r.attention, viz.layer), r.src_pieces, r.hyp_pieces).items():
            save(f"{i:04d}{'' if name == 'alignment' else f'_{name}'}.png", fig)
        if alignment is not None and run.links is not None:
            ref_pieces = required(r.ref_pieces, "a record's reference pieces")  # given with links
            ref_words = required(r.ref_words, "a record's reference words")
            sure, possible = run.links[i]
            links = [piece_links(cells, r.src_words, ref_words) for cells in (sure, possible - sure)]
            view = alignment["view"]
            weights = named_view(run.result.forced[i], view)
            fig = alignment_figure(weights, r.src_pieces, ref_pieces, f"{view}, reference forced", links)
            save(f"{i:04d}_reference.png", fig)
