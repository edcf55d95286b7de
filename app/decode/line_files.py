"""The line files of ``make translate`` (``translate.input``, ``.prefix``, ``.constraints``), read a window of lines
at a time so that memory stays flat in a file's length, and where a run stopped (``translate.resume``).

Each file is checked whole before the model loads (it exists, is not a folder, is UTF-8 line by line, is not
empty) and its lines counted, in one streaming pass; standard input is first copied to a temporary file, so a pipe
is checked, counted and read the same way. The output of an interrupted run is cut back to the start of the window
holding its first missing line: that window is translated again, as the uninterrupted run translated it, so the
finished file is the same, byte for byte (the windows are fixed by line number: window k holds lines kW to
(k + 1)W - 1)."""

from __future__ import annotations

import codecs
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import BinaryIO, Optional

from app.run.errors import UserError


@dataclass(frozen=True)
class LineFile:
    """A checked file of lines: the file read, how errors name it, its lines and those not empty."""

    path: str
    where: str  # "translate.prefix='p.txt'" or "standard input"
    lines: int
    filled: int


def open_line_file(path: Optional[str], setting: str, purpose: str, spool: str) -> LineFile:
    """The file ``path`` (the value of ``setting``), or standard input copied into the folder ``spool``, checked and
    counted; one that is missing, a folder, unreadable, not UTF-8 or empty (nothing to ``purpose``) is a
    UserError."""
    where = f"{setting}={path!r}" if path else "standard input"
    if path and os.path.isdir(path):
        raise UserError(f"{where}: a folder, not a file")
    if not path:
        path = os.path.join(spool, "stdin.txt")
        with open(path, "wb") as copy:
            shutil.copyfileobj(sys.stdin.buffer, copy)
        name = "standard input"
    else:
        name = path
    try:  # any file that reads: also /dev/null, a named pipe, a shell's <(...)
        source = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{where}: file not found") from None
    except OSError as err:
        raise UserError(f"{where}: cannot be read ({err.strerror})") from None
    if not os.path.isfile(path):  # a pipe reads once: copy it, as standard input
        with source, open(os.path.join(spool, f"{setting}.txt"), "wb") as copy:
            shutil.copyfileobj(source, copy)
        path = copy.name
        source = open(path, "rb")
    lines = filled = 0
    with source:
        for lines, raw in enumerate(source, start=1):
            try:
                filled += bool(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                raise UserError(f"{name}:{lines}: not valid UTF-8") from None
    if not lines:
        raise UserError(f"{where}: nothing to {purpose} (it is empty)")
    return LineFile(path, where, lines, filled)


def read_lines(path: Optional[str], setting: str, purpose: str) -> list[str]:
    """Every line of the file ``path`` (the value of ``setting``) or of standard input, checked as
    ``open_line_file`` checks them: for commands that need them all at once (make score)."""
    with tempfile.TemporaryDirectory(prefix="lines-") as spool:
        file = open_line_file(path, setting, purpose, spool)
        return next(windows(file, file.lines))


def read_parallel(source: str, target: str, section: str, purpose: str) -> tuple[list[str], list[str]]:
    """The lines of the files ``source`` and ``target`` (the settings ``<section>.source`` and ``<section>.target``),
    checked as ``read_lines`` checks them, as many of each: a pair a line."""
    texts = read_lines(source, f"{section}.source", purpose), read_lines(target, f"{section}.target", purpose)
    if len(texts[0]) != len(texts[1]):
        raise UserError(
            f"{section}.source={source!r} has {len(texts[0])} lines but {section}.target={target!r} has "
            f"{len(texts[1])}: give one target line per source line"
        )
    return texts


def windows(file: LineFile, size: int, start: int = 0) -> Iterator[list[str]]:
    """The lines of ``file`` from line ``start`` (0-based), ``size`` at a time, without their line ends; a
    byte-order mark before the first line dropped, as the corpus files' (app/data/text_files.py)."""
    with open(file.path, "rb") as source:
        rest = islice(source, start, None)
        while window := list(islice(rest, size)):
            if start == 0:  # the file's first line is in this window
                window[0], start = window[0].removeprefix(codecs.BOM_UTF8), -1
            yield [raw.decode("utf-8").rstrip("\r\n") for raw in window]


def resume_point(output: str, total: int, window: int, nbest: bool) -> tuple[int, int]:
    """Where an interrupted ``make translate`` goes on: the first input line of the window holding the first line
    ``output`` lacks, and the byte where that window's translations begin (what is kept of ``output``). A line of
    the output is complete once its line end is written; in an n-best list (``index ||| ...``) the last index
    written may lack hypotheses, so its line counts as missing. (0, 0) for an output not yet written."""
    if not os.path.exists(output):
        return 0, 0
    window_starts: dict[int, int] = {}  # window -> the byte its first complete output line begins at
    done = at = 0
    with open(output, "rb") as written:
        for n, raw in enumerate(written):
            if not raw.endswith(b"\n"):
                break
            line = index_of(raw, output, n) if nbest else n
            window_starts.setdefault(line // window, at)
            done, at = (line if nbest else n + 1), at + len(raw)
    if done > total or (nbest and done >= total):
        raise UserError(
            f"translate.output={output!r} holds translations of {done + nbest} lines and the input has {total}: "
            "not this input's translation"
        )
    if done == total:  # finished: nothing is translated again
        return total, at
    return done // window * window, window_starts.get(done // window, at)


def index_of(raw: bytes, output: str, n: int) -> int:
    """The input line an n-best line (``index ||| hypothesis ||| score``) is for."""
    head = raw.split(b" ||| ", 1)[0]
    if not head.isdigit():
        raise UserError(f"{output}:{n + 1}: not an n-best line (index ||| hypothesis ||| score): not resumable")
    return int(head)


def open_output(path: Optional[str], byte: Optional[int]) -> BinaryIO:
    """The stream translations go to: standard output, or the file ``path`` written anew (``byte`` None) or kept up
    to ``byte`` and continued."""
    if not path:
        return sys.stdout.buffer
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if byte is None or not os.path.exists(path):
        return open(path, "wb")
    out = open(path, "r+b")
    out.truncate(byte)
    out.seek(byte)
    return out
