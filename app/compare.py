"""``make compare``: the report over a Hydra multirun that trained and evaluated several models.

Reads every run of a sweep folder (train_summary.json, eval/<split>/metrics.json, Hydra's record of
the overrides) and writes, in the sweep folder, ``compare.md`` (one table row per run) and
``bleu_by_length.png`` (test BLEU against source sentence length, all runs in one figure, as
Bahdanau et al. 2014, Fig. 2), also logged to TensorBoard under ``<sweep>/tb``.
"""

from __future__ import annotations

import json
import os

import yaml

from app.errors import UserError
from app.utils import atomic_write, atomic_write_text


def load_runs(sweep_dir: str, split: str = "test") -> list[dict]:
    if not os.path.isdir(sweep_dir):
        raise UserError(f"compare.dir={sweep_dir!r} is not a folder")
    runs = []
    for name in sorted(os.listdir(sweep_dir), key=lambda n: (len(n), n)):
        run = os.path.join(sweep_dir, name)
        summary_path, metrics_path = (
            os.path.join(run, "train_summary.json"),
            os.path.join(run, "eval", split, "metrics.json"),
        )
        if not (os.path.exists(summary_path) and os.path.exists(metrics_path)):
            continue
        overrides_path = os.path.join(run, ".hydra", "train", "overrides.yaml")
        overrides = yaml.safe_load(open(overrides_path)) if os.path.exists(overrides_path) else []
        with open(summary_path) as f, open(metrics_path) as g:
            runs.append({"dir": name, "overrides": overrides, "summary": json.load(f), "metrics": json.load(g)})
    if not runs:
        raise UserError(f"{sweep_dir}: no run with train_summary.json and eval/{split}/metrics.json")
    # label each run by the overrides that differ between runs (what the sweep varied)
    common = set.intersection(*(set(r["overrides"]) for r in runs))
    for r in runs:
        r["label"] = " ".join(o for o in r["overrides"] if o not in common) or r["dir"]
    return runs


def markdown_table(runs: list[dict]) -> str:
    head = (
        "| run | params | train min | tgt tokens/s | best dev BLEU | test BLEU | test chrF | BLEU longest 10 % | "
        "decoding | decode s | sent/s | KV cache MiB | device |\n" + "|---" * 13 + "|\n"
    )
    rows = "".join(
        f"| {r['label']} | {r['summary']['parameters'] / 1e6:.2f} M | {r['summary']['train_minutes']} | "
        f"{r['summary']['tgt_tokens_per_s']:,} | {r['summary']['best_dev_bleu']:.2f} | {r['metrics']['bleu']:.2f} | "
        f"{r['metrics']['chrf']:.2f} | {_cell(r['metrics'].get('bleu_longest_10pct'), '.2f')} | "
        f"{r['metrics']['decoding']} | {r['metrics']['decode_seconds']} | {r['metrics']['sentences_per_s']} | "
        f"{_cell(r['metrics'].get('kv_cache_mib'), '.3f')} | {r['metrics']['device']} |\n"
        for r in runs
    )
    return head + rows


def _cell(value, spec: str) -> str:
    """A number, or "-" for a metric the run does not have (an RNN's KV cache, an older evaluation)."""
    return "-" if value is None else format(value, spec)


def length_figure(runs: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    names = [b["bucket"] for b in runs[0]["metrics"]["bleu_by_source_length"]]  # every bucket, in order
    for r in runs:
        buckets = [b for b in r["metrics"]["bleu_by_source_length"] if "bleu" in b]
        ax.plot([names.index(b["bucket"]) for b in buckets], [b["bleu"] for b in buckets], marker="o", label=r["label"])
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("source sentence length (words)")
    ax.set_ylabel("test BLEU")
    ax.set_title("BLEU by source sentence length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def compare_report(sweep_dir: str, split: str = "test") -> str:
    from torch.utils.tensorboard import SummaryWriter

    runs = load_runs(sweep_dir, split)
    table = markdown_table(runs)
    atomic_write_text(os.path.join(sweep_dir, "compare.md"), f"# Comparison: {sweep_dir}\n\n{table}")
    fig = length_figure(runs)
    atomic_write(os.path.join(sweep_dir, "bleu_by_length.png"), lambda f: fig.savefig(f, format="png"))
    with SummaryWriter(os.path.join(sweep_dir, "tb")) as writer:
        writer.add_figure("compare/bleu_by_source_length", fig)
        writer.add_text("compare/table", table)
    print(table)
    print(f"wrote {sweep_dir}/compare.md and bleu_by_length.png")
    return table
