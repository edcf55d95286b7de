"""The batch schedule: every update's sentences from (seed, epoch, position, budget) alone, so a checkpoint's
``state_dict`` replays the rest of a run exactly; out-of-memory halving; each rank's share. And the training
state a checkpoint holds, read on the CPU whatever device training runs on."""

import random

import pytest
import torch
from conftest import Vocab, compose_config

from app.data.schedule import BatchSchedule
from app.models import build_model
from app.run.device import rng_state
from app.run.errors import UserError
from app.train.state import TrainingState
from app.train.update import make_optimizer

rng = random.Random(0)
SRC = [rng.randint(1, 40) for _ in range(300)]
TGT = [rng.randint(1, 40) for _ in range(300)]


def take(schedule, n):
    """The next ``n`` updates, each trained on (advanced past)."""
    updates = []
    for update in schedule:
        schedule.advance(update)
        updates.append(update)
        if len(updates) == n:
            return updates


def test_epochs_are_finished_with_their_last_update_and_a_resume_knows_it():
    """train.max_epochs counts the epochs every update of which was trained on; a schedule resumed from a
    checkpoint taken anywhere counts the same."""
    counted = BatchSchedule(SRC, TGT, 400, seed=3, world=2, accum=2)  # 4 batches an update: a left-over group
    per_epoch = [len(counted.epoch_batches(e)) // counted.group for e in range(3)]
    finished = []
    for update in counted:
        counted.advance(update)
        finished.append(counted.epochs_finished())
        if len(finished) == sum(per_epoch):
            break
    expected = []
    for epoch, updates in enumerate(per_epoch):  # finished with the epoch's last update
        expected += [epoch] * (updates - 1) + [epoch + 1]
    assert finished == expected
    assert all(len(counted.epoch_batches(e)) % counted.group for e in range(3))  # each epoch leaves batches out
    for n in (per_epoch[0] - 1, per_epoch[0], per_epoch[0] + 1):
        first = BatchSchedule(SRC, TGT, 400, seed=3, world=2, accum=2)
        take(first, n)
        resumed = BatchSchedule(SRC, TGT, 400, seed=3, world=2, accum=2)
        resumed.load_state_dict(first.state_dict(), configured_batch_tokens=400, saved_batch_tokens=400)
        assert resumed.epochs_finished() == first.epochs_finished() == (n >= per_epoch[0])


def test_a_resumed_schedule_replays_the_same_updates_across_epochs():
    whole = take(BatchSchedule(SRC, TGT, 400, seed=3), 120)  # several epochs
    first = BatchSchedule(SRC, TGT, 400, seed=3)
    head = take(first, 47)
    resumed = BatchSchedule(SRC, TGT, 400, seed=3)
    resumed.load_state_dict(first.state_dict(), configured_batch_tokens=400, saved_batch_tokens=400)
    tail = take(resumed, 120 - 47)
    assert [u.parts for u in head + tail] == [u.parts for u in whole]
    assert len({u.epoch for u in whole}) > 2


def test_every_sentence_once_per_epoch_and_tokens_counted_with_eos():
    schedule = BatchSchedule(SRC, TGT, 400, seed=1)
    epoch = [u for u in take(schedule, 200) if u.epoch == 0]
    seen = [i for u in epoch for part in u.parts for i in part]
    assert sorted(seen) == list(range(len(SRC)))
    assert all(u.tgt_tokens == sum(TGT[i] + 1 for part in u.parts for i in part) for u in epoch)


def test_iterating_ahead_does_not_move_the_schedule():
    schedule = BatchSchedule(SRC, TGT, 400, seed=1)
    updates = iter(schedule)
    first, _ = next(updates), next(updates)  # a prefetcher ran one ahead
    schedule.advance(first)
    assert schedule.state_dict()["position"] == 1


def test_halving_cuts_the_rest_of_the_epoch_and_the_next_one_with_the_new_budget():
    schedule = BatchSchedule(SRC, TGT, 800, seed=2)
    updates = iter(schedule)
    update = next(updates)
    assert schedule.halve() == 400
    pieces = schedule.parts_in_force(update)
    assert len(pieces) >= 2 and sorted(i for p in pieces for i in p) == sorted(update.parts[0])
    schedule.advance(update)
    later = [u for u in take(schedule, 200) if u.epoch == 1]
    assert later and all(u.epoch_batch_tokens == 400 for u in later)


def test_each_rank_takes_its_share_of_the_same_global_batches():
    ranks = [BatchSchedule(SRC, TGT, 400, seed=4, world=2, rank=r, accum=2) for r in range(2)]
    a, b = (take(s, 5) for s in ranks)
    for ua, ub in zip(a, b):
        assert len(ua.parts) == len(ub.parts) == 2 and ua.tgt_tokens == ub.tgt_tokens
        assert not set(i for p in ua.parts for i in p) & set(i for p in ub.parts for i in p)


def test_a_changed_budget_applies_from_the_next_batches_and_a_changed_seed_is_refused():
    first = BatchSchedule(SRC, TGT, 400, seed=3)
    take(first, 5)
    resumed = BatchSchedule(SRC, TGT, 300, seed=3)
    resumed.load_state_dict(first.state_dict(), configured_batch_tokens=300, saved_batch_tokens=400)
    assert resumed.batch_tokens == 300 and resumed.epoch_batch_tokens == 400
    other = BatchSchedule(SRC, TGT, 400, seed=9)
    with pytest.raises(UserError, match="train.seed=9 but the checkpoint's run has seed 3"):
        other.load_state_dict(first.state_dict(), configured_batch_tokens=400, saved_batch_tokens=400)


def training_state(device):
    cfg = compose_config(
        "model=transformer_small",
        "model.d_model=16",
        "model.heads=2",
        "model.enc_layers=1",
        "model.dec_layers=1",
        "model.ff_dim=32",
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocab(20, 20))
    optimizer, scheduler = make_optimizer(model, cfg)
    schedule = BatchSchedule(SRC, TGT, cfg.train.batch_tokens, cfg.train.seed)
    return TrainingState(model, optimizer, scheduler, schedule, cfg, {"vocab": 20}, device)


def test_resume_reads_the_checkpoint_on_the_cpu_whatever_device_training_runs_on(tmp_path):
    """A CUDA run mapped its checkpoint onto the GPU and crashed turning the RNG state into numpy. Here the
    training device is 'meta' (no data, like a device the host cannot read): a checkpoint mapped onto it
    cannot restore the random generators; read on the CPU it restores them exactly."""
    path = str(tmp_path / "last.pt")
    saved = training_state(torch.device("cpu"))
    saved.progress.step = 7
    torch.save(saved.checkpoint(), path)
    expected = torch.rand(3)  # what the generator draws next, as saved
    resumed = training_state(torch.device("meta"))
    torch.rand(5)  # the generator moves on before the resume
    resumed.restore(path, rank=0, world=1)
    assert resumed.progress.step == 7
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises((NotImplementedError, RuntimeError)):  # what mapping it onto the device would do
        torch.load(path, map_location="meta", weights_only=True)["rng"]["torch"].cpu()
    assert rng_state(torch.device("cpu"))["torch"].device.type == "cpu"
