"""Averaged weights: the exponential moving average (train.ema_decay, app/train/ema.py) follows its formula in one
fused update, is what validation scores and checkpoints hand out, and resumes bit for bit; the closing average
(train.average_snapshots, app/train/closing_average.py) averages the chosen snapshots and keeps as best.pt whichever
of it and the best single weights scored higher on dev, inside the time budget."""

import json
import shutil

import pytest
import torch
from conftest import TINY, Vocab, compose_config, model_config

from app.config.schema import TrainConfig
from app.data.corpus import prepare_data
from app.decode.trained import load_trained
from app.models import build_model
from app.run.checkpoint import average_files
from app.train import trainer as training
from app.train.closing_average import chosen_steps, kept_snapshots
from app.train.ema import ExponentialAverage

SMALL = {
    "transformer": dict(arch="transformer", d_model=16, heads=2, enc_layers=1, dec_layers=1, ff_dim=32),
    "rnn": dict(arch="rnn", attention="bahdanau", emb_dim=8, hidden=16, enc_layers=1),
}


@pytest.mark.parametrize("family", SMALL)
def test_moving_average_follows_its_formula(family):
    """θ̄ ← θ̄ + w_t (θ − θ̄), w_t = max(1 − decay, 9 / (10 + t)), checked in float64 against the fused update."""
    torch.manual_seed(0)
    model = build_model(model_config(**SMALL[family]), Vocab(20, 20))
    ema = ExponentialAverage(model, decay=0.9)
    expected = [p.detach().double().clone() for p in model.parameters()]
    for t in range(1, 40):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(t)
        w = max(0.1, 9 / (10 + t))
        expected = [e + w * (p.double() - e) for e, p in zip(expected, model.parameters())]
    assert [w for w in (ema.weight(1), ema.weight(80), ema.weight(1000))] == pytest.approx([9 / 11, 0.1, 0.1])
    for average, want in zip(ema.model.parameters(), expected):
        torch.testing.assert_close(average.double(), want, rtol=0, atol=1e-5)
    assert not any(p.requires_grad for p in ema.model.parameters()) and not ema.model.training


def test_moving_average_of_bfloat16_weights_is_kept_in_float32():
    """A decay of 0.999 moves the average by a thousandth of the difference: bfloat16 (8 bits of mantissa) would
    round that away."""
    torch.manual_seed(0)
    model = build_model(model_config(**SMALL["transformer"]), Vocab(20, 20)).to(torch.bfloat16)
    ema = ExponentialAverage(model, decay=0.999)
    start = [p.clone() for p in ema.model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for t in range(1, 4):
        ema.update(10_000 + t)  # past the start: w = 1 - decay
    assert all(p.dtype == torch.float32 for p in ema.model.parameters())
    for before, after in zip(start, ema.model.parameters()):
        moved = after - before
        assert moved.abs().max() > 0 and torch.allclose(moved, torch.full_like(moved, 0.003), atol=1e-4)


def test_snapshot_choice_and_what_the_rotation_keeps():
    validations = [[10, 5.0], [20, 7.0], [30, 6.0], [40, 7.0], [50, 4.0]]
    steps = [10, 20, 30, 40, 50]
    last = TrainConfig(average_snapshots=3, keep_last=2, keep_best=0)
    best = TrainConfig(average_snapshots=3, average_from="best", keep_last=2, keep_best=1)
    assert chosen_steps(last, steps, validations) == [30, 40, 50]
    assert chosen_steps(best, steps, validations) == [20, 30, 40]  # 7.0 at 20 and 40, then 6.0
    assert kept_snapshots(last) == (3, 0) and kept_snapshots(best) == (2, 3)
    assert kept_snapshots(TrainConfig(average_snapshots=3, eval_every=0, keep_last=2)) == (2, 0)  # nothing to choose by


def test_bad_averaging_settings_are_one_line():
    for settings, words in (
        (dict(ema_decay=1.0), "train.ema_decay=1.0 must be in [0, 1)"),
        (dict(average_from="worst"), "train.average_from='worst' is not a choice: choose last or best"),
        (dict(average_snapshots=-1), "train.average_snapshots=-1: a number of snapshots, 0 for none"),
    ):
        with pytest.raises(Exception, match=words.replace("[", r"\[").replace(")", r"\)")):
            TrainConfig(**settings)


@pytest.fixture
def workdir(tmp_path, corpus_tsv, monkeypatch):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    return tmp_path


FAMILY_ARGS = {
    "transformer": [],
    "rnn": ["model=rnn_bahdanau", "model.emb_dim=16", "model.hidden=32", "model.enc_layers=1"],
}


def train_run(workdir, name, family, *extra):
    base = [a for a in TINY if not a.startswith(("name=", "train.eval_every", "train.save_every"))]
    if family == "rnn":
        base = [a for a in base if not a.startswith("model")]
    cfg = compose_config(*base, *FAMILY_ARGS[family], f"run_dir={workdir / name}", *extra)
    tokenizer = prepare_data(cfg)
    torch.manual_seed(0)  # the same initial weights in every run
    return training.train(cfg, model=build_model(cfg.model, tokenizer))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_ARGS)
def test_resume_with_a_moving_average_is_bit_exact(workdir, family):
    """A run cut at step 4 and resumed ends with the uninterrupted run's average and trained weights, bit for
    bit; the checkpoints' model is the average, which eval loads."""
    settings = ["train.ema_decay=0.9", "train.eval_every=0", "train.save_every=4", "train.batch_tokens=600"]
    train_run(workdir, "full", family, *settings, "train.max_steps=10")
    train_run(workdir, "cut", family, *settings, "train.max_steps=4")
    train_run(workdir, "cut", family, *settings, "train.max_steps=10", "train.resume=true")
    full, cut = (torch.load(workdir / name / "last.pt", weights_only=True) for name in ("full", "cut"))
    for key in ("model", "trained_model"):
        assert full[key].keys() == cut[key].keys() and all(torch.equal(full[key][k], cut[key][k]) for k in full[key])
    assert any(not torch.equal(full["model"][k], full["trained_model"][k]) for k in full["model"])
    served = load_trained(str(workdir / "full"), "last", torch.device("cpu")).model.state_dict()
    assert all(torch.equal(served[k], full["model"][k]) for k in served)


@pytest.mark.slow
def test_closing_average_is_validated_and_kept_if_it_scores_higher(workdir):
    """Snapshots every 6 steps, the newest 3 averaged at the end: averaged.pt is their mean, validated on dev
    like every checkpoint, and best.pt is whichever of it and the best single weights has the higher dev
    BLEU, as the summary says."""
    summary = train_run(
        workdir,
        "run",
        "transformer",
        "train.eval_every=6",
        "train.save_every=6",
        "train.keep_last=1",  # raised to the 3 the average needs
        "train.average_snapshots=3",
        "train.max_steps=24",
    )
    run = workdir / "run"
    average = summary["average"]
    steps = sorted(int(p.name[5:12]) for p in run.glob("step_*.pt"))
    assert average["steps"] == steps == [12, 18, 24]
    mean = average_files([str(run / f"step_{s:07d}.pt") for s in steps])["model"]
    averaged, best = (torch.load(run / f"{name}.pt", weights_only=True) for name in ("averaged", "best"))
    assert all(torch.allclose(averaged["model"][k], v) for k, v in mean.items())
    assert average["gain"] == pytest.approx(average["dev_bleu"] - average["best_single_dev_bleu"], abs=0.011)
    if average["gain"] > 0:
        assert average["kept"] == "average" and all(torch.equal(best["model"][k], v) for k, v in mean.items())
    else:
        assert average["kept"] == "best single" and best["progress"]["step"] == average["best_single_step"]
    assert summary["best_dev_bleu"] == max(average["dev_bleu"], average["best_single_dev_bleu"])
    assert json.loads((run / "train_summary.json").read_text())["average"] == average
