"""Settings a user sets are honoured: train.eval_every=0 means no validation at all; a time budget is a
wall-clock promise that includes the closing validation; a run says early how long it will take."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, compose_config

from app.run.errors import TrainingInterrupted
from app.train import closing_average
from app.train import trainer as training
from app.train.stop_rules import StopNow

pytestmark = [pytest.mark.slow, pytest.mark.wall_clock]  # toy trainings, timed against their budgets


def config(run_dir, *overrides):
    base = [a for a in TINY if not a.startswith(("name=", "train.eval_every", "train.save_every"))]
    return compose_config(*base, f"run_dir={run_dir}", "train.save_every=1000", *overrides)


def test_eval_every_zero_means_no_validation_and_best_is_the_last_checkpoint(corpus_folder, caplog):
    caplog.set_level("INFO")
    summary = training.train(config(corpus_folder / "run", "train.eval_every=0", "train.max_steps=12"))
    assert summary["validations"] == 0 and summary["validation_minutes"] == 0
    assert summary["best_step"] == 12 and summary["best_dev_bleu"] == -1.0  # the step of best.pt's weights, not 0
    best, last = (torch.load(corpus_folder / "run" / f"{name}.pt", weights_only=True) for name in ("best", "last"))
    assert best["progress"]["step"] == last["progress"]["step"] == 12
    assert all(torch.equal(best["model"][k], v) for k, v in last["model"].items())
    assert "train.eval_every=0: no validation, best.pt holds the last weights (step 12)" in caplog.text
    # best.pt: the weights users evaluate, without the optimizer's state that last.pt keeps for a resume
    assert "optimizer" in last and "trained_model" in last and "optimizer" not in best and "trained_model" not in best
    assert os.path.getsize(corpus_folder / "run" / "best.pt") < 0.4 * os.path.getsize(corpus_folder / "run" / "last.pt")


@pytest.mark.parametrize("closing_average", [False, True])
def test_the_time_budget_includes_the_closing_validation(corpus_folder, closing_average):
    """Validations every 4 steps, a budget of 8 s: training stops early enough for the closing validation
    to end inside the budget (it is given as long as the last validation took), where it used to start at
    the budget and run past it; and for the closing average's validation as well where there is one."""
    budget = 8.0
    limits = ["train.max_steps=100000", f"train.max_minutes={budget / 60}", "train.patience=0"]
    average = ["train.average_snapshots=2", "train.save_every=4"] if closing_average else ["train.average_snapshots=0"]
    cfg = config(corpus_folder / "run", "train.eval_every=4", *limits, *average)
    summary = training.train(cfg)
    state = torch.load(corpus_folder / "run" / "last.pt", weights_only=True)["progress"]
    assert summary["stopped"].startswith("time budget") and summary["validations"] >= 1
    assert state["validations"][-1][0] == summary["steps"]  # the closing validation ran, at the last step
    assert ("average" in summary) == closing_average
    # its own duration varies a little from the last one's: allow half of it, and a second of slack
    elapsed = summary["train_minutes"] * 60  # after the closing average
    validation = state["last_validation_seconds"]
    # the closing average is given a validation as long as the last one (and its disk work, ~0 here): where it took
    # longer on a loaded machine, that overrun is the machine's, not a budget left unreserved
    overrun = max(0.0, summary["average"]["seconds"] - validation) if closing_average else 0.0
    assert elapsed <= budget + 0.5 * validation + 1.0 + 0.3 + overrun, (summary, state)  # 0.3: rounding


def test_a_run_out_of_budget_and_cut_off_in_its_closing_average_stops_again_when_resumed(corpus_folder, monkeypatch):
    """A signal in the closing average's validation (StopNow, as a signal raises it there) after the budget stopped
    training: the resume, the same command plus train.resume=true, keeps the closing work's time as the run did after
    each step, and closes the run at the step it stopped at, where it used to train on."""
    budget = 6.0  # a loaded machine makes a few steps of it: a snapshot of every one, so that two are averaged
    limits = ["train.max_steps=100000", f"train.max_minutes={budget / 60}", "train.patience=0"]
    args = [*limits, "train.eval_every=4", "train.save_every=1", "train.average_snapshots=2"]

    def signalled(*args, **kwargs):
        raise StopNow(signal.SIGTERM)

    with monkeypatch.context() as patched:
        patched.setattr(closing_average, "validate", signalled)
        with pytest.raises(TrainingInterrupted):
            training.train(config(corpus_folder / "run", *args))
    stopped = torch.load(corpus_folder / "run" / "last.pt", weights_only=True)["progress"]["step"]
    summary = training.train(config(corpus_folder / "run", *args, "train.resume=true"))
    assert summary["steps"] == stopped and summary["stopped"] == f"time budget of {budget / 60} min", summary
    assert summary["average"]["steps"][-1] == stopped


def test_a_run_says_how_long_its_budget_takes_at_the_measured_speed(corpus_folder, capsys):
    training.train(config(corpus_folder / "run", "train.eval_every=0", "train.max_steps=14"))
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "s/step, the" in line]
    assert len(lines) == 1 and "steps left of train.max_steps=14 take about" in lines[0]
    summary = json.loads((corpus_folder / "run" / "train_summary.json").read_text())
    assert summary["steps"] == 14 and os.path.exists(corpus_folder / "run" / "best.pt")


def test_a_budget_that_ends_before_the_first_validation_keeps_time_for_the_closing_one(corpus_folder, caplog):
    """No validation before the budget ends (train.eval_every beyond it): the closing validation's time is
    sampled on dev once the first steps are timed, and training stops early enough for it, where it used to
    start at the budget and run past it."""
    caplog.set_level("INFO")
    budget = 10.0
    limits = ["train.max_steps=100000", f"train.max_minutes={budget / 60}", "train.eval_every=100000"]
    cfg = config(corpus_folder / "run", *limits, "train.average_snapshots=0", "train.max_dev_sentences=0")
    summary = training.train(cfg)
    state = torch.load(corpus_folder / "run" / "last.pt", weights_only=True)["progress"]
    assert summary["stopped"].startswith("time budget") and summary["validations"] == 1
    assert "closing validation: about" in caplog.text and "sampled on dev" in caplog.text
    assert state["validations"][-1][0] == summary["steps"]  # the closing validation ran, at the last step
    elapsed = summary["train_minutes"] * 60
    assert elapsed <= budget + 0.5 * state["last_validation_seconds"] + 1.0 + 0.3, (summary, state)


def test_a_budget_that_ends_before_the_warm_up_says_so_at_once(corpus_folder, caplog, capsys):
    """A budget that the measured speed shows to end before the learning-rate warm-up does is told at the
    first estimate (after the first ten steps), with the setting that fixes it; the summary says it again."""
    caplog.set_level("INFO")
    limits = ["train.max_steps=100000", "train.max_minutes=0.1", "train.eval_every=0", "train.warmup_steps=100000"]
    summary = training.train(config(corpus_folder / "run", *limits))
    warnings = [r for r in caplog.records if "before the learning-rate warm-up ends" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    message = warnings[0].getMessage()
    assert re.match(
        r"train\.max_minutes=0\.1 ends near step \d+ at [\d.e-]+ s/step, before the learning-rate "
        r"warm-up ends at step 100000 \(train\.warmup_steps\): too few updates",
        message,
    ), message
    assert re.search(r"train\.max_minutes=\d+ reaches step 100000 at this speed", message), message
    hint = [line for line in capsys.readouterr().out.splitlines() if "s/step, the" in line]
    assert len(hint) == 1 and "stops near step" in hint[0]
    assert summary["steps"] < 100000 and "before the warm-up (train.warmup_steps=100000)" in summary["warning"]


def test_a_budget_past_the_warm_up_gives_no_warning(corpus_folder, caplog):
    caplog.set_level("INFO")
    limits = ["train.max_steps=30", "train.max_minutes=5", "train.eval_every=0", "train.warmup_steps=10"]
    summary = training.train(config(corpus_folder / "run", *limits))
    assert "warm-up" not in caplog.text and "warning" not in summary


def test_log_lines_during_training_are_whole_lines_above_the_bar_and_the_budget_warning_ends_the_first_ones(
    corpus_folder,
):
    """Through the CLI, stdout and stderr in one stream as a terminal shows them: every log line printed while the
    progress bar runs (the budget warning among them) is a line of its own, never glued to the bar's text; the
    warning is the last of the run's opening lines on the console, before its first validation, and in
    train.log."""
    args = [a for a in TINY if not a.startswith(("name=", "train.eval_every="))]
    limits = ["train.max_steps=100000", "train.max_minutes=0.1", "train.eval_every=20", "train.warmup_steps=100000"]
    result = subprocess.run(
        [sys.executable, "-m", "app", "command=train", *args, *limits, "name=budget"],
        cwd=corpus_folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"},
        timeout=600,
    )
    out = result.stdout.decode()
    assert result.returncode == 0, out[-3000:]
    warning = "too few updates for this model to learn anything"
    pieces = [(m.start(), m.group()) for m in re.finditer(r"[^\r\n]+", out)]
    logged = [(start, piece) for start, piece in pieces if re.search(r"\]\[(INFO|WARNING)\] - ", piece)]
    assert any(warning in piece for _, piece in logged), out[-3000:]
    for start, piece in logged:
        assert piece.startswith("[") and "step/s" not in piece, piece  # nothing of the bar before or after it
        assert out[start + len(piece)] == "\n", piece
        before = out[:start]
        # at the start of a line: after a newline, or after the bar's line cleared (\r, blanks, \r)
        assert start == 0 or before.endswith("\n") or re.search(r"(^|[\r\n]) *\r$", before), repr(before[-200:])

    # the bars' pieces left out: training's, and a closing validation's (on a loaded machine the budget can end
    # before step 20, and the first validation is then the closing one: its notice first, then its bars)
    bars = re.compile(r"step/s|\d+%\|")
    lines = [piece for _, piece in pieces if not bars.search(piece) and piece.strip()]
    first_validation = next(i for i, line in enumerate(lines) if re.match(r"step \d+: (dev loss|closing)", line))
    assert warning in lines[first_validation - 1], lines[: first_validation + 1]

    log = (corpus_folder / "checkpoints" / "budget" / "train.log").read_text().splitlines()
    # what was printed above the bar is in train.log too: how long the run takes, each validation's results
    assert any("s/step, the" in line for line in log) and any(re.search(r"step \d+: dev loss ", x) for x in log), log
    at = next(i for i, line in enumerate(log) if warning in line)
    opening = ("model: ", "each update: ", "closing validation: about")
    assert all(any(kind in line for line in log[:at]) for kind in opening), log
    assert not any(kind in line for line in log[at + 1 :] for kind in opening), log
