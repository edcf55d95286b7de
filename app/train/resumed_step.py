"""Where a run starts its update loop: for a resumed run, the work its last.pt's step still owes, and whether a
stop rule already holds there.

A signal can come between a step and its validation, or during that validation (which it stops at once); a kill
can come between the background writes of last.pt and the step's snapshot. last.pt then holds step N without
the validation or the snapshot that train.eval_every / train.save_every give N. The resumed run does them first,
as the uninterrupted run did after step N, so that both go on alike (the same validations, plateau cuts,
snapshots and closing average). And a run that stopped (early stopping, the time budget with its closing
reserve) but was cut off in its closing work stops again at once, instead of training on."""

from __future__ import annotations

import logging
import os
from typing import Optional

from app.run import distributed
from app.run.checkpoint import snapshot_name
from app.train.stop_rules import early_stopping

log = logging.getLogger(__name__)


def due(every: int, step: int) -> bool:
    """Whether ``train.eval_every`` or ``train.save_every`` (``every``; 0: never) falls on ``step``."""
    return every > 0 and step > 0 and step % every == 0


def start_loop(trainer) -> Optional[str]:
    """Before an app.train.trainer.Trainer's first update: what its last step owes (a resumed run), then why the run
    stops before any update, if it does (None: it trains)."""
    t, p = trainer.cfg.train, trainer.progress
    stop_reason = None
    validated = due(t.eval_every, p.step) and trainer.last_eval_step != p.step
    if validated:
        log.info("step %d: its validation did not run before the run stopped; it runs now", p.step)
        trainer.last_eval_step = p.step
        if trainer.validate():
            stop_reason = early_stopping(t)
    saved_here = due(t.save_every, p.step)
    path = os.path.join(trainer.run_dir, f"{snapshot_name(p.step)}.pt")
    unwritten = saved_here and trainer.keep_last > 0 and not os.path.exists(path)
    unwritten = distributed.from_main(unwritten, trainer.device)  # rank 0's disk
    if validated or unwritten:  # last.pt then holds the validation, as the uninterrupted run's did
        trainer.save(snapshot=saved_here)
    if stop_reason is None and p.step > 0 and t.patience and p.bad_evals >= t.patience:
        stop_reason = early_stopping(t)  # it stopped early and was cut off in its closing work
    resumed = p.step > 0  # a resumed run keeps time for its closing work, as after each step
    used = trainer.elapsed() + (trainer.closing_reserve() if resumed else 0.0)
    epochs = trainer.schedule.epochs_finished()
    return stop_reason or trainer.limits.reached(p.step, epochs, trainer.limits.out_of_time(used))
