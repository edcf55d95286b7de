"""train.max_epochs: a run stops after its Nth pass over the training data, with the last update of that epoch, and
a resume asked for more epochs goes on to them."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, run_cli

from app.config.schema import Config, TrainConfig
from app.data.schedule import BatchSchedule
from app.train.decay_end import DecayEnd
from app.train.summary import duration_hint
from app.train.update import make_optimizer


def test_the_run_says_how_long_its_epochs_take():
    """After its first steps a run says what its limits mean at the measured speed: the epochs, where they end
    before train.max_steps (where: each epoch's own updates counted)."""
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


def test_where_the_epochs_end_is_the_same_from_every_step_and_from_a_resumed_schedule():
    """20 batches an epoch, 3 to an update (train.accum_steps=3): 6 updates an epoch, 2 batches left out. Counted
    from the share of the epoch's batches done, a schedule resumed at step 5 put the end of 1 epoch at step 7, of
    2 at 13: a resumed run decayed its learning rate to another step than the uninterrupted one."""
    schedule = BatchSchedule([5] * 200, [6] * 200, 130, seed=1, accum=3)
    assert len(schedule.epoch_batches()) == 20
    for step, update in enumerate(schedule, start=1):
        schedule.advance(update)
        resumed = BatchSchedule([5] * 200, [6] * 200, 130, seed=1, accum=3)
        resumed.load_state_dict(schedule.state_dict(), 130, 130)
        ends = [resumed.step_of_epochs(step, epochs) for epochs in (1, 2, 3)]
        assert ends == [max(end, step) for end in (6, 12, 18)], step  # an end passed already is now
        if step == 15:
            break


def test_epochs_shuffled_into_other_numbers_of_batches_end_where_their_own_updates_do():
    """Without subword sampling epochs still differ: pairs of 3 + 5 and 5 + 3 tokens sort alike, and a batch the
    shuffle mixes them in pads to 6 + 6 tokens a row (6 rows of 72 tokens), one of 3 + 5 alone to 4 + 6 (7 rows):
    here 15, 16 and 16 updates of 2 ranks (counted as 3 × 15, the decay ended 2 steps early). The end of N epochs
    is the sum of each one's updates, from every step and on every rank, and counting the epochs to come leaves
    the loop's cached epoch where it is."""
    src, tgt = [3] * 180 + [5] * 20, [5] * 180 + [3] * 20
    ranks = [BatchSchedule(src, tgt, 72, seed=5, world=2, rank=rank) for rank in (0, 1)]
    schedule = ranks[0]
    ends = {epochs: schedule.step_of_epochs(0, epochs) for epochs in (1, 2, 3)}
    assert schedule._epoch_cache is not None and schedule._epoch_cache[0][0] == 0  # the loop's first epoch, cached
    assert ranks[1].step_of_epochs(0, 3) == ends[3]
    per_epoch, finished = [0, 0, 0], {}
    for step, update in enumerate(schedule, start=1):
        schedule.advance(update)
        per_epoch[update.epoch] += 1
        assert schedule.step_of_epochs(step, 3) == ends[3], step
        assert schedule._epoch_cache[0][0] == update.epoch  # counting did not move the cache off the loop's epoch
        finished.setdefault(schedule.epochs_finished(), step)
        if schedule.epochs_finished() == 3:
            break
    assert per_epoch == [15, 16, 16]
    assert ends == {epochs: finished[epochs] for epochs in (1, 2, 3)} == {1: 15, 2: 31, 3: 47}


def test_a_resumed_run_decays_to_the_end_its_epochs_were_given_and_a_new_limit_moves_it():
    """Later epochs can cut another number of batches (shuffled, or segmented anew): the end a run computed at its
    start is what a resume to the same train.max_epochs keeps (LambdaLR's state_dict carries it); another
    train.max_epochs is counted again from where the run stands."""
    t = TrainConfig(lr=1e-3, warmup_steps=1, lr_schedule="linear", max_epochs=2)

    def trainer(cfg: Config, scheduler, end_from_here: int):
        schedule = SimpleNamespace(step_of_epochs=lambda step, epochs: end_from_here if epochs else None)
        progress = SimpleNamespace(step=6, eval_seconds=0.0)
        return SimpleNamespace(cfg=cfg, scheduler=scheduler, schedule=schedule, progress=progress, elapsed=lambda: 0)

    model = torch.nn.Linear(2, 2)
    _, first = make_optimizer(model, Config(train=t))
    assert DecayEnd(trainer(Config(train=t), first, 14)).rate.epochs_end == 14
    _, resumed = make_optimizer(model, Config(train=t))
    resumed.load_state_dict(first.state_dict())
    assert DecayEnd(trainer(Config(train=t), resumed, 15)).rate.epochs_end == 14
    more = dataclasses.replace(t, max_epochs=3)
    assert DecayEnd(trainer(Config(train=more), resumed, 21)).rate.epochs_end == 21


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
