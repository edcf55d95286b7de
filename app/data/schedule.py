"""The batch schedule of a training run: which sentences every update trains on.

One object owns what decides it: the seed, the epoch and the position in it, the token budget in force
(``train.batch_tokens``, halved on out-of-memory with ``train.oom_retry``), the number of ranks and this
rank's share, and the micro-batches accumulated per update. An epoch's batches are cut by length under
the budget it started with and shuffled by (seed, epoch) alone (app/data/batching.py), so its
``state_dict`` in a checkpoint is enough to replay the same updates on resume, as JoeyNMT's batch
sampler does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from app.config.schema import CUDA_GRAPH_MODES, TrainConfig
from app.data.batching import batch_shape, make_batches, padded_tokens, split_batch
from app.data.shapes import CAPTURE_PADDING, CAPTURE_SHAPES, SUGGESTED_SHAPES, BatchShapes, Lengths
from app.run.errors import UserError

log = logging.getLogger(__name__)


class EpochLengths(Protocol):
    """The pairs' lengths as ``epoch`` segments them (app/data/subword_sampling.py ``TrainSegmentations.lengths``);
    ``keep=False``: for an epoch only counted, not kept among the ones the loop reads."""

    def __call__(self, epoch: int, keep: bool = True) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class Update:
    """One optimizer update: this rank's micro-batches (sentence indices) as its epoch cut them, what the
    update counts, and where the schedule stands once it is done."""

    parts: list[list[int]]
    tgt_tokens: int  # target tokens (with EOS) of the whole update, over all ranks: the loss normalizer
    epoch: int
    position: int  # batches of the epoch done once this update is
    epoch_batch_tokens: int  # the budget its epoch was cut with
    ends_epoch: bool = False  # the last update of its epoch


class BatchSchedule:
    """Length-bucketed, shuffled epochs of updates: ``for update in schedule`` never ends (the caller stops).
    ``epoch_lengths(epoch)``: the pairs' lengths as that epoch segments them (train.subword_alpha), where they
    change from epoch to epoch; else ``src_lens`` and ``tgt_lens``, every epoch."""

    def __init__(
        self,
        src_lens: Lengths,
        tgt_lens: Lengths,
        batch_tokens: int,
        seed: int,
        world: int = 1,
        rank: int = 0,
        accum: int = 1,
        shapes: BatchShapes | None = None,
        epoch_lengths: Optional[EpochLengths] = None,
    ):
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self.epoch_lengths = epoch_lengths
        self.subword_sampling: Optional[dict] = None  # train.subword_* in force, where on: a resume must keep them
        self.shapes = shapes  # train.batch_shapes: every batch padded to one of a fixed set of shapes
        self.seed, self.world, self.rank, self.accum = seed, world, rank, accum
        self.epoch = 0
        self.position = 0  # batches of the current epoch already trained on
        self.finished = 0  # epochs every update of which was trained on (train.max_epochs)
        self.batch_tokens = batch_tokens  # the budget in force
        self.epoch_batch_tokens = batch_tokens  # the budget the current epoch's batches were cut with
        self.by_length = True  # false: batches cut from a random order (make bench's ablation; not with shapes)
        self._epoch_cache: tuple[tuple[int, int, bool], list[list[int]]] | None = None
        self._counts: dict[tuple[int, int, bool], int] = {}  # batches of every epoch cut or counted, by the same key

    @property
    def group(self) -> int:
        """Batches per update: each of the ranks takes ``accum`` of them."""
        return self.world * self.accum

    def lengths(self, epoch: int) -> tuple[Lengths, Lengths]:
        """Source and target lengths (without EOS / BOS) of every pair in ``epoch``."""
        return self.epoch_lengths(epoch) if self.epoch_lengths else (self.src_lens, self.tgt_lens)

    def epoch_batches(self, epoch: int | None = None, budget: int | None = None) -> list[list[int]]:
        """An epoch's batches (every rank's), cut with ``budget`` (default: the current epoch's and the budget
        in force when it started)."""
        epoch, budget = self.epoch if epoch is None else epoch, self.epoch_batch_tokens if budget is None else budget
        key = (epoch, budget, self.by_length)
        if self._epoch_cache is None or self._epoch_cache[0] != key:
            batches = self._cut(epoch, budget)
            self._counts[key] = len(batches)
            if len(batches) < self.group:
                raise UserError(
                    f"the train split makes {len(batches)} batches of train.batch_tokens={key[1]}, fewer than one "
                    f"update takes ({self.world} ranks × {self.accum} accumulated): lower train.batch_tokens"
                )
            self._epoch_cache = (key, batches)
        return self._epoch_cache[1]

    def _cut(self, epoch: int, budget: int, keep: bool = True) -> list[list[int]]:
        """``epoch``'s batches cut anew with ``budget`` (``keep=False``: only counted, its segmentations not kept)."""
        if self.shapes is not None:
            return list(self.shapes.batches(budget, shuffle=True, seed=self.seed, epoch=epoch))
        lengths = self.epoch_lengths(epoch, keep=keep) if self.epoch_lengths else (self.src_lens, self.tgt_lens)
        src_lens, tgt_lens = (np.asarray(lens).tolist() for lens in lengths)  # quick to index
        return make_batches(
            src_lens, tgt_lens, budget, shuffle=True, seed=self.seed, epoch=epoch, by_length=self.by_length
        )

    def batch_count(self, epoch: int, budget: int) -> int:
        """How many batches ``epoch`` cuts with ``budget``: each epoch its own number (segmented anew with
        train.subword_alpha; cut from another shuffle, which breaks ties between pairs of one length another
        way), counted once and kept. The loop's cached epoch stays as it is: another epoch is cut aside (the
        current one into the cache while it holds none: the loop reads it first)."""
        key = (epoch, budget, self.by_length)
        cached = self._epoch_cache
        if cached is not None and cached[0] == key:
            return len(cached[1])
        if cached is None and (epoch, budget) == (self.epoch, self.epoch_batch_tokens):
            return len(self.epoch_batches())
        if key not in self._counts:
            self._counts[key] = len(self._cut(epoch, budget, keep=False))
        return self._counts[key]

    def __iter__(self) -> Iterator[Update]:
        """Updates from where the schedule stands on; a last group smaller than one update is left out of an
        epoch. Iterating does not move the schedule (a prefetcher may run ahead): ``advance`` does, once an
        update is trained on, so that a checkpoint written then resumes with the next one."""
        epoch, position, budget = self.epoch, self.position, self.epoch_batch_tokens
        while True:
            batches = self.epoch_batches(epoch, budget)
            tgt_plus_eos = np.asarray(self.lengths(epoch)[1], dtype=np.int64) + 1
            for start in range(position, len(batches) - self.group + 1, self.group):
                group = batches[start : start + self.group]
                tgt_tokens = int(sum(tgt_plus_eos[indices].sum() for indices in group))  # known on every rank
                parts = group[self.rank * self.accum : (self.rank + 1) * self.accum]
                ends = self.epoch_ends_at(start + self.group, len(batches))
                yield Update(parts, tgt_tokens, epoch, start + self.group, budget, ends)
            # the next epoch is cut with the budget in force when it starts
            epoch, position, budget = epoch + 1, 0, self.batch_tokens

    def parts_in_force(self, update: Update) -> list[list[int]]:
        """The update's micro-batches within the budget in force: cut again if it was halved since its epoch began."""
        return update.parts if self.batch_tokens >= update.epoch_batch_tokens else self.cut(update.parts, update.epoch)

    def advance(self, update: Update) -> None:
        """``update`` was trained on: the schedule stands after it."""
        self.epoch, self.position, self.epoch_batch_tokens = update.epoch, update.position, update.epoch_batch_tokens
        self.finished = update.epoch + update.ends_epoch

    def cut(self, parts: list[list[int]], epoch: int) -> list[list[int]]:
        """The same sentences (as ``epoch`` segments them) in micro-batches within the budget in force."""
        src_lens, tgt_lens = self.lengths(epoch)
        return [piece for part in parts for piece in split_batch(part, src_lens, tgt_lens, self.batch_tokens)]

    def halve(self) -> int:
        """Out of memory: half the token budget from now on (the current update is cut again with it)."""
        self.batch_tokens = max(self.batch_tokens // 2, 1)
        return self.batch_tokens

    def epoch_stats(self) -> dict:
        """Padding and distinct batch shapes (what CUDA graphs record one graph each for) over the first epoch."""
        src_lens, tgt_lens = self.lengths(0)
        src_len = np.asarray(src_lens, dtype=np.int64) + 1  # + EOS
        tgt_len = np.asarray(tgt_lens, dtype=np.int64) + 1  # + BOS / EOS
        batches = self.epoch_batches(0, self.batch_tokens)
        padded = sum(padded_tokens(b, src_len, tgt_len) for b in batches)
        return {
            "epoch_padding_ratio": round(1 - float(src_len.sum() + tgt_len.sum()) / padded, 3),
            "epoch_batch_shapes": len({batch_shape(b, src_len, tgt_len) for b in batches}),
            "epoch_batches": len(batches),
        }

    def epoch_ends_at(self, position: int, batches: int) -> bool:
        """Whether an epoch of ``batches`` batches is done once ``position`` of them are: no whole update is left."""
        return position + self.group > batches

    def epochs_finished(self) -> int:
        """Epochs every update of which was trained on (an epoch's last group smaller than an update is left out)."""
        return self.finished

    def step_of_epochs(self, step: int, epochs: int) -> Optional[int]:
        """The step at which ``epochs`` epochs are finished, from ``step`` where the schedule stands: the current
        epoch's updates left, then every later epoch's own, cut with the budget in force (as ``__iter__`` cuts
        them; one halved later moves the end); None for no limit (0). Every rank counts every rank's batches."""
        if not epochs:
            return None
        left = 0
        if self.epoch < epochs:
            left = max(self.batch_count(self.epoch, self.epoch_batch_tokens) - self.position, 0) // self.group
        left += sum(self.batch_count(epoch, self.batch_tokens) // self.group for epoch in range(self.epoch + 1, epochs))
        return step + left

    def epochs_done(self) -> float:
        """Epochs trained, with the share of the current one."""
        return self.epoch + self.position / self.batch_count(self.epoch, self.epoch_batch_tokens)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "batch_tokens": self.batch_tokens,
            "epoch_batch_tokens": self.epoch_batch_tokens,
            "batch_shapes": self.shape_count,
            "subword_sampling": self.subword_sampling,
        }

    @property
    def shape_count(self) -> int:
        return 0 if self.shapes is None else len(self.shapes.shapes)

    def load_state_dict(self, state: dict, configured_batch_tokens: int, saved_batch_tokens: int) -> None:
        """Continue where ``state`` left off. The budget follows ``train.batch_tokens`` from the next batches
        on if the user changed it since the checkpoint (``saved_batch_tokens``: the setting then)."""
        if state["seed"] != self.seed:
            raise UserError(
                f"train.seed={self.seed} but the checkpoint's run has seed {state['seed']}: a resumed run replays "
                "its batch order; keep the seed"
            )
        if state.get("batch_shapes", 0) != self.shape_count:
            raise UserError(
                f"train.batch_shapes gives {self.shape_count or 'no fixed'} shapes but the checkpoint's run was cut "
                f"into {state.get('batch_shapes', 0) or 'no fixed'} shapes: a resumed run replays its batches; "
                "keep train.batch_shapes and train.shape_padding (on CUDA a captured Transformer pads to fixed shapes "
                "unless train.capture=false)"
            )
        if state.get("subword_sampling") != self.subword_sampling:
            was = " ".join(f"train.subword_{k}={v}" for k, v in (state.get("subword_sampling") or {"alpha": 0}).items())
            raise UserError(
                f"the checkpoint's run trained with {was}: a resumed run replays its segmentations; keep those settings"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self.epoch_batch_tokens = state["epoch_batch_tokens"] or saved_batch_tokens
        self.finished = self.epoch + self.epoch_ends_at(self.position, len(self.epoch_batches()))
        self.batch_tokens = state["batch_tokens"] or saved_batch_tokens
        if saved_batch_tokens != configured_batch_tokens:
            self.batch_tokens = configured_batch_tokens


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


def training_schedule(
    t: TrainConfig,
    src_lens: Lengths,
    tgt_lens: Lengths,
    world: int,
    rank: int,
    accum: int,
    cuda: bool,
    epoch_lengths: Optional[EpochLengths] = None,
    captured: bool = False,
) -> BatchSchedule:
    """The schedule of ``train.*``: length-bucketed batches, or with train.batch_shapes padded to fixed shapes;
    with train.subword_alpha cut by each epoch's segmentations (``epoch_lengths``). A ``captured`` update
    (app/train/capture.py) replays a graph per shape: without train.batch_shapes, the fewest of CAPTURE_SHAPES
    shapes whose pairs pad at most CAPTURE_PADDING of their tokens."""
    k, max_padding = t.batch_shapes, t.shape_padding
    if captured and not k:
        k, max_padding = CAPTURE_SHAPES, CAPTURE_PADDING
    shapes = BatchShapes(src_lens, tgt_lens, k, max_padding) if k else None
    schedule = BatchSchedule(src_lens, tgt_lens, t.batch_tokens, t.seed, world, rank, accum, shapes, epoch_lengths)
    if t.subword_alpha > 0:
        schedule.subword_sampling = {"alpha": t.subword_alpha, "nbest": t.subword_nbest, "variants": t.subword_variants}
    if shapes is None and cuda and t.compile and t.compile_mode in CUDA_GRAPH_MODES:
        log.warning(
            "train.compile_mode=%s records a CUDA graph for every batch shape, and an epoch has %d of them: "
            "train.batch_shapes=%d pads every batch to that many",
            t.compile_mode,
            schedule.epoch_stats()["epoch_batch_shapes"],
            SUGGESTED_SHAPES,
        )
    if shapes is not None:
        padding = schedule.epoch_stats()["epoch_padding_ratio"]
        log.info(
            "%s%s: every batch padded to one of %d (source, target) lengths %s; the pairs pad "
            "%.1f %% of their tokens, an epoch with its batches' empty rows %.1f %%",
            f"train.batch_shapes={k}" if t.batch_shapes else f"train.capture: at most {k} batch shapes",
            (f" train.shape_padding={max_padding:g}" if t.batch_shapes else f" padding at most {max_padding:g}")
            if max_padding
            else "",
            len(shapes.shapes),
            " ".join(f"{src}x{tgt}" for src, tgt in shapes.shapes),
            100 * shapes.pair_padding,
            100 * padding,
        )
        if max_padding and shapes.pair_padding > max_padding:
            log.warning(
                "%d shapes pad %.1f %% of the pairs' tokens, more than train.shape_padding=%g: "
                "allow more shapes (a larger train.batch_shapes) to pad less",
                k,
                100 * shapes.pair_padding,
                max_padding,
            )
    return schedule
