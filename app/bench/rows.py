"""``make bench``'s rows run each on its own: a row that raises (a compile, a decoding engine, an export, out of
memory) is recorded with its one-line error, and the other rows still run, print and write their measurements;
the command then exits non-zero (app/cli.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Optional, TypeVar

import torch

from app.run.errors import UserError

T = TypeVar("T")


def one_line(error: BaseException) -> str:
    """An exception as a table cell: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def attempt(failed: dict[str, str], row: str, run: Callable[[], T]) -> Optional[T]:
    """``run()``, the measurements of one row; if it raises, its one-line error goes into ``failed`` under ``row`` and
    None comes back. Bad settings (a UserError) still stop the whole bench with one line."""
    try:
        return run()
    except UserError:
        raise
    except Exception as error:
        failed[row] = one_line(error)
        print(f"{row}: failed, {failed[row]}")
        if torch.cuda.is_available():  # what the failed row held (out of memory) is not the next row's
            with contextlib.suppress(RuntimeError):  # an allocator that failed an assertion may fail this too
                torch.cuda.empty_cache()
        return None
