"""Files written whole or not at all (a temporary file renamed into place), and the hashes that name
what a cache was made from."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile

from app.run.errors import DiskFull, UserError, disk_full


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", size: int = 0):
    """A file to write ``path`` through: a temp file in the same folder, fsynced and renamed when the
    block ends, removed if it fails. A crash leaves either the old file or the new one, never a torn one;
    a full disk is a DiskFull naming the file, ``size`` (what it needs, where known) and the space left."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, Exception) and disk_full(err):
            needs = f"it needs about {human_bytes(size)}, " if size else ""
            free = human_bytes(shutil.disk_usage(folder).free)
            raise DiskFull(f"{path}: no space left on its device to write it ({needs}{free} free)") from None
        raise


def check_output_file(path: str, where: str) -> None:
    """Refuse, before any work is done, an output file ``path`` that cannot be written: a folder, or one whose folder
    cannot be made or written to. ``where`` names it in the message: ``translate.output='out.txt'``."""
    if os.path.isdir(path):
        raise UserError(f"{where}: a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    check_makeable(folder, f"{where}: its folder {folder}")


def check_output_folder(path: str, where: str) -> None:
    """Refuse, before any work is done, an output folder ``path`` that cannot be written: a file, or a folder that
    cannot be made or written to. ``where`` names it in the message: ``export.dir=out``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{where}: a file, not a folder")
    check_makeable(os.path.abspath(path), where)


def check_makeable(folder: str, where: str) -> None:
    """A UserError unless ``folder`` is there or can be made, and can be written to. The folders made to find out
    are removed again: a refused command leaves none, and the writer makes them."""
    made, above = [], folder
    while not os.path.lexists(above):
        made.append(above)  # deepest first
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UserError(f"{where} cannot be made: {above} is a file")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise UserError(f"{where} cannot be made ({err.strerror})") from None
    writable = os.access(folder, os.W_OK | os.X_OK)
    for empty in made:
        os.rmdir(empty)
    if not writable:
        raise UserError(f"{where} cannot be written to (permission denied)")


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def atomic_write(path: str, write, size: int = 0) -> None:
    """Write ``path`` atomically through ``write(file_object)`` (see atomic_open)."""
    with atomic_open(path, size=size) as f:
        write(f)


def atomic_write_text(path: str, text: str) -> None:
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data), size=len(data))
