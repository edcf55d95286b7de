"""What a command refused before it starts leaves in its run folder: nothing.

Hydra makes the run folder and writes its record of the settings (``.hydra/<command>/``) before the command
runs, and a command that owns a folder locks it first (app/run/folder_lock.py). A command refused then (a
UserError: ``name=`` of a run that does not exist, a setting checked by the command) has written nothing
of its own: ``FolderBefore.undo`` removes the folder where this command made it, or puts the command's
earlier record back where the folder was there before (so that it still describes the outputs beside it).

The log file (``<command>.log``) is opened at its first line (``delay`` in conf/config.yaml): a command
that logs nothing leaves no empty log, and one that logs keeps its log.
"""

from __future__ import annotations

import os
import shutil
import time


def _ours(relative: str) -> bool:
    """Whether a file of the run folder is one Hydra or a lock writes for any command (not its outputs)."""
    top = relative.split(os.sep)[0]
    return top == ".hydra" or top.startswith(".lock") or (os.sep not in relative and top.endswith(".log"))


def written_since(folder: str, since: float) -> list[str]:
    """Files of ``folder`` (outside Hydra's record, locks and logs) modified at or after ``since``."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                if not _ours(os.path.relpath(path, folder)) and os.path.getmtime(path) >= since:
                    found.append(path)
            except OSError:  # removed meanwhile
                pass
    return found


def _first_missing(folder: str) -> str | None:
    """The outermost folder of ``folder``'s path that does not exist yet (``folder`` itself or a parent)."""
    missing, path = None, os.path.abspath(folder)
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


class FolderBefore:
    """A run folder as it was before Hydra wrote into it for ``command``."""

    def __init__(self, folder: str, command: str):
        self.folder, self.record = folder, os.path.join(folder, ".hydra", command)
        self.started = time.time()
        self.made = _first_missing(folder)  # what this command will create, None if the folder exists
        self.saved: dict[str, bytes] | None = None
        if os.path.isdir(self.record):
            self.saved = {}
            for name in os.listdir(self.record):
                path = os.path.join(self.record, name)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        self.saved[name] = f.read()

    def undo(self) -> None:
        """After a refusal: the folder as it was, where the command wrote nothing of its own there."""
        if not os.path.isdir(self.folder) or written_since(self.folder, self.started):
            return
        if self.made:
            shutil.rmtree(self.folder, ignore_errors=True)
            path = os.path.dirname(os.path.abspath(self.folder))
            while len(path) >= len(self.made):  # parents made for it, where empty
                try:
                    os.rmdir(path)
                except OSError:
                    break
                path = os.path.dirname(path)
            return
        shutil.rmtree(self.record, ignore_errors=True)
        if self.saved is not None:
            os.makedirs(self.record, exist_ok=True)
            for name, content in self.saved.items():
                with open(os.path.join(self.record, name), "wb") as f:
                    f.write(content)
        else:
            try:
                os.rmdir(os.path.dirname(self.record))  # .hydra, where it holds no other command's record
            except OSError:
                pass
