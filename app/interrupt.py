"""Graceful stop: SIGINT / SIGTERM ask training to save a checkpoint at the end of the current step.

The first signal only sets a flag, so no step is cut in half and no checkpoint is torn; a second
SIGINT (Ctrl-C twice) stops at once, as Python normally does.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

from app.errors import UserError


class TrainingInterrupted(UserError):
    """Training stopped on a signal after saving; the CLI exits with 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """Context manager: while active, SIGINT/SIGTERM set ``signum`` instead of killing the process."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: the user wants out now
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
