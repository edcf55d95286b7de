"""When training stops: at its limits (train.max_steps, the time budget train.max_minutes), or
gracefully on SIGINT / SIGTERM, which ask training to save a checkpoint at the end of the current step.

The first signal only sets a flag, so no step is cut in half and no checkpoint is torn; a second
SIGINT (Ctrl-C twice) stops at once, as Python normally does. ``resume_hint`` is the command that continues
a stopped run.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch

from app import distributed
from app.config import TrainConfig


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

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class StopRules:
    """The limits of a run. Under DDP the ranks must agree on stopping, so they compare their flags
    (a collective: a host sync) every ``CHECK_EVERY`` steps rather than after every one."""

    CHECK_EVERY = 10

    def __init__(self, t: TrainConfig, world: int, device: torch.device):
        self.max_steps, self.max_minutes, self.world, self.device = t.max_steps, t.max_minutes, world, device
        self.budget = t.max_minutes * 60 if t.max_minutes else None

    def time_left(self, elapsed: float) -> Optional[float]:
        return None if self.budget is None else self.budget - elapsed

    def check(self, step: int, elapsed: float, signalled: bool, reason: Optional[str]) -> tuple[Optional[str], bool]:
        """After a step: why training stops now (``reason``, an early stop, if already set; None: go on),
        and whether a signal asks it to save and leave instead."""
        out_of_time = self.out_of_time(elapsed)
        if self.world > 1:
            agree = step % self.CHECK_EVERY == 0 or step >= self.max_steps
            out_of_time, signalled = (
                distributed.any_rank([out_of_time, signalled], self.device) if agree else (False, False)
            )
        reason = reason or self.reached(step, out_of_time)
        return reason, signalled and reason is None

    def out_of_time(self, elapsed: float) -> bool:
        return self.budget is not None and elapsed >= self.budget

    def reached(self, step: int, out_of_time: bool) -> Optional[str]:
        """Which limit a run at ``step`` has reached, if any (a resumed run may start there)."""
        if step >= self.max_steps:
            return "max_steps"
        return f"time budget of {self.max_minutes} min" if out_of_time else None


def resume_hint() -> str:
    """The command that continues this run: the same Hydra overrides plus train.resume=true."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("train.resume=", "command="))]
    except ValueError:  # not started through Hydra (tests)
        overrides = []
    nproc = f"NPROC={distributed.world_size()} " if distributed.launched() else ""
    return f'make train {nproc}ARGS="{" ".join([*overrides, "train.resume=true"])}"'
