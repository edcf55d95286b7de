"""Checkpoints: written atomically, read with ``weights_only=True`` (no arbitrary unpickling).

A run folder holds
- ``last.pt``: the full training state (model, optimizer, scheduler, progress, RNG states): resume;
- ``best.pt``: the weights of the best validation (dev BLEU), without the optimizer's state: what eval,
  translate and export read (a resume falls back on it only where ``last.pt`` is damaged);
- ``step_NNNNNNN.pt``: model-only snapshots, rotated: the newest ``train.keep_last`` and those of the
  ``train.keep_best`` best validations are kept; ``make average`` averages them;
- ``averaged.pt``: what ``make average`` wrote.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from app.run.errors import UserError
from app.run.files import atomic_write

SNAPSHOT = re.compile(r"step_(\d+)\.pt$")
CHECKPOINT_KEYS = frozenset({"model", "config", "vocab"})  # what every checkpoint a run writes holds


def save_checkpoint(path: str, payload: dict) -> None:
    atomic_write(path, lambda f: torch.save(payload, f), size=tensor_bytes(payload))


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a checkpoint's nested dicts and lists: about the size of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def host_copy(obj):
    """``obj`` (a checkpoint's nested dicts, lists and tensors) with every tensor copied to the host: a
    snapshot that training can go on changing the live tensors after."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints in a background thread, one after the other in the order they were handed over:
    training hands over a host copy of its state (``host_copy``) and goes on while it is serialized and
    synced to disk. A write that failed raises in the training thread at the next hand-over or ``wait``."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending: list[Future] = []

    def submit(self, write: Callable, *args) -> None:
        self._raise_failures()
        self.pending.append(self.executor.submit(write, *args))

    def _raise_failures(self) -> None:
        done = [f for f in self.pending if f.done()]
        self.pending = [f for f in self.pending if not f.done()]
        for future in done:
            future.result()

    def wait(self) -> None:
        """Until every checkpoint handed over is on disk."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.wait()
        self.executor.shutdown()


class UnloadableCheckpoint(UserError):
    """A checkpoint file that is there but does not load."""


def load_checkpoint(path: str, device: torch.device | str = "cpu", mmap: bool = False) -> dict:
    """A checkpoint's contents (``mmap``: its tensors mapped from the file, read when used)."""
    if not os.path.exists(path):
        raise UserError(f"{path}: checkpoint not found (train first, or check name=)")
    if os.path.isdir(path):
        raise UnloadableCheckpoint(f"{path}: a folder, not a checkpoint file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
        except Exception as err:  # torch's warnings about a file it cannot read go too: the line says why
            raise UnloadableCheckpoint(f"{path}: not a loadable checkpoint: {load_failure(path, err)}") from None
    for w in caught:  # those of a file that loads are torch's to say
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise UnloadableCheckpoint(
            f"{path}: not a checkpoint of this project (it holds no {'/'.join(sorted(CHECKPOINT_KEYS))}: a bare "
            "state_dict?); give one a run wrote: its best.pt, last.pt, step_*.pt or averaged.pt"
        )
    return state


def load_failure(path: str, err: Exception) -> str:
    """Why a checkpoint does not load, in a few words. Never torch's advice to load with weights_only=False:
    that runs whatever code the file holds."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if size == 0:
        return "the file is empty"
    if head != b"PK\x03\x04":  # torch.save writes a zip archive
        return "not a file torch.save wrote"
    if not zipfile.is_zipfile(path):
        return f"cut short ({size} bytes, without the end of its archive): written or copied incompletely"
    if isinstance(err, pickle.UnpicklingError):
        return "it holds Python objects besides tensors and plain values, refused (loading them could run code)"
    return f"damaged ({str(err).split('. ')[0].splitlines()[0]})"


def checkpoint_step(state: dict) -> int:
    """The training step of a checkpoint or snapshot (of the newest snapshot an average was made of)."""
    if "progress" in state:
        return state["progress"]["step"]
    return max(map(snapshot_step, state.get("averaged", [])), default=0)


def intact_checkpoints(run_dir: str, skip: str = "") -> list[tuple[str, int]]:
    """(name, step) of the checkpoints in ``run_dir`` that load (all but ``skip``), newest first: what a
    damaged one's message offers instead. Their tensors are mapped, not read."""
    names = ["last", "best", "averaged", *(snapshot_name(step) for step in reversed(snapshot_steps(run_dir)))]
    found = []
    for name in names:
        path = os.path.join(run_dir, f"{name}.pt")
        if os.path.exists(path) and os.path.abspath(path) != os.path.abspath(skip or "-"):
            try:
                found.append((name, checkpoint_step(load_checkpoint(path, mmap=True))))
            except UserError:
                pass
    return sorted(found, key=lambda found: -found[1])


def intact_note(run_dir: str, found: list[tuple[str, int]]) -> str:
    """``intact checkpoints of <run_dir>: last (step 60), step_0000055 (step 55)``, or that there is none."""
    listed = ", ".join(f"{name} (step {step})" for name, step in found)
    return f"intact checkpoints of {run_dir}: {listed}" if found else f"{run_dir} has no other intact checkpoint"


def checkpoint_path(run_dir: str, which: str, setting: str = "checkpoint") -> str:
    """``best`` | ``last`` | ``averaged`` | ``step_NNNNNNN`` (a snapshot) -> its file in ``run_dir``; another
    value of ``setting`` is a UserError naming it."""
    if which not in ("best", "last", "averaged") and not SNAPSHOT.match(f"{which}.pt"):
        raise UserError(f"{setting}={which!r}: choose best, last, averaged or a snapshot such as step_0001000")
    return os.path.join(run_dir, f"{which}.pt")


def missing_checkpoint(run_dir: str, path: str, setting: str) -> UserError:
    """The error for a checkpoint ``path`` that is not there: a run with none is not trained yet; one with others
    names them (a snapshot rotated away, or a typo in ``setting``)."""
    found = intact_checkpoints(run_dir)
    if not found:
        return UserError(f"{path}: checkpoint not found (train first, or check name=)")
    return UserError(f"{path}: checkpoint not found; {intact_note(run_dir, found)}: choose one with {setting}=")


def named_checkpoint(given: str) -> str:
    """The checkpoint file ``given`` names (it may not exist): a ``.pt`` file, a run folder's best.pt, or that of
    the run of that name (``checkpoints/<name>/best.pt``, as the CLI's run folders)."""
    return given if given.endswith(".pt") else checkpoint_path(run_folder(given), "best")


def run_folder(given: str) -> str:
    """The run folder ``given`` names: a folder, or the run of that name (``checkpoints/<name>``)."""
    return given if os.path.isdir(given) else os.path.join("checkpoints", given)


def snapshot_steps(run_dir: str) -> list[int]:
    """Steps of the model snapshots in ``run_dir``, oldest first."""
    found = (SNAPSHOT.search(os.path.basename(p)) for p in glob.glob(os.path.join(run_dir, "step_*.pt")))
    return sorted(int(m.group(1)) for m in found if m)


def snapshot_step(name: str) -> int:
    """The step of a snapshot's name or file name (``step_0001000`` -> 1000)."""
    found = SNAPSHOT.search(name if name.endswith(".pt") else f"{name}.pt")
    if found is None:
        raise ValueError(f"{name!r} is not a snapshot's name (step_NNNNNNN)")
    return int(found.group(1))


def snapshot_name(step: int) -> str:
    return f"step_{step:07d}"


def write_snapshot(
    run_dir: str, step: int, payload: dict, keep_last: int, keep_best: int, validations: list[list[float]]
) -> None:
    """``step_NNNNNNN.pt`` (once per step), then the rotation below."""
    path = os.path.join(run_dir, f"{snapshot_name(step)}.pt")
    if not os.path.exists(path):
        save_checkpoint(path, payload)
    rotate_snapshots(run_dir, keep_last, keep_best, validations)


def rotate_snapshots(run_dir: str, keep_last: int, keep_best: int, validations: list[list[float]]) -> None:
    """Delete snapshots that are neither among the newest ``keep_last`` nor among the ``keep_best``
    best validations (``validations``: [step, dev BLEU] pairs)."""
    steps = snapshot_steps(run_dir)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    keep |= best_steps(validations, keep_best)
    for step in steps:
        if step not in keep:
            os.unlink(os.path.join(run_dir, f"{snapshot_name(step)}.pt"))


def best_steps(validations: list[list[float]], n: int) -> set[int]:
    """The steps of the ``n`` best validations ([step, score] pairs, higher better: app/train/state.py's
    ranking_score; the earlier step on ties)."""
    ranked = sorted(validations, key=lambda v: (-v[1], v[0]))
    return {int(step) for step, _ in ranked[:n]}


def average_snapshots(run_dir: str, last: int) -> tuple[dict, list[str]]:
    """Element-wise mean of the newest ``last`` snapshots' parameters (Vaswani et al. 2017, §6.1);
    returns a loadable checkpoint (config and vocab of the newest) and the files averaged."""
    steps = snapshot_steps(run_dir)
    if last < 1:
        raise UserError(f"average.last={last}: give at least 1")
    if not steps and not intact_checkpoints(run_dir):
        raise UserError(f"{run_dir}: checkpoint not found (train first, or check name=)")
    if len(steps) < last:
        raise UserError(
            f"{run_dir}: {len(steps)} snapshot(s) step_*.pt, fewer than average.last={last} "
            "(raise train.keep_last, or average fewer)"
        )
    paths = [os.path.join(run_dir, f"{snapshot_name(s)}.pt") for s in steps[-last:]]
    return average_files(paths), paths


def average_files(paths: list[str]) -> dict:
    """The checkpoint whose parameters are the element-wise mean of those of ``paths`` (model snapshots of one
    run), with the config and vocab of the last and the names of the files averaged (``averaged``)."""
    states = [load_checkpoint(p) for p in paths]
    newest = states[-1]
    for path, state in zip(paths, states):
        if state["config"]["model"] != newest["config"]["model"] or state["vocab"] != newest["vocab"]:
            raise UserError(f"{path}: a different model or vocabulary than {paths[-1]}; cannot average them")
    averaged = {}
    for key, value in newest["model"].items():
        if value.is_floating_point():
            total = sum(s["model"][key].double() for s in states)
            averaged[key] = (total / len(states)).to(value.dtype)
        else:  # integer buffers (counters) are not averaged
            averaged[key] = value
    return {
        "model": averaged,
        "config": newest["config"],
        "vocab": newest["vocab"],
        "averaged": [os.path.basename(p) for p in paths],
    }
