"""Reliability through the real CLI: exact resume after SIGTERM or SIGKILL at a random step, refusal
to overwrite a run, mismatched resume, snapshot rotation and averaging, over-long translate input."""

import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli, start_cli

pytestmark = pytest.mark.slow  # every test here runs the real CLI in a subprocess, or compiles

# log every step (per-step losses to compare), no validation in the way, a snapshot every 5 steps
RUN = [a for a in TINY if not a.startswith(("train.eval_every", "train.save_every", "train.log_every", "name="))] + [
    "train.log_every=1",
    "train.eval_every=1000",
    "train.save_every=5",
    "train.keep_last=3",
]
STEPS = 60


def start_training(cwd, name, *extra):
    """The run ``name`` started (a fork of the warm interpreter, or a fresh one in a fresh_interpreter test), its
    output in ``name``.log."""
    args = ["command=train", *RUN, f"name={name}", f"train.max_steps={STEPS}", *extra]
    return start_cli(cwd, *args, output=Path(cwd) / f"{name}.log")


def wait_for(path, process, seconds=300):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert process.poll() is None, "training ended before writing its first checkpoint"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def step_losses(tb_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def weights(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    root = tmp_path_factory.mktemp("reliability")
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    result = run_cli(root, "command=train", *RUN, "name=full", f"train.max_steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.fresh_interpreter
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_resume_is_bit_exact(workdir, sig):
    name = f"stopped_{sig.name}"
    process = start_training(workdir, name)
    wait_for(workdir / "checkpoints" / name / "last.pt", process)
    time.sleep(random.uniform(0.0, 0.4))  # a random step after the first checkpoint
    process.send_signal(sig)
    assert process.wait(timeout=120) == 128 + sig
    output = (workdir / f"{name}.log").read_text()
    assert "Traceback" not in output
    stopped = int(re.search(r"stopped after step (\d+)", output).group(1))
    assert 5 <= stopped < STEPS
    assert 'continue with: make train ARGS="' in output and "train.resume=true" in output
    assert torch.load(workdir / "checkpoints" / name / "last.pt", weights_only=True)["progress"]["step"] == stopped

    result = run_cli(workdir, "command=train", *RUN, f"name={name}", f"train.max_steps={STEPS}", "train.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr and f"at step {stopped} " in result.stdout + result.stderr
    full, resumed = step_losses(workdir / "checkpoints/full/tb"), step_losses(workdir / "checkpoints" / name / "tb")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == full  # every per-step loss, bit for bit
    for key, value in weights(workdir / "checkpoints/full/last.pt").items():
        assert torch.equal(value, weights(workdir / "checkpoints" / name / "last.pt")[key]), key


def test_sigkill_loses_only_the_steps_since_the_last_checkpoint(workdir):
    name = "killed"
    run = workdir / "checkpoints" / name
    process = start_training(workdir, name)
    wait_for(run / "last.pt", process)
    time.sleep(random.uniform(0.0, 0.4))
    process.kill()
    process.wait(timeout=60)
    saved = torch.load(run / "last.pt", weights_only=True)["progress"]["step"]  # never a torn file
    assert saved % 5 == 0 and saved >= 5
    result = run_cli(workdir, "command=train", *RUN, f"name={name}", f"train.max_steps={STEPS}", "train.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {saved} " in result.stdout + result.stderr
    for key, value in weights(workdir / "checkpoints/full/last.pt").items():
        assert torch.equal(value, weights(run / "last.pt")[key]), key


@pytest.mark.fresh_interpreter
def test_auto_resume_continues_a_killed_run_and_keeps_a_finished_one(workdir):
    """What lets make compare continue a cut sweep: the same command again resumes a killed run from its
    last.pt, then leaves the finished run (and its evaluation) as it is, and evaluates it if that was cut."""
    name, auto = "auto", ("train.auto_resume=true", "train.evaluate=true")
    run = workdir / "checkpoints" / name
    process = start_training(workdir, name, *auto)
    wait_for(run / "last.pt", process)
    time.sleep(random.uniform(0.0, 0.4))
    process.kill()
    process.wait(timeout=60)
    saved = torch.load(run / "last.pt", weights_only=True)["progress"]["step"]
    again = [*RUN, f"name={name}", f"train.max_steps={STEPS}", *auto]
    result = run_cli(workdir, "command=train", *again)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'last.pt'} at step {saved} " in result.stdout + result.stderr
    for key, value in weights(workdir / "checkpoints/full/last.pt").items():
        assert torch.equal(value, weights(run / "last.pt")[key]), key  # as if never killed
    metrics = run / "eval" / "test" / "metrics.json"
    kept = {path: path.stat().st_mtime_ns for path in (run / "last.pt", run / "train_summary.json", metrics)}

    result = run_cli(workdir, "command=train", *again)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished earlier" in result.stdout and "resumed from" not in result.stdout + result.stderr
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # neither trained nor evaluated again

    metrics.unlink()  # cut during its evaluation
    result = run_cli(workdir, "command=train", *again)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished earlier" in result.stdout and metrics.exists()
    assert (run / "last.pt").stat().st_mtime_ns == kept[run / "last.pt"]


def test_training_again_into_a_finished_run_is_refused(workdir):
    result = run_cli(workdir, "command=train", *RUN, "name=full", f"train.max_steps={STEPS}")
    assert result.returncode == 2
    assert "last.pt exists" in result.stderr and "train.resume=true" in result.stderr
    assert "Traceback" not in result.stderr


def test_resume_with_other_model_settings_names_the_difference(workdir):
    result = run_cli(
        workdir, "command=train", *RUN, "name=full", "train.max_steps=80", "train.resume=true", "model.d_model=64"
    )
    assert result.returncode == 2
    assert "model.d_model=32 there, 64 here" in result.stderr and "Traceback" not in result.stderr


def test_resume_with_other_data_settings_names_them_before_touching_the_corpus(workdir):
    """Preparing data/<name> again with them would rewrite the corpus (and tokenizer) other runs of it read."""
    prepared = next((workdir / "data").glob("*/prepare.json"))
    before = prepared.stat().st_mtime_ns
    args = ["name=full", "train.max_steps=80", "train.resume=true", "data.test_fraction=0.2"]
    result = run_cli(workdir, "command=train", *RUN, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "trained on other data settings: data.test_fraction=0.08 there, 0.2 here" in result.stderr, result.stderr
    assert prepared.stat().st_mtime_ns == before
    # a starting point named on a resume would be recorded in its settings, and not be where it started
    started = run_cli(workdir, "command=train", *RUN, *args[:3], "train.init_from=full")
    assert started.returncode == 2
    assert "train.init_from='full' here, None there: a resumed run goes on" in started.stderr, started.stderr


def test_resume_with_another_learning_rate_or_optimizer_setting_is_refused_naming_them(workdir):
    """last.pt's AdamW param_groups and schedule state come back whatever the command line says: a resume with
    train.lr=0.01 and a cosine schedule trained on at the old rate, its config.yaml recording the new one."""
    args = ["name=full", "train.max_steps=80", "train.resume=true", "train.lr=0.01", "train.lr_schedule=cosine"]
    result = run_cli(workdir, "command=train", *RUN, *args, "train.adam_betas=[0.8,0.9]")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "train.adam_betas=[0.8, 0.9] here, [0.9, 0.98] there; train.lr=0.01 here, 0.001 there; " in line, line
    assert "train.lr_schedule='cosine' here, 'inverse_sqrt' there: a resumed run goes on with the optimizer" in line
    assert "train.init_from=<this run>" in line


def test_snapshots_rotate_and_average_into_a_loadable_checkpoint(workdir):
    run = workdir / "checkpoints" / "full"
    snapshots = sorted(f for f in os.listdir(run) if f.startswith("step_"))
    # train.keep_last=3, raised to the 5 the closing average reads (train.average_snapshots, its default)
    assert snapshots == [f"step_{step:07d}.pt" for step in (40, 45, 50, 55, 60)]
    result = run_cli(workdir, "command=average", "name=full", "average.last=2")
    assert result.returncode == 0, result.stderr[-3000:]
    averaged = weights(run / "averaged.pt")
    a, b = weights(run / "step_0000055.pt"), weights(run / "step_0000060.pt")
    for key, value in averaged.items():
        assert torch.allclose(value, (a[key] + b[key]) / 2, atol=1e-7), key
    result = run_cli(
        workdir,
        "command=eval",
        "name=full",
        "device=cpu",
        "eval.checkpoint=averaged",
        "decode.beam_size=1",
        "viz.eval_plots=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "command=average", "name=full", "average.last=9")
    assert result.returncode == 2 and "fewer than average.last=9" in result.stderr


def test_translate_refuses_a_line_longer_than_the_model_takes(workdir):
    huge = " ".join(["palabra"] * 1500) + "\n"
    result = run_cli(workdir, "command=translate", "name=full", "device=cpu", stdin="Y dijo Dios.\n" + huge)
    assert result.returncode == 2
    assert "standard input: line 2 has" in result.stderr and "model.max_len=1024" in result.stderr
    assert "Traceback" not in result.stderr
