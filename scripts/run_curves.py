"""Dev BLEU and dev loss over training minutes of several runs, from their TensorBoard events: a PNG of both
curves and a markdown table (docs/training.md, "Choosing the defaults on a CPU").

    .venv/bin/python scripts/run_curves.py OUT.png LABEL=checkpoints/<run> [LABEL=checkpoints/<run> ...]

Runs whose labels share the part before the last '/' (``today/seed1``, ``today/seed2``) are one arm: one colour;
the part after it is the seed: one line style, the same in every arm. Minutes are wall-clock minutes since the
run started (train_summary.json ``started``), validations included; the closing average (train_summary.json
``average``) is a star at the run's end.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def curves(run_dir: str) -> dict:
    """{"minutes", "steps", "bleu", "loss"} at every validation, the summary, and the closing average."""
    summary = json.load(open(os.path.join(run_dir, "train_summary.json")))
    start = datetime.fromisoformat(summary["started"]).timestamp()
    events = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0})
    events.Reload()
    bleu, loss = events.Scalars("dev/bleu"), events.Scalars("dev/loss")
    return {
        "minutes": [(e.wall_time - start) / 60 for e in bleu],
        "steps": [e.step for e in bleu],
        "bleu": [e.value for e in bleu],
        "loss": [e.value for e in loss],
        "summary": summary,
    }


def main(out: str, runs: list[str]) -> None:
    labelled = [run.split("=", 1) for run in runs]
    data = {label: curves(path) for label, path in labelled}
    arms = list(dict.fromkeys(label.rsplit("/", 1)[0] for label in data))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    fig, (ax_bleu, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    seeds = list(dict.fromkeys(label.rsplit("/", 1)[-1] for label in data))  # one line style per seed, in every arm
    for label, c in data.items():
        arm, seed = label.rsplit("/", 1)[0], label.rsplit("/", 1)[-1]
        colour, style = colours[arms.index(arm) % len(colours)], styles[seeds.index(seed) % len(styles)]
        ax_bleu.plot(c["minutes"], c["bleu"], style, color=colour, label=label, marker=".", markersize=4)
        ax_loss.plot(c["minutes"], c["loss"], style, color=colour, label=label, marker=".", markersize=4)
        average = c["summary"].get("average")
        if average:
            end = c["summary"]["train_minutes"]
            ax_bleu.plot([end], [average["dev_bleu"]], "*", color=colour, markersize=10)
            ax_loss.plot([end], [average["dev_loss"]], "*", color=colour, markersize=10)
    for ax, what in ((ax_bleu, "dev BLEU (greedy)"), (ax_loss, "dev loss (no smoothing)")):
        ax.set_xlabel("minutes")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax_bleu.legend(fontsize=7)
    if any(c["summary"].get("average") for c in data.values()):
        ax_bleu.set_title("★ closing average", fontsize=8, loc="right")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out} ({os.path.getsize(out) // 1024} KB)")
    header = "run | steps | minutes | best dev BLEU (step) | lowest dev loss (step) | closing average | best.pt BLEU"
    print(f"| {header} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, c in data.items():
        s = c["summary"]
        b = max(range(len(c["bleu"])), key=lambda i: (c["bleu"][i], -i))
        low = min(range(len(c["loss"])), key=lambda i: c["loss"][i])
        average = s.get("average")
        closing = f"{average['dev_bleu']:.2f} ({average['kept']})" if average else "–"
        print(
            f"| {label} | {s['steps']} | {s['train_minutes']:.1f} | {c['bleu'][b]:.2f} ({c['steps'][b]}) | "
            f"{c['loss'][low]:.3f} ({c['steps'][low]}) | {closing} | {s['best_dev_bleu']:.2f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
