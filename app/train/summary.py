"""What a training run says about itself: its settings and sizes at the start, its progress bar,
``train_summary.json``, the size of an update, how long the run will take at the speed its first steps show,
and what torch.compile built."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from typing import Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from app.config.schema import Config, TrainConfig
from app.models import count_parameters
from app.run.console import announce
from app.run.files import atomic_write_text
from app.train.freeze import frozen_note, frozen_parameters
from app.train.stop_rules import abortable
from app.train.update import DECAYS, LearningRate
from app.train.validation import sampled_seconds

log = logging.getLogger(__name__)

# A run that would take longer than this on a CPU is told about experiment=quick
LONG_CPU_RUN_HOURS = 2.0


def run_summary(trainer, stop_reason: str) -> dict:
    """``train_summary.json`` of an app.train.trainer.Trainer: how far training went, how fast, and on what."""
    p, device, s = trainer.progress, trainer.device, trainer.schedule
    training_seconds = max(p.elapsed_seconds - p.eval_seconds, 1e-9)
    summary = {
        "stopped": stop_reason,
        "started": p.started,
        "steps": p.step,
        "epochs": round(s.epochs_done(), 3),
        "train_minutes": round(p.elapsed_seconds / 60, 2),
        "validation_minutes": round(p.eval_seconds / 60, 2),
        "validations": len(p.validations),
        "tgt_tokens_per_s": round(p.tgt_tokens / training_seconds),
        "best_dev_bleu": p.best_bleu,
        "best_step": p.best_step if p.validations else p.step,  # no validation: best.pt holds the last weights
        "best_metric": trainer.cfg.train.best_metric,  # what chose best_step
        "skipped_steps": p.skipped_steps,
        "batch_tokens": s.batch_tokens,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tgt_tokens_per_update": round(p.tgt_tokens / max(p.step, 1)),
    }
    if device.type == "cuda":
        summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    summary.update(parameters=count_parameters(trainer.model), amp=str(trainer.dtype or "fp32"))
    if trainer.cfg.train.freeze:
        summary["frozen"] = {"parts": list(trainer.cfg.train.freeze), "parameters": frozen_parameters(trainer.model)}
    summary.update(ranks=s.world, accum_steps=s.accum)
    if p.init_from:
        summary["init_from"] = p.init_from
    if trainer.cfg.train.subword_alpha:
        summary["subword_sampling"] = trainer.data.train.stats()
    if trainer.average:  # the closing average (app/train/closing_average.py): best_dev_bleu is best.pt's
        kept = trainer.average["dev_bleu"] if trainer.average["kept"] == "average" else p.best_bleu
        summary.update(average=trainer.average, best_dev_bleu=kept)
    if trainer.compiles.enabled:
        summary.update(compile_graphs=trainer.compiles.graphs, compile_seconds=round(trainer.compiles.seconds, 1))
    if trainer.captured is not None:
        summary["capture"] = trainer.captured.describe()
        trainer.captured.log_summary()
    t = trainer.cfg.train
    if stop_reason.startswith("time budget") and p.step < t.warmup_steps:
        summary["warning"] = (
            f"the time budget (train.max_minutes={t.max_minutes:g}) ended at step {p.step}, before the warm-up "
            f"(train.warmup_steps={t.warmup_steps}): too few updates to train this model"
        )
        if trainer.main:
            log.warning(summary["warning"])
    return summary


def update_size(t: TrainConfig, world: int, accum: int, batch_tokens: int) -> str:
    return (
        f"{world} rank(s) × {accum} micro-batch(es) of up to {batch_tokens} tokens = "
        f"{world * accum * batch_tokens} padded tokens"
        + (f" (train.tokens_per_update={t.tokens_per_update})" if t.tokens_per_update else "")
    )


class RunEstimate:
    """Seconds per step over the first ``steps`` steps of this run after its first (which warms up and
    compiles), measured once."""

    def __init__(self, start_step: int, steps: int = 10):
        self.first, self.last = start_step + 1, start_step + 1 + steps
        self.start: Optional[float] = None
        self.done = False

    def tick(self, step: int) -> Optional[float]:
        """After each step; the seconds per step once, when they are measured."""
        if self.done:
            return None
        if step == self.first:
            self.start = time.perf_counter()
        elif step >= self.last and self.start is not None:
            self.done = True
            return (time.perf_counter() - self.start) / (step - self.first)
        return None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def duration_hint(
    cfg: Config,
    device: torch.device,
    model,
    step: int,
    seconds_per_step: float,
    seconds_left: Optional[float] = None,
    epoch_end: Optional[int] = None,
) -> str:
    """What the budget means at the measured speed (``seconds_left``: of the time budget, what training has
    before the closing validation must start; ``epoch_end``: about the step train.max_epochs ends at); on a CPU, a
    run that would take hours is pointed at ``experiment=quick``."""
    t = cfg.train
    limit, named = t.max_steps, f"train.max_steps={t.max_steps}"
    if epoch_end is not None and epoch_end < limit:
        limit, named = epoch_end, f"train.max_epochs={t.max_epochs} (near step {epoch_end})"
    steps_left = max(limit - step, 0)
    by_steps = steps_left * seconds_per_step
    left = t.max_minutes * 60 if seconds_left is None else max(seconds_left, 0.0)
    line = f"at {seconds_per_step:.3g} s/step, the {steps_left} steps left of {named}"
    if t.max_minutes and left < by_steps:
        end = reach(step, seconds_per_step, left)
        line += f" would take {_duration(by_steps)}: train.max_minutes={t.max_minutes:g} stops near step {end}"
        expected = t.max_minutes * 60
    else:
        line += f" take about {_duration(by_steps)}"
        expected = by_steps
    if device.type == "cpu" and expected > LONG_CPU_RUN_HOURS * 3600:
        size = f"{count_parameters(model) / 1e6:.1f} M parameters"
        line += (
            f". This model ({size}) is sized for a GPU: on a CPU, "
            '`make train ARGS="experiment=quick"` trains a small Transformer that learns visibly in minutes'
        )
    return line


def reach(step: int, seconds_per_step: float, seconds_left: float) -> int:
    """The step a run at ``step`` reaches in ``seconds_left`` at the measured speed."""
    return step + int(max(seconds_left, 0.0) / seconds_per_step)


def short_budget(
    t: TrainConfig, step: int, seconds_per_step: float, seconds_left: float, reserve: float, elapsed: float
) -> Optional[str]:
    """Where the time budget ends before the learning-rate warm-up (train.warmup_steps) does, the warning to
    give at once, with the budget that trains as many steps after the warm-up as in it."""
    end = reach(step, seconds_per_step, seconds_left)
    if not t.max_minutes or end >= t.warmup_steps or end >= t.max_steps:
        return None
    target = min(2 * t.warmup_steps, t.max_steps)
    minutes = math.ceil((elapsed + (target - step) * seconds_per_step + reserve) / 60)
    return (
        f"train.max_minutes={t.max_minutes:g} ends near step {end} at {seconds_per_step:.3g} s/step, before the "
        f"learning-rate warm-up ends at step {t.warmup_steps} (train.warmup_steps): too few updates for this model "
        f"to learn anything (expect a BLEU near 0). train.max_minutes={minutes} reaches step {target} at this "
        f"speed; or lower train.warmup_steps, or train on a GPU"
    )


def decay_beyond_budget(t: TrainConfig, end: int) -> Optional[str]:
    """Where train.lr_schedule decays to an end and the time budget ends the run well before train.max_steps (near
    step ``end``) with no validation to estimate that end again (train.eval_every=0: app/train/decay_end.py), the
    warning to give at once: the learning rate would still be high where the run stops."""
    if t.lr_schedule not in DECAYS or end >= 0.9 * t.max_steps or t.eval_every > 0:
        return None
    return (
        f"train.lr_schedule={t.lr_schedule} decays over train.max_steps={t.max_steps}, but train.max_minutes="
        f"{t.max_minutes:g} ends near step {end}, and without validations (train.eval_every=0) the decay cannot follow "
        f"it: the learning rate would still be {LearningRate(t)(end):.0%} of train.lr there; train.max_steps={end} "
        "decays within it"
    )


def first_estimate(trainer, seconds_per_step: float) -> None:
    """Once an app.train.trainer.Trainer has timed its first steps (on rank 0). On a time budget with validations,
    where none has run yet, the closing validation's time is measured on a sample of dev first
    (app/train/validation.py ``sampled_seconds``), so that the budget keeps it; then what the budget means at the
    measured speed on the console, and a warning where it ends before the warm-up does, or well before a decaying
    schedule ends."""
    cfg, p = trainer.cfg, trainer.progress
    t = cfg.train
    if t.max_minutes and t.eval_every > 0 and not p.last_validation_seconds:
        start, d = time.perf_counter(), trainer.data
        with abortable():  # a signal stops it at once, as it does a validation
            p.last_validation_seconds = sampled_seconds(trainer.state.served_model, d.dev, cfg, d.dev_links is not None)
        p.eval_seconds += time.perf_counter() - start
        log.info(
            "closing validation: about %.0f s, sampled on dev; the time budget keeps it", p.last_validation_seconds
        )
    left, epoch_end = trainer.time_left(), trainer.schedule.step_of_epochs(p.step, t.max_epochs)
    announce(duration_hint(cfg, trainer.device, trainer.model, p.step, seconds_per_step, left, epoch_end), log)
    if left is not None:
        warning = short_budget(t, p.step, seconds_per_step, left, trainer.closing_reserve(), trainer.elapsed())
        if warning:
            log.warning(warning)
        if decay := decay_beyond_budget(t, reach(p.step, seconds_per_step, left)):
            log.warning(decay)


class CompileWatch:
    """How many graphs torch.compile built during training, and the seconds of the steps that built them."""

    def __init__(self, enabled: bool):
        self.enabled, self.graphs, self.seconds = enabled, 0, 0.0
        self.steps: list[int] = []  # the steps that built graphs

    def watch(self, step: int) -> contextlib.AbstractContextManager:
        return self._watch(step) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _watch(self, step: int):
        before, start = torch._dynamo.utils.counters["stats"]["unique_graphs"], time.perf_counter()
        yield
        built = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        if built:
            self.graphs += built
            self.seconds += time.perf_counter() - start
            self.steps.append(step)

    def describe(self) -> str:
        steps = ", ".join(map(str, self.steps[:10])) + (" ..." if len(self.steps) > 10 else "")
        return f"built {self.graphs} graph(s) in {self.seconds:.1f} s (at step {steps or '-'})"


class LoopClock:
    """Wall time of the training loop from the end of step ``start`` to the end of step ``stop`` (make bench
    times the real loop with it), the device synchronized at both ends: the figure a user's run gets."""

    def __init__(self, start: int, stop: int, device: torch.device):
        self.start, self.stop, self.device = start, stop, device
        self.began: Optional[float] = None
        self.seconds: Optional[float] = None

    def tick(self, step: int) -> None:
        if step in (self.start, self.stop) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if step == self.start:
            self.began = time.perf_counter()
        elif step == self.stop and self.began is not None:
            self.seconds = time.perf_counter() - self.began


def record_start(trainer) -> None:
    """``config.yaml`` in an app.train.trainer.Trainer's run folder, and what trains on what in the log."""
    cfg = trainer.cfg
    atomic_write_text(os.path.join(trainer.run_dir, "config.yaml"), OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    size = f"{count_parameters(trainer.model) / 1e6:.1f} M parameters"
    if frozen := frozen_note(trainer.model, cfg.train.freeze):
        size += f" ({frozen})"
    data = f"{len(trainer.data.train)} train / {len(trainer.data.dev)} dev pairs"
    if cfg.train.subword_alpha:
        data += f" ({trainer.data.train.describe()}, train.subword_alpha={cfg.train.subword_alpha:g})"
    log.info("model: %s, %s; device %s, %s; %s", cfg.model.arch, size, trainer.device, trainer.dtype or "fp32", data)
    s = trainer.schedule
    log.info("each update: %s", update_size(cfg.train, s.world, s.accum, s.batch_tokens))


@contextlib.contextmanager
def bar_safe_logging():
    """While training's progress bar runs: the console's log lines written through ``tqdm.write``, each on a line
    of its own above the bar instead of glued to the bar's line; the log file's handler as it is. Nothing changes
    where no handler logs to the console (tests, a library's caller)."""
    console = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]
    if not any(h.stream in (sys.stdout, sys.stderr) for h in console):
        yield
        return
    with logging_redirect_tqdm():
        yield


def progress_bar(t: TrainConfig, step: int, main: bool) -> tqdm:
    """Steps done and to do; with a time budget the step-count ETA is meaningless (time_left in the
    postfix says it instead), so the bar then has no total."""
    total = None if t.max_minutes else t.max_steps
    return tqdm(total=total, initial=step, desc="training", unit="step", dynamic_ncols=True, disable=not main)
