"""Scale-out through the real launcher: two gloo processes under torchrun against one process with
gradient accumulation on the same global batches, rank-0-only outputs, resume under DDP, and the
token budget per update."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, run_cli
from test_reliability import step_losses, weights

from app.config.schema import TrainConfig
from app.data.schedule import accumulation_steps

pytestmark = pytest.mark.slow  # every test here runs the real CLI in a subprocess, or compiles

# no dropout: the two set-ups draw their random numbers differently; small batches: several per epoch
EXACT = [a for a in TINY if not a.startswith(("train.", "name="))] + [
    "model.dropout=0",
    "model.attention_dropout=0",
    "model.activation_dropout=0",
    "train.batch_tokens=600",
    "train.warmup_steps=10",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.save_every=10",
    "train.keep_last=0",
]
# one thread per process: a matrix product summed in another order would differ in the last bits
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def torchrun(cwd, *args, nproc=2, timeout=600):
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "app",
        "command=train",
        *args,
    ]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


def single(cwd, *args):
    return run_cli(cwd, "command=train", *args, env=ONE_THREAD)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_tsv):
    """Two ranks × 1 micro-batch and 1 rank × 2 micro-batches, 20 updates each."""
    root = tmp_path_factory.mktemp("ddp")
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    ddp = torchrun(root, *EXACT, "name=ddp", "train.max_steps=20")
    assert ddp.returncode == 0, "\n".join(
        line for line in (ddp.stdout + ddp.stderr).splitlines() if "training:" not in line
    )[-6000:]
    accumulated = single(root, *EXACT, "name=accum", "train.max_steps=20", "train.accum_steps=2")
    assert accumulated.returncode == 0, accumulated.stderr[-3000:]
    return root, ddp


def test_two_ranks_equal_one_process_accumulating_the_same_batches(runs):
    root, _ = runs
    ddp, accum = step_losses(root / "checkpoints/ddp/tb"), step_losses(root / "checkpoints/accum/tb")
    assert sorted(ddp) == sorted(accum) == list(range(1, 21))
    for step in ddp:
        assert abs(ddp[step] - accum[step]) <= 1e-5, (step, ddp[step], accum[step])
    assert ddp[20] < ddp[1]  # it learned
    a, b = weights(root / "checkpoints/ddp/last.pt"), weights(root / "checkpoints/accum/last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


def test_the_summary_states_ranks_accumulation_and_tokens_per_update(runs):
    root, _ = runs
    ddp = json.loads((root / "checkpoints/ddp/train_summary.json").read_text())
    accum = json.loads((root / "checkpoints/accum/train_summary.json").read_text())
    assert (ddp["ranks"], ddp["accum_steps"]) == (2, 1) and (accum["ranks"], accum["accum_steps"]) == (1, 2)
    assert ddp["tgt_tokens_per_update"] == accum["tgt_tokens_per_update"] > 0


def test_only_rank_zero_writes(runs):
    root, ddp = runs
    listing = lambda run: sorted(  # noqa: E731
        os.path.relpath(os.path.join(folder, name), run) for folder, _, names in os.walk(run) for name in names
    )
    ddp_files, accum_files = listing(root / "checkpoints/ddp"), listing(root / "checkpoints/accum")
    folders = lambda files: sorted(os.path.dirname(f) for f in files if "tfevents" in f)  # noqa: E731
    assert folders(ddp_files) == sorted(set(folders(ddp_files))) == folders(accum_files)  # one writer per folder
    assert "tb" in folders(ddp_files)
    no_events = lambda files: [f for f in files if "tfevents" not in f]  # noqa: E731
    assert no_events(ddp_files) == no_events(accum_files)  # the same files as one process writes, once
    assert sorted(os.listdir(root)) == ["checkpoints", "corpus.tsv", "data"]  # nothing else anywhere
    assert ddp.stdout.count("training stopped") + ddp.stderr.count("training stopped") == 1  # one log
    assert not (root / "checkpoints/ddp/.lock").exists()  # rank 0's lock file, removed as it let go of the lock


def test_resume_under_ddp_continues_exactly(runs):
    root, _ = runs
    dropout = [
        a for a in EXACT if not a.startswith(("model.dropout", "model.attention_dropout"))
    ]  # each rank's own stream
    full = torchrun(root, *dropout, "name=ddp_full", "train.max_steps=20")
    assert full.returncode == 0, "\n".join(
        line for line in (full.stdout + full.stderr).splitlines() if "training:" not in line
    )[-8000:]
    first = torchrun(root, *dropout, "name=ddp_resumed", "train.max_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(root, *dropout, "name=ddp_resumed", "train.max_steps=20", "train.resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    a, b = weights(root / "checkpoints/ddp_full/last.pt"), weights(root / "checkpoints/ddp_resumed/last.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_tokens_per_update_sets_accumulation_for_the_number_of_ranks():
    cfg = TrainConfig(batch_tokens=4000, tokens_per_update=32000)
    assert [accumulation_steps(cfg, world) for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert accumulation_steps(TrainConfig(accum_steps=3), 2) == 3


def test_oom_retry_is_refused_with_several_ranks(runs):
    root, _ = runs
    result = torchrun(root, *EXACT, "name=oom", "train.max_steps=2", "train.oom_retry=true")
    assert result.returncode != 0
    assert "error: train.oom_retry=true works in a single process only" in result.stderr


def test_a_time_budget_decay_ends_alike_on_every_rank(tmp_path, corpus_tsv):
    """Where the time budget ends is rank 0's estimate, broadcast at each validation (app/train/decay_end.py): every
    rank takes part (a rank left out would hang the run), and the decay ends with the budget."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = ["train.max_minutes=0.3", "train.max_steps=100000", "train.eval_every=5", "train.patience=0"]
    args += ["train.lr=2e-3", "train.lr_schedule=linear", "train.lr_floor=0.1", "name=budget"]
    result = torchrun(tmp_path, *EXACT, *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "checkpoints" / "budget" / "train_summary.json").read_text())
    assert summary["stopped"] == "time budget of 0.3 min" and summary["ranks"] == 2, summary
    state = torch.load(tmp_path / "checkpoints" / "budget" / "last.pt", weights_only=True)
    (rate,) = state["scheduler"]["lr_lambdas"]
    assert 0 < rate["budget_end"] < 100_000 and state["scheduler"]["_last_lr"][0] <= 2e-3 * 0.6, (rate, summary)
