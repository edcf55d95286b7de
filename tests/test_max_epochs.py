"""train.max_epochs: a run stops after its Nth pass over the training data, with the last update of that epoch, and
a resume asked for more epochs goes on to them."""

import json
import shutil

import pytest
import torch
from conftest import TINY, run_cli

from app.config.schema import Config, TrainConfig
from app.data.schedule import BatchSchedule
from app.train.summary import duration_hint


def test_the_run_says_how_long_its_epochs_take():
    """After its first steps a run says what its limits mean at the measured speed: the epochs, where they end
    before train.max_steps (about where: the current epoch's updates an epoch)."""
    schedule = BatchSchedule([5] * 100, [6] * 100, 130, seed=1)  # 13 tokens a pair, 10 a batch: 10 updates an epoch
    for update in schedule:
        schedule.advance(update)
        if update.position == 4:
            break
    assert schedule.step_of_epochs(4, 3) == 30 and schedule.step_of_epochs(4, 0) is None
    cfg = Config(train=TrainConfig(max_steps=1000, max_epochs=3))
    hint = duration_hint(cfg, torch.device("cpu"), None, 4, 0.5, None, schedule.step_of_epochs(4, 3))
    assert hint == "at 0.5 s/step, the 26 steps left of train.max_epochs=3 (near step 30) take about 13 s"
    cfg = Config(train=TrainConfig(max_steps=20, max_epochs=3))  # max_steps first
    hint = duration_hint(cfg, torch.device("cpu"), None, 4, 0.5, None, schedule.step_of_epochs(4, 3))
    assert hint == "at 0.5 s/step, the 16 steps left of train.max_steps=20 take about 8 s"


@pytest.mark.fresh_interpreter
@pytest.mark.slow
def test_a_run_stops_after_its_epochs_and_a_resume_trains_the_next(tmp_path, corpus_tsv):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = [a for a in TINY if not a.startswith(("name=", "train.eval_every=", "train.save_every="))]
    args += ["name=epochs", "train.eval_every=0", "train.save_every=1000"]
    result = run_cli(tmp_path, "command=train", *args, "train.max_epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "checkpoints" / "epochs"
    summary = json.loads((run / "train_summary.json").read_text())
    schedule = torch.load(run / "last.pt", weights_only=True)["schedule"]
    # the second epoch's last update (an epoch's last group smaller than an update is left out)
    assert summary["stopped"] == "max_epochs (2)" and schedule["epoch"] == 1 and 1.9 < summary["epochs"] <= 2.0
    two = summary["steps"]
    resumed = run_cli(tmp_path, "command=train", *args, "train.max_epochs=3", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "train_summary.json").read_text())
    schedule = torch.load(run / "last.pt", weights_only=True)["schedule"]
    assert summary["stopped"] == "max_epochs (3)" and schedule["epoch"] == 2 and 2.9 < summary["epochs"] <= 3.0
    assert 1.4 * two < summary["steps"] < 1.6 * two  # one more epoch, about half as many steps again
    again = run_cli(tmp_path, "command=train", *args, "train.max_epochs=3", "train.resume=true")  # done: no step
    assert again.returncode == 0 and json.loads((run / "train_summary.json").read_text())["steps"] == summary["steps"]
