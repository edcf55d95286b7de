"""The learning-rate schedules (train.lr_schedule): known values at the warm-up, the middle and the end of each
decay; the same rates through torch's LambdaLR on the optimizer training builds; the warning where a time budget
ends long before a decay does; a CLI run whose last rate is train.lr × train.lr_floor."""

import json
import math
import shutil

import pytest
import torch
from conftest import TINY, run_cli

from app.config.schema import Config, TrainConfig
from app.run.errors import UserError
from app.train.summary import decay_beyond_budget
from app.train.update import cut_on_plateau, learning_rate_factor, make_optimizer


def rates(schedule: str, steps, floor: float = 0.1) -> list[float]:
    factor = learning_rate_factor(TrainConfig(warmup_steps=10, max_steps=110, lr_schedule=schedule, lr_floor=floor))
    return [factor(step - 1) for step in steps]  # update n is step n - 1 of LambdaLR's count


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "cosine", "linear", "constant"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    assert rates(schedule, [1, 5, 10]) == pytest.approx([0.1, 0.5, 1.0])


def test_the_decays_at_known_points():
    # p: how far from the warm-up's end (update 10) to train.max_steps (110); f = 0.1
    assert rates("cosine", [35, 60, 85, 110, 500]) == pytest.approx(
        [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0, 1.0)]
    )
    assert rates("cosine", [60])[0] == pytest.approx(0.55)
    assert rates("linear", [35, 60, 110, 500]) == pytest.approx([0.775, 0.55, 0.1, 0.1])
    assert rates("linear", [110], floor=0.0) == [0.0]
    assert rates("constant", [11, 110, 10_000]) == [1.0, 1.0, 1.0]
    # Vaswani et al.'s, rescaled to peak at 1, as before the setting existed: min(n / w, √(w / n))
    steps = [1, 3, 9, 10, 11, 40, 110, 10_000]
    assert rates("inverse_sqrt", steps) == [min(n / 10, math.sqrt(10 / n)) for n in steps]


def test_the_optimizer_training_builds_follows_the_schedule():
    model = torch.nn.Linear(4, 4)
    cfg = Config(train=TrainConfig(lr=2e-3, warmup_steps=4, max_steps=12, lr_schedule="linear", lr_floor=0.25))
    optimizer, scheduler = make_optimizer(model, cfg)
    seen = []
    for _ in range(14):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [2e-3 * n / 4 for n in (1, 2, 3)] + [2e-3 * (0.25 + 0.75 * (1 - (n - 4) / 8)) for n in range(4, 13)]
    assert seen == pytest.approx(expected + [2e-3 * 0.25] * 2)


def test_a_floor_outside_zero_to_one_is_refused():
    with pytest.raises(UserError, match=r"^train.lr_floor=1.5 must be in \[0, 1\]: where a decay ends, × train.lr$"):
        TrainConfig(lr_floor=1.5)


def test_a_limit_that_ends_the_run_long_before_the_decay_is_a_warning():
    t = TrainConfig(max_minutes=7, max_steps=100_000, warmup_steps=1000, lr_schedule="cosine")
    assert decay_beyond_budget(t, 12_000, "train.max_minutes=7") == (
        "train.lr_schedule=cosine decays over train.max_steps=100000, but train.max_minutes=7 ends near step 12000: "
        "the learning rate would still be 97% of train.lr there; train.max_steps=12000 decays within it"
    )
    linear = TrainConfig(max_epochs=3, max_steps=10_000, warmup_steps=0, lr_schedule="linear")
    assert decay_beyond_budget(linear, 2_500, "train.max_epochs=3") == (
        "train.lr_schedule=linear decays over train.max_steps=10000, but train.max_epochs=3 ends near step 2500: "
        "the learning rate would still be 75% of train.lr there; train.max_steps=2500 decays within it"
    )
    assert decay_beyond_budget(TrainConfig(max_steps=13_000, lr_schedule="cosine"), 12_000, "a limit") is None
    assert decay_beyond_budget(TrainConfig(max_minutes=7), 12_000, "a limit") is None  # inverse_sqrt: it has no end


def test_a_plateau_cuts_the_rate_after_its_patience_down_to_the_floor():
    """Every train.lr_patience validations without a gain the rate is halved (lr_decay), now and from then on, not
    below lr × lr_floor; a scheduler restored from the state_dict goes on at the cut rate."""
    model = torch.nn.Linear(4, 4)
    t = TrainConfig(lr=1e-3, warmup_steps=1, lr_schedule="plateau", lr_patience=2, lr_decay=0.5, lr_floor=0.2)
    optimizer, scheduler = make_optimizer(model, Config(train=t))
    rates = []
    for bad_evals in range(1, 10):
        optimizer.step()
        scheduler.step()
        cut_on_plateau(scheduler, t, bad_evals, bad_evals, torch.device("cpu"), main=True)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4, 2e-4, 2e-4, 2e-4, 2e-4])
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    restored_optimizer, restored = make_optimizer(model, Config(train=t))
    restored.load_state_dict(scheduler.state_dict())
    restored_optimizer.step()
    restored.step()
    assert restored_optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    from app.train.capture import learning_rate_on_device

    learning_rate_on_device(restored_optimizer, torch.device("cpu"))  # as a captured update reads it: a tensor
    rate = restored_optimizer.param_groups[0]["lr"]
    cut_on_plateau(restored, t, 2, 12, torch.device("cpu"), main=True)  # at the floor already: no cut
    assert restored_optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(2e-4)
    restored.base_lrs = [1e-3]
    rate.fill_(1e-3)
    cut_on_plateau(restored, t, 2, 12, torch.device("cpu"), main=True)
    assert restored_optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(5e-4)  # in place
    other = TrainConfig(lr=1e-3, lr_schedule="constant", lr_patience=1)
    optimizer, scheduler = make_optimizer(model, Config(train=other))
    cut_on_plateau(scheduler, other, 5, 5, torch.device("cpu"), main=True)  # not a plateau schedule: no cut
    assert scheduler.base_lrs == [1e-3]


@pytest.mark.slow
def test_a_run_that_does_not_learn_cuts_its_rate_at_each_validation(tmp_path, corpus_tsv):
    """A rate too small to learn anything: BLEU 0 at every validation, so with lr_patience=1 each validation after
    the first halves it, said in the log."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = [a for a in TINY if not a.startswith("name=")] + ["name=plateau", "train.lr=1e-7"]
    args += ["train.lr_schedule=plateau", "train.lr_patience=1", "train.max_steps=60", "train.average_snapshots=0"]
    result = run_cli(tmp_path, "command=train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    history = [
        json.loads(line) for line in (tmp_path / "checkpoints/plateau/validations.jsonl").read_text().splitlines()
    ]
    assert [e["dev_bleu"] for e in history] == [0.0, 0.0, 0.0]
    log = (tmp_path / "checkpoints/plateau/train.log").read_text()
    said = [line for line in log.splitlines() if "no better dev score" in line]
    assert [line.split(" - ")[-1] for line in said] == [
        "step 40: no better dev score (train.best_metric=bleu) in 1 validations: learning rate 1e-07 -> 5e-08 "
        "(train.lr_decay=0.5)",
        "step 60: no better dev score (train.best_metric=bleu) in 1 validations: learning rate 5e-08 -> 2.5e-08 "
        "(train.lr_decay=0.5)",
    ]
    state = torch.load(tmp_path / "checkpoints/plateau/last.pt", weights_only=True)
    assert state["scheduler"]["base_lrs"] == pytest.approx([2.5e-8])


@pytest.mark.slow
def test_a_run_ends_its_linear_decay_at_the_floor(tmp_path, corpus_tsv):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = ("train.max_steps=30", "train.lr=2e-3", "train.lr_schedule=linear", "train.lr_floor=0.1", "name=linear")
    result = run_cli(tmp_path, "command=train", *[a for a in TINY if not a.startswith("name=")], *args)
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoints" / "linear" / "last.pt", weights_only=True)
    assert state["progress"]["step"] == 30
    assert state["scheduler"]["_last_lr"] == pytest.approx([2e-3 * 0.1])
