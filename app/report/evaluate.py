"""``make eval``: a split (or its first ``eval.max_sentences``) decoded by a run's checkpoint (or its
CTranslate2 export), scored with sacrebleu, its attention measured against reference links where the corpus
has them, and what a person reads written beside it: ``hyp.txt``, ``metrics.json``, the attention files
(``alignments.npz`` and its index ``alignments.jsonl``) and heatmaps, the explorer, TensorBoard. Each stage
is timed: the command prints where its seconds went and ``metrics.json`` records it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from app.checkpoint import checkpoint_path
from app.config import Config, VizConfig
from app.data.corpus import ParallelData, load_split
from app.data.links import pharaoh_line, piece_links, read_pharaoh
from app.data.sources import SPLITS
from app.decode.ensemble import ensemble_of
from app.decode.search import Hypotheses, describe
from app.decode.trained import TrainedModel, load_ct2, load_trained
from app.errors import UserError
from app.host_worker import host_worker, submit
from app.models import count_parameters
from app.report.aer import align_scope, alignment_view, hypothesis_links, links_view, score_alignments
from app.report.attention_files import write_attention_files
from app.report.attention_views import attention_shape, figure_views, named_view
from app.report.board import log_eval
from app.report.explorer import evaluation_records, write_explorer
from app.report.head_roles import summary as head_summary
from app.report.plots import alignment_figure, figures, png_bytes
from app.report.scores import split_scores, ter_of_statistics, ter_statistics
from app.report.split_pass import SentenceRecord, add_self_attention, sentence_records
from app.utils import Stopwatch, atomic_write, atomic_write_text, resolve_device

METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}
# the share of the sentences whose TER the host worker counts: this process meanwhile writes the attention files,
# heatmaps and explorer (2.4 s beside TER's 8.5 s of the quick model's 998 test verses, 2-core CPU), then counts
# the rest; both end near together
TER_WORKER_SHARE = 0.6


def ter_worker_share(gold_path: Optional[str], attention: bool, own: bool = False) -> float:
    """How much of TER the host worker counts: all of it beside a teacher-forced pass, the AER's (reference links and
    a model with attention: 14 s for the quick model's test and dev splits, longer than TER) or the self-attention's
    (``own``: 4-6 s of the quick model's test split), else TER_WORKER_SHARE."""
    return 1.0 if (gold_path and attention) or own else TER_WORKER_SHARE


def evaluated(cfg: Config) -> bool:
    """Whether eval/<split>/metrics.json is newer than the checkpoint it would evaluate, and of the whole
    split (an ``eval.max_sentences`` look at its first sentences is not its evaluation)."""
    metrics = os.path.join(cfg.run_dir, "eval", cfg.eval.split, "metrics.json")
    checkpoint = checkpoint_path(cfg.run_dir, cfg.eval.checkpoint)
    if not all(map(os.path.exists, (metrics, checkpoint))) or os.path.getmtime(metrics) < os.path.getmtime(checkpoint):
        return False
    with open(metrics, encoding="utf-8") as f:
        return not json.load(f).get("subset")


def evaluate_run(cfg: Config) -> dict:
    """Decode ``eval.split`` (its first ``eval.max_sentences``) with the run's ``eval.checkpoint``, score it,
    write ``eval/<split>/``."""
    check_settings(cfg)
    clock = Stopwatch()
    with clock("load"):
        trained = load_trained(
            cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device), "eval.checkpoint", cfg.ensemble
        )
        data = load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
        split_size, data = len(data), data.head(cfg.eval.max_sentences)
        ct2 = load_ct2(cfg, trained, "eval.engine") if cfg.eval.engine == "ct2" else None
    with clock("decode"):
        if ct2:
            hyps = ct2.translate(data.src, cfg.decode, need_attention=True)
        else:
            hyps = trained.translate(data.src, cfg.decode, progress=True, need_attention=True)
    texts = trained.tokenizer.decode_tgt(hyps.tokens)
    gold_path = cfg.eval.gold_align or reference_links(trained.config.data.dir, cfg.eval.split)
    own = hyps.attention is not None and self_attention(cfg, trained)
    with clock("score"):  # TER of most sentences in the host worker, on another core, while the rest is written
        worker = host_worker(preload=("app.report.scores",)) if cfg.viz.worker else None
        share = ter_worker_share(gold_path, hyps.attention is not None, own)
        cut = round(share * len(texts)) if worker else 0
        ter = submit(worker, ter_statistics, texts[:cut], data.tgt_texts[:cut])
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.split)
    print_plan(cfg, data, split_size, hyps.attention is not None, own, gold_path, clock)
    with clock("score"):
        metrics, bleu = split_scores(texts, data.tgt_texts, data.src_texts, list(cfg.eval.length_buckets), ter=False)
    metrics.update(subset_stats(len(data), split_size))
    metrics.update(decoding_stats(cfg, trained, ct2, hyps, clock.seconds["decode"]))
    forced = None
    if gold_path:
        with clock("alignment"):
            forced = evaluate_alignment(trained, data, gold_path, cfg, split_size)
        if forced:
            metrics["alignment"] = forced.result
    records = []  # each sentence's record, built once: every output below reads them (app/report/split_pass.py)
    views = dict(keep=cfg.eval.attention, layer=cfg.viz.layer)  # what the files and the explorer keep of a map
    with clock("files"):
        atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in texts))
        if hyps.attention is not None:  # of the hypotheses' attention, the map plots show (viz.layer)
            metrics["attention"] = attention_shape(hyps.attention, cfg.viz.layer)
            refs = forced is not None
            progress = "attention views"
            records = sentence_records(data, hyps, trained.tokenizer, references=refs, progress=progress, **views)
            metrics["hyp_align_view"] = write_hypothesis_links(out_dir, records, cfg.viz.layer, metrics)
    if own:
        with clock("self-attention"):  # one teacher-forced pass of every hypothesis, without logits
            # batches as the AER's forced passes: a batch's maps grow with its sentences' squared lengths
            passes = (trained.model, data.src, hyps.tokens, trained.device, cfg.decode.batch_tokens, trained.dtype)
            roles = add_self_attention(records, *passes, progress="self-attention", **views)
            metrics["self_attention_heads"] = {kind: heads.result() for kind, heads in roles.items()}
    if records:
        with clock("files"):
            write_alignments(out_dir, records, cfg, metrics.get("alignment"))
    if hyps.attention is not None:
        with clock("heatmaps"):
            write_heatmaps(out_dir, records[: cfg.viz.eval_plots], cfg.viz, forced)
        with clock("explorer"):
            explored = evaluation_records(data, records, texts, bleu, forced)
            explored = tqdm(explored, "explorer", len(data), leave=False, unit="sentence")
            meta = explorer_meta(cfg, trained, metrics)
            title = f"{cfg.name}: {cfg.eval.split}" + (f" ({metrics['subset']})" if metrics["subset"] else "")
            path = os.path.join(out_dir, "alignments.html")
            write_explorer(path, explored, title, meta, cfg.viz.layer, cfg.eval.attention)
    with clock("score"):  # TER of the other sentences here, then the worker's share, if it is not there yet
        rest, signature, _ = ter_statistics(texts[cut:], data.tgt_texts[cut:])
        shared, shared_signature, ter_seconds = ter.result()
        metrics = with_ter(metrics, ter_of_statistics(shared + rest, shared_signature or signature))
    cfg = tensorboard_config(cfg, metrics)
    with clock("tensorboard"):
        tb = log_eval(cfg, trained.config, trained.step, data, texts, bleu, records, metrics)
    metrics["seconds"] = clock.rounded()
    if worker:  # its share of TER, alongside the stages above, on another core
        metrics.update(ter_worker_share=round(cut / len(texts), 3), ter_worker_seconds=round(ter_seconds, 2))
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    print_report(metrics, out_dir, tb, trained.step, ct2, hyps.attention is not None, clock)
    return metrics


def self_attention(cfg: Config, trained: TrainedModel) -> bool:
    """Whether the evaluation keeps the self-attention too: ``viz.self_attention``, a model that has one, decoded by
    it (a CTranslate2 export returns one map of its cross-attention, nothing of its self-attention)."""
    return cfg.viz.self_attention and cfg.eval.engine == "torch" and hasattr(trained.model, "self_attention")


def check_settings(cfg: Config) -> None:
    if cfg.eval.split not in SPLITS:
        raise UserError(f"eval.split={cfg.eval.split!r} is not a split; the splits are {', '.join(SPLITS)}")
    if cfg.eval.max_sentences < 0:
        raise UserError(f"eval.max_sentences={cfg.eval.max_sentences}: the first N sentences of the split, 0 for all")


def subset_stats(sentences: int, split_size: int) -> dict:
    """How much of the split was scored: a subset is said so, so that nobody takes it for the split's score."""
    subset = f"first {sentences} of {split_size} sentences" if sentences < split_size else None
    return {"split_sentences": split_size, "subset": subset}


def with_ter(metrics: dict, ter: dict) -> dict:
    """``metrics`` with TER and its signature after chrF's, where ``score`` puts them."""
    keys = list(metrics)
    at = keys.index("chrf_signature") + 1
    return {**{k: metrics[k] for k in keys[:at]}, **ter, **{k: metrics[k] for k in keys[at:]}}


def tensorboard_config(cfg: Config, metrics: dict) -> Config:
    """The settings TensorBoard files the evaluation under: a subset's scores go to ``eval/<split>_first<N>/``,
    not the split's tags, and are not the test split's HPARAMS (log_eval writes those for split "test")."""
    if not metrics["subset"]:
        return cfg
    split = f"{cfg.eval.split}_first{metrics['sentences']}"
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, split=split))


def print_plan(
    cfg: Config,
    data: ParallelData,
    split_size: int,
    has_attention: bool,
    own: bool,
    gold_path: Optional[str],
    clock: Stopwatch,
) -> None:
    """What is left once the hypotheses exist (``own``: the self-attention too): long work shows its own progress
    bar."""
    what = ["scores (TER in a worker process)"] + ["AER against the reference links"] * bool(gold_path)
    what += ["the self-attention of every hypothesis (viz.self_attention)"] * own
    if has_attention:
        plots = min(cfg.viz.eval_plots, len(data))
        what += [f"attention files, {plots} heatmap{'s' * (plots != 1)}, the explorer"]
    subset = f" (first {len(data)} of {split_size})" if len(data) < split_size else ""
    print(
        f"decoded {len(data)} {cfg.eval.split} sentences{subset} in {clock.seconds['decode']:.1f} s; "
        f"now {', '.join(what)} and TensorBoard",
        flush=True,
    )


def decoding_stats(cfg: Config, trained: TrainedModel, ct2, hyps: Hypotheses, seconds: float) -> dict:
    """How the split was decoded, on what, and how fast."""
    return {
        "split": cfg.eval.split,
        "checkpoint": cfg.eval.checkpoint,
        "decoding": describe(cfg.decode),
        "decode_seconds": round(seconds, 2),
        "sentences_per_s": round(len(hyps.tokens) / seconds, 1),
        "tokens_per_s": round(sum(len(h) + 1 for h in hyps.tokens) / seconds),
        # the largest cache of one decoding batch (decode.batch_tokens, beam size): compare runs decoded alike
        "kv_cache_mib": None if hyps.kv_cache_bytes is None else round(hyps.kv_cache_bytes / 2**20, 3),
        "device": torch.cuda.get_device_name(trained.device) if trained.device.type == "cuda" else "cpu",
        "engine": f"ctranslate2 {ct2.info['ctranslate2_version']}, {ct2.info['quantization']}" if ct2 else "torch",
        **({"ensemble": trained.members} if trained.members else {}),
    }


def print_report(metrics: dict, out_dir: str, tb: str, step: int, ct2, has_attention: bool, clock: Stopwatch) -> None:
    scored = f"{metrics['sentences']} sentences"
    if metrics["subset"]:  # eval.max_sentences
        scored = f"{metrics['subset']}: a subset, not the split's score"
    which = ensemble_of(metrics.get("ensemble")) or f"{metrics['checkpoint']}.pt, step {step}"
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
    for kind, heads in metrics.get("self_attention_heads", {}).items():  # confidence: the mean of largest weights
        print(f"  {kind} self-attention heads: {head_summary(heads)}")
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
            if has_attention
            else " (this model has no attention to plot)"
        )
        + f"; TensorBoard: {tb} at step {step}"
    )
    shared = ""
    if (alongside := metrics.get("ter_worker_seconds")) is not None:
        share = metrics["ter_worker_share"]
        shared = f"; TER of {share:.0%} of the sentences took {alongside:.1f} s in a worker process beside"
    print(f"  time: {clock.line()}{shared}")


def explorer_meta(cfg: Config, trained: TrainedModel, metrics: dict) -> dict:
    """The explorer's header: what was evaluated, how, and how well."""
    model = trained.config.model
    family = model.arch if model.arch == "transformer" else f"rnn {model.attention}"
    meta = {
        "run": cfg.name,
        "model": f"{family} ({count_parameters(trained.model) / 1e6:.1f} M parameters)",
        "checkpoint": ensemble_of(trained.members) or f"{cfg.eval.checkpoint} (step {trained.step})",
        "split": cfg.eval.split,
        "sentences": metrics["subset"] or metrics["sentences"],
        "decoding": metrics["decoding"],
        "BLEU": f"{metrics['bleu']:.2f}",
        "chrF": f"{metrics['chrf']:.2f}",
    }
    if a := metrics.get("alignment"):
        meta["AER"] = f"{a['aer']:.3f} ({alignment_view(a)})"
    if view := metrics.get("hyp_align_view"):
        meta["hyp.align"] = f"links read from {view}"
    for kind, heads in metrics.get("self_attention_heads", {}).items():
        meta[f"{kind} heads"] = head_summary(heads)
    return meta


def write_alignments(out_dir: str, records: list[SentenceRecord], cfg: Config, alignment: Optional[dict]) -> None:
    """The attention files (``alignments.npz`` and its index ``alignments.jsonl``; app.report.attention_files):
    per sentence its tokens and the views ``eval.attention`` keeps of the attention of the decoding that produced
    the hypothesis; with reference links, the view of the attention AER was scored on."""

    def sentences():
        for r in records:
            entry = {"index": r.index, "id": r.id, "src_tokens": r.src_pieces, "hyp_tokens": r.hyp_pieces}
            if r.stored.layers:
                entry["layer"] = cfg.viz.layer % r.stored.layers  # the layer the plots show
            if alignment:
                entry["alignment_view"] = {"view": alignment["view"], "chosen_on": alignment["chosen_on"]}
            yield entry, r.stored, r.self_attention or {}

    write_attention_files(out_dir, sentences())


def write_hypothesis_links(out_dir: str, records: list[SentenceRecord], layer: int, metrics: dict) -> str:
    """``hyp.align``: per hypothesis, its word links to the source in Pharaoh format, read from the attention
    that wrote it (app.report.aer.hypothesis_links: the view AER chose, else the plotted one), kept in each record's
    ``hyp_links``. Returns the view."""
    view = links_view(records[0].attention, layer, metrics.get("alignment", {}).get("view"))
    for r in records:  # kept for the explorer, which outlines them on the hypothesis' map
        r.hyp_links = hypothesis_links(r.attention, r.src_pieces, r.hyp_pieces, view)
    atomic_write_text(os.path.join(out_dir, "hyp.align"), "".join(pharaoh_line(r.hyp_links) + "\n" for r in records))
    return view


def write_heatmaps(
    out_dir: str,
    records: list[SentenceRecord],
    viz: VizConfig,
    forced: Optional[ForcedAlignment],
) -> None:
    """``alignments/NNNN*.png`` for ``records`` (the first ``viz.eval_plots`` sentences): the attention that
    produced the hypothesis and, with reference links, the forced attention of the view AER chose, the links
    over it."""
    plot_dir = os.path.join(out_dir, "alignments")
    shutil.rmtree(plot_dir, ignore_errors=True)  # plots of an earlier evaluation must not mix with these

    def save(name: str, fig) -> None:
        png = png_bytes(fig)
        atomic_write(os.path.join(plot_dir, name), lambda f: f.write(png))

    for r in records:
        i = r.index
        for name, fig in figures(figure_views(r.attention, viz.layer), r.src_pieces, r.hyp_pieces).items():
            save(f"{i:04d}{'' if name == 'alignment' else f'_{name}'}.png", fig)
        if forced is not None:
            ref_pieces = r.ref_pieces
            sure, possible = forced.links[i]
            links = [piece_links(cells, r.src_pieces, ref_pieces) for cells in (sure, possible - sure)]
            view = forced.result["view"]
            weights = named_view(forced.attention[i], view)
            fig = alignment_figure(weights, r.src_pieces, ref_pieces, f"{view}, reference forced", links)
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
    trained: TrainedModel, data: ParallelData, gold_path: str, cfg: Config, split_size: int
) -> Optional[ForcedAlignment]:
    """AER of every view of the teacher-forced attention (each head of each layer, each layer's mean;
    an RNN's one map) against ``gold_path``. The view reported is the best on dev when the corpus has
    dev links (and the gold is its own), else the best on this split (said so: an optimistic choice).
    ``data``: the split's first sentences (of ``split_size``), scored against the gold's first lines; dev is
    cut alike. None for a model without attention."""
    tok = trained.tokenizer
    scope = align_scope(cfg.eval.align_scope, gold_file=bool(cfg.eval.gold_align))
    run = lambda split_data, gold, name, keep=0: score_alignments(  # noqa: E731
        trained.model, split_data, gold, tok, trained.device, trained.dtype, cfg.decode.batch_tokens, keep, scope, name
    )
    gold = first_lines(read_pharaoh(gold_path), split_size, len(data))
    score, kept = run(data, gold, f"AER on {cfg.eval.split}", len(data))
    if score is None:
        if cfg.eval.gold_align:
            raise UserError("eval.gold_align: this model has no attention to align with")
        return None
    view, chosen_on = score.best(), cfg.eval.split
    dev_path = reference_links(trained.config.data.dir, "dev")
    if cfg.eval.split != "dev" and dev_path and not cfg.eval.gold_align:
        dev = load_split(trained.config.data.dir, "dev", tok)
        dev_size, dev = len(dev), dev.head(len(data) if len(data) < split_size else 0)
        view = run(dev, first_lines(read_pharaoh(dev_path), dev_size, len(dev)), "AER on dev")[0].best()
        chosen_on = "dev" if len(dev) == dev_size else f"dev (first {len(dev)} of {dev_size} sentences)"
    views = {name: score.result(name)["aer"] for name in score.views}
    result = {**score.result(view), "view": view, "chosen_on": chosen_on, "gold": gold_path, "scope": scope}
    result["aer_by_view"] = views
    return ForcedAlignment(result, kept, gold)


def first_lines(gold: list, split_size: int, n: int) -> list:
    """The links of the first ``n`` sentences, once the gold is known to cover the whole split."""
    if len(gold) != split_size:
        raise UserError(f"{split_size} sentences to align but the reference links have {len(gold)} lines")
    return gold[:n]
