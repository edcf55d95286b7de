"""The end of a run with ``train.average_snapshots=N``: N snapshots averaged into one model (Vaswani et al.
2017, §6.1; what fairseq's and JoeyNMT's checkpoint averaging do), validated on dev as every checkpoint is,
and kept as ``best.pt`` where it scores a higher dev BLEU than the best single weights. The log and
``train_summary.json`` (``average``) say which was kept and by how much; ``averaged.pt`` holds the average
either way (``eval.checkpoint=averaged``).

Which snapshots: the newest N (``train.average_from=last``, written every ``train.save_every`` steps) or those
of the N best validations (``best``); the run keeps as many as that needs, whatever ``train.keep_last`` and
``train.keep_best`` say. The average's validation and the disk work before it count in the time budget:
training stops early enough for them (``reserve_seconds``)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from typing import Optional

from app.config.schema import TrainConfig
from app.run import distributed
from app.run.checkpoint import average_files, best_steps, save_checkpoint, snapshot_name, snapshot_steps
from app.train.state import BEST_METRICS, Progress, metric_value, ranking_score
from app.train.validation import validate

log = logging.getLogger(__name__)

# Seconds per GB of float32 weights to wait for the last checkpoint's write, then read and average the
# snapshots (torch.save with fsync, torch.load, the mean in float64), with a margin over what was measured
# (docs/benchmarking.md#measurements-behind-the-code)
SECONDS_PER_GB = 2.0


def averaging(t: TrainConfig) -> bool:
    """Whether the run ends with an average: it needs dev scores to choose by."""
    return t.average_snapshots > 0 and t.eval_every > 0


def kept_snapshots(t: TrainConfig) -> tuple[int, int]:
    """(keep_last, keep_best) for the snapshot rotation: the user's, raised to what the closing average reads."""
    n = t.average_snapshots if averaging(t) else 0
    return (
        max(t.keep_last, n) if t.average_from == "last" else t.keep_last,
        max(t.keep_best, n) if t.average_from == "best" else t.keep_best,
    )


def chosen_steps(t: TrainConfig, steps: list[int], validations: list[list[float]]) -> list[int]:
    """The steps of the snapshots to average, of those on disk (``steps``, oldest first)."""
    if t.average_from == "last":
        return steps[-t.average_snapshots :]
    best = best_steps(validations, t.average_snapshots)
    return [step for step in steps if step in best]


def reserve_seconds(t: TrainConfig, parameters: int, validation_seconds: float) -> float:
    """What the closing average takes: a validation as long as the last one, and its disk work (the last
    checkpoint written: model, optimizer moments and the trained weights, then N snapshots read)."""
    if not averaging(t):
        return 0.0
    gigabytes = 4 * parameters * (4 + 1 + t.average_snapshots) / 1e9
    return validation_seconds + gigabytes * SECONDS_PER_GB


def average_at_end(trainer) -> Optional[dict]:
    """Average the snapshots of an app.train.trainer.Trainer's run, validate the average and keep the better of it
    and the best single weights as best.pt (on rank 0, after the final checkpoint). Returns what
    ``train_summary.json`` says of it, None where there is nothing to average."""
    t, p, run_dir = trainer.cfg.train, trainer.progress, trainer.run_dir
    if not averaging(t) or not distributed.is_main():
        return None
    start = time.perf_counter()
    trainer.checkpoints.wait()  # the final snapshot on disk
    steps = chosen_steps(t, snapshot_steps(run_dir), p.validations)
    if len(steps) < 2:
        log.info(
            "closing average: %d snapshot(s) to average (train.average_snapshots=%d): none made",
            len(steps),
            t.average_snapshots,
        )
        return None
    average = average_files([os.path.join(run_dir, f"{snapshot_name(step)}.pt") for step in steps])
    model = copy.deepcopy(trainer.state.served_model)
    model.load_state_dict(average["model"])
    loaded = time.perf_counter() - start
    d = trainer.data
    writer = distributed.writer(os.path.join(run_dir, "tb", "averaged"))  # its own curve beside the run's
    scratch = Progress(step=p.step, best_score=math.inf)  # compared below, not against the run's validations
    log.info(
        "closing average: %d snapshots (%s, train.average_from=%s)",
        len(steps),
        ", ".join(map(str, steps)),
        t.average_from,
    )
    metrics = validate(model, d.dev, d.dev_links, d.tokenizer, trainer.cfg, writer, scratch)
    writer.close()
    metric = t.best_metric
    gain = ranking_score(metrics, metric) - p.best_score  # in the metric's units; for the loss, how much lower
    kept = "average" if gain > 0 else "best single"
    trainer.checkpoints.submit(save_checkpoint, os.path.join(run_dir, "averaged.pt"), average)
    if kept == "average":
        trainer.checkpoints.submit(save_checkpoint, trainer.best_path, {**average, "progress": dataclasses.asdict(p)})
    summary = {
        "from": t.average_from,
        "steps": steps,
        "dev_bleu": metrics["bleu"],
        "dev_loss": round(metrics["loss"], 4),
        "best_single_dev_bleu": p.best_bleu,
        "best_single_step": p.best_step,
        "kept": kept,
        "metric": metric,
        "gain": round(gain, 4 if metric == "loss" else 2),
        "seconds": round(time.perf_counter() - start, 2),
        "disk_seconds": round(loaded, 2),
    }
    name, best = BEST_METRICS[metric], metric_value(p.best_score, metric)
    single = f"the best single weights (step {p.best_step}, dev {name} {best:.2f})"
    if kept == "average":
        log.info(
            "best.pt: the average of %d snapshots (dev %s %.2f), %+.2f over %s",
            len(steps),
            name,
            metrics[metric],
            metric_value(gain, metric),
            single,
        )
    else:
        log.info(
            "best.pt: %s; the average of %d snapshots scored %.2f (%+.2f)",
            single,
            len(steps),
            metrics[metric],
            metric_value(gain, metric),
        )
    return summary
