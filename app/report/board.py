"""What goes to TensorBoard besides the training scalars: sample translations as text tables, a run's
settings and results for the HPARAMS tab, and what ``make eval`` and ``make heads`` measured and drew, in the run's
own event files (``checkpoints/<run>/tb``) at the step of the evaluated checkpoint."""

from __future__ import annotations

import dataclasses
import os
import random

from app.config.schema import Config
from app.evaluation.views import SCALE, figure_views, mean_name, self_attention_axes
from app.report.plots import TENSORBOARD_WIDTH, draw_pngs, tensorboard_tokens

# declared in every run's HPARAMS record, so that runs trained and evaluated at different times share columns
HPARAM_METRICS = (
    "dev_bleu steps tgt_tokens_per_s parameters_m test_bleu test_chrf test_ter test_aer decode_seconds".split()
)


def run_hparams(cfg: Config) -> dict:
    """A run's settings as HPARAMS columns: the model family, its sizes and variant, the training settings."""
    model = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
    keys = "batch_tokens lr warmup_steps label_smoothing max_steps max_minutes align_weight seed".split()
    train = {f"train.{k}": getattr(cfg.train, k) for k in keys}
    return {"name": cfg.name, "data": cfg.data.name, "tokenizer.vocab_size": cfg.tokenizer.vocab_size, **model, **train}


def event_file(writer):
    """The writer's event file, reopened if the writer was closed (as SummaryWriter's own add_* do): the Trainer
    closes it when a run ends, and make bench runs the same Trainer again."""
    return writer._get_file_writer()


def write_hparams(writer, cfg: Config, metrics: dict, step: int) -> None:
    """The run's HPARAMS record and the values of ``metrics`` (names from HPARAM_METRICS) at ``step``.
    Written by training (dev BLEU, steps, speed) and by each evaluation (test scores): the record is
    the same every time, and the values add up in the run's event files."""
    from torch.utils.tensorboard.summary import hparams

    values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in run_hparams(cfg).items()}
    for summary in hparams(values, {f"hparams/{name}": 0.0 for name in HPARAM_METRICS}):
        event_file(writer).add_summary(summary)
    for name, value in metrics.items():
        if value is not None:
            writer.add_scalar(f"hparams/{name}", value, step)


def alignment_figures(tag: str, records: list, layer: int, every_layer: bool = False) -> dict:
    """``<tag>/<n>/<figure>`` -> what app.report.plots.draw_pngs draws, sized for the IMAGES tab, for each
    sentence record of ``records`` (app.evaluation.records.SentenceRecord): numbers and strings, drawable in a
    worker process. A record with the self-attention (make eval's) also has ``encoder_self`` and ``decoder_self``
    (each layer's mean of heads: rows over columns, as the explorer draws them)."""
    specs = {}
    for n, r in enumerate(records):
        for name, (maps, titles) in figure_views(r.attention, layer, every_layer).items():
            specs[f"{tag}/{n}/{name}"] = (maps, r.src_pieces, r.hyp_pieces, titles, TENSORBOARD_WIDTH)
        for kind, stored in (r.self_attention or {}).items():  # make eval's: each layer's mean of heads
            means = [stored.names.index(mean_name(i)) for i in range(stored.layers)]
            rows, columns = self_attention_axes(kind, r.src_pieces, r.hyp_pieces)
            titles = [f"{kind} self-attention, {stored.names[i]}" for i in means]
            specs[f"{tag}/{n}/{kind}_self"] = (stored.maps[means] / SCALE, columns, rows, titles, TENSORBOARD_WIDTH)
    return specs


def write_pngs(writer, pngs: dict[str, tuple[bytes, tuple[int, int]]], step: int) -> None:
    """Each tag's (PNG, (width, height)) as an image at ``step``; encoded once (add_image would encode an array)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    for tag, (png, (width, height)) in pngs.items():
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
        event_file(writer).add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


def add_alignment_figures(writer, tag: str, records: list, layer: int, step: int, every_layer: bool = False) -> None:
    """The heatmaps of each sentence record of ``records`` as ``<tag>/<n>/<figure>``,
    sized for the IMAGES tab: the one way to put attention in TensorBoard (validation takes the same three
    steps, drawing in its worker process)."""
    write_pngs(writer, draw_pngs(alignment_figures(tag, records, layer, every_layer)), step)


def training_results(summary: dict) -> dict:
    """The HPARAMS values of a finished training run, from its train_summary.json."""
    return {
        "dev_bleu": summary["best_dev_bleu"],
        "steps": summary["steps"],
        "tgt_tokens_per_s": summary["tgt_tokens_per_s"],
        "parameters_m": summary["parameters"] / 1e6,
    }


def tensorboard_sentences(src: list[list[int]], n: int) -> list[int]:
    """Indices of ``n`` sentences whose maps TensorBoard shows with readable labels: the first ones with
    a short enough source, then the shortest of the rest."""
    fits = [i for i, s in enumerate(src) if len(s) + 1 <= tensorboard_tokens()]
    shown = set(fits[:n])
    rest = sorted((i for i in range(len(src)) if i not in shown), key=lambda i: len(src[i]))
    return (fits[:n] + rest)[:n]


def sample_table(
    ids: list[str], sources: list[str], references: list[str], hypotheses: list[str], bleu: list[float], title: str = ""
) -> str:
    """A markdown table for TensorBoard's TEXT tab: one row per sentence."""
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    rows = [
        f"| {cell(i)} | {cell(s)} | {cell(r)} | {cell(h)} | {b:.1f} |"
        for i, s, r, h, b in zip(ids, sources, references, hypotheses, bleu)
    ]
    head = (f"**{title}**\n\n" if title else "") + "| id | source | reference | hypothesis | sentence BLEU |\n"
    return head + "| --- | --- | --- | --- | --- |\n" + "\n".join(rows)


def eval_samples(data, texts: list[str], bleu: list[float], per_group: int = 5) -> str:
    """The best and the worst sentences by sentence BLEU (of at least 5 words) and a few at random."""
    candidates = [i for i in range(len(texts)) if len(data.tgt_texts[i].split()) >= 5] or list(range(len(texts)))
    ranked = sorted(candidates, key=lambda i: -bleu[i])
    groups = {
        "best": ranked[:per_group],
        "worst": ranked[::-1][:per_group],
        "random": sorted(random.Random(0).sample(candidates, min(per_group, len(candidates)))),
    }
    return "\n\n".join(
        sample_table(
            [data.ids[i] for i in idx],
            [data.src_texts[i] for i in idx],
            [data.tgt_texts[i] for i in idx],
            [texts[i] for i in idx],
            [bleu[i] for i in idx],
            f"{name} by sentence BLEU" if name != "random" else "at random",
        )
        for name, idx in groups.items()
    )


def log_eval(
    cfg: Config, trained: Config, step: int, data, texts: list[str], bleu: list[float], records, metrics, split: str
) -> str:
    """``make eval`` (settings ``cfg``) of a run trained with ``trained`` into the run's TensorBoard:
    scores as ``eval/<split>/...`` scalars (``split``: what was evaluated), the alignment figures of
    ``viz.sentences`` readable sentences (every layer's heads), a table of sample translations, and, for the test
    split, the scores in HPARAMS. ``bleu``: each hypothesis's sentence BLEU; ``records``: the split's sentence
    records (none for a model without attention). Returns the event folder."""
    from torch.utils.tensorboard import SummaryWriter

    tb = os.path.join(cfg.run_dir, "tb")
    with SummaryWriter(tb) as writer:
        for key in ("bleu", "chrf", "ter"):
            writer.add_scalar(f"eval/{split}/{key}", metrics[key], step)
        if "alignment" in metrics:
            writer.add_scalar(f"eval/{split}/aer", metrics["alignment"]["aer"], step)
        writer.add_text(f"eval/{split}/samples", eval_samples(data, texts, bleu), step)
        if records:
            chosen = [records[i] for i in tensorboard_sentences(data.src, cfg.viz.sentences)]
            add_alignment_figures(writer, f"eval/{split}/alignment", chosen, cfg.viz.layer, step, True)
        if split == "test":
            scores = {f"test_{k}": metrics[k] for k in ("bleu", "chrf", "ter")}
            scores["test_aer"] = metrics.get("alignment", {}).get("aer")
            write_hparams(writer, trained, {**scores, "decode_seconds": metrics["decode_seconds"]}, step)
    return tb


def log_heads(run_dir: str, split: str, png: tuple[bytes, tuple[int, int]], report: dict, step: int) -> str:
    """``make heads`` into the run's TensorBoard at the measured checkpoint's ``step``: its figure (``png``: bytes,
    (width, height)) as the image ``heads/<split>/importance``, the loss with every head and the gradient's
    agreement with masking as scalars. Returns the event folder."""
    from torch.utils.tensorboard import SummaryWriter

    tb = os.path.join(run_dir, "tb")
    with SummaryWriter(tb) as writer:
        write_pngs(writer, {f"heads/{split}/importance": png}, step)
        writer.add_scalar(f"heads/{split}/loss", report["loss"], step)
        writer.add_scalar(f"heads/{split}/gradient_agreement", report["gradient_agreement"], step)
    return tb
