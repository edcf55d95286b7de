"""``make compare``: the report over a Hydra multirun that trained and evaluated several models.

Reads every run of a sweep folder (train_summary.json, eval/<split>/metrics.json, Hydra's record of
the overrides, validations.jsonl, and provenance.json where ``scripts/gpu_check.sh compare`` trained the
run on a lent machine) and writes, in the sweep folder or ``compare.out``, ``compare.md`` (one table row
per run), ``bleu_by_length.png`` (test BLEU against source sentence length, all runs in one figure, as
Bahdanau et al. 2014, Fig. 2) and ``learning_curves.png`` (dev BLEU per validation against updates and
minutes, and the attention's entropy), also logged to TensorBoard under ``<out>/tb``.
"""

from __future__ import annotations

import json
import os

import yaml

from app.data.prepare import read_tsv
from app.evaluation.head_roles import positional_count
from app.evaluation.metrics import sentence_bleu
from app.evaluation.significance import Compared, in_words, interval, paired_significance, sentence_wins
from app.evaluation.views import SELF_ATTENTION
from app.report.history import FILE as HISTORY_FILE
from app.report.history import read_history
from app.run.errors import UserError
from app.run.files import atomic_write, atomic_write_text, check_output_folder


def load_runs(sweep_dir: str, split: str = "test") -> list[dict]:
    """Every trained and evaluated run in ``sweep_dir``, in the order they were first started (so runs
    added to the folder by later calls come after the earlier ones)."""
    if not os.path.isdir(sweep_dir):
        raise UserError(f"compare.dir={sweep_dir!r} is not a folder")
    runs = []
    for name in os.listdir(sweep_dir):
        run = os.path.join(sweep_dir, name)
        summary_path, metrics_path = (
            os.path.join(run, "train_summary.json"),
            os.path.join(run, "eval", split, "metrics.json"),
        )
        if not (os.path.exists(summary_path) and os.path.exists(metrics_path)):
            continue
        overrides_path = os.path.join(run, ".hydra", "train", "overrides.yaml")
        overrides = yaml.safe_load(open(overrides_path)) if os.path.exists(overrides_path) else []
        overrides = [o for o in overrides if not o.startswith(IDENTITY_FREE)]
        provenance_path = os.path.join(run, "provenance.json")
        provenance = json.load(open(provenance_path)) if os.path.exists(provenance_path) else {}
        with open(summary_path) as f, open(metrics_path) as g:
            summary, metrics = json.load(f), json.load(g)
        runs.append(
            {
                "dir": name,
                "path": run,
                "overrides": overrides,
                "summary": summary,
                "metrics": metrics,
                "provenance": provenance,
                "history": read_history(run),
            }
        )
    if not runs:
        raise UserError(f"{sweep_dir}: no run with train_summary.json and eval/{split}/metrics.json")
    runs.sort(key=lambda r: (r["summary"].get("started", ""), r["dir"]))
    check_same_test_set(runs, split)
    # label each run by its name in the plan that trained it (scripts/gpu_check.sh compare), else by the
    # overrides that differ between runs (what the sweep varied); a run that differs in none of its own
    # (the baseline of runs that add settings) by its model preset
    common = set.intersection(*(set(r["overrides"]) for r in runs))
    for r in runs:
        differing = [o for o in r["overrides"] if o not in common]
        model = [o for o in r["overrides"] if o.startswith("model=")]
        r["label"] = r["provenance"].get("name") or " ".join(differing or model) or r["dir"]
    return runs


# settings that say how a run was started, not what it is
IDENTITY_FREE = ("command=", "train.resume=", "train.auto_resume=")


def bleu_tokenize(run: dict) -> str:
    """The words a run's BLEU counted (metrics.json's bleu_tokenize; 13a, sacrebleu's default, before it was
    recorded)."""
    return run["metrics"].get("bleu_tokenize", "13a")


def references(run: dict) -> int:
    """How many reference translations of each sentence a run's scores counted (eval.references: more than 1)."""
    return run["metrics"].get("references", 1)


def check_same_test_set(runs: list[dict], split: str) -> None:
    """The rows compare only if every run decoded the same sentences, bucketed alike, scored against as many
    references, and counted BLEU's words alike."""

    def shape(r):
        return r["metrics"]["sentences"], [(b["bucket"], b["sentences"]) for b in r["metrics"]["bleu_by_source_length"]]

    first = runs[0]
    for r in runs[1:]:
        if shape(r) != shape(first):
            raise UserError(
                f"{r['dir']} and {first['dir']} were evaluated on different {split} sentences or length buckets "
                f"({shape(r)[0]} vs {shape(first)[0]} sentences): evaluate them alike, or compare them apart"
            )
        if references(r) != references(first):
            raise UserError(
                f"{r['dir']} and {first['dir']} were scored against {references(r)} and {references(first)} "
                "references a sentence (eval.references): evaluate them against the same references"
            )
        if bleu_tokenize(r) != bleu_tokenize(first):
            raise UserError(
                f"{r['dir']} and {first['dir']} counted BLEU's words apart (eval.bleu_tokenize {bleu_tokenize(r)} vs "
                f"{bleu_tokenize(first)}): evaluate them with one eval.bleu_tokenize"
            )


COLUMNS = [  # (header, cell of a run)
    ("run", lambda r: r["label"]),
    ("params", lambda r: f"{r['summary']['parameters'] / 1e6:.2f} M"),
    ("updates", lambda r: f"{r['summary']['steps']:,}"),
    ("train min", lambda r: f"{r['summary']['train_minutes']}"),
    ("tgt tokens/s", lambda r: f"{r['summary']['tgt_tokens_per_s']:,}"),
    ("best dev BLEU", lambda r: f"{r['summary']['best_dev_bleu']:.2f}"),
    ("test BLEU", lambda r: f"{r['metrics']['bleu']:.2f}"),
    ("test chrF", lambda r: f"{r['metrics']['chrf']:.2f}"),
    ("BLEU longest 10 %", lambda r: _cell(r["metrics"].get("bleu_longest_10pct"), ".2f")),
    ("attention entropy", lambda r: _cell(r["metrics"].get("attention", {}).get("entropy"), ".3f")),
    ("monotonicity", lambda r: _cell(r["metrics"].get("attention", {}).get("monotonicity"), ".3f")),
    ("re-attention", lambda r: _cell(r["metrics"].get("attention", {}).get("reattention"), ".3f")),
    ("positional heads enc, dec", lambda r: positional_heads(r["metrics"].get("self_attention_heads"))),
    ("decoding", lambda r: r["metrics"]["decoding"]),
    ("decode s", lambda r: f"{r['metrics']['decode_seconds']}"),
    ("sent/s", lambda r: f"{r['metrics']['sentences_per_s']}"),
    ("KV cache MiB", lambda r: _cell(r["metrics"].get("kv_cache_mib"), ".3f")),
    ("device", lambda r: r["metrics"]["device"]),
]


def positional_heads(heads: dict | None) -> str:
    """``3/48, 5/48``: the positional self-attention heads of the encoder and the decoder (evaluation/head_roles.py),
    "-" for a run without (an RNN, or evaluated without viz.self_attention)."""
    return ", ".join(positional_count(heads[kind]) for kind in SELF_ATTENTION) if heads else "-"


def markdown_table(runs: list[dict]) -> str:
    head = "| " + " | ".join(h for h, _ in COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|\n"
    return head + "".join("| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |\n" for r in runs)


def length_table(runs: list[dict]) -> str:
    """Test BLEU per source-length bucket, one row per run; the header counts each bucket's sentences."""
    buckets = runs[0]["metrics"]["bleu_by_source_length"]
    head = "| run | " + " | ".join(f"{b['bucket']} ({b['sentences']})" for b in buckets) + " |\n"
    rows = "".join(
        f"| {r['label']} | "
        + " | ".join(_cell(b.get("bleu"), ".2f") for b in r["metrics"]["bleu_by_source_length"])
        + " |\n"
        for r in runs
    )
    return head + "|---" * (len(buckets) + 1) + "|\n" + rows


def commands(runs: list[dict]) -> str:
    """How each run was trained (Hydra's record of its overrides), where its files are, why it stopped
    (a run that stopped early used less than the budget), and for a run trained on a lent machine, the code
    and the day."""

    def trained(r):
        p = r["provenance"]
        return f" (code {p.get('commit', 'unknown')}, {p['finished']})" if p else ""

    def stopped(r):
        return f"; stopped: {r['summary']['stopped']}" if r["summary"].get("stopped") else ""

    return "".join(
        f"- `{r['dir']}`: `python -m app command=train {' '.join(r['overrides'])}`{trained(r)}{stopped(r)}\n"
        for r in runs
    )


def devices_note(runs: list[dict]) -> str:
    """Runs trained on different devices share no clock: their updates and tokens/s in one budget differ
    by the hardware, so the report says so above the table."""
    by_device: dict[str, list[str]] = {}
    for r in runs:
        by_device.setdefault(r["summary"].get("device", "unknown"), []).append(r["label"])
    if len(by_device) < 2:
        return ""
    where = "; ".join(f"{device}: {', '.join(labels)}" for device, labels in by_device.items())
    return f"**Trained on different devices** ({where}): updates and tokens/s in one budget do not compare.\n\n"


def _cell(value, spec: str) -> str:
    """A number, or "-" for a metric the run does not have (an RNN's KV cache, an older evaluation)."""
    return "-" if value is None else format(value, spec)


def length_figure(runs: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    every = runs[0]["metrics"]["bleu_by_source_length"]  # every bucket, in order
    names = [b["bucket"] for b in every]
    for r in runs:
        buckets = [b for b in r["metrics"]["bleu_by_source_length"] if "bleu" in b]
        ax.plot([names.index(b["bucket"]) for b in buckets], [b["bleu"] for b in buckets], marker="o", label=r["label"])
    ax.set_xticks(range(len(names)), [f"{b['bucket']}\n{b['sentences']} sent." for b in every])
    ax.set_xlabel("source sentence length (words)")
    ax.set_ylabel("test BLEU")
    ax.set_title("BLEU by source sentence length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def curves_figure(runs: list[dict]):
    """Dev BLEU per validation against updates and against training minutes, and the dev attention's entropy
    against updates: how fast each run learned and when its attention sharpened. None where no run has a
    history."""
    if not any(r["history"] for r in runs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, sharpness) = plt.subplots(1, 3, figsize=(14, 4.2), dpi=110)
    for r in runs:
        h = r["history"]
        if not h:
            continue
        line = by_step.plot([e["step"] for e in h], [e["dev_bleu"] for e in h], marker=".", label=r["label"])[0]
        by_time.plot([e["minutes"] for e in h], [e["dev_bleu"] for e in h], marker=".", color=line.get_color())
        attended = [(e["step"], e["attention_entropy"]) for e in h if "attention_entropy" in e]
        if attended:
            sharpness.plot(*zip(*attended), marker=".", color=line.get_color())
    for ax, xlabel, ylabel in (
        (by_step, "updates", "dev BLEU (greedy)"),
        (by_time, "training minutes (validations included)", "dev BLEU (greedy)"),
        (sharpness, "updates", "dev attention entropy (nats)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle("Learning curves (every validation)")
    fig.tight_layout()
    return fig


def curves_section(runs: list[dict]) -> str:
    """Where the learning curves are, and which runs have no validation history to draw."""
    if not any(r["history"] for r in runs):
        return ""
    missing = [r["label"] for r in runs if not r["history"]]
    note = f" No {HISTORY_FILE} (trained before it was written): {', '.join(missing)}." if missing else ""
    return (
        "\n## Learning curves\n\n`learning_curves.png`: dev BLEU at every validation against updates and against "
        f"training minutes, and the dev attention's entropy, from each run's {HISTORY_FILE}.{note}\n"
    )


def significance_section(runs: list[dict], split: str, baseline: str | None) -> str:
    """Each run against the baseline (``compare.baseline``, a run's folder or label; unset: the first): BLEU and chrF
    with their bootstrap 95 % intervals and the p-values of both paired tests, then in words which differences are
    significant (app/evaluation/significance.py)."""
    if len(runs) < 2:
        return "\n## Significance\n\nOne run: nothing to test it against.\n"
    order = list(range(len(runs)))
    if baseline:
        at = [i for i, r in enumerate(runs) if baseline in (r["dir"], r["label"])]
        if not at:
            raise UserError(f"compare.baseline={baseline}: no such run; the runs: {', '.join(r['dir'] for r in runs)}")
        order = [at[0]] + [i for i in order if i != at[0]]
    if references(runs[0]) > 1:  # the files of eval.references are not among what a run keeps
        return (
            f"\n## Significance\n\nNot tested: the runs were scored against {references(runs[0])} references a "
            "sentence (eval.references), and only the first is the corpus's; make eval with eval.baseline=<run> and "
            "the same eval.references tests one run against another on all of them.\n"
        )
    missing = [runs[i]["dir"] for i in order if not os.path.exists(hypotheses_path(runs[i], split))]
    if missing or not os.path.exists(os.path.join(runs[order[0]]["path"], "config.yaml")):
        without = ", ".join(missing) or runs[order[0]]["dir"]
        return (
            f"\n## Significance\n\nNot tested: {without} kept no hypotheses or settings (evaluated before they were).\n"
        )
    systems = [(runs[i]["label"], run_hypotheses(runs[i], split)) for i in order]
    refs, tokenize = run_references(runs[order[0]], split), bleu_tokenize(runs[order[0]])
    compared = paired_significance(systems, refs, tokenize)
    bleus = [sentence_bleu(hyps, refs, tokenize) for _, hyps in systems]
    wins = ["baseline"] + ["{better} / {worse} / {same}".format(**sentence_wins(b, bleus[0])) for b in bleus[1:]]
    head = (
        "| run | BLEU (95 % CI) | p bootstrap, randomization | chrF (95 % CI) | p bootstrap, randomization "
        "| sentences with a higher / lower / the same BLEU |\n"
    )
    rows = "".join(f"| {c.name} | {cells(c)} | {w} |\n" for c, w in zip(compared, wins))
    words = "".join(f"- {line}\n" for line in in_words(compared))
    return (
        f"\n## Significance against {compared[0].name}\n\nPaired bootstrap resampling (1,000 resamples) and "
        "approximate randomization (10,000 trials) of sacrebleu, seeded; a difference is significant where both give "
        f"p < 0.05; the last column counts the sentences whose sentence BLEU is above, below or equal to the "
        f"baseline's.\n\n{head}|---|---|---|---|---|---|\n{rows}\n{words}"
    )


def cells(c: Compared) -> str:
    def p(s: dict) -> str:
        return "baseline" if s["p_bootstrap"] is None else f"{s['p_bootstrap']:.4f}, {s['p_randomization']:.4f}"

    return " | ".join(f"{interval(c.scores[m])} | {p(c.scores[m])}" for m in ("BLEU", "chrF2"))


def hypotheses_path(run: dict, split: str) -> str:
    return os.path.join(run["path"], "eval", split, "hyp.txt")


def run_hypotheses(run: dict, split: str) -> list[str]:
    with open(hypotheses_path(run, split), encoding="utf-8") as f:
        return f.read().splitlines()


def run_references(run: dict, split: str) -> list[str]:
    """The references a run was evaluated against: its corpus's split (the first ``sentences`` of it)."""
    with open(os.path.join(run["path"], "config.yaml"), encoding="utf-8") as f:
        data_dir = yaml.safe_load(f)["data"]["dir"]
    return [pair.tgt for pair in read_tsv(os.path.join(data_dir, f"{split}.tsv"))][: run["metrics"]["sentences"]]


def compare_report(sweep_dir: str, split: str = "test", out: str | None = None, baseline: str | None = None) -> str:
    """The report over the runs of ``sweep_dir``, written to ``out`` (default: the sweep folder)."""
    from torch.utils.tensorboard import SummaryWriter

    if out:
        check_output_folder(out, f"compare.out={out!r}")
    runs = load_runs(sweep_dir, split)
    out = out or sweep_dir
    os.makedirs(out, exist_ok=True)
    table = markdown_table(runs)
    significance = significance_section(runs, split, baseline)
    report = (
        f"# Comparison: {sweep_dir}\n\n{devices_note(runs)}{table}{significance}\n"
        f"## {split} BLEU by source length (words; sentences per bucket)\n\n"
        f"{length_table(runs)}{curves_section(runs)}\n## Runs\n\n{commands(runs)}"
    )
    atomic_write_text(os.path.join(out, "compare.md"), report)
    fig = length_figure(runs)
    atomic_write(os.path.join(out, "bleu_by_length.png"), lambda f: fig.savefig(f, format="png"))
    curves = curves_figure(runs)
    if curves is not None:
        atomic_write(os.path.join(out, "learning_curves.png"), lambda f: curves.savefig(f, format="png"))
    with SummaryWriter(os.path.join(out, "tb")) as writer:
        writer.add_figure("compare/bleu_by_source_length", fig)
        if curves is not None:
            writer.add_figure("compare/learning_curves", curves)
        writer.add_text("compare/table", table)
    print(table + significance)
    print(f"wrote {out}/compare.md and bleu_by_length.png" + (" and learning_curves.png" if curves is not None else ""))
    return table
