"""When training stops: at its limits (train.max_steps, the time budget train.max_minutes), or on SIGINT /
SIGTERM, which stop training at the end of the current step, with a checkpoint that a resume continues from.

The first signal during the update loop only sets a flag, so no step is cut in half and no checkpoint is torn;
the loop looks at it after each step. Where the loop is not in a step but in work that can be cut without
harm (a validation, the closing one included, or the first estimate's timing of one: ``abortable``), the
signal stops that work at once (StopNow) instead of waiting for its end. Before the loop (data preparation,
the model's build) and after it, a signal stops at once too. A second SIGINT (Ctrl-C twice) stops at once,
as Python normally does. ``resume_hint`` is the command that continues a stopped run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Optional

import torch

from app.config.schema import TrainConfig
from app.run import distributed
from app.train.state import BEST_METRICS


class StopNow(BaseException):
    """A signal that stops training where it stands: outside a step. Not an Exception, so that no ``except
    Exception`` on its way takes it for an error (as KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_active: list[StopRequest] = []  # the requests in force, innermost last


class StopRequest:
    """Context manager: while active, SIGINT/SIGTERM are training's to handle instead of ending the process.
    ``deferred`` (the update loop): the first signal sets ``signum``, and raises StopNow only inside
    ``abortable``; else (before and after the loop) it raises StopNow at once. ``can_abort``: whether work may be
    cut at all (not under DDP, where the ranks must stop at the same point: there the loop's check decides)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, deferred: bool = True, can_abort: bool = True):
        self.deferred, self.can_abort = deferred, can_abort
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._cutting = 0  # depth of abortable blocks

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: the user wants out now
        self.signum = self.signum or signum
        if not self.deferred or self._cutting:
            raise StopNow(self.signum)

    @contextlib.contextmanager
    def abortable(self):
        """A block a signal stops at once (StopNow), also one that came before it."""
        if not self.deferred or not self.can_abort:
            yield
            return
        self._cutting += 1
        try:
            if self.signum is not None:
                raise StopNow(self.signum)
            yield
        finally:
            self._cutting -= 1

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._previous:
            _active.remove(self)
        self._previous = {}


def abortable(when: bool = True) -> contextlib.AbstractContextManager:
    """Work a signal may cut short (``StopRequest.abortable`` of the request in force; nothing without one, nor
    where not ``when``)."""
    if when and _active and threading.current_thread() is threading.main_thread():
        return _active[-1].abortable()
    return contextlib.nullcontext()


def stopped(signum: int, last_path: str, step: Optional[int] = None, saved: bool = False) -> str:
    """What a run that a signal stopped says: where it stopped (``step``; None: before the update loop), what
    holds it, and how to go on."""
    name = signal.Signals(signum).name
    if saved:
        return f"{name}: stopped after step {step} and saved {last_path}; continue with: {resume_hint()}"
    if os.path.exists(last_path):
        where = f"after step {step}, which {last_path} holds" if step is not None else f"before {last_path} went on"
        return f"{name}: stopped {where}; continue with: {resume_hint()}"
    return f"{name}: stopped before its first step: nothing to save"


class StopRules:
    """The limits of a run. Under DDP the ranks must agree on stopping, so they compare their flags
    (a collective: a host sync) every ``CHECK_EVERY`` steps rather than after every one."""

    CHECK_EVERY = 10

    def __init__(self, t: TrainConfig, world: int, device: torch.device):
        self.max_steps, self.max_minutes, self.world, self.device = t.max_steps, t.max_minutes, world, device
        self.max_epochs = t.max_epochs
        self.budget = t.max_minutes * 60 if t.max_minutes else None

    def time_left(self, elapsed: float) -> Optional[float]:
        return None if self.budget is None else self.budget - elapsed

    def check(
        self, step: int, epochs: int, elapsed: float, signalled: bool, reason: Optional[str]
    ) -> tuple[Optional[str], bool]:
        """After a step (``epochs``: those finished, the same on every rank): why training stops now (``reason``,
        an early stop, if already set; None: go on), and whether a signal asks it to save and leave instead."""
        out_of_time = self.out_of_time(elapsed)
        if self.world > 1:
            agree = step % self.CHECK_EVERY == 0 or step >= self.max_steps
            out_of_time, signalled = (
                distributed.any_rank([out_of_time, signalled], self.device) if agree else (False, False)
            )
        reason = reason or self.reached(step, epochs, out_of_time)
        return reason, signalled and reason is None

    def out_of_time(self, elapsed: float) -> bool:
        return self.budget is not None and elapsed >= self.budget

    def reached(self, step: int, epochs: int, out_of_time: bool) -> Optional[str]:
        """Which limit a run at ``step``, ``epochs`` finished, has reached, if any (a resumed run may start there)."""
        if step >= self.max_steps:
            return "max_steps"
        if self.max_epochs and epochs >= self.max_epochs:
            return f"max_epochs ({self.max_epochs})"
        return f"time budget of {self.max_minutes} min" if out_of_time else None


def early_stopping(t: TrainConfig) -> str:
    """Why a run that early stopping ends stops."""
    return f"early stopping (no dev {BEST_METRICS[t.best_metric]} gain in {t.patience} validations)"


def resume_hint() -> str:
    """The command that continues this run: the same Hydra overrides plus train.resume=true."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("train.resume=", "command="))]
    except ValueError:  # not started through Hydra (tests)
        overrides = []
    nproc = f"NPROC={distributed.world_size()} " if distributed.launched() else ""
    return f'make train {nproc}ARGS="{" ".join([*overrides, "train.resume=true"])}"'
