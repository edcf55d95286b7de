"""``make bench``'s training rows, timed through the Trainer itself (app/train/trainer.py), so that the bench
figure is the figure a user's ``make train`` gets:

- ``step``: the Trainer's own update with its data path (the batches padded from the Arrow cache and copied
  to the device, then the update and its bookkeeping), called back to back, nothing prepared ahead;
- ``loop``: ``Trainer.run``, the whole loop as ``make train`` runs it (the prefetch thread, the metrics
  window, the progress bar, logging, stop checks), with validation and checkpoints left out.

``loop_vs_step`` (loop steps/s over step steps/s) is how much of its step's speed the loop keeps;
``ema_update_ms`` what the moving average of the weights (train.ema_decay, app/train/ema.py) adds to each step, timed
alone whether the run has it on or not (``ema_vs_step``: its share of the step).
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Callable

import numpy as np
import torch

from app.config.schema import Config
from app.data.batching import batch_shape, padded_tokens
from app.data.schedule import BatchSchedule, Update
from app.models.flops import peak_flops, training_flops
from app.run.errors import required
from app.train.ema import ExponentialAverage
from app.train.summary import LoopClock
from app.train.trainer import Trainer, build_trainer


def bench_run_config(cfg: Config) -> Config:
    """The settings of the timed run: a scratch run folder, no validation, no checkpoints, no budget."""
    run = copy.deepcopy(cfg)
    run.run_dir = os.path.join("checkpoints", "bench", f"{cfg.name}_run")
    t = run.train
    t.eval_every, t.save_every, t.keep_last, t.keep_best = 0, 0, 0, 0
    t.max_steps, t.max_minutes, t.resume, t.auto_resume, t.evaluate = 10**9, 0.0, False, False, False
    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(trainer: Trainer, updates: list[Update], seconds: float) -> dict:
    """Steps/s, tokens/s, padding and model FLOP/s (MFU where the device's peak is known) of ``updates``."""
    src_lens, tgt_lens = trainer.src_lens + 1, trainer.tgt_lens + 1  # + EOS / BOS
    parts = [part for update in updates for part in update.parts]
    src, tgt = np.concatenate([src_lens[p] for p in parts]), np.concatenate([tgt_lens[p] for p in parts])
    padded = sum(padded_tokens(p, src_lens, tgt_lens) for p in parts)
    flops = training_flops(trainer.model, src, tgt)
    peak = peak_flops(trainer.device)
    return {
        "steps_per_s": round(len(updates) / seconds, 2),
        "train_tgt_tokens_per_s": round(int(tgt.sum()) / seconds),
        "train_src_tgt_tokens_per_s": round(int(src.sum() + tgt.sum()) / seconds),
        "padding_ratio": round(1 - float(src.sum() + tgt.sum()) / padded, 3),
        # what CUDA graphs record one graph each for (compile_mode=reduce-overhead); every other step replays
        "batch_shapes_seen": len({batch_shape(p, src_lens, tgt_lens) for p in parts}),
        "model_tflops_per_s": float(f"{flops / seconds / 1e12:.3g}"),  # 3 significant digits: tiny CPU runs too
        "mfu": round(flops / seconds / peak, 4) if peak else None,
    }


def time_ema(trainer: Trainer, step_seconds: float, updates: int = 20) -> dict:
    """Milliseconds of one update of a moving average of the trainer's weights, and its share of a step."""
    ema = ExponentialAverage(trainer.model, 0.999)
    ema.update(1)  # allocator and first-call work
    _sync(trainer.device)
    start = time.perf_counter()
    for t in range(updates):
        ema.update(t + 2)
    _sync(trainer.device)
    seconds = (time.perf_counter() - start) / updates
    return {"ema_update_ms": round(1000 * seconds, 3), "ema_vs_step": round(seconds / step_seconds, 4)}


def next_updates(schedule: BatchSchedule, skip: int, take: int) -> list[Update]:
    """The updates ``skip`` + 1 .. ``skip`` + ``take`` from where ``schedule`` stands (it does not move)."""
    updates = iter(schedule)
    for _ in range(skip):
        next(updates)
    return [next(updates) for _ in range(take)]


def host_step(trainer: Trainer, tokens: int, steps: int = 20) -> dict:
    """Milliseconds per update of the Trainer on one batch of the shortest training pairs, at most ``tokens``
    padded tokens: a batch so small that on a GPU its compute is a fraction of a millisecond and the time is the
    host's (Python, dispatch, kernel launches), what bounds every step that the GPU finishes first. On a CPU the
    compute counts too, unless the model is narrow (docs/benchmarking.md)."""
    order = np.argsort(trainer.src_lens + trainer.tgt_lens, kind="stable")
    count = 1
    while (
        count < len(order) and padded_tokens(order[: count + 1], trainer.src_lens + 1, trainer.tgt_lens + 1) <= tokens
    ):
        count += 1
    part = [int(i) for i in order[:count]]
    target = int(trainer.tgt_lens[part].sum()) + count  # + EOS each
    ready = trainer.prepare(Update([part], target, epoch=0, position=0, epoch_batch_tokens=tokens))
    for _ in range(3):
        trainer.optimize(ready)
    _sync(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.optimize(ready)
    _sync(trainer.device)
    padded = padded_tokens(part, trainer.src_lens + 1, trainer.tgt_lens + 1)
    return {"host_step_ms": round((time.perf_counter() - start) / steps * 1e3, 2), "host_step_tokens": padded}


def record_every_shape(trainer: Trainer, one_update: Callable[[], None]) -> dict:
    """Updates until every batch shape of the schedule has its CUDA graph (train.capture, app/train/capture.py),
    so that the timed updates replay and none records; at most three epochs of them."""
    captured, stats = trainer.captured, trainer.schedule.epoch_stats()
    assert captured is not None
    shapes, most = stats["epoch_batch_shapes"], 3 * stats["epoch_batches"]
    updates, start = 0, time.perf_counter()
    while len(captured.graphs) < shapes and updates < most:
        one_update()
        updates += 1
    _sync(trainer.device)
    return {"recording_updates": updates, "recording_seconds": round(time.perf_counter() - start, 2)}


def without_loop_features(trainer: Trainer, naive: frozenset[str]) -> None:
    """The loop-level speed features ``naive`` names turned off, for the ablation (app/bench/suite.py): "sync" reads
    the loss back after every update (a host sync), "unbucketed" cuts batches from a random order, "pageable" copies
    batches without pinned memory."""
    if "sync" in naive:
        update = trainer.train_step

        def synced(*args):
            result = update(*args)
            result.loss_sum.item()
            return result

        trainer.train_step = synced
    if "unbucketed" in naive:
        trainer.schedule.by_length = False
    if "pageable" in naive:
        trainer.pin_memory = False


def time_trainer(
    cfg: Config, steps: int, warmup: int, rounds: int = 2, naive: frozenset[str] = frozenset(), extras: bool = True
) -> tuple[dict, Callable[[], None]]:
    """The ``step`` and ``loop`` measurements of ``steps`` timed updates each, the two taking turns in ``rounds``
    rounds (a load change on a shared machine hits both alike), each turn after ``warmup`` untimed updates;
    and a function that runs one more of the Trainer's updates (what the profiler records). ``naive``: loop
    features turned off (``without_loop_features``); ``extras=False`` leaves out the moving average's and the host
    step's timings (the ablation's rows)."""
    run_cfg = bench_run_config(cfg)
    shutil.rmtree(run_cfg.run_dir, ignore_errors=True)
    trainer = build_trainer(run_cfg, quiet=True)
    without_loop_features(trainer, naive)
    device, schedule = trainer.device, trainer.schedule
    updates = iter(schedule)
    timed: dict[str, list[Update]] = {"step": [], "loop": []}
    seconds = {"step": 0.0, "loop": 0.0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def one_update() -> None:
        trainer.train_update(trainer.prepare(next(updates)))

    recording = record_every_shape(trainer, one_update) if trainer.captured is not None else {}

    share = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    for n in share:
        updates = iter(schedule)
        for _ in range(warmup):
            one_update()
        timed["step"] += next_updates(schedule, 0, n)
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            one_update()
        _sync(device)
        seconds["step"] += time.perf_counter() - start

        # the loop's clock starts at the end of a step: at least one untimed step of it comes first
        first, loop_warmup = trainer.progress.step, max(warmup, 1)
        timed["loop"] += next_updates(schedule, loop_warmup, n)
        clock = LoopClock(first + loop_warmup, first + loop_warmup + n, device)
        trainer.run(max_steps=first + loop_warmup + n, clock=clock)
        seconds["loop"] += required(
            clock.seconds, f"the loop's time to step {first + loop_warmup + n} (it stopped before)"
        )
    step, loop = (throughput(trainer, timed[kind], seconds[kind]) for kind in ("step", "loop"))
    measured = {**loop, "step_steps_per_s": step["steps_per_s"], "loop_rounds": rounds}
    measured["loop_vs_step"] = round(loop["steps_per_s"] / step["steps_per_s"], 3)
    measured.update(trainer.schedule.epoch_stats())
    if device.type == "cuda":
        measured["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if extras:
        measured.update(time_ema(trainer, 1 / step["steps_per_s"]))
        measured.update(host_step(trainer, cfg.bench.host_tokens))
    measured["captured"] = trainer.captured is not None  # train.capture in force (CUDA, the Transformer)
    if trainer.captured is not None:
        measured["capture"] = {**trainer.captured.describe(), **recording}
    updates = iter(schedule)  # the profiler's updates follow the loop's
    return measured, one_update
