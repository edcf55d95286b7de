"""A folder owned by one process at a time: an OS lock (``flock``) on ``<folder>/.lock``.

The kernel releases the lock when its process ends, however it ends, so a killed run never blocks its
resume. The file records who holds it (PID, start time, command and name) for the message the next process
prints.

Its holder removes the file when it lets go of the lock: on ``release``, and at the exit of the process
(``atexit``) for a lock still held then, whatever ended it: a return, an error, Ctrl-C, ``sys.exit``, and SIGTERM,
which while this process holds a lock ends it as ``sys.exit(143)`` does (unless something else handles
SIGTERM: training does, app/train/stop_rules.py), so that its exit handlers run. A SIGKILL leaves the file,
which is harmless: the next process takes the flock of a file nobody holds. Removing the file is safe because
taking the lock checks, after ``flock``, that the file it locked is still the one at the path (the classic
flock-and-unlink protocol): its holder removes the file while it still holds it, so a process that was
waiting on that file wakes to find it removed (or replaced by a newer one), lets go of it and tries again,
and never holds a removed file while another holds the new one. A process forked while a lock is held (a
``multiprocessing`` worker) closes its copy of the descriptor, so that the lock ends with its holder.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import threading
from datetime import datetime
from typing import Optional

from app.run.errors import UserError

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"
_held: dict[str, FolderLock] = {}  # the folders ``owning`` holds, by real path
_holding: list[FolderLock] = []  # every lock this process holds: released (their files removed) at its exit
_sigterm_pid: Optional[int] = None  # the process that set SIGTERM to end it as sys.exit (not a forked one)
_terminated = False  # SIGTERM ended it: said at exit, once its locks are released


class FolderBusy(UserError):
    """Another process owns the folder."""


class Terminated(SystemExit):
    """SIGTERM, while this process holds a folder lock: it exits with status 143 (128 + 15), running its
    ``finally`` blocks and exit handlers on the way."""


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
        said = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy = holder(fd)
                    if not wait:
                        raise FolderBusy(f"{self.folder} is in use by {busy}{advice}") from None
                    if not said:
                        log.info("%s is in use by %s: waiting for it to finish", self.folder, busy)
                        said = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
                if _is_at_path(fd, self.path):
                    break
            except BaseException:  # busy, or Ctrl-C while waiting
                os.close(fd)
                raise
            os.close(fd)  # its holder removed it (or it was replaced) while this process waited: again
        record = json.dumps(owner_record()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self.fd = fd
        _holding.append(self)
        _end_on_sigterm()

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (in this order: see the module's docstring)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        if self in _holding:
            _holding.remove(self)
        try:
            if _is_at_path(fd, self.path):
                os.unlink(self.path)
        except OSError:  # removed by hand, or a folder this process may no longer write: the lock still ends
            pass
        os.close(fd)  # closing the only descriptor of the open file releases its lock
        if not _holding:
            _default_on_sigterm()


def _is_at_path(fd: int, path: str) -> bool:
    """Whether the file open as ``fd`` is the one at ``path`` (not removed, nor replaced by another)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def _end_on_sigterm() -> None:
    """While this process holds a lock, SIGTERM raises Terminated (sys.exit(143)) in its main thread, where it
    would otherwise end the process at once, with no exit handler to remove the lock file. A handler already set
    (training's, a server's) is left as it is."""
    global _sigterm_pid
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_pid = os.getpid()


def _default_on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum, frame) -> None:
    global _terminated
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
    if os.getpid() != _sigterm_pid:  # a forked process that inherited the handler: as if it had none
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _terminated = True
    raise Terminated(128 + signum)


@atexit.register
def _release_all() -> None:
    """At exit: every lock still held released, its file removed; and a SIGTERM that ended the process said."""
    for lock in list(_holding):
        lock.release()
    if _terminated:
        sys.stderr.write("interrupted: SIGTERM\n")
        sys.stderr.flush()


def _forget_in_child() -> None:
    """In a process forked from a holder: its copies of the descriptors closed (the lock stays the parent's,
    and ends with it), nothing to release at its exit."""
    for lock in _holding:
        if lock.fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
    _holding.clear()
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def owner_record() -> dict:
    """Who holds a lock: this process, under torchrun also its launcher (the workers' parent)."""
    from app.run import distributed  # torch: not before the command line's settings are checked (app/cli.py)

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
            _held.pop(key, None)  # gone in a process forked meanwhile (_forget_in_child)
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
