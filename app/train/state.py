"""What a checkpoint holds of a training run (model, optimizer, learning-rate schedule, batch schedule,
progress, random generators, settings, vocabulary), how a run resumes from it exactly, and whether a run
folder is new, to be resumed or finished.

A checkpoint's ``model`` is always the model users get, what eval, translate, export and make average read:
with ``train.ema_decay`` on, the moving average of the weights (app/train/ema.py); the trained weights it follows
are then ``trained_model``, what a resume continues from.

A checkpoint is read on the CPU whatever the device training runs on: the model and optimizer states go
to their device through ``load_state_dict``, and the random generators' states never leave the host."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any, Optional

import torch

from app.config.load import check_compatible
from app.config.ranges import check_layer
from app.config.schema import Config, TrainConfig, target_language
from app.data.schedule import BatchSchedule
from app.evaluation.metrics import bleu_tokenizer
from app.run.checkpoint import UnloadableCheckpoint, load_checkpoint, snapshot_name, snapshot_steps
from app.run.device import rng_state, set_rng_state
from app.run.errors import UserError
from app.train.capture import learning_rate_on_host
from app.train.ema import ExponentialAverage

log = logging.getLogger(__name__)


BEST_METRICS = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss"}  # train.best_metric's, as logs name them


def ranking_score(metrics: dict, best_metric: str) -> float:
    """What validations are ranked by (train.best_metric), higher better: dev BLEU, chrF, or the loss negated."""
    return -metrics["loss"] if best_metric == "loss" else metrics[best_metric]


def metric_value(score: float, best_metric: str) -> float:
    """The dev score itself of a ``ranking_score`` (or of a difference of two: for the loss, how much lower)."""
    return -score if best_metric == "loss" else score


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    best_score: float = -math.inf  # the best validation's ranking_score
    best_bleu: float = -1.0  # the best validation's dev BLEU
    best_step: int = 0
    bad_evals: int = 0  # validations since the last improvement (early stopping)
    elapsed_seconds: float = 0.0  # wall clock of the training loop, validations included
    eval_seconds: float = 0.0
    last_validation_seconds: float = 0.0  # what the closing validation is expected to take (time budgets)
    tgt_tokens: int = 0
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient
    validations: list = field(default_factory=list)  # [step, ranking_score] of every validation
    history: list = field(default_factory=list)  # a dict per validation: validations.jsonl (app/report/history.py)
    started: str = ""  # when the run first started (ISO, local time); a resume keeps it
    init_from: Optional[dict] = None  # the checkpoint a fine-tuning run started from (app/train/init_from.py)

    def record_validation(self, score: float, bleu: float, seconds: float) -> bool:
        """Note a validation at the current step (its ``ranking_score`` and dev BLEU); returns whether it is the best
        so far."""
        self.validations.append([self.step, score])
        self.eval_seconds += seconds
        self.last_validation_seconds = seconds
        improved = score > self.best_score
        if improved:
            self.best_score, self.best_bleu, self.best_step, self.bad_evals = score, bleu, self.step, 0
        else:
            self.bad_evals += 1
        return improved


def progress_from(saved: dict) -> Progress:
    """A checkpoint's progress; one from before train.best_metric ranked its validations by dev BLEU."""
    if "best_score" not in saved and saved.get("best_bleu", -1.0) >= 0:
        saved = {**saved, "best_score": saved["best_bleu"]}
    known = {f.name for f in fields(Progress)}
    return Progress(**{k: v for k, v in saved.items() if k in known})


@dataclass
class TrainingState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    schedule: BatchSchedule
    cfg: Config
    vocab: dict  # the tokenizer's fingerprint
    device: torch.device
    ema: Optional[ExponentialAverage] = None  # train.ema_decay
    clock: Optional[Callable[[], float]] = None  # the training loop's seconds so far: what a checkpoint records
    progress: Progress = field(default_factory=lambda: Progress(started=datetime.now().isoformat(timespec="seconds")))

    def __post_init__(self) -> None:
        self.config = asdict(self.cfg)

    @property
    def served_model(self) -> torch.nn.Module:
        """The weights validation scores and checkpoints hand out: the moving average where there is one."""
        return self.model if self.ema is None else self.ema.model

    def checkpoint(self, rng_ranks: Optional[list] = None) -> dict:
        """Everything a resume needs (``last.pt``); ``rng_ranks``: every rank's generators."""
        state: dict[str, Any] = {
            "model": self.served_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "schedule": self.schedule.state_dict(),
            "progress": asdict(self.progress) | self.written_at(),
            "config": self.config,
            "vocab": self.vocab,
            "rng": rng_state(self.device),
        }
        if self.ema is not None:
            state["trained_model"] = self.model.state_dict()
        if rng_ranks and len(rng_ranks) > 1:
            state["rng_ranks"] = rng_ranks  # each rank's dropout stream, for an exact resume under DDP
        return state

    def written_at(self) -> dict:
        """The loop's seconds as the checkpoint is made, its step's and that step's validation's included (the
        progress's own ``elapsed_seconds`` is set after both): where a resumed run's time budget goes on from."""
        return {} if self.clock is None else {"elapsed_seconds": self.clock()}

    def snapshot(self) -> dict:
        """A checkpoint without the optimizer's state (AdamW's two moment estimates per parameter) nor, with a
        moving average, the trained weights beside it: ``best.pt`` and ``step_NNNNNNN.pt``, the weights users get
        for evaluation and averaging (a quarter of ``last.pt``'s size with a moving average), and what a resume
        falls back on when ``last.pt`` is damaged."""
        state = self.checkpoint()
        del state["optimizer"]
        state.pop("trained_model", None)
        return state

    def restore(self, last_path: str, rank: int, world: int) -> None:
        """Continue from ``last_path`` (or, where it is damaged, from the run's newest intact checkpoint that
        can continue it: ``resume_state``): its weights, optimizer, schedules, progress and random
        generators. The token budget follows train.batch_tokens if the user changed it."""
        state, path = resume_state(last_path)  # on the CPU: see the module's docstring
        check_compatible(state, path, self.vocab, self.cfg.model)
        # a snapshot holds only the weights users get (the moving average, where there is one): training goes
        # on from them, and AdamW's moments start again from zero
        self.model.load_state_dict(state.get("trained_model", state["model"]))
        if self.ema is not None:  # a run without one before: the average starts from the trained weights
            self.ema.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            learning_rate_on_host(self.optimizer)  # a captured run's device scalar (app/train/capture.py)
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = p = progress_from(state["progress"])
        saved_budget = state["config"]["train"]["batch_tokens"]
        schedule = state.get("schedule") or legacy_schedule(state["progress"], self.cfg.train.seed)
        self.schedule.load_state_dict(schedule, self.cfg.train.batch_tokens, saved_budget)
        rng = state.get("rng_ranks") or [state["rng"]]
        if len(rng) == world:
            set_rng_state(rng[rank], self.device)
        else:  # resumed with another number of ranks: same weights and data order, fresh dropout streams
            set_rng_state(state["rng"], self.device)
            torch.manual_seed(self.cfg.train.seed + rank + 7919 * p.step)
        s = self.schedule
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, p.step, s.epoch, s.position)


def resume_state(last_path: str) -> tuple[dict, str]:
    """``last.pt`` and its path; where it does not load, the newest intact checkpoint of the run that can
    continue it (``best.pt`` or a snapshot, which lack only the optimizer's state), said so in the log.
    Where none can, a UserError says why not, checkpoint by checkpoint."""
    try:
        return load_checkpoint(last_path), last_path
    except UnloadableCheckpoint as err:
        damaged = str(err)
    run_dir, why_not = os.path.dirname(last_path), []
    names = ["best", *(snapshot_name(step) for step in reversed(snapshot_steps(run_dir)))]
    candidates = []
    for name in names:
        path = os.path.join(run_dir, f"{name}.pt")
        if not os.path.exists(path):
            continue
        try:
            state = load_checkpoint(path, mmap=True)
        except UserError as err:
            why_not.append(str(err))
            continue
        if "schedule" not in state:
            why_not.append(f"{path}: holds no data position (a snapshot written before they did)")
        else:
            candidates.append((state["progress"]["step"], "optimizer" in state, path))
    if not candidates:
        reasons = "; ".join(why_not) or f"{run_dir} has no best.pt and no snapshot step_*.pt (train.keep_last=0)"
        raise UserError(f"{damaged}; no other checkpoint can continue the run: {reasons}")
    step, full, path = max(candidates)  # the newest; at a tie, the full checkpoint
    lost = (
        ""
        if full
        else (
            "; AdamW's moment estimates start again from zero and training goes on from its weights "
            "(best.pt and the snapshots hold no optimizer state, nor with train.ema_decay the trained weights "
            "beside the average)"
        )
    )
    log.warning("%s; continuing from %s, the newest intact checkpoint (step %d)%s", damaged, path, step, lost)
    return load_checkpoint(path), path


def legacy_schedule(progress: dict, seed: int) -> dict:
    """The batch schedule of a checkpoint written before it had its own entry (it was part of the progress)."""
    return {
        "seed": seed,
        "epoch": progress.get("epoch", 0),
        "position": progress.get("batch_in_epoch", 0),
        "batch_tokens": progress.get("batch_tokens", 0),
        "epoch_batch_tokens": progress.get("epoch_batch_tokens", 0),
    }


def resuming(t: TrainConfig, last_path: str) -> bool:
    return t.resume or (t.auto_resume and os.path.exists(last_path))


def finished(run_dir: str) -> bool:
    """Whether a run has ended: train_summary.json is written after the final last.pt, and a resumed
    run that saves again makes last.pt the newer one."""
    summary, last = os.path.join(run_dir, "train_summary.json"), os.path.join(run_dir, "last.pt")
    return os.path.exists(summary) and os.path.exists(last) and os.path.getmtime(summary) >= os.path.getmtime(last)


def check_settings(cfg: Config, last_path: str, world: int, resume: bool) -> None:
    """A resumed run needs its last.pt; a new one must not overwrite another run's; out-of-memory
    retries cut batches differently on each rank; validation's BLEU tokenizer must be at hand (sacrebleu's extras
    for ja-mecab and ko-mecab), said before any data work, not at the first validation."""
    bleu_tokenizer(cfg.eval.bleu_tokenize, target_language(cfg.data))
    check_layer(cfg.viz.layer, cfg.model)  # validation's figures, not minutes from now
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
    if resume:
        check_resumable_settings(cfg, last_path)


# settings that change how the corpus is made, not what it is: data.num_proc (tokenizing processes), tokenizer.dir
# (where the SentencePiece model is read from: the resume compares the vocabulary itself, check_compatible)
NOT_THE_CORPUS = ("data.num_proc", "tokenizer.dir")


# what a resume restores from last.pt's optimizer and scheduler states, not from the command line (a plateau's
# train.lr_decay and lr_patience are read at each validation: a resume may change them)
OPTIMIZER_SETTINGS = ("lr", "lr_schedule", "warmup_steps", "lr_floor", "weight_decay", "adam_betas")


def normal(value: Any) -> Any:
    """A setting as recorded and as given compared alike: a list of numbers as a tuple of floats."""
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_resumable_settings(cfg: Config, last_path: str) -> None:
    """A resumed run reads the corpus and tokenizer it was trained on: data.* and tokenizer.* as its last.pt
    records them, else a UserError naming what differs, before any data work (preparing data/<name> again with
    other settings would rewrite the folder every run of that corpus reads, and the resume would then fail on its
    vocabulary); a train.init_from given must be the one it started from, and train.best_metric the one its
    validations were ranked by. A last.pt that does not load is left to
    the resume to say so."""
    try:
        recorded = load_checkpoint(last_path, mmap=True)["config"]
    except (UserError, KeyError):
        return
    ours = asdict(cfg)
    differ = [
        f"{section}.{key}={theirs!r} there, {ours[section].get(key)!r} here"
        for section in ("data", "tokenizer")
        for key, theirs in sorted(recorded.get(section, {}).items())
        if key in ours[section] and ours[section][key] != theirs and f"{section}.{key}" not in NOT_THE_CORPUS
    ]
    if differ:
        raise UserError(
            f"{last_path}: trained on other data settings: {'; '.join(differ)}; resume with that run's, or train "
            "under another name="
        )
    metric = recorded.get("train", {}).get("best_metric", "bleu")
    if cfg.train.best_metric != metric:  # the validations so far are ranked by it
        raise UserError(
            f"{last_path}: train.best_metric={cfg.train.best_metric} here, {metric} there: its validations are ranked "
            f"by {metric}; resume with it, or train under another name="
        )
    optimized = [  # AdamW's param_groups and the schedule's state come back from last.pt, whatever is given now
        f"train.{key}={ours['train'][key]!r} here, {theirs!r} there"
        for key, theirs in sorted(recorded.get("train", {}).items())
        if key in OPTIMIZER_SETTINGS and key in ours["train"] and normal(ours["train"][key]) != normal(theirs)
    ]
    if optimized:
        raise UserError(
            f"{last_path}: {'; '.join(optimized)}: a resumed run goes on with the optimizer and learning-rate schedule "
            "it saved; resume with that run's, or go on from this run under another name= with train.init_from=<this "
            "run> (a fresh optimizer and schedule)"
        )
    frozen = recorded.get("train", {}).get("freeze", [])
    if sorted(cfg.train.freeze) != sorted(frozen):  # AdamW's saved state is of the parameters that trained
        given = lambda parts: f"[{','.join(parts)}]"  # noqa: E731
        raise UserError(
            f"{last_path}: train.freeze={given(cfg.train.freeze)} here, {given(frozen)} there: AdamW's state is of the "
            "parameters that trained; resume with it, or go on from this run under another name= with "
            "train.init_from=<this run> and the parts you want frozen"
        )
    started = recorded.get("train", {}).get("init_from")
    if cfg.train.init_from and cfg.train.init_from != started:  # it would be recorded, and not be what was done
        raise UserError(
            f"{last_path}: train.init_from={cfg.train.init_from!r} here, {started!r} there: a resumed run goes on from "
            "its last.pt; leave train.init_from out, or fine-tune under another name="
        )
