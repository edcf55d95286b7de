"""A run's validation history, ``validations.jsonl`` in its folder: one JSON line per validation, as JoeyNMT's
validations.txt, so that learning curves can be read and compared without TensorBoard's event files (what a
lent GPU's records bring back; ``make compare`` draws them, app/report/compare.py).

Each line: the step, the minutes of the training loop so far (validations included: the clock a time budget
runs on), the target tokens trained on, the learning rate, the training loss of the last logged window, the
dev loss, perplexity, BLEU and chrF, the AER where the dev split has reference links, the mean entropy and
monotonicity of the attention of the TensorBoard sentences (models with attention), whether it was the best
dev BLEU so far, and the validation's seconds.

The history is part of the run's progress, saved in every checkpoint, and the file is written whole from it at
every validation: a run resumed from an earlier checkpoint drops the validations after it at its next one.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from app.run.files import atomic_write_text

FILE = "validations.jsonl"


def history_entry(
    step: int, minutes: float, tgt_tokens: int, lr: float, train_loss: Optional[float], metrics: dict
) -> dict:
    """One validation's line from its ``metrics`` (app.train.validation.validate) and where training stood."""
    entry = {
        "step": step,
        "minutes": round(minutes, 3),
        "tgt_tokens": tgt_tokens,
        "lr": lr,
        "train_loss": None if train_loss is None or not math.isfinite(train_loss) else round(train_loss, 4),
        "dev_loss": round(metrics["loss"], 4),
        "dev_ppl": round(metrics["ppl"], 3),
        "dev_bleu": metrics["bleu"],
        "dev_chrf": metrics["chrf"],
    }
    for key in ("aer", "attention_entropy", "attention_monotonicity", "attention_reattention"):
        if key in metrics:
            entry[key if key.startswith("attention") else f"dev_{key}"] = round(metrics[key], 4)
    entry.update(best=bool(metrics["improved"]), seconds=metrics["seconds"]["total"])
    return entry


def write_history(run_dir: str, history: list[dict]) -> None:
    atomic_write_text(os.path.join(run_dir, FILE), "".join(json.dumps(e) + "\n" for e in history))


def read_history(run_dir: str) -> list[dict]:
    """The validations of a run folder, or [] where it has none (a run from before the file, eval_every=0)."""
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
