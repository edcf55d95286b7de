"""Skip work whose inputs did not change, and redo work whose outputs were damaged.

A stamp file next to the outputs records a key (a hash of everything the outputs depend on: settings,
input files), the size and content hash of every output file as it was written, and what else the stage
wants to keep. A cache whose files are missing or of another size is rebuilt, saying so in one line; with
``verify`` (``make data``) their content hashes are compared too, which finds any change."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Optional

from app.run.files import atomic_write_text, file_hash

log = logging.getLogger(__name__)


def cached(stamp: str, key: str, outputs: Iterable[str], verify: bool = False) -> Optional[dict]:
    """The record stored with ``key`` when the stamp holds that key and every output is as it was written;
    None when the work must be (re)done."""
    try:
        with open(stamp, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("%s does not read (%s): rebuilding what it records", stamp, err)
        return None
    if record.get("key") != key:
        return None
    if "files" not in record:  # a stamp written before its outputs were recorded: record them now
        outputs = list(outputs)
        if not all(os.path.exists(path) for path in outputs):
            return None
        try:
            return mark_done(stamp, key, outputs, **{k: v for k, v in record.items() if k != "key"})
        except PermissionError:  # a corpus folder this user may only read
            return record
    problem = damage(os.path.dirname(stamp), record["files"], verify)
    if problem:
        log.warning("%s: rebuilding it from its inputs", problem)
        return None
    return record


def mark_done(stamp: str, key: str, outputs: Iterable[str], **record) -> dict:
    """Write the stamp last, once the outputs (files, or folders: every file in them) are in place: an
    interrupted stage leaves none."""
    base = os.path.dirname(stamp)
    files = {
        os.path.relpath(path, base): [os.path.getsize(path), file_hash(path)] for path in output_files(outputs, stamp)
    }
    record = {"key": key, **record, "files": files}
    atomic_write_text(stamp, json.dumps(record, indent=2))
    return record


def output_files(outputs: Iterable[str], stamp: str) -> list[str]:
    files = []
    for path in outputs:
        if os.path.isdir(path):
            found = (os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)
            files += sorted(p for p in found if os.path.abspath(p) != os.path.abspath(stamp))
        else:
            files.append(path)
    return files


def damage(base: str, files: dict[str, list], verify: bool) -> Optional[str]:
    """The first recorded output file (path relative to ``base``) that is not as it was written, and how;
    None when all are."""
    for name, (size, digest) in files.items():
        path = os.path.join(base, name)
        try:
            actual = os.path.getsize(path)
            if actual != size:
                return f"{path} is damaged ({actual} bytes, {size} when written)"
            if verify and file_hash(path) != digest:
                return f"{path} is damaged (its content changed since it was written)"
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as err:
            return f"{path} does not read ({err.strerror})"
    return None
