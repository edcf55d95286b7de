"""A resumed run starts where the run it continues stood: the validation and snapshot that a signal or a kill left
undone at last.pt's step are done first (app/train/resumed_step.py), a run stopped early but cut off in its closing
work stops again, and every checkpoint holds the time of its own step and validation. The stops are made as a
signal makes them: StopNow, which a signal raises in work it may cut (app/train/stop_rules.py)."""

import signal

import pytest
import torch
from test_training_budget import config as budget_config

from app.run.checkpoint import snapshot_steps
from app.run.errors import TrainingInterrupted
from app.train import closing_average
from app.train import trainer as training
from app.train.stop_rules import StopNow

pytestmark = pytest.mark.slow  # toy trainings in this process


def config(run_dir, *overrides):
    """test_training_budget's tiny run, validated and saved every 10 steps."""
    return budget_config(run_dir, "train.eval_every=10", "train.save_every=10", *overrides)


def progress(run_dir, name="last"):
    return torch.load(run_dir / f"{name}.pt", weights_only=True)["progress"]


def stop_in_validation(monkeypatch, module, at_step):
    """``module``'s validations stopped at ``at_step`` as a signal stops them: at once, nothing recorded."""
    real = module.validate

    def validate(model, dev, links, tokenizer, cfg, writer, progress, *rest):
        if progress.step == at_step:
            raise StopNow(signal.SIGTERM)
        return real(model, dev, links, tokenizer, cfg, writer, progress, *rest)

    monkeypatch.setattr(module, "validate", validate)


def killed_before_the_snapshot(monkeypatch, at_step):
    """A kill between the writes of last.pt and step ``at_step``'s snapshot: the snapshot is not written, and the run
    ends after that step, its last.pt written."""
    real_write, real_after = training.write_snapshot, training.Trainer.after_step

    def write_snapshot(run_dir, step, *rest):
        if step != at_step:
            real_write(run_dir, step, *rest)

    def after_step(trainer):
        real_after(trainer)
        if trainer.progress.step == at_step:
            raise StopNow(signal.SIGKILL)

    monkeypatch.setattr(training, "write_snapshot", write_snapshot)
    monkeypatch.setattr(training.Trainer, "after_step", after_step)


@pytest.mark.parametrize("cut", ["validation", "snapshot"])
def test_the_resumed_run_does_what_its_last_step_still_owed_and_goes_on_as_the_uninterrupted_one(
    corpus_folder, monkeypatch, cut
):
    steps = ["train.max_steps=30", "train.average_snapshots=3"]
    whole = training.train(config(corpus_folder / "whole", *steps))
    with monkeypatch.context() as patched:
        if cut == "validation":  # a signal in step 20, or in its validation
            stop_in_validation(patched, training, at_step=20)
        else:
            killed_before_the_snapshot(patched, at_step=20)
        with pytest.raises(TrainingInterrupted):
            training.train(config(corpus_folder / "cut", *steps))
    assert progress(corpus_folder / "cut")["step"] == 20
    owed = [10] if cut == "validation" else [10, 20]
    assert [v[0] for v in progress(corpus_folder / "cut")["validations"]] == owed
    assert snapshot_steps(corpus_folder / "cut") == [10]

    resumed = training.train(config(corpus_folder / "cut", *steps, "train.resume=true"))
    assert (
        progress(corpus_folder / "cut")["validations"] == progress(corpus_folder / "whole")["validations"]
    )  # steps and scores
    assert snapshot_steps(corpus_folder / "cut") == snapshot_steps(corpus_folder / "whole") == [10, 20, 30]
    assert resumed["average"]["steps"] == whole["average"]["steps"] == [10, 20, 30]
    assert resumed["average"]["dev_loss"] == whole["average"]["dev_loss"]
    for name in ("last", "averaged"):
        ours, theirs = (
            torch.load(corpus_folder / r / f"{name}.pt", weights_only=True)["model"] for r in ("cut", "whole")
        )
        assert all(torch.equal(ours[k], v) for k, v in theirs.items()), name


def test_a_run_stopped_early_and_cut_off_in_its_closing_average_stops_again_when_resumed(corpus_folder, monkeypatch):
    """A learning rate of 1e-12 changes no hypothesis: the second validation's dev BLEU is no gain, and patience 1
    stops the run there. A signal in the closing average's validation; the resume, its own command plus
    train.resume=true, ends the run where it stopped instead of training on."""
    args = ["train.max_steps=100", "train.lr=1e-12", "train.best_metric=bleu", "train.patience=1"]
    args += ["train.average_snapshots=2"]
    with monkeypatch.context() as patched:
        stop_in_validation(patched, closing_average, at_step=20)
        with pytest.raises(TrainingInterrupted):
            training.train(config(corpus_folder / "run", *args))
    assert progress(corpus_folder / "run")["step"] == 20 and progress(corpus_folder / "run")["bad_evals"] == 1

    summary = training.train(config(corpus_folder / "run", *args, "train.resume=true"))
    assert summary["steps"] == 20 and summary["stopped"] == "early stopping (no dev BLEU gain in 1 validations)"
    assert summary["average"]["steps"] == [10, 20] and (corpus_folder / "run" / "averaged.pt").exists()
    assert [v[0] for v in progress(corpus_folder / "run")["validations"]] == [10, 20]


def test_a_checkpoint_holds_the_time_of_its_own_step_and_validation(corpus_folder):
    """The snapshot of step 20, written after step 20's validation, holds at least the time that validation ended
    at (validations.jsonl's minutes, to 0.001), not the time step 19 ended at."""
    training.train(config(corpus_folder / "run", "train.max_steps=21", "train.average_snapshots=0"))
    snapshot = progress(corpus_folder / "run", "step_0000020")
    validated = next(entry for entry in snapshot["history"] if entry["step"] == 20)
    assert snapshot["elapsed_seconds"] >= validated["minutes"] * 60 - 0.03, (snapshot["elapsed_seconds"], validated)
