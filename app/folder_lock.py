"""A folder owned by one process at a time: an OS lock (``flock``) on ``<folder>/.lock``.

The kernel releases the lock when its process ends, however it ends, so a killed run never blocks its
resume. The file records who holds it (PID, start time, command and name) for the message the next process
prints. The file stays when its holder ends: deleting it while it is held would let a second process lock
a new file of the same name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
from datetime import datetime
from typing import Optional

from app.errors import UserError

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"
_held: dict[str, FolderLock] = {}  # the folders ``owning`` holds, by real path


class FolderBusy(UserError):
    """Another process owns the folder."""


class FolderLock:
    """The lock of one folder, held from ``acquire`` until ``release`` or the end of the process."""

    def __init__(self, folder: str, name: str = LOCK_FILE):
        self.folder = folder
        self.path = os.path.join(folder, name)
        self.fd: Optional[int] = None

    def acquire(self, wait: bool = False, advice: str = "") -> None:
        """Lock the folder, or raise FolderBusy naming its holder (``advice``: what to do instead); with
        ``wait``, say once whom it waits for and wait until the holder ends."""
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            busy = None
        except BlockingIOError:
            busy = holder(fd)
        if busy and not wait:
            os.close(fd)
            raise FolderBusy(f"{self.folder} is in use by {busy}{advice}")
        if busy:
            log.info("%s is in use by %s: waiting for it to finish", self.folder, busy)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # Ctrl-C while waiting
                os.close(fd)
                raise
        record = json.dumps(owner_record()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor of the open file releases its lock
            self.fd = None


def owner_record() -> dict:
    """Who holds a lock: this process, under torchrun also its launcher (the workers' parent)."""
    from app import distributed  # torch: not before the command line's settings are checked (app/cli.py)

    record = {
        "pid": os.getpid(),
        "started": datetime.now().isoformat(sep=" ", timespec="seconds"),
        "command": " ".join(a for a in sys.argv[1:] if a.startswith(("command=", "name=", "run_dir="))),
    }
    if distributed.launched():
        record["launcher_pid"] = os.getppid()
    return record


@contextlib.contextmanager
def owning(folder: str):
    """The folder's lock for a block, waiting for another process that holds it. A lock this process
    already holds through ``owning`` is kept as it is; a folder it may not write goes unlocked (it writes
    nothing there either)."""
    key = os.path.realpath(folder)
    lock = None if key in _held else FolderLock(folder)
    if lock:
        try:
            lock.acquire(wait=True)
            _held[key] = lock
        except PermissionError:
            lock = None
    try:
        yield
    finally:
        if lock:
            del _held[key]
            lock.release()


def holder(fd: int) -> str:
    """The holder of a lock, from its file: ``process 123 (started 2026-01-31 12:00:00: command=train name=x)``."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        record = {}
    if "pid" not in record:  # between its lock and its record
        return "another process, which has just started"
    launcher = f", rank 0 of torchrun process {record['launcher_pid']}" if "launcher_pid" in record else ""
    command = f": {record['command']}" if record.get("command") else ""
    return f"process {record['pid']} (started {record['started']}{launcher}{command})"
