"""Settings a user sets are honoured: train.eval_every=0 means no validation at all; a time budget is a
wall-clock promise that includes the closing validation; a run says early how long it will take."""

import json
import os
import shutil

import pytest
import torch
from conftest import TINY, compose_config

from app.train import trainer as training

pytestmark = pytest.mark.slow  # toy trainings


@pytest.fixture
def workdir(tmp_path, corpus_tsv, monkeypatch):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config(run_dir, *overrides):
    base = [a for a in TINY if not a.startswith(("name=", "train.eval_every", "train.save_every"))]
    return compose_config(*base, f"run_dir={run_dir}", "train.save_every=1000", *overrides)


def test_eval_every_zero_means_no_validation_and_best_is_the_last_checkpoint(workdir, caplog):
    caplog.set_level("INFO")
    summary = training.train(config(workdir / "run", "train.eval_every=0", "train.max_steps=12"))
    assert summary["validations"] == 0 and summary["validation_minutes"] == 0
    best, last = (torch.load(workdir / "run" / f"{name}.pt", weights_only=True) for name in ("best", "last"))
    assert best["progress"]["step"] == last["progress"]["step"] == 12
    assert all(torch.equal(best["model"][k], v) for k, v in last["model"].items())
    assert "train.eval_every=0: no validation, best.pt is the last checkpoint (step 12)" in caplog.text


@pytest.mark.parametrize("closing_average", [False, True])
def test_the_time_budget_includes_the_closing_validation(workdir, closing_average):
    """Validations every 4 steps, a budget of 20 s: training stops early enough for the closing validation
    to end inside the budget (it is given as long as the last validation took), where it used to start at
    the budget and run past it; and for the closing average's validation as well where there is one."""
    budget = 20.0
    limits = ["train.max_steps=100000", f"train.max_minutes={budget / 60}", "train.patience=0"]
    average = ["train.average_snapshots=2", "train.save_every=4"] if closing_average else ["train.average_snapshots=0"]
    cfg = config(workdir / "run", "train.eval_every=4", *limits, *average)
    summary = training.train(cfg)
    state = torch.load(workdir / "run" / "last.pt", weights_only=True)["progress"]
    assert summary["stopped"].startswith("time budget") and summary["validations"] >= 1
    assert state["validations"][-1][0] == summary["steps"]  # the closing validation ran, at the last step
    assert ("average" in summary) == closing_average
    # its own duration varies a little from the last one's: allow half of it, and a second of slack
    elapsed = summary["train_minutes"] * 60  # after the closing average
    assert elapsed <= budget + 0.5 * state["last_validation_seconds"] + 1.0 + 0.3, (summary, state)  # 0.3: rounding


def test_a_run_says_how_long_its_budget_takes_at_the_measured_speed(workdir, capsys):
    training.train(config(workdir / "run", "train.eval_every=0", "train.max_steps=14"))
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "s/step, the" in line]
    assert len(lines) == 1 and "steps left of train.max_steps=14 take about" in lines[0]
    summary = json.loads((workdir / "run" / "train_summary.json").read_text())
    assert summary["steps"] == 14 and os.path.exists(workdir / "run" / "best.pt")
