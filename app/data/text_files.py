r"""Text files read as the corpus and link files are: checked (a file, not a folder), line by line, lines ending at
``\n`` only, a byte-order mark dropped, UTF-8 errors named by file and line."""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterator

from app.run.errors import UserError


def check_file(path: str, where: str = "") -> None:
    """A UserError unless ``path`` is a file; ``where`` is how the error names it (the path by default). A named
    pipe (a shell's ``<(...)``) or a device is refused as such: a corpus is read more than once and known by
    its size and time."""
    if os.path.isdir(path):
        raise UserError(f"{where or path}: a folder, not a file")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UserError(f"{where or path}: a pipe or a device, not a file: write it into a file and give that")
    if not os.path.isfile(path):
        raise UserError(f"{where or path}: file not found")


def text_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of a UTF-8 text file, read lazily. Lines end at LF only, so the numbers are
    the file's own (a CRLF's CR is dropped; a lone CR stays in its line, where the cleaning reads it as a
    space, as any whitespace); a byte-order mark at the start is dropped. A line that is not UTF-8 is a
    UserError naming file and line."""
    check_file(path)
    try:
        f = open(path, "rb")  # binary: text mode would also end lines at a lone \r
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror})") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                yield line_no, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{line_no}: not valid UTF-8") from None
