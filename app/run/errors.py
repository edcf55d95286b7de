"""The project's error kinds, and which of them an exception is: the CLI prints a UserError as one line
(app/cli.py), exits with 128 + the signal number for a TrainingInterrupted, and names a full disk."""

from __future__ import annotations

import errno
from typing import Optional, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input or settings: the CLI prints it as one line, without a traceback."""


class DiskFull(UserError):
    """A write that found no space left on its device (app/run/files.atomic_open names the file)."""


class TrainingInterrupted(UserError):
    """Training stopped on a signal after saving; the CLI exits with 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def required(value: Optional[T], what: str) -> T:
    """``value``, which the settings in force guarantee (an Optional field that they fill): None is a bug, raised
    naming ``what``."""
    if value is None:
        raise AssertionError(f"{what} is missing")
    return value


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` comes of a full disk or quota, also when a library wrapped the OSError (torch.save
    raises a RuntimeError whose context is the OSError)."""
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in causes(err))


def causes(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: Optional[BaseException] = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
