"""Where a command's seconds went, stage by stage."""

from __future__ import annotations

import contextlib
import time


class Stopwatch:
    """Seconds per named stage of a command: ``with clock("decode"): ...``; a stage entered again adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def rounded(self, digits: int = 2) -> dict[str, float]:
        return {stage: round(seconds, digits) for stage, seconds in self.seconds.items()}

    def line(self) -> str:
        """``load 1.2 s, decode 7.0 s, ... (total 9.3 s)``"""
        stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.seconds.items())
        return f"{stages} (total {sum(self.seconds.values()):.1f} s)"
