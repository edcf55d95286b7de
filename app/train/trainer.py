"""The training run: ``build_trainer`` assembles its parts (device, data, model, optimizer, batch schedule) and a
``Trainer`` runs them: set-up or exact resume, ``for update in schedule: train on it``, validation and checkpoints
(last, best, rotated snapshots), early stopping and a wall-clock budget that includes the closing validation, a stop
on SIGINT/SIGTERM, out-of-memory handling, DDP under torchrun, and a progress bar.

The math of one update is in app/train/update.py (on CUDA replayed from a graph: app/train/capture.py), the batch order
in app/data/schedule.py, what a checkpoint holds in app/train/state.py, validation in app/train/validation.py, where the
learning rate's decay ends in app/train/decay_end.py. The loop's own host work is kept off the device's way: the next
update's batches are padded and copied in a background thread (app/data/prefetch.py), its counts come from the host's
lengths, and the numbers stay on the device between log lines."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
from typing import Optional

import torch
from tqdm import tqdm

from app.config.schema import Config
from app.data.batching import Batcher
from app.data.prefetch import Prefetcher
from app.data.schedule import BatchSchedule, Update, accumulation_steps, training_schedule
from app.models import Family, build_model, count_parameters
from app.models.flops import FlopCounter, peak_flops
from app.report.board import training_results, write_hparams
from app.report.history import history_entry, write_history
from app.run import distributed
from app.run.checkpoint import CheckpointWriter, host_copy, save_checkpoint, write_snapshot
from app.run.device import amp_dtype, resolve_device, rng_state, seed_everything
from app.run.errors import TrainingInterrupted, UserError
from app.run.files import atomic_write_text
from app.train.capture import CapturedUpdates, capture_in_force
from app.train.closing_average import average_at_end, kept_snapshots, reserve_seconds
from app.train.decay_end import DecayEnd
from app.train.ema import ExponentialAverage
from app.train.init_from import starting_point
from app.train.master_weights import MasterWeights
from app.train.metrics_window import MetricsWindow, progress_postfix, report_skips
from app.train.resumed_step import start_loop
from app.train.state import Progress, TrainingState, check_settings, resuming
from app.train.stop_rules import StopNow, StopRequest, StopRules, abortable, early_stopping, stopped
from app.train.summary import (
    CompileWatch,
    LoopClock,
    RunEstimate,
    bar_safe_logging,
    first_estimate,
    progress_bar,
    record_start,
    run_summary,
)
from app.train.training_data import Prepared, TrainingData, load_data
from app.train.update import compiled_for_training, cut_on_plateau, make_optimizer, train_step
from app.train.validation import validate, validation_worker

log = logging.getLogger(__name__)


class Trainer:
    """One training run over the parts ``build_trainer`` made: set-up (or resume), the update loop,
    validation and checkpoints."""

    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        data: TrainingData,
        model: Family,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        schedule: BatchSchedule,
        resume: bool = False,
        quiet: bool = False,
        capture: bool = False,
    ):
        self.cfg, self.run_dir, self.device, self.data = cfg, cfg.run_dir, device, data
        self.model, self.optimizer, self.scheduler, self.schedule = model, optimizer, scheduler, schedule
        self.last_path, self.best_path = os.path.join(self.run_dir, "last.pt"), os.path.join(self.run_dir, "best.pt")
        self.rank, self.world, self.main = distributed.rank(), distributed.world_size(), distributed.is_main()
        self.dtype = amp_dtype(cfg.train.amp, device)
        vocab = data.tokenizer.fingerprint()
        self.ema = ExponentialAverage(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.state = TrainingState(model, optimizer, scheduler, schedule, cfg, vocab, device, self.ema, self.elapsed)
        if resume:
            self.state.restore(self.last_path, self.rank, self.world)
        elif self.world > 1:  # same initial weights (DDP broadcasts rank 0's), different dropout per rank
            torch.manual_seed(cfg.train.seed + self.rank)
        # what trains: under bf16 a copy on bf16 weights (train.master_weights), under DDP wrapped; self.model: fp32
        self.master = MasterWeights(model, self.dtype if cfg.train.master_weights else None)
        self.trained = compiled_for_training(distributed.wrap(self.master.compute, device), cfg)
        self.captured = CapturedUpdates(optimizer, device) if capture else None  # after restore: its lr on the device
        self.train_step = self.captured or train_step  # or the update replayed from a CUDA graph per batch shape
        self.compiles = CompileWatch(cfg.train.compile)
        self.batcher = Batcher(data.train.src, data.train.tgt)
        self.pin_memory = True  # batches go to a GPU through pinned memory (false: make bench's ablation)
        self.src_lens, self.tgt_lens = data.train.lengths(0)  # what make bench cuts its fixed batches by
        self.flop_counter = FlopCounter(model) if (peak := peak_flops(device)) else None  # MFU where a peak is known
        guided, paused = data.align_targets is not None, lambda: self.progress.eval_seconds  # validations: not timed
        self.window = MetricsWindow(device, peak, guided, cfg.train.coverage_weight > 0, paused)
        self.writer = distributed.writer(os.path.join(self.run_dir, "tb"))
        self.limits = StopRules(cfg.train, self.world, device)
        self.bar = progress_bar(cfg.train, self.progress.step, self.main and not quiet)  # quiet: make bench
        self.loop_start = time.time() - self.progress.elapsed_seconds
        self.postfix: dict = {}  # what the bar shows after the step count
        self.train_loss: Optional[float] = None  # of the last logged window, for the validation history
        self.postfix_at = 0.0  # when its time_left was last set
        self.estimate, self.saved_step = RunEstimate(self.progress.step), self.progress.step  # last.pt's step
        self.decay_end = DecayEnd(self)  # where a decaying learning rate ends: with the run
        self.parameters = count_parameters(model)
        self.keep_last, self.keep_best = kept_snapshots(cfg.train)
        self.average: Optional[dict] = None  # what the closing average kept (train.average_snapshots)

    @property
    def progress(self) -> Progress:
        return self.state.progress

    def elapsed(self) -> float:
        return time.time() - self.loop_start

    def save(self, snapshot: bool = True) -> None:
        """``last.pt`` and (``snapshot``) a model-only snapshot ``step_NNNNNNN.pt`` for averaging, rotated
        (train.keep_last / keep_best), written in the background. Called on every rank (it gathers their RNG
        states); rank 0 alone writes."""
        rng_ranks = distributed.gather_objects(rng_state(self.device)) if self.world > 1 else None
        self.saved_step = self.progress.step
        if not self.main:
            return
        self.checkpoints.submit(save_checkpoint, self.last_path, host_copy(self.state.checkpoint(rng_ranks)))
        if snapshot and self.keep_last > 0:
            self.snapshot()

    def snapshot(self) -> None:
        p = self.progress
        payload, validations = host_copy(self.state.snapshot()), [list(v) for v in p.validations]
        keep = self.keep_last, self.keep_best
        self.checkpoints.submit(write_snapshot, self.run_dir, p.step, payload, *keep, validations)

    def validate(self, closing: bool = False) -> bool:
        """Validate on rank 0, keep the best checkpoint; returns on every rank whether early stopping says stop."""
        stop, t = False, self.cfg.train
        if self.main:
            d, model = self.data, self.state.served_model
            metrics = validate(model, d.dev, d.dev_links, d.tokenizer, self.cfg, self.writer, self.progress, closing)
            p, lr = self.progress, float(self.scheduler.get_last_lr()[0])
            p.history.append(history_entry(p.step, self.elapsed() / 60, p.tgt_tokens, lr, self.train_loss, metrics))
            write_history(self.run_dir, p.history)
            if metrics["improved"]:  # the weights users evaluate, without the optimizer's state (last.pt has it)
                self.checkpoints.submit(save_checkpoint, self.best_path, host_copy(self.state.snapshot()))
            if self.keep_best > 0:
                self.snapshot()
            stop = bool(t.patience) and self.progress.bad_evals >= t.patience
        cut_on_plateau(self.scheduler, t, self.progress.bad_evals, self.progress.step, self.device, self.main)
        self.decay_end.follow_budget(closing)
        return distributed.from_main(stop, self.device)

    # --- updates ----------------------------------------------------------------------------------

    def prepare(self, update: Update, parts: Optional[list[list[int]]] = None) -> Prepared:
        """The update's batches on the host and on the device, and its counts (in the prefetch thread)."""
        parts = update.parts if parts is None else parts
        batches = [self.batcher(self.data.train.rows_of(update.epoch, indices)) for indices in parts]
        if (align := self.data.align_targets) is not None:
            for batch, indices in zip(batches, parts):
                batch.align = align(indices, batch.src, batch.targets[1])
        src_lens, tgt_lens = self.data.train.lengths(update.epoch)
        local_tokens = int(sum(tgt_lens[indices].sum() + len(indices) for indices in parts))  # + EOS each
        flops = self.flop_counter.of_batches(parts, src_lens, tgt_lens) if self.flop_counter else 0.0
        on_device = [b.to(self.device, pin=self.pin_memory) for b in batches]
        return Prepared(update, parts, batches, on_device, local_tokens, flops)

    def train_update(self, ready: Prepared) -> None:
        """One update on this rank's share of ``ready.update``, accumulated over its micro-batches. Out of
        memory (single process, train.oom_retry): halve the budget and cut the same sentences into more
        micro-batches of the same update."""
        p, update = self.progress, ready.update
        parts = self.schedule.parts_in_force(update)
        if parts is not update.parts:  # cut again after an out-of-memory halving: prefetched with the old budget
            ready = self.prepare(update, parts)
        while (oom_shape := self.optimize(ready)) is not None:
            # out of memory: the failed step's tensors are gone once its exception frame is
            self.master.compute.zero_grad(set_to_none=True)
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self.cfg.train.oom_retry or all(len(part) == 1 for part in ready.parts):
                raise UserError(
                    f"out of {self.device.type} memory at step {p.step + 1} on a batch of {oom_shape}: "
                    f"lower train.batch_tokens (now {self.schedule.batch_tokens})"
                    + ("" if self.cfg.train.oom_retry else " or set train.oom_retry=true")
                )
            halved = self.schedule.halve()
            log.warning("out of memory on a batch of %s: train.batch_tokens halved to %d", oom_shape, halved)
            ready = self.prepare(update, self.schedule.cut(ready.parts, update.epoch))
        self.schedule.advance(update)

    def optimize(self, ready: Prepared) -> Optional[str]:
        """One optimizer update on the prepared micro-batches. When it runs out of memory, nothing changes
        and the batch's shape comes back."""
        n_tokens, step = ready.update.tgt_tokens, self.progress.step
        try:  # a signal cuts the step short where nothing is unsaved (it would lose nothing), until it counts
            with self.compiles.watch(step + 1), abortable(step == self.saved_step):
                parts = (self.optimizer, self.scheduler, self.cfg, self.dtype, self.world, self.master)
                result = self.train_step(self.trained, ready.on_device, n_tokens, *parts)
        except torch.OutOfMemoryError:
            big = max(ready.batches, key=lambda b: b.src.numel() + b.targets[0].numel())
            return f"{big.src.size(0)} sentences, source {tuple(big.src.shape)}, target {tuple(big.targets[0].shape)}"
        p, t = self.progress, self.cfg.train
        p.step += 1
        if self.ema is not None:
            self.ema.update(p.step)
        p.tgt_tokens += n_tokens
        self.window.add(result, ready.local_tokens, n_tokens, ready.flops)
        self.bar.update(1)
        if p.step % t.log_every == 0 or (t.max_bad_steps and p.step % t.max_bad_steps == 0):
            self.log_window(write_scalars=p.step % t.log_every == 0)
        return None

    def log_window(self, write_scalars: bool) -> None:
        """Skipped updates and the abort check, then (at log_every) the window's scalars and postfix."""
        p = self.progress
        report_skips(self.window, p, self.writer, self.cfg.train.max_bad_steps)
        if write_scalars:
            values = self.window.log(self.writer, p.step, lr=float(self.scheduler.get_last_lr()[0]))
            self.train_loss = values["loss"]
            self.postfix = progress_postfix(values, self.time_left())
            self.bar.set_postfix(self.postfix, refresh=False)

    def time_left(self) -> Optional[float]:
        """Of the time budget, what training has left before the closing validation must start."""
        left = self.limits.time_left(self.elapsed())
        return None if left is None else left - self.closing_reserve()

    def closing_reserve(self) -> float:
        """Seconds kept for the closing validation, as long as the last one took (none measured yet: 0), and for
        the closing average."""
        seconds = self.progress.last_validation_seconds if self.cfg.train.eval_every > 0 else 0.0
        return seconds + reserve_seconds(self.cfg.train, self.parameters, seconds)

    # --- the loop ---------------------------------------------------------------------------------

    def run(self, max_steps: Optional[int] = None, clock: Optional[LoopClock] = None) -> dict:
        """Train until a stop rule (``max_steps``: a step limit in place of train.max_steps); ``clock`` (make
        bench) times the loop's steps. The console's log lines go above the progress bar meanwhile; SIGINT and
        SIGTERM stop it (app/train/stop_rules.py)."""
        p = self.progress
        if max_steps is not None:
            self.limits.max_steps = max_steps
        self.model.train()
        self.window.reset()
        self.saved_step = p.step  # last.pt holds it (a resumed run), or there is nothing to save yet
        self.last_eval_step = p.validations[-1][0] if p.validations else -1  # the same on every rank
        self.checkpoints = CheckpointWriter()  # every checkpoint of this run is written through it
        updates: Optional[Prefetcher[Update, Prepared]] = None
        with bar_safe_logging(), StopRequest(can_abort=self.world == 1) as stop:
            try:
                if self.main:
                    record_start(self)
                stop_reason = start_loop(self)  # a resumed run's owed validation and snapshot; it may be done
                updates = Prefetcher(iter(self.schedule), self.prepare) if stop_reason is None else None
                stop_reason = self.loop(updates if updates is not None else iter(()), stop, stop_reason, clock)
                self.close_run()
            except StopNow as now:  # in a validation (its frames let go of first: its progress bar closes)
                self.interrupt(now.with_traceback(None).signum)
            finally:
                if isinstance(updates, Prefetcher):
                    updates.close()
                self.bar.close()  # now, not at exit after the error message
                self.checkpoints.close()  # every checkpoint on disk before the run returns or raises
            assert stop_reason is not None  # the loop ends on a stop rule
            summary = self.finish(stop_reason)
            if stop.signum is not None:  # a signal during the last saves: the run is complete
                self.interrupt(stop.signum)
        return summary

    def loop(self, updates, stop: StopRequest, stop_reason: Optional[str], clock: Optional[LoopClock]) -> Optional[str]:
        """The updates until a stop rule says why training stops; a signal stops it after the step it came in."""
        cfg, p = self.cfg, self.progress
        crossed = lambda every, before: every > 0 and p.step // every > before // every  # noqa: E731
        for ready in updates:
            before = p.step
            self.train_update(ready)
            if clock is not None:
                clock.tick(p.step)
            if crossed(cfg.train.eval_every, before):
                self.last_eval_step = p.step
                if self.validate():
                    stop_reason = early_stopping(cfg.train)
            if crossed(cfg.train.save_every, before):
                self.save()
            p.elapsed_seconds = self.elapsed()
            self.after_step()
            budget_used = p.elapsed_seconds + self.closing_reserve()
            epochs = self.schedule.epochs_finished()
            stop_reason, signalled = self.limits.check(p.step, epochs, budget_used, stop.requested, stop_reason)
            if signalled:
                self.interrupt(stop.signum or signal.SIGTERM)
            if stop_reason:
                break
        return stop_reason

    def close_run(self) -> None:
        """After the last step: the closing validation (unless that step was validated), the last checkpoint, the
        closing average, and best.pt where no validation wrote one."""
        cfg, p = self.cfg, self.progress
        self.bar.close()
        self.log_window(write_scalars=False)  # skipped updates of the last, partial window
        if cfg.train.eval_every > 0 and self.last_eval_step != p.step:
            self.validate(closing=True)
        p.elapsed_seconds = self.elapsed()
        self.save()
        self.average = average_at_end(self)
        p.elapsed_seconds = self.elapsed()
        self.checkpoints.wait()
        if self.main and not os.path.exists(self.best_path):
            if cfg.train.eval_every <= 0:
                log.info("train.eval_every=0: no validation, best.pt holds the last weights (step %d)", p.step)
            save_checkpoint(self.best_path, host_copy(self.state.snapshot()))

    def after_step(self) -> None:
        """Once a second at most: the time left on the bar; once, early on: how long the whole run will take."""
        now = time.time()
        if self.main and now - self.postfix_at >= 1.0 and (left := self.time_left()) is not None:
            self.postfix["time_left"] = tqdm.format_interval(max(left, 0))
            self.bar.set_postfix(self.postfix, refresh=False)
            self.postfix_at = now
        seconds_per_step = self.estimate.tick(self.progress.step)
        if self.main and seconds_per_step is not None:
            first_estimate(self, seconds_per_step)

    def interrupt(self, signum: int) -> None:
        """Stop on a signal, with ``last.pt`` (no snapshot) where a step was done since the last save."""
        step = self.progress.step
        if saved := step > self.saved_step:
            self.save(snapshot=False)
        self.checkpoints.wait()
        self.bar.close()
        self.writer.close()
        raise TrainingInterrupted(stopped(signum, self.last_path, step, saved), signum)

    def finish(self, stop_reason: str) -> dict:
        summary = run_summary(self, stop_reason)
        if self.compiles.enabled:
            log.info("torch.compile: %s", self.compiles.describe())
        if self.main:
            write_hparams(self.writer, self.cfg, training_results(summary), summary["steps"])
            atomic_write_text(os.path.join(self.run_dir, "train_summary.json"), json.dumps(summary, indent=2))
            log.info("training stopped: %s. %s", stop_reason, json.dumps(summary))
        self.writer.close()
        return summary


def build_trainer(cfg: Config, model: Optional[Family] = None, quiet: bool = False) -> Trainer:
    """A Trainer with every part built from ``cfg`` (``model``: a model to train instead of
    ``build_model(cfg.model, ...)``, e.g. one a test made faulty), resumed when the run is to be; ``quiet``:
    without its progress bar (make bench prints its own table)."""
    device = distributed.setup(resolve_device(cfg.device))
    world, rank = distributed.world_size(), distributed.rank()
    last_path = os.path.join(cfg.run_dir, "last.pt")
    resume = resuming(cfg.train, last_path)
    start = starting_point(cfg, resume)  # train.init_from: its tokenizer (which a resume compares), then its weights
    check_settings(cfg, last_path, world, resume)  # before any data work
    accum = accumulation_steps(cfg.train, world)
    seed_everything(cfg.train.seed)
    if distributed.is_main() and cfg.train.eval_every > 0:
        validation_worker(cfg)  # it starts up while the data loads
    data = load_data(cfg, distributed.is_main())
    model = (model if model is not None else build_model(cfg.model, data.tokenizer)).to(device)
    started = start.load_weights(model, data.tokenizer.fingerprint(), cfg) if start and not resume else None
    optimizer, scheduler = make_optimizer(model, cfg)
    train, cuda = data.train, device.type == "cuda"
    capture = capture_in_force(cfg, device, model)  # app/train/capture.py: fixed batch shapes, replayed graphs
    schedule = training_schedule(cfg.train, *train.lengths(0), world, rank, accum, cuda, train.lengths, capture)
    trainer = Trainer(cfg, device, data, model, optimizer, scheduler, schedule, resume, quiet, capture)
    trainer.progress.init_from = trainer.progress.init_from or started
    return trainer


def train(cfg: Config, model: Optional[Family] = None) -> dict:
    """Train a run: build its parts, then ``Trainer.run``. A signal before its update loop (preparing the data,
    building the model) stops it at once: nothing of it to save yet."""
    stopped_by, summary = None, {}
    try:
        with StopRequest(deferred=False):
            summary = build_trainer(cfg, model).run()
    except StopNow as now:
        stopped_by = TrainingInterrupted(stopped(now.signum, os.path.join(cfg.run_dir, "last.pt")), now.signum)
    except TrainingInterrupted as err:  # every rank stops at the same step
        stopped_by = err.with_traceback(None)  # its frames hold the DDP model, which must go before the group
    gc.collect()
    distributed.teardown()
    if stopped_by:
        raise stopped_by
    return summary
