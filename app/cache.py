"""Skip work whose inputs did not change: a stamp file next to the outputs records a key, a hash of
everything the outputs depend on (settings, input files), and what else the stage wants to keep."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Optional

from app.utils import atomic_write_text


def cached(stamp: str, key: str, outputs: Iterable[str] = ()) -> Optional[dict]:
    """The record stored with ``key`` when the stamp holds that key and every output exists; None
    when the work must be (re)done."""
    if not os.path.exists(stamp) or not all(os.path.exists(path) for path in outputs):
        return None
    with open(stamp, encoding="utf-8") as f:
        record = json.load(f)
    return record if record.get("key") == key else None


def mark_done(stamp: str, key: str, **record) -> dict:
    """Write the stamp last, once the outputs are in place: an interrupted stage leaves none."""
    record = {"key": key, **record}
    atomic_write_text(stamp, json.dumps(record, indent=2))
    return record
