"""Where a decaying learning rate (train.lr_schedule=cosine or linear) ends: at train.max_steps, or where another
limit ends the run before it. train.max_epochs' step is known from the batch schedule at the start; the time
budget's (train.max_minutes) is estimated at each validation from the speed since the one before (validations'
own seconds counted in), on rank 0, and broadcast, so that every rank decays alike. Without it a 7-minute run of
12,000 updates under the default train.max_steps=100000 would stop with the rate at 97 % of its peak."""

from __future__ import annotations

import logging
from typing import Optional

from app.run import distributed
from app.train.update import DECAYS, LearningRate

log = logging.getLogger(__name__)


def budget_end(step: int, seconds_per_step: float, seconds_left: float, validation_seconds: float, every: int) -> int:
    """The step a run at ``step`` reaches in ``seconds_left``, at ``seconds_per_step`` and a validation of
    ``validation_seconds`` every ``every`` steps."""
    per_step = seconds_per_step + (validation_seconds / every if every > 0 else 0.0)
    return step + int(max(seconds_left, 0.0) / max(per_step, 1e-9))


class DecayEnd:
    """A Trainer's learning-rate schedule kept ending with the run (the scheduler's ``LearningRate``)."""

    def __init__(self, trainer) -> None:
        self.trainer, t = trainer, trainer.cfg.train
        rate = trainer.scheduler.lr_lambdas[0]
        self.rate: Optional[LearningRate] = rate if isinstance(rate, LearningRate) and t.lr_schedule in DECAYS else None
        if self.rate is not None:  # this run's settings (a resumed run keeps only its estimate of the budget's end)
            self.rate.max_steps = t.max_steps
            if self.rate.max_epochs != t.max_epochs or not t.max_epochs:  # a resume to the same epochs keeps its end:
                # the one the run has decayed towards (counted again, later epochs would be cut with a budget halved
                # since, another number); each epoch's own updates are counted (BatchSchedule.step_of_epochs)
                self.rate.epochs_end = trainer.schedule.step_of_epochs(trainer.progress.step, t.max_epochs) or 0
                self.rate.max_epochs = t.max_epochs
        self.mark = self.trained_seconds(), trainer.progress.step  # the speed is measured from here

    def trained_seconds(self) -> float:
        """The loop's seconds so far, its validations' left out."""
        return self.trainer.elapsed() - self.trainer.progress.eval_seconds

    def follow_budget(self, closing: bool = False) -> None:
        """At a validation (every rank, after it): the time budget's end estimated again, where it comes before
        train.max_steps; not at the closing validation, after the last update."""
        trainer, t = self.trainer, self.trainer.cfg.train
        if self.rate is None or not t.max_minutes or closing:
            return
        p, end = trainer.progress, 0
        (seconds, step), now = self.mark, self.trained_seconds()
        left = trainer.time_left()
        if trainer.main and left is not None and p.step > step:
            end = budget_end(p.step, (now - seconds) / (p.step - step), left, p.last_validation_seconds, t.eval_every)
        self.mark = now, p.step
        end = distributed.int_from_main(end, trainer.device)
        if 0 < end < t.max_steps:
            if not self.rate.budget_end:
                log.info(
                    "train.lr_schedule=%s decays to where train.max_minutes=%g ends: near step %d, estimated again at "
                    "each validation",
                    t.lr_schedule,
                    t.max_minutes,
                    end,
                )
            self.rate.budget_end = end
