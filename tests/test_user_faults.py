"""Faults a user meets, each through the real CLI on the tiny corpus: two processes on one run folder,
damaged token caches, a full disk, an unknown split, damaged checkpoints, run_dir=. Each ends in one line
that says what to do, or in the work done (docs/reliability.md lists them)."""

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TINY, run_cli

from app.cli import OWNING_COMMANDS
from app.data.cache import cached, mark_done
from app.run.checkpoint import save_checkpoint
from app.run.errors import UserError
from app.run.files import file_hash
from app.run.folder_lock import FolderBusy, FolderLock, owning
from app.train.state import resume_state

# a checkpoint every 5 steps, no validation (best.pt is a copy of the last last.pt)
RUN = [a for a in TINY if not a.startswith(("name=", "train.eval_every=", "train.save_every="))] + [
    "train.eval_every=0",
    "train.save_every=5",
]
ENV = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module")
def root(tmp_path_factory, corpus_tsv):
    """A folder with the tiny corpus and a run of 10 steps, checkpoints/base."""
    root = tmp_path_factory.mktemp("faults")
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    result = run_cli(root, "command=train", *RUN, "name=base", "train.max_steps=10")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def copy_run(root, name):
    shutil.copytree(root / "checkpoints" / "base", root / "checkpoints" / name)
    return root / "checkpoints" / name


def error_line(result) -> str:
    """The one line a failed command ends with (progress bars may come before it), never a traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    return last


@pytest.mark.slow
def test_a_second_process_on_a_run_folder_stops_at_once_naming_the_first(root):
    run = root / "checkpoints" / "busy"
    with open(root / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "app", "command=train", *RUN, "name=busy", "train.max_steps=100000"],
            cwd=root,
            stdout=log,
            stderr=log,
            env=ENV,
        )
    try:
        deadline = time.time() + 300
        while not (run / ".hydra" / "train" / "overrides.yaml").exists():  # locked, and then its record written
            assert first.poll() is None and time.time() < deadline, (root / "first.log").read_text()[-3000:]
            time.sleep(0.05)
        record = json.loads((run / ".lock").read_text())
        assert record["pid"] == first.pid
        second = run_cli(root, "command=train", *RUN, "name=busy", "train.max_steps=7")
        assert second.stderr == (
            f"error: checkpoints/busy is in use by process {first.pid} (started {record['started']}: command=train "
            "name=busy): wait for it to end, or give another name= (or run_dir=)\n"
        )
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert "train.max_steps=7" not in (run / ".hydra" / "train" / "overrides.yaml").read_text()  # the first's
    FolderLock(str(run)).acquire()  # the first one ended: free again


@pytest.mark.slow
def test_damaged_token_caches_are_rebuilt_by_train_and_by_make_data(root):
    import datasets

    cache = root / "data" / "tiny" / "tokenized" / "spm_unigram400"
    arrow = cache / "train" / "data-00000-of-00001.arrow"
    before = datasets.load_from_disk(str(cache / "train"), keep_in_memory=True)["src_ids"]
    size = arrow.stat().st_size
    arrow.write_bytes(arrow.read_bytes()[:1000])  # truncated
    (cache / "dev" / "state.json").unlink()  # deleted
    result = run_cli(root, "command=train", *RUN, "name=rebuilt", "train.max_steps=2", "train.eval_every=0")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert f"data/tiny/tokenized/spm_unigram400/train/data-00000-of-00001.arrow is damaged (1000 bytes, {size}" in out
    assert "data/tiny/tokenized/spm_unigram400/dev/state.json is missing: rebuilding it from its inputs" in out
    assert datasets.load_from_disk(str(cache / "train"), keep_in_memory=True)["src_ids"] == before

    damaged = bytearray(arrow.read_bytes())  # the same size, other content: make data compares content hashes
    damaged[size // 2] ^= 0xFF
    arrow.write_bytes(bytes(damaged))
    result = run_cli(root, "command=prepare", *[a for a in RUN if a.startswith(("data", "tokenizer"))])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "spm_unigram400/train/data-00000-of-00001.arrow is damaged (its content changed since it was written)" in (
        result.stdout + result.stderr
    )
    assert datasets.load_from_disk(str(cache / "train"), keep_in_memory=True)["src_ids"] == before


# The 3rd checkpoint written (last.pt at step 10) finds the disk full, as torch.save meets it: the
# file object's write raises ENOSPC and torch.save raises a RuntimeError while handling it.
FULL_DISK = """
import errno, os, sys, torch
real_save, calls = torch.save, []

class FullDisk:
    def __init__(self, f):
        self.f, self.written = f, 0
    def write(self, data):
        if self.written + len(data) > 500:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        return self.f.write(data)
    def flush(self):
        self.f.flush()

def save(obj, f, *args, **kwargs):
    calls.append(f)
    return real_save(obj, f if len(calls) < 3 else FullDisk(f), *args, **kwargs)

torch.save = save
sys.argv = ["app", *sys.argv[1:]]
from app.cli import main
main()
"""


@pytest.mark.slow
def test_a_full_disk_names_the_file_the_space_and_the_checkpoint_to_resume_from(root):
    command = [sys.executable, "-c", FULL_DISK, "command=train", *RUN, "name=full", "train.max_steps=10"]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, env=ENV, timeout=600)
    line = error_line(result)
    run = root / "checkpoints" / "full"
    assert re.match(rf"error: {run}/(last|step_0000010)\.pt: no space left on its device to write it \(it needs", line)
    assert f"intact checkpoints of {run}: last (step 5)" in line
    resume = " ".join([*RUN, "name=full", "train.max_steps=10", "train.resume=true"])
    assert line.endswith(f'once there is space, continue with: make train ARGS="{resume}"')
    assert torch.load(run / "last.pt", weights_only=True)["progress"]["step"] == 5
    assert not [f for f in os.listdir(run) if f.startswith(".tmp-")]


@pytest.mark.slow
def test_a_refused_command_leaves_no_folder_no_record_and_no_empty_log(root):
    """A command refused before it starts leaves nothing behind: no run folder where there was none, the
    earlier settings record where there was one; a command that logs nothing leaves no empty log."""
    refused = ("eval", "translate", "export", "score")
    for args in ([f"command={command}", "name=nope"] for command in refused):
        result = run_cli(root, *args, "device=cpu", stdin="Hola.\n")
        assert (
            error_line(result)
            == f"error: {root}/checkpoints/nope/best.pt: checkpoint not found (train first, or check name=)"
        )
        assert not (root / "checkpoints" / "nope").exists(), args
    elsewhere = root / "new" / "deeper" / "run"
    assert error_line(run_cli(root, "command=eval", f"run_dir={elsewhere}")).startswith(f"error: {elsewhere}/best.pt")
    assert not (root / "new").exists()

    run = copy_run(root, "kept")
    record = run / ".hydra" / "eval"
    for args in (["eval.checkpoint=step_0000099"], ["eval.split=nonexistent"]):  # no record before: none after
        error_line(run_cli(root, "command=eval", "name=kept", "device=cpu", *args))
        assert not record.exists() and not (run / "eval").exists() and not (run / "eval.log").exists()
    first = run_cli(root, "command=eval", "name=kept", "device=cpu", "eval.max_sentences=2", "decode.beam_size=1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_text() for p in record.iterdir()}
    error_line(run_cli(root, "command=eval", "name=kept", "device=cpu", "eval.checkpoint=step_0000099"))
    assert {p.name: p.read_text() for p in record.iterdir()} == before  # the record of the evaluation that ran
    assert "eval.max_sentences=2" in before["overrides.yaml"]

    translated = run_cli(root, "command=translate", "name=kept", "device=cpu", stdin="Hola.\n")
    assert translated.returncode == 0, translated.stderr[-3000:]
    logs = {p.name: p.stat().st_size for p in run.glob("*.log")}
    assert logs.get("train.log", 0) > 0 and all(logs.values()), logs  # the logs written hold lines


@pytest.mark.slow
def test_an_unknown_split_names_the_splits_there_are(root):
    result = run_cli(root, "command=eval", "name=base", "device=cpu", "eval.split=nonexistent")
    assert error_line(result) == "error: eval.split='nonexistent' is not a split; the splits are train, dev, test"


@pytest.mark.slow
def test_a_checkpoint_of_random_bytes_names_the_intact_ones_not_torchs_advice(root):
    run = copy_run(root, "garbled")
    (run / "best.pt").write_bytes(b"\x80\xb9" + os.urandom(4998))  # opens as a pickle of protocol 185: torch warns
    result = run_cli(root, "command=eval", "name=garbled", "device=cpu")
    assert error_line(result) == (
        f"error: {run}/best.pt: not a loadable checkpoint: not a file torch.save wrote; intact checkpoints of {run}: "
        "last (step 10), step_0000010 (step 10), step_0000005 (step 5): choose one with eval.checkpoint="
    )
    assert "weights_only" not in result.stderr
    result = run_cli(
        root,
        "command=eval",
        "name=garbled",
        "device=cpu",
        "eval.checkpoint=step_0000010",
        "eval.max_sentences=1",
        "decode.beam_size=1",
        "viz.worker=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_a_checkpoint_that_is_a_folder_is_one_line(root):
    """best.pt or a snapshot made a folder: open() raised IsADirectoryError while saying why it did not load."""
    run = copy_run(root, "folders")
    (run / "best.pt").unlink()
    (run / "best.pt").mkdir()
    result = run_cli(root, "command=translate", "name=folders", "device=cpu", stdin="Hola.\n")
    assert error_line(result) == (
        f"error: {run}/best.pt: a folder, not a checkpoint file; intact checkpoints of {run}: last (step 10), "
        "step_0000010 (step 10), step_0000005 (step 5): choose one with translate.checkpoint="
    )
    (run / "step_0000010.pt").unlink()
    (run / "step_0000010.pt").mkdir()
    result = run_cli(root, "command=average", "name=folders", "average.last=2")
    assert error_line(result) == f"error: {run}/step_0000010.pt: a folder, not a checkpoint file"


NOT_OURS = "not a checkpoint of this project (it holds no config/model/vocab: a bare state_dict?); give one a run wrote"


@pytest.mark.slow
def test_a_bare_state_dict_is_not_taken_for_a_checkpoint(root):
    """torch.save(model.state_dict()), or {'model': ...} alone, as best.pt or in ensemble=: a KeyError ('vocab',
    'config') once loaded; now one line naming the file and what to give instead."""
    run = copy_run(root, "bare")
    weights = torch.load(run / "best.pt", weights_only=True)["model"]
    torch.save(weights, run / "best.pt")
    result = run_cli(root, "command=translate", "name=bare", "device=cpu", stdin="Hola.\n")
    assert error_line(result) == (
        f"error: {run}/best.pt: {NOT_OURS}: its best.pt, last.pt, step_*.pt or averaged.pt; intact checkpoints of "
        f"{run}: last (step 10), step_0000010 (step 10), step_0000005 (step 5): choose one with translate.checkpoint="
    )
    torch.save({"model": weights}, root / "only_model.pt")
    result = run_cli(root, "command=translate", "name=base", "device=cpu", "ensemble=[only_model.pt]", stdin="Hola.\n")
    assert error_line(result) == (
        f"error: ensemble: only_model.pt: {NOT_OURS}: its best.pt, last.pt, step_*.pt or averaged.pt"
    )


@pytest.mark.slow
def test_resume_with_a_damaged_last_pt_continues_from_the_newest_intact_snapshot(root):
    run = copy_run(root, "cut")
    last = torch.load(run / "last.pt", weights_only=True)
    (run / "last.pt").write_bytes((run / "last.pt").read_bytes()[:100000])  # cut short
    (run / "best.pt").write_bytes(b"\x80\xb9" + os.urandom(4998))  # opens as a pickle of protocol 185: torch warns
    result = run_cli(root, "command=train", *RUN, "name=cut", "train.max_steps=12", "train.resume=true")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert (
        f"{run}/last.pt: not a loadable checkpoint: cut short (100000 bytes, without the end of its archive): "
        f"written or copied incompletely; continuing from {run}/step_0000010.pt, the newest intact checkpoint "
        "(step 10); AdamW's moment estimates start again from zero" in out
    )
    schedule = last["schedule"]  # the data position last.pt had
    assert f"at step 10 (epoch {schedule['epoch']}, batch {schedule['position']})" in out
    assert json.loads((run / "train_summary.json").read_text())["steps"] == 12


def test_resume_says_why_no_checkpoint_can_continue_the_run(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"")
    cut = b"PK\x03\x04 and then nothing"  # the start of a zip archive
    (tmp_path / "best.pt").write_bytes(cut)
    step = {"model": {}, "config": {}, "vocab": {}, "progress": {"step": 20}}
    save_checkpoint(str(tmp_path / "step_0000020.pt"), step)  # no data position
    with pytest.raises(UserError) as err:
        resume_state(str(tmp_path / "last.pt"))
    assert str(err.value) == (
        f"{tmp_path}/last.pt: not a loadable checkpoint: the file is empty; no other checkpoint can continue the "
        f"run: {tmp_path}/best.pt: not a loadable checkpoint: cut short ({len(cut)} bytes, without the end of its "
        f"archive): written or copied incompletely; {tmp_path}/step_0000020.pt: holds no data position (a snapshot "
        "written before they did)"
    )


@pytest.mark.slow
def test_run_dir_moves_the_log_and_the_settings_record_with_the_run(root):
    moved = root / "elsewhere" / "moved"
    args = ["name=moved", f"run_dir={moved}", "train.max_steps=2", "train.eval_every=0"]
    result = run_cli(root, "command=train", *RUN, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("last.pt", "train.log", ".hydra/train/overrides.yaml"):
        assert (moved / name).exists(), name
    assert not (moved / ".lock").exists()  # its lock file: removed when the run let go of it
    assert "training stopped" in (moved / "train.log").read_text()
    assert not (root / "checkpoints" / "moved").exists()


def hold(folder, ready, release):
    lock = FolderLock(folder)
    lock.acquire()
    ready.set()
    release.wait(60)
    os._exit(0)  # ends without releasing: the kernel does


def test_a_folder_lock_names_its_holder_and_ends_with_it(tmp_path):
    fork = multiprocessing.get_context("fork")
    ready, release = fork.Event(), fork.Event()
    holder = fork.Process(target=hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(FolderBusy, match=f"^{tmp_path} is in use by process {holder.pid} \\(started "):
            FolderLock(str(tmp_path)).acquire()
        # make eval beside a training run: its own lock, which a second make eval would find taken
        evaluating = FolderLock(str(tmp_path), OWNING_COMMANDS["eval"])
        evaluating.acquire()
        with pytest.raises(FolderBusy, match="is in use by process"):
            FolderLock(str(tmp_path), OWNING_COMMANDS["eval"]).acquire()
        evaluating.release()
    finally:
        release.set()
        holder.join(60)
    with owning(str(tmp_path)), owning(str(tmp_path)):  # free again; held once per process
        pass


def test_a_cache_with_a_missing_truncated_or_changed_file_is_rebuilt(tmp_path, caplog):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.bin").write_bytes(b"x" * 100)
    stamp = str(tmp_path / "stamp.json")
    mark_done(stamp, "k", [str(tmp_path / "out")], note="kept")
    assert cached(stamp, "k", [])["note"] == "kept"
    assert cached(stamp, "other key", []) is None
    (tmp_path / "out" / "a.bin").write_bytes(b"y" * 100)  # same size: only the content hash tells
    assert cached(stamp, "k", []) is not None and cached(stamp, "k", [], verify=True) is None
    (tmp_path / "out" / "a.bin").write_bytes(b"x" * 10)
    assert cached(stamp, "k", []) is None
    assert f"{tmp_path}/out/a.bin is damaged (10 bytes, 100 when written): rebuilding it" in caplog.text
    (tmp_path / "out" / "a.bin").unlink()
    assert cached(stamp, "k", []) is None and "a.bin is missing" in caplog.text
    (tmp_path / "stamp.json").write_text('{"key": "k"')  # the stamp itself cut short
    assert cached(stamp, "k", []) is None

    (tmp_path / "out" / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "stamp.json").write_text('{"key": "k"}')  # written before stamps recorded their files
    assert cached(stamp, "k", [str(tmp_path / "missing")]) is None
    recorded = cached(stamp, "k", [str(tmp_path / "out")])["files"]
    assert recorded == {"out/a.bin": [100, file_hash(tmp_path / "out" / "a.bin")]}
