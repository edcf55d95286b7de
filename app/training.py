"""The training run: set-up or exact resume, the update loop over length-bucketed epochs, validation
and checkpoints (last, best, rotated snapshots), early stopping and time budgets, a graceful stop on
SIGINT/SIGTERM, out-of-memory handling, DDP under torchrun, and a progress bar with what is left.
The math of one update is in app/step.py, validation in app/validation.py."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
from typing import Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from app import distributed
from app.alignment import read_pharaoh
from app.board import training_figures, write_hparams
from app.checkpoint import load_checkpoint, save_checkpoint, write_snapshot
from app.config import Config, TrainConfig
from app.data.batching import Batcher, make_batches, split_batch
from app.data.corpus import load_split, load_tokenized, load_tokenizer, prepare_data
from app.data.tokenizer import PAD
from app.errors import UserError
from app.flops import FlopCounter, peak_flops
from app.guided_alignment import alignment_targets
from app.interrupt import StopRequest, StopRules, TrainingInterrupted
from app.metrics_window import MetricsWindow, progress_postfix
from app.models import build_model, count_parameters
from app.train_state import Progress, TrainingState, check_settings, resuming
from app.update import compiled_for_training, make_optimizer, train_step
from app.utils import amp_dtype, atomic_write_text, resolve_device, rng_state, seed_everything
from app.validation import validate

log = logging.getLogger(__name__)


class Trainer:
    """One training run: set-up (or resume), the update loop, validation and checkpoints."""

    def __init__(self, cfg: Config):
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.last_path, self.best_path = os.path.join(self.run_dir, "last.pt"), os.path.join(self.run_dir, "best.pt")
        self.device = distributed.setup(resolve_device(cfg.device))
        self.rank, self.world, self.main = distributed.rank(), distributed.world_size(), distributed.is_main()
        self.resuming = resuming(cfg.train, self.last_path)
        check_settings(cfg, self.last_path, self.world, self.resuming)  # before any data work
        self.accum = accumulation_steps(cfg.train, self.world)
        self.dtype = amp_dtype(cfg.train.amp, self.device)
        seed_everything(cfg.train.seed)
        self.tokenizer, self.train_data, self.dev_data, self.dev_links = load_data(cfg, self.main)
        self.model = build_model(cfg.model, self.tokenizer).to(self.device)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)
        self.state = TrainingState(
            self.model, self.optimizer, self.scheduler, cfg, self.tokenizer.fingerprint(), self.device
        )
        if self.resuming:
            self.state.restore(load_checkpoint(self.last_path, self.device), self.last_path, self.rank, self.world)
        elif self.world > 1:  # same initial weights (DDP broadcasts rank 0's), different dropout per rank
            torch.manual_seed(cfg.train.seed + self.rank)
        # the module that trains: DDP all-reduces its gradients; self.model stays the plain model
        self.trained = compiled_for_training(distributed.wrap(self.model, self.device), cfg)
        self.batcher = Batcher(self.train_data.src, self.train_data.tgt)
        self.src_lens, self.tgt_lens = self.train_data.src_lens, self.train_data.tgt_lens
        self.align_targets = alignment_targets(cfg, self.tokenizer, len(self.train_data))
        peak = peak_flops(self.device)
        self.flop_counter = FlopCounter(self.model) if peak else None  # MFU in the log where the peak is known
        self.window = MetricsWindow(self.device, peak, guided=self.align_targets is not None)
        self.writer = distributed.writer(os.path.join(self.run_dir, "tb"))
        self.limits = StopRules(cfg.train, self.world, self.device)
        self.bar = progress_bar(cfg.train, self.progress.step, self.main)
        self.loop_start = time.time() - self.progress.elapsed_seconds

    @property
    def progress(self) -> Progress:
        return self.state.progress

    def save(self) -> None:
        """``last.pt`` and a model-only snapshot ``step_NNNNNNN.pt`` for averaging, rotated (train.keep_last /
        keep_best). Called on every rank (it gathers their RNG states); rank 0 alone writes."""
        rng_ranks = distributed.gather_objects(rng_state(self.device)) if self.world > 1 else None
        if not self.main:
            return
        save_checkpoint(self.last_path, self.state.checkpoint(rng_ranks))
        if self.cfg.train.keep_last > 0:
            self.snapshot()

    def snapshot(self) -> None:
        t, p = self.cfg.train, self.progress
        write_snapshot(self.run_dir, p.step, self.state.snapshot(), t.keep_last, t.keep_best, p.validations)

    # --- validation -------------------------------------------------------------------------------

    def validate(self) -> bool:
        """Validate on rank 0, keep the best checkpoint; returns on every rank whether early stopping says stop."""
        stop, t = False, self.cfg.train
        if self.main:
            metrics = validate(
                self.model, self.dev_data, self.dev_links, self.tokenizer, self.cfg, self.writer, self.progress
            )
            if metrics["improved"]:
                save_checkpoint(self.best_path, self.state.checkpoint())
            if t.keep_best > 0:
                self.snapshot()
            stop = bool(t.patience) and self.progress.bad_evals >= t.patience
        return distributed.from_main(stop, self.device)

    # --- updates ----------------------------------------------------------------------------------

    def train_update(self, group: list[list[int]]) -> None:
        """One update on a group of world × accum batches of the epoch: this rank's share, accumulated.
        Out of memory (single process, train.oom_retry): halve the budget and cut the same sentences
        into more micro-batches of the same update."""
        p = self.progress
        n_tokens = sum(self.tgt_lens[i] + 1 for indices in group for i in indices)  # +1: EOS; known on every rank
        parts = group[self.rank * self.accum : (self.rank + 1) * self.accum]
        if p.batch_tokens < p.epoch_batch_tokens:  # the budget was halved during this epoch
            parts = self.cut(parts)
        while (oom_shape := self.update(parts, n_tokens)) is not None:
            # out of memory: the failed step's tensors are gone once its exception frame is
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self.cfg.train.oom_retry or all(len(part) == 1 for part in parts):
                raise UserError(
                    f"out of {self.device.type} memory at step {p.step + 1} on a batch of {oom_shape}: "
                    f"lower train.batch_tokens (now {p.batch_tokens})"
                    + ("" if self.cfg.train.oom_retry else " or set train.oom_retry=true")
                )
            p.batch_tokens = max(p.batch_tokens // 2, 1)
            log.warning("out of memory on a batch of %s: train.batch_tokens halved to %d", oom_shape, p.batch_tokens)
            parts = self.cut(parts)

    def cut(self, parts: list[list[int]]) -> list[list[int]]:
        """The same sentences in micro-batches within the budget in force (halved after out of memory)."""
        budget = self.progress.batch_tokens
        return [piece for part in parts for piece in split_batch(part, self.src_lens, self.tgt_lens, budget)]

    def update(self, parts: list[list[int]], n_tokens: int) -> Optional[str]:
        """One optimizer update on this rank's micro-batches ``parts`` (``n_tokens`` target tokens in the
        update over all ranks). When it runs out of memory, nothing changes and the batch's shape comes back."""
        batches = [self.batcher(indices) for indices in parts]
        for batch, indices in zip(batches, parts) if self.align_targets else ():
            batch.align = self.align_targets(indices, batch.src, batch.tgt_out)
        on_device = [b.to(self.device) for b in batches]
        try:
            result = train_step(
                self.trained, on_device, n_tokens, self.optimizer, self.scheduler, self.cfg, self.dtype, self.world
            )
        except torch.OutOfMemoryError:
            big = max(batches, key=lambda b: b.src.numel() + b.tgt_in.numel())
            return f"{big.src.size(0)} sentences, source {tuple(big.src.shape)}, target {tuple(big.tgt_in.shape)}"
        p, t = self.progress, self.cfg.train
        p.step += 1
        p.tgt_tokens += n_tokens
        local_tokens = sum(int((b.tgt_out != PAD).sum()) for b in batches)
        flops = self.flop_counter.of_batches(parts, self.src_lens, self.tgt_lens) if self.flop_counter else 0.0
        self.window.add(result, local_tokens, n_tokens, flops)
        self.bar.update(1)
        if p.step % t.log_every == 0 or (t.max_bad_steps and p.step % t.max_bad_steps == 0):
            self.log_window(write_scalars=p.step % t.log_every == 0)
        return None

    def log_window(self, write_scalars: bool) -> None:
        """Skipped updates and the abort check, then (at log_every) the window's scalars and postfix."""
        p = self.progress
        report_skips(self.window, p, self.writer, self.cfg.train.max_bad_steps)
        if write_scalars:
            figures = self.window.log(self.writer, p.step, lr=self.scheduler.get_last_lr()[0])
            self.bar.set_postfix(progress_postfix(figures, self.limits.time_left(time.time() - self.loop_start)))

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, p = self.cfg, self.progress
        if self.main:
            record_start(self)
        stop_reason = self.limits.reached(p.step, self.limits.out_of_time(p.elapsed_seconds))  # resumed: maybe done
        last_eval_step, batches = -1, []
        self.model.train()
        self.window.reset()
        crossed = lambda every, before: every > 0 and p.step // every > before // every  # noqa: E731
        group = self.world * self.accum  # batches per update: each rank takes accum of them
        with StopRequest() as stop:
            while stop_reason is None:
                batches = epoch_batches(self.src_lens, self.tgt_lens, p, cfg.train.seed, self.world, self.accum)
                # every rank walks the same global batches; a last group smaller than one update is left out
                for start in range(p.batch_in_epoch, len(batches) - group + 1, group):
                    before = p.step
                    self.train_update(batches[start : start + group])
                    p.batch_in_epoch = start + group
                    if crossed(cfg.train.eval_every, before):
                        last_eval_step = p.step
                        if self.validate():
                            stop_reason = f"early stopping (no dev BLEU gain in {cfg.train.patience} validations)"
                    if crossed(cfg.train.save_every, before):
                        self.save()
                    p.elapsed_seconds = time.time() - self.loop_start
                    stop_reason, signalled = self.limits.check(p.step, p.elapsed_seconds, stop.requested, stop_reason)
                    if signalled:
                        self.interrupt(stop.signum or signal.SIGTERM)
                    if stop_reason:
                        break
                else:
                    p.epoch, p.batch_in_epoch, p.epoch_batch_tokens = p.epoch + 1, 0, p.batch_tokens
            self.bar.close()
            self.log_window(write_scalars=False)  # skipped updates of the last, partial window
            if last_eval_step != p.step:
                self.validate()
            p.elapsed_seconds = time.time() - self.loop_start
            self.save()
        if self.main and not os.path.exists(self.best_path):
            save_checkpoint(self.best_path, self.state.checkpoint())
        return self.finish(stop_reason, len(batches))

    def interrupt(self, signum: int) -> None:
        self.save()
        self.bar.close()
        self.writer.close()
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name}: stopped after step {self.progress.step} and saved "
            f"{self.last_path}; continue with: {resume_hint()}",
            signum,
        )

    def finish(self, stop_reason: str, epoch_batches: int) -> dict:
        summary = run_summary(self, stop_reason, epoch_batches)
        if self.main:
            write_hparams(self.writer, self.cfg, training_figures(summary), summary["steps"])
            atomic_write_text(os.path.join(self.run_dir, "train_summary.json"), json.dumps(summary, indent=2))
            log.info("training stopped: %s. %s", stop_reason, json.dumps(summary))
        self.writer.close()
        return summary


def report_skips(window: MetricsWindow, p: Progress, writer, max_bad_steps: int) -> None:
    """Count and report the updates skipped for a non-finite loss or gradient; abort after
    ``train.max_bad_steps`` of them in a row."""
    skipped, worst = window.read_skips()
    if skipped:
        p.skipped_steps += skipped
        writer.add_scalar("train/skipped_steps", p.skipped_steps, p.step)
        tqdm.write(
            f"step {p.step}: skipped {skipped} update(s) with a non-finite loss or gradient ({p.skipped_steps} in all)"
        )
    if max_bad_steps and worst >= max_bad_steps:
        raise UserError(
            f"training aborted at step {p.step}: {worst} updates in a row had a non-finite loss or "
            f"gradient (train.max_bad_steps={max_bad_steps}); lower train.lr or raise "
            "train.warmup_steps, and check the data"
        )


def record_start(trainer: Trainer) -> None:
    """``config.yaml`` in the run folder, and what trains on what in the log."""
    cfg, p = trainer.cfg, trainer.progress
    atomic_write_text(os.path.join(trainer.run_dir, "config.yaml"), OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    size = f"{count_parameters(trainer.model) / 1e6:.1f} M parameters"
    data = f"{len(trainer.train_data)} train / {len(trainer.dev_data)} dev pairs"
    log.info("model: %s, %s; device %s, %s; %s", cfg.model.arch, size, trainer.device, trainer.dtype or "fp32", data)
    log.info("each update: %s", update_size(cfg.train, trainer.world, trainer.accum, p.batch_tokens))


def progress_bar(t: TrainConfig, step: int, main: bool) -> tqdm:
    """Steps done and to do; with a time budget the step-count ETA is meaningless (time_left in the
    postfix says it instead), so the bar then has no total."""
    total = None if t.max_minutes else t.max_steps
    return tqdm(total=total, initial=step, desc="training", unit="step", dynamic_ncols=True, disable=not main)


def epoch_batches(src_lens: list[int], tgt_lens: list[int], p: Progress, seed: int, world: int, accum: int) -> list:
    """The current epoch's batches, cut with the budget in force when it started and shuffled by (seed,
    epoch) alone, so a resumed run cuts the same ones."""
    batches = make_batches(src_lens, tgt_lens, p.epoch_batch_tokens, shuffle=True, seed=seed, epoch=p.epoch)
    if len(batches) < world * accum:
        raise UserError(
            f"the train split makes {len(batches)} batches of train.batch_tokens={p.epoch_batch_tokens}, fewer "
            f"than one update takes ({world} ranks × {accum} accumulated): lower train.batch_tokens"
        )
    return batches


def run_summary(trainer: Trainer, stop_reason: str, epoch_batches: int) -> dict:
    """``train_summary.json``: how far training went, how fast, and on what."""
    p, device = trainer.progress, trainer.device
    summary = {
        "stopped": stop_reason,
        "started": p.started,
        "steps": p.step,
        "epochs": round(p.epoch + p.batch_in_epoch / max(epoch_batches, 1), 3),
        "train_minutes": round(p.elapsed_seconds / 60, 2),
        "validation_minutes": round(p.eval_seconds / 60, 2),
        "tgt_tokens_per_s": round(p.tgt_tokens / max(p.elapsed_seconds - p.eval_seconds, 1e-9)),
        "best_dev_bleu": p.best_bleu,
        "best_step": p.best_step,
        "skipped_steps": p.skipped_steps,
        "batch_tokens": p.batch_tokens,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tgt_tokens_per_update": round(p.tgt_tokens / max(p.step, 1)),
    }
    if device.type == "cuda":
        summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    summary.update(parameters=count_parameters(trainer.model), amp=str(trainer.dtype or "fp32"))
    summary.update(ranks=trainer.world, accum_steps=trainer.accum)
    return summary


def load_data(cfg: Config, main: bool) -> tuple:
    """The tokenizer, the train split (memory-mapped), the dev sentences validation reads and their
    reference links (None if the corpus has none). Rank 0 prepares data, tokenizer and Arrow caches;
    the other ranks wait, then read them."""
    if main:
        prepare_data(cfg)
    distributed.barrier()
    tokenizer = load_tokenizer(cfg.data.dir, cfg.tokenizer)
    dev = load_split(cfg.data.dir, "dev", tokenizer).head(cfg.train.max_dev_sentences)
    links_path = os.path.join(cfg.data.dir, "dev.align")
    dev_links = read_pharaoh(links_path)[: len(dev)] if os.path.exists(links_path) else None
    return tokenizer, load_tokenized(cfg.data.dir, "train", tokenizer), dev, dev_links


def update_size(t: TrainConfig, world: int, accum: int, batch_tokens: int) -> str:
    return (
        f"{world} rank(s) × {accum} micro-batch(es) of up to {batch_tokens} tokens = "
        f"{world * accum * batch_tokens} padded tokens"
        + (f" (train.tokens_per_update={t.tokens_per_update})" if t.tokens_per_update else "")
    )


def resume_hint() -> str:
    """The command that continues this run: the same Hydra overrides plus train.resume=true."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("train.resume=", "command="))]
    except ValueError:  # not started through Hydra (tests)
        overrides = []
    nproc = f"NPROC={distributed.world_size()} " if distributed.launched() else ""
    return f'make train {nproc}ARGS="{" ".join([*overrides, "train.resume=true"])}"'


def accumulation_steps(t: TrainConfig, world: int) -> int:
    """Micro-batches per rank and update: train.accum_steps, or what train.tokens_per_update asks for
    with this many ranks (so the tokens per update stay the same when the number of GPUs changes)."""
    if t.tokens_per_update <= 0:
        if t.accum_steps < 1:
            raise UserError(f"train.accum_steps={t.accum_steps} must be at least 1")
        return t.accum_steps
    accum = max(1, round(t.tokens_per_update / (t.batch_tokens * world)))
    if accum * t.batch_tokens * world != t.tokens_per_update:
        log.warning(
            "train.tokens_per_update=%d is not a multiple of %d ranks × train.batch_tokens=%d: using %d "
            "accumulation steps (%d tokens per update)",
            t.tokens_per_update,
            world,
            t.batch_tokens,
            accum,
            accum * world * t.batch_tokens,
        )
    return accum


def train(cfg: Config) -> dict:
    stopped, summary = None, {}
    try:
        summary = Trainer(cfg).run()
    except TrainingInterrupted as err:  # every rank stops at the same step
        stopped = err.with_traceback(None)  # its frames hold the DDP model, which must go before the group
    gc.collect()
    distributed.teardown()
    if stopped:
        raise stopped
    return summary
