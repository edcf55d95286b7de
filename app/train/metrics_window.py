"""The training values between two log lines. They stay on the device, so that no update waits for
the host; the window is read once per ``train.log_every`` updates, the one host sync between
validations."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Optional

import torch
from tqdm import tqdm

from app.run import distributed
from app.run.console import announce
from app.run.errors import UserError
from app.train.update import StepResult

log = logging.getLogger(__name__)


class MetricsWindow:
    """``paused``: the seconds training has spent not training so far (validations: the run's eval_seconds), which
    the window's speed and MFU leave out, as train_summary.json's do; a window that holds a validation would
    otherwise read slower than the updates ran."""

    def __init__(
        self,
        device: torch.device,
        peak_flops: Optional[float] = None,
        guided: bool = False,
        covering: bool = False,
        paused: Callable[[], float] = lambda: 0.0,
    ):
        self.device, self.peak_flops, self.guided, self.covering = device, peak_flops, guided, covering
        self.paused = paused
        self.bad_run = self._zero(torch.long)  # consecutive skipped updates: a run may span windows
        self.grad_norm = self._zero(torch.float32)  # the last update's, copied: a replayed graph rewrites its own
        self.reset()

    def _zero(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((), dtype=dtype, device=self.device)

    def reset(self) -> None:
        self.start, self.update_tokens, self.updates, self.flops = time.time(), 0, 0, 0.0
        self.paused_before = self.paused()
        self.loss_sum, self.loss_tokens = self._zero(torch.float32), self._zero(torch.long)
        self.nll_sum = self._zero(torch.float32)
        self.skipped, self.align_loss = self._zero(torch.long), self._zero(torch.float32)
        self.coverage_sum = self._zero(torch.float32)
        self.worst_bad_run = self.bad_run.clone()

    def add(self, step: StepResult, local_tokens: int, update_tokens: int, flops: float = 0.0) -> None:
        """One update: its summed loss over this rank's ``local_tokens`` target tokens, counted only
        when finite; ``update_tokens`` target tokens over all ranks; its useful FLOPs (for MFU)."""
        finite = step.finite
        self.update_tokens += update_tokens
        self.updates += 1
        self.flops += flops
        self.loss_sum += torch.where(finite, step.loss_sum, 0.0)
        self.nll_sum += torch.where(finite, step.nll_sum, 0.0)
        self.loss_tokens += finite * local_tokens
        self.align_loss += torch.where(finite, step.align_loss, 0.0)
        if step.coverage_loss is not None:
            self.coverage_sum += torch.where(finite, step.coverage_loss, 0.0)
        self.bad_run = (self.bad_run + 1) * ~finite
        self.worst_bad_run = torch.maximum(self.worst_bad_run, self.bad_run)
        self.skipped += ~finite
        self.grad_norm.copy_(step.grad_norm)

    def read_skips(self) -> tuple[int, int]:
        """Updates skipped since the last read, and the longest run of skips in this window."""
        skipped, worst = int(self.skipped), int(self.worst_bad_run)
        self.skipped.zero_()
        return skipped, worst

    def summary(self) -> dict:
        """The window's scalars: loss (over all ranks; label-smoothed where trained so), the loss without smoothing and
        its perplexity, gradient norm, target tokens per second and per update, guided alignment's and the coverage
        loss when trained on, and MFU where the device's peak is known."""
        sums = [self.loss_sum, self.nll_sum, self.loss_tokens, self.coverage_sum]
        loss_sum, nll_sum, tokens, coverage_sum = distributed.sum_all(torch.stack([t.double() for t in sums])).tolist()
        loss, nll = (loss_sum / tokens, nll_sum / tokens) if tokens else (float("nan"), float("nan"))
        elapsed = max(time.time() - self.start - (self.paused() - self.paused_before), 1e-9)
        values = {
            "loss": loss,  # the objective: label-smoothed where train.label_smoothing is on
            "nll_loss": nll,  # the cross-entropy alone, as dev/loss is: its exp is the perplexity (fairseq's too)
            "ppl": math.exp(min(nll, 50)),
            "grad_norm": float(self.grad_norm),
            "tgt_tokens_per_s": self.update_tokens / elapsed,
            "tgt_tokens_per_update": self.update_tokens / max(self.updates, 1),
        }
        if self.guided:  # the mean guided alignment loss of this rank's updates (skipped ones count 0)
            values["align_loss"] = float(self.align_loss) / max(self.updates, 1)
        if self.covering:  # the coverage loss per target piece, as the loss is
            values["coverage_loss"] = coverage_sum / tokens if tokens else float("nan")
        if self.peak_flops:
            values["mfu"] = self.flops / elapsed / self.peak_flops  # this rank's share on its own device
        return values

    def log(self, writer, step: int, **extra: float) -> dict:
        """The window's scalars and ``extra`` ones (the learning rate) to TensorBoard under train/;
        then a new window starts. Returns what was logged."""
        values = {**self.summary(), **extra}
        for key, value in values.items():
            writer.add_scalar(f"train/{key}", value, step)
        self.reset()
        return values


def progress_postfix(values: dict, time_left: Optional[float]) -> dict:
    """What the progress bar shows after the step count: loss, learning rate, speed, MFU (CUDA), and
    the time left under a time budget (where the step-count ETA means little)."""
    postfix = dict(loss=f"{values['loss']:.3f}", lr=f"{values['lr']:.2e}", tok_s=f"{values['tgt_tokens_per_s']:,.0f}")
    if "mfu" in values:
        postfix["mfu"] = f"{100 * values['mfu']:.1f}%"
    if time_left is not None:
        postfix["time_left"] = tqdm.format_interval(max(time_left, 0))
    return postfix


def report_skips(window: MetricsWindow, progress, writer, max_bad_steps: int) -> None:
    """Count the updates skipped for a non-finite loss or gradient into ``progress`` and report them; abort
    after ``train.max_bad_steps`` of them in a row."""
    skipped, worst = window.read_skips()
    p = progress
    if skipped:
        p.skipped_steps += skipped
        writer.add_scalar("train/skipped_steps", p.skipped_steps, p.step)
        announce(
            f"step {p.step}: skipped {skipped} update(s) with a non-finite loss or gradient ({p.skipped_steps} in all)",
            log,
            logging.WARNING,
        )
    if max_bad_steps and worst >= max_bad_steps:
        raise UserError(
            f"training aborted at step {p.step}: {worst} updates in a row had a non-finite loss or "
            f"gradient (train.max_bad_steps={max_bad_steps}); lower train.lr or raise "
            "train.warmup_steps, and check the data"
        )
