"""What a checkpoint holds of a training run (model, optimizer, schedule, progress, random generators,
settings, vocabulary), how a run resumes from it exactly, and whether a run folder is new, to be
resumed or finished."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Optional

import torch

from app.checkpoint import check_compatible
from app.config import Config, TrainConfig
from app.errors import UserError
from app.utils import rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already trained on
    best_bleu: float = -1.0
    best_step: int = 0
    bad_evals: int = 0  # validations since the last improvement (early stopping)
    elapsed_seconds: float = 0.0  # wall clock of the training loop, validations included
    eval_seconds: float = 0.0
    tgt_tokens: int = 0
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient
    batch_tokens: int = 0  # token budget in force (halved on out-of-memory with train.oom_retry)
    epoch_batch_tokens: int = 0  # the budget the current epoch's batches were cut with
    validations: list = field(default_factory=list)  # [step, dev BLEU] of every validation
    started: str = ""  # when the run first started (ISO, local time); a resume keeps it

    def record_validation(self, bleu: float, seconds: float) -> bool:
        """Note a validation at the current step; returns whether its dev BLEU is the best so far."""
        self.validations.append([self.step, bleu])
        self.eval_seconds += seconds
        improved = bleu > self.best_bleu
        if improved:
            self.best_bleu, self.best_step, self.bad_evals = bleu, self.step, 0
        else:
            self.bad_evals += 1
        return improved


@dataclass
class TrainingState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cfg: Config
    vocab: dict  # the tokenizer's fingerprint
    device: torch.device
    progress: Progress = None

    def __post_init__(self) -> None:
        self.config = asdict(self.cfg)
        self.progress = self.progress or Progress(
            batch_tokens=self.cfg.train.batch_tokens,
            epoch_batch_tokens=self.cfg.train.batch_tokens,
            started=datetime.now().isoformat(timespec="seconds"),
        )

    def checkpoint(self, rng_ranks: Optional[list] = None) -> dict:
        """Everything a resume needs (``last.pt``, ``best.pt``); ``rng_ranks``: every rank's generators."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "progress": asdict(self.progress),
            "config": self.config,
            "vocab": self.vocab,
            "rng": rng_state(self.device),
        }
        if rng_ranks and len(rng_ranks) > 1:
            state["rng_ranks"] = rng_ranks  # each rank's dropout stream, for an exact resume under DDP
        return state

    def snapshot(self) -> dict:
        """The model alone (``step_NNNNNNN.pt``, for averaging and evaluation)."""
        return {
            "model": self.model.state_dict(),
            "config": self.config,
            "vocab": self.vocab,
            "progress": asdict(self.progress),
        }

    def restore(self, state: dict, path: str, rank: int, world: int) -> None:
        """Continue from a checkpoint of this run: its weights, optimizer, schedule, progress and random
        generators. The token budget follows train.batch_tokens if the user changed it."""
        check_compatible(state, path, self.vocab, self.cfg.model)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = p = Progress(**state["progress"])
        rng = state.get("rng_ranks") or [state["rng"]]
        if len(rng) == world:
            set_rng_state(rng[rank], self.device)
        else:  # resumed with another number of ranks: same weights and data order, fresh dropout streams
            set_rng_state(state["rng"], self.device)
            torch.manual_seed(self.cfg.train.seed + rank + 7919 * p.step)
        saved_budget = state["config"]["train"]["batch_tokens"]
        p.epoch_batch_tokens = p.epoch_batch_tokens or saved_budget  # checkpoints older than these fields
        p.batch_tokens = p.batch_tokens or saved_budget
        if saved_budget != self.cfg.train.batch_tokens:  # the user changed it: from the next batches on
            p.batch_tokens = self.cfg.train.batch_tokens
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, p.step, p.epoch, p.batch_in_epoch)


def resuming(t: TrainConfig, last_path: str) -> bool:
    return t.resume or (t.auto_resume and os.path.exists(last_path))


def finished(run_dir: str) -> bool:
    """Whether a run has ended: train_summary.json is written after the final last.pt, and a resumed
    run that saves again makes last.pt the newer one."""
    summary, last = os.path.join(run_dir, "train_summary.json"), os.path.join(run_dir, "last.pt")
    return os.path.exists(summary) and os.path.exists(last) and os.path.getmtime(summary) >= os.path.getmtime(last)


def check_settings(cfg: Config, last_path: str, world: int, resume: bool) -> None:
    """A resumed run needs its last.pt; a new one must not overwrite another run's; out-of-memory
    retries cut batches differently on each rank."""
    if world > 1 and cfg.train.oom_retry:
        raise UserError(
            "train.oom_retry=true works in a single process only: with several ranks every "
            "rank must cut the same batches; lower train.batch_tokens instead"
        )
    if resume and not os.path.exists(last_path):
        raise UserError(f"train.resume=true but {last_path} does not exist")
    if not resume and os.path.exists(last_path):
        raise UserError(
            f"{last_path} exists: continue that run with train.resume=true, "
            "or train under another name= (or delete the folder)"
        )
