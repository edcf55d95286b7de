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
from app.train.decay_end import budget_end
from app.train.summary import decay_beyond_budget
from app.train.update import LearningRate, cut_on_plateau, make_optimizer


def rates(schedule: str, steps, floor: float = 0.1) -> list[float]:
    factor = LearningRate(TrainConfig(warmup_steps=10, max_steps=110, lr_schedule=schedule, lr_floor=floor))
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


def test_the_decay_ends_where_the_first_limit_ends_and_a_resumed_scheduler_keeps_it():
    """The decay's end is the first of train.max_steps, the step train.max_epochs ends at and the step the time
    budget ends at (estimated at validations); LambdaLR's state_dict carries them to a resumed run."""
    t = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=1010, lr_schedule="linear", lr_floor=0.0)
    rate = LearningRate(t)
    assert rate.end == 1010 and rate(509) == pytest.approx(0.5)
    rate.epochs_end = 510
    assert rate.end == 510 and rate(259) == pytest.approx(0.5) and rate(509) == 0.0
    rate.budget_end = 210
    assert rate.end == 210 and rate(109) == pytest.approx(0.5) and rate(209) == 0.0
    rate.max_steps = 110
    assert rate.end == 110
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = make_optimizer(model, Config(train=t))
    scheduler.lr_lambdas[0].budget_end = 210
    for _ in range(110):
        optimizer.step()
        scheduler.step()
    _, restored = make_optimizer(model, Config(train=t))
    restored.load_state_dict(scheduler.state_dict())
    assert restored.lr_lambdas[0].budget_end == 210 and restored.get_last_lr() == pytest.approx(
        [1e-3 * (1 - 101 / 200)]
    )


def test_where_the_time_budget_ends():
    # 10 s left at 0.1 s a step: 100 steps; with a validation of 2 s every 20 steps, 0.2 s a step: 50 steps
    assert budget_end(400, 0.1, 10.0, 0.0, 0) == 500
    assert budget_end(400, 0.1, 10.0, 2.0, 20) == 450
    assert budget_end(400, 0.1, -3.0, 2.0, 20) == 400


def test_a_time_budget_without_validations_that_ends_long_before_the_decay_is_a_warning():
    t = TrainConfig(max_minutes=7, max_steps=100_000, warmup_steps=1000, lr_schedule="cosine", eval_every=0)
    assert decay_beyond_budget(t, 12_000) == (
        "train.lr_schedule=cosine decays over train.max_steps=100000, but train.max_minutes=7 ends near step 12000, "
        "and without validations (train.eval_every=0) the decay cannot follow it: the learning rate would still be "
        "97% of train.lr there; train.max_steps=12000 decays within it"
    )
    validated = TrainConfig(max_minutes=7, max_steps=100_000, warmup_steps=1000, lr_schedule="cosine")
    assert decay_beyond_budget(validated, 12_000) is None  # its validations move the decay's end (decay_end.py)
    assert decay_beyond_budget(TrainConfig(max_steps=13_000, lr_schedule="cosine", eval_every=0), 12_000) is None
    assert decay_beyond_budget(TrainConfig(max_minutes=7, eval_every=0), 12_000) is None  # inverse_sqrt: no end


def test_a_plateau_cuts_the_rate_after_its_patience_down_to_the_floor():
    """After more than train.lr_patience validations without a gain the rate is halved (lr_decay), now and from then
    on, not below lr × lr_floor, as torch's ReduceLROnPlateau with that patience does (JoeyNMT's "plateau": a config
    of theirs means the same here); a scheduler restored from the state_dict goes on at the cut rate."""
    model = torch.nn.Linear(4, 4)
    t = TrainConfig(lr=1e-3, warmup_steps=1, lr_schedule="plateau", lr_patience=2, lr_decay=0.5, lr_floor=0.2)
    optimizer, scheduler = make_optimizer(model, Config(train=t))
    reference = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(reference, mode="max", factor=0.5, patience=2, min_lr=2e-4)
    plateau.step(10.0)  # the best dev score; each validation after it scores lower
    rates, torch_rates = [], []
    for bad_evals in range(1, 13):
        optimizer.step()
        scheduler.step()
        cut_on_plateau(scheduler, t, bad_evals, bad_evals, torch.device("cpu"), main=True)
        rates.append(optimizer.param_groups[0]["lr"])
        plateau.step(9.0)
        torch_rates.append(reference.param_groups[0]["lr"])
    assert rates == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4, 5e-4, 2.5e-4, 2.5e-4, 2.5e-4, 2e-4, 2e-4, 2e-4, 2e-4])
    assert rates == pytest.approx(torch_rates)
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
    cut_on_plateau(restored, t, 3, 12, torch.device("cpu"), main=True)  # at the floor already: no cut
    assert restored_optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(2e-4)
    restored.base_lrs = [1e-3]
    rate.fill_(1e-3)
    cut_on_plateau(restored, t, 3, 12, torch.device("cpu"), main=True)
    assert restored_optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(5e-4)  # in place
    other = TrainConfig(lr=1e-3, lr_schedule="constant", lr_patience=1)
    optimizer, scheduler = make_optimizer(model, Config(train=other))
    cut_on_plateau(scheduler, other, 5, 5, torch.device("cpu"), main=True)  # not a plateau schedule: no cut
    assert scheduler.base_lrs == [1e-3]


@pytest.mark.slow
def test_a_run_that_does_not_learn_cuts_its_rate_at_each_validation(tmp_path, corpus_tsv):
    """A rate too small to learn anything: BLEU 0 at every validation, so with lr_patience=0 each validation after
    the first halves it, said in the log."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = [a for a in TINY if not a.startswith("name=")] + ["name=plateau", "train.lr=1e-7"]
    args += ["train.lr_schedule=plateau", "train.lr_patience=0", "train.max_steps=60", "train.average_snapshots=0"]
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


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["train.max_epochs=3", "train.max_minutes=0.3"])
def test_a_run_ends_its_decay_with_the_limit_that_stops_it(tmp_path, corpus_tsv, limit):
    """Under the default train.max_steps=100000, a run stopped by its epochs, or by its time budget, still ends its
    decay: at the floor where the epochs end (their step known at the start), near it where the time budget ends
    (its step estimated at each validation)."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = ["train.lr=2e-3", "train.lr_schedule=linear", "train.lr_floor=0.1", "train.eval_every=10", "name=limit"]
    args.append("train.patience=0")  # no early stopping: the limit stops it
    result = run_cli(tmp_path, "command=train", *[a for a in TINY if not a.startswith("name=")], *args, limit)
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoints" / "limit" / "last.pt", weights_only=True)
    step, (rate,) = state["progress"]["step"], state["scheduler"]["lr_lambdas"]
    assert rate["max_steps"] == 100_000 and step < 5000
    summary = json.loads((tmp_path / "checkpoints" / "limit" / "train_summary.json").read_text())
    assert summary["stopped"] == ("max_epochs (3)" if "epochs" in limit else "time budget of 0.3 min"), summary
    if limit.startswith("train.max_epochs"):
        assert rate["epochs_end"] == step and state["scheduler"]["_last_lr"] == pytest.approx([2e-3 * 0.1])
    else:  # the last estimate, at the last validation before the closing one, is within a few steps of the end
        assert 0.8 * step <= rate["budget_end"] <= 1.25 * step, (rate, step)
        # near the floor (0.1) where the last estimates were right; under train.max_steps alone it would be 0.99
        assert state["scheduler"]["_last_lr"][0] <= 2e-3 * 0.6
        log = (tmp_path / "checkpoints" / "limit" / "train.log").read_text()
        assert "train.lr_schedule=linear decays to where train.max_minutes=0.3 ends: near step " in log
