"""train.best_metric: the dev score best.pt, early stopping, train.keep_best and the closing average follow (BLEU,
chrF, or the loss, lower better); a checkpoint from before it goes on ranking by BLEU; a resume asked to rank by
another is refused; a CLI run whose best.pt is the validation of lowest dev loss."""

import json
import math
import shutil

import pytest
import torch
from conftest import TINY, run_cli

from app.run.checkpoint import best_steps
from app.train.state import Progress, progress_from, ranking_score

DEV = [
    {"loss": 3.2, "bleu": 4.0, "chrf": 20.0},
    {"loss": 2.9, "bleu": 3.5, "chrf": 21.0},
    {"loss": 3.0, "bleu": 5.0, "chrf": 19.0},
]


@pytest.mark.parametrize(
    "metric,best,bad,two",
    [("bleu", 300, 0, {300, 100}), ("chrf", 200, 1, {200, 100}), ("loss", 200, 1, {200, 300})],
    ids=["bleu", "chrf", "loss"],
)
def test_the_best_validation_is_the_metrics(metric, best, bad, two):
    p = Progress()
    improved = []
    for step, metrics in zip((100, 200, 300), DEV):
        p.step = step
        improved.append(p.record_validation(ranking_score(metrics, metric), metrics["bleu"], 1.0))
    assert p.best_step == best and p.bad_evals == bad and improved[0]
    assert p.best_bleu == DEV[best // 100 - 1]["bleu"]  # the dev BLEU of best.pt, whatever ranked it
    assert best_steps(p.validations, 1) == {best}
    assert best_steps(p.validations, 2) == two  # train.keep_best's and average_from=best's snapshots


def test_a_loss_above_one_is_still_an_improvement_on_nothing():
    p = Progress()
    assert p.record_validation(ranking_score({"loss": 7.5}, "loss"), 0.0, 1.0) and p.best_score == -7.5


def test_a_checkpoint_from_before_best_metric_ranks_by_bleu():
    old = {"step": 400, "best_bleu": 12.5, "best_step": 300, "validations": [[300, 12.5], [400, 11.0]]}
    p = progress_from(old)
    assert (p.best_score, p.best_bleu, p.best_step) == (12.5, 12.5, 300)
    p.step = 500
    assert not p.record_validation(12.0, 12.0, 1.0) and p.record_validation(13.0, 13.0, 1.0)
    assert progress_from({"step": 0, "best_bleu": -1.0}).best_score == -math.inf  # no validation yet


@pytest.mark.slow
def test_a_run_keeps_the_weights_of_its_lowest_dev_loss(tmp_path, corpus_tsv):
    """40 steps, validated at 20 and 40: best.pt is the step of the lower dev loss, said in train_summary.json; a
    resume asked to rank by BLEU is refused in one line."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = [a for a in TINY if not a.startswith("name=")] + ["name=by_loss", "train.best_metric=loss"]
    result = run_cli(tmp_path, "command=train", *args, "train.max_steps=40", "train.lr=1e-2")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "checkpoints" / "by_loss"
    history = [json.loads(line) for line in (run / "validations.jsonl").read_text().splitlines()]
    lowest = min(history, key=lambda e: (e["dev_loss"], e["step"]))
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["best_metric"], summary["best_step"]) == ("loss", lowest["step"])
    assert [e["best"] for e in history] == [True, history[1]["dev_loss"] < history[0]["dev_loss"]]
    average = summary["average"]  # of the snapshots at 20 and 40, against the best single weights by dev loss
    assert average["metric"] == "loss" and average["best_single_step"] == lowest["step"]
    assert average["gain"] == pytest.approx(lowest["dev_loss"] - average["dev_loss"], abs=2e-4)
    assert average["kept"] == ("average" if average["gain"] > 0 else "best single")
    kept_bleu = average["dev_bleu"] if average["kept"] == "average" else lowest["dev_bleu"]
    assert summary["best_dev_bleu"] == kept_bleu  # the dev BLEU of best.pt, whatever ranked it
    if average["kept"] == "best single":
        assert torch.load(run / "best.pt", weights_only=True)["progress"]["step"] == lowest["step"]
    refused = run_cli(tmp_path, "command=train", *args[:-1], "name=by_loss", "train.resume=true", "train.max_steps=60")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: {run / 'last.pt'}: train.best_metric=bleu here, loss there: its validations are ranked by loss; "
        "resume with it, or train under another name="
    ), refused.stderr
