"""Stopping on SIGINT / SIGTERM in every phase of a run, through the real CLI, the signal sent to the whole
process group as a terminal's Ctrl-C is (the host worker included): in the middle of a long step, during a
validation, while the data is prepared. And the protocol of a folder's lock file (app/run/folder_lock.py),
which its holder removes when it lets go of it (docs/reliability.md#stopping-and-resuming)."""

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, as_a_terminal_starts_it, run_cli, start_cli

from app.run.folder_lock import LOCK_FILE, FolderLock

# A larger tiny model on the whole tiny corpus in one batch: about 4 s a step on one CPU core
LONG_STEP = [
    "model.d_model=128",
    "model.heads=4",
    "model.enc_layers=2",
    "model.dec_layers=2",
    "model.ff_dim=512",
    "train.batch_tokens=40000",
]
BASE = [a for a in TINY if not a.startswith(("name=", "train.eval_every=", "train.save_every=", "train.log_every="))]
BASE += ["train.log_every=1", "train.save_every=1000", "train.average_snapshots=0"]
ENV = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"}
STARTED: list = []  # killed after each test, should one fail before its command ended


class Command:
    """``python -m app ARGS`` in its own process group (as a shell starts it), its output read as it comes."""

    def __init__(self, cwd, *args):
        self.log = Path(cwd) / f"command-{len(STARTED)}.log"
        self.process = start_cli(cwd, *args, output=self.log)
        STARTED.append(self.process)

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace")

    def wait_for(self, pattern: str, seconds: float = 300) -> float:
        """When the output first held ``pattern`` (looked at every 20 ms)."""
        deadline = time.time() + seconds
        while True:
            if re.search(pattern, self.output()):
                return time.time()
            assert self.process.poll() is None, f"ended before {pattern!r}:\n{self.output()[-3000:]}"
            assert time.time() < deadline, f"no {pattern!r} in {seconds} s:\n{self.output()[-3000:]}"
            time.sleep(0.02)

    def signal(self, sig) -> tuple[int, float]:
        """Send ``sig`` to the process group; its exit status and how many seconds after the signal it ended."""
        sent = time.time()
        os.killpg(self.process.pid, sig)
        try:
            code = self.process.wait(timeout=120)
        finally:
            if self.process.poll() is None:
                kill(self.process)
        return code, time.time() - sent


def kill(process) -> None:
    """SIGKILL to the process group of a command that has not ended, then its end."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)


def lock_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".lock*"))


def half_written(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith(".tmp-"))


def saved_step(run) -> int:
    return torch.load(run / "last.pt", weights_only=True)["progress"]["step"]


@pytest.fixture
def root(tmp_path, corpus_tsv):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    yield tmp_path
    while STARTED:
        kill(STARTED.pop())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_a_long_step_stops_at_its_end_saves_and_resumes(root, sig):
    name = f"long_{sig.name}"
    run = root / "checkpoints" / name
    command = Command(root, "command=train", *BASE, *LONG_STEP, f"name={name}", "train.max_steps=50")
    first = command.wait_for(r"\| 1/50 ")
    second = command.wait_for(r"\| 2/50 ")
    step = second - first  # one step's time on this machine now
    time.sleep(step / 2)  # the middle of step 3
    code, seconds = command.signal(sig)
    out = command.output()
    assert code == 128 + sig, out[-3000:]
    assert seconds <= step + 5, (seconds, step, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    stopped = int(re.match(rf"interrupted: {sig.name}: stopped after step (\d+) and saved ", last).group(1))
    assert stopped >= 2 and saved_step(run) == stopped
    assert "train.resume=true" in last
    assert lock_files(root) == [] and half_written(root) == []

    args = [*BASE, *LONG_STEP, f"name={name}", f"train.max_steps={stopped + 1}", "train.resume=true"]
    result = run_cli(root, "command=train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'last.pt'} at step {stopped} " in result.stdout + result.stderr
    assert saved_step(run) == stopped + 1 and lock_files(root) == []


@pytest.mark.slow
def test_a_signal_during_a_validation_stops_it_at_once_and_saves(root):
    """A validation of 80 dev sentences decoded to 600 pieces each (an untrained model writes no end) takes
    15-20 s on 2 cores: Ctrl-C in it stops at once, saves the step before it, and the run resumes."""
    name, run = "validating", root / "checkpoints" / "validating"
    data = ["data.name=tiny_dev50", "data.dev_fraction=0.5", "decode.max_len_extra=600", "train.eval_every=1"]
    args = [a for a in BASE if not a.startswith(("data.name=", "data.dev_fraction="))] + LONG_STEP + data
    command = Command(root, "command=train", *args, f"name={name}", "train.max_steps=3")
    command.wait_for(r"\| 1/3 ")  # the validation of step 1 begins
    time.sleep(1.0)
    code, seconds = command.signal(signal.SIGINT)
    out = command.output()
    assert code == 130 and "Traceback" not in out, out[-3000:]
    assert seconds <= 5, (seconds, out[-3000:])
    assert "step 1: dev loss" not in out  # it did not finish
    assert re.search(r"interrupted: SIGINT: stopped after step 1 and saved .*train\.resume=true", out), out[-3000:]
    assert saved_step(run) == 1 and lock_files(root) == [] and half_written(root) == []

    result = run_cli(root, "command=train", *args, f"name={name}", "train.max_steps=2", "train.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "at step 1 " in out
    validation = float(re.search(r"step 2: dev loss .* \((\d+)s: ", out).group(1))
    assert validation >= seconds + 5, (validation, seconds)  # what waiting for the validation would have cost


def big_corpus(root, pairs: int = 40000) -> None:
    """A corpus whose preparation takes a few seconds: the tiny corpus's verses over and over, each made unique."""
    verses = (root / "corpus.tsv").read_text(encoding="utf-8").splitlines()
    with open(root / "big.tsv", "w", encoding="utf-8") as f:
        for i in range(pairs):
            ref, es, en = verses[i % len(verses)].split("\t")
            f.write(f"{ref}.{i}\t{es} {i}\t{en} {i}\n")


@pytest.mark.slow
@pytest.mark.parametrize("command_name", ["prepare", "train"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_data_is_prepared_ends_at_once_in_one_line(root, command_name, sig):
    big_corpus(root)
    data = ["data=files", "data.name=big", "data.train=big.tsv", "tokenizer.vocab_size=400"]
    training = [a for a in BASE if not a.startswith(("data", "tokenizer"))] + ["name=early", "train.max_steps=10"]
    command = Command(root, f"command={command_name}", *(training if command_name == "train" else []), *data)
    command.wait_for("data: preparing data/big from source")  # reading and filtering 40,000 pairs: about 1 s
    time.sleep(0.3)
    code, seconds = command.signal(sig)
    out = command.output()
    assert code == 128 + sig, out[-3000:]
    assert seconds <= 5, (seconds, out[-3000:])
    assert "Traceback" not in out and out.strip().splitlines()[-1].startswith("interrupted"), out[-3000:]
    assert lock_files(root) == [] and half_written(root) == []
    assert not (root / "data" / "big" / "prepare.json").exists()  # nothing half done recorded as done
    assert not (root / "checkpoints" / "early" / "last.pt").exists()


def test_ctrl_c_caught_inside_a_string_exec_still_exits_130(tmp_path):
    """CPython marks a KeyboardInterrupt that ends an ``exec`` of a string as uncaught even where the program
    catches it, and under ``python -m`` ends the process by SIGINT instead of with the status asked for. Ctrl-C
    during an import that makes a dataclass (datasets' imports) did that to make data: status -2, not 130."""
    (tmp_path / "interrupted_in_exec.py").write_text(
        "from app.cli import exit_interrupted\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt', {})\n"
        "except KeyboardInterrupt:\n"
        "    exit_interrupted()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_in_exec"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        preexec_fn=as_a_terminal_starts_it,
    )
    assert (done.returncode, done.stderr.strip()) == (130, "interrupted")


# --- the lock file's protocol ------------------------------------------------------------------------------


def test_releasing_a_lock_removes_its_file_and_a_killed_holder_leaves_a_harmless_one(tmp_path):
    lock = FolderLock(str(tmp_path))
    lock.acquire()
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()

    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    holder = fork.Process(target=hold_until_killed, args=(str(tmp_path), ready), daemon=True)
    holder.start()
    assert ready.wait(60)
    holder.kill()  # SIGKILL: no Python code runs, the file stays and records the dead holder
    holder.join(60)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    again = FolderLock(str(tmp_path))
    again.acquire()  # nobody holds its flock: taken at once
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    again.release()
    assert not (tmp_path / LOCK_FILE).exists()


def hold_until_killed(folder, ready):
    FolderLock(folder).acquire()
    ready.set()
    time.sleep(600)


def wait_then_hold(folder, start, waiting, woke, go, holding, release):
    """A process waiting for the lock, made to pause right after its flock returns (on the file its first holder
    has removed by then), until a third process has locked a new file: it must see that and wait again."""
    import fcntl

    flock = fcntl.flock

    def paused(fd, operation):
        blocking = operation == fcntl.LOCK_EX  # a waiter's call, not the first try's LOCK_NB
        if blocking:
            waiting.set()
        flock(fd, operation)
        if blocking:
            woke.set()
            go.wait(30)

    fcntl.flock = paused
    start.wait(30)
    lock = FolderLock(folder)
    lock.acquire(wait=True)
    stat, held = os.stat(lock.path), os.fstat(lock.fd)
    holding.put((stat.st_ino, held.st_ino, held.st_nlink))
    release.wait(30)
    lock.release()
    os._exit(0)


def test_a_waiter_woken_on_a_removed_lock_file_waits_for_the_new_one(tmp_path):
    fork = multiprocessing.get_context("fork")
    start, waiting, woke, go, release = (fork.Event() for _ in range(5))
    holding = fork.Queue()
    waiter = fork.Process(
        target=wait_then_hold, args=(str(tmp_path), start, waiting, woke, go, holding, release), daemon=True
    )
    waiter.start()  # before this process takes the lock: it inherits no descriptor of it
    first = FolderLock(str(tmp_path))
    first.acquire()
    start.set()
    try:
        assert waiting.wait(30)
        time.sleep(0.3)  # the waiter is blocked in flock on the first holder's file
        first.release()  # removes the file, then lets go of it
        assert woke.wait(30)  # the waiter's flock returned: on the removed file
        third = FolderLock(str(tmp_path))
        third.acquire()  # a new file at the path, which nobody holds: the third process takes it
        go.set()
        time.sleep(0.5)
        assert holding.empty()  # the waiter did not take the removed file for the lock
        third.release()  # removes its file: the waiter wakes again, and takes a file of its own
        path_inode, held_inode, links = holding.get(timeout=30)
        assert held_inode == path_inode and links == 1  # the file it holds is the one at the path
    finally:
        go.set()
        release.set()
        waiter.join(30)
        if waiter.is_alive():
            waiter.kill()
    assert not (tmp_path / LOCK_FILE).exists()


def test_under_torchrun_the_lock_file_names_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    lock = FolderLock(str(tmp_path))
    lock.acquire()
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    lock.release()
    assert record["pid"] == os.getpid() and record["launcher_pid"] == os.getppid()
