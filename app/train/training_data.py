"""What a training run trains and validates on: the train split's segmentations, the dev sentences and their
reference links, guided alignment's targets; and an update's batches as the loop receives them (``Prepared``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from app.config.schema import Config
from app.data.batching import Batch
from app.data.corpus import ParallelData, load_split, load_tokenized, load_tokenizer, prepare_data
from app.data.links import read_pharaoh
from app.data.schedule import Update
from app.data.subword_sampling import TrainSegmentations, train_segmentations
from app.data.tokenizer import Tokenizer
from app.run import distributed
from app.run.errors import UserError
from app.train.guided_alignment import AlignmentTargets, alignment_targets


@dataclass
class TrainingData:
    """What a run trains and validates on."""

    tokenizer: Tokenizer
    train: TrainSegmentations  # memory-mapped: the split's segmentation, or those train.subword_alpha samples
    dev: ParallelData  # the dev sentences validation reads (train.max_dev_sentences)
    dev_links: Optional[list]  # their reference links, where the corpus has them
    align_targets: Optional[AlignmentTargets]  # guided alignment's targets (train.align_weight > 0)


def load_data(cfg: Config, main: bool) -> TrainingData:
    """The tokenizer, the train split (memory-mapped; train.subword_alpha: its sampled segmentations, which the first
    rank to come samples), the dev sentences validation reads and their reference links, guided alignment's
    targets. Rank 0 prepares data, tokenizer and Arrow caches; the other ranks wait, then read them."""
    if main:
        prepare_data(cfg)
    distributed.barrier()
    tokenizer = load_tokenizer(cfg.data.dir, cfg.tokenizer)
    dev = load_split(cfg.data.dir, "dev", tokenizer).head(cfg.train.max_dev_sentences)
    links_path = os.path.join(cfg.data.dir, "dev.align")
    dev_links = read_pharaoh(links_path)[: len(dev)] if os.path.exists(links_path) else None
    train = train_segmentations(cfg.data.dir, tokenizer, load_tokenized(cfg.data.dir, "train", tokenizer), cfg.train)
    check_positions(getattr(cfg.model, "max_len", None), {"train": train.lengths(0), "dev": dev_lengths(dev)})
    return TrainingData(tokenizer, train, dev, dev_links, alignment_targets(cfg, tokenizer, len(train)))


def dev_lengths(dev: ParallelData) -> tuple[np.ndarray, np.ndarray]:
    return np.array([len(s) for s in dev.src], dtype=int), np.array([len(t) for t in dev.tgt], dtype=int)


def check_positions(max_len: Optional[int], splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Every pair's pieces and their EOS (or BOS) within a Transformer's positions (``model.max_len``), else a
    UserError before the first update (the model raised it mid-step, a traceback)."""
    for split, (src, tgt) in splits.items():
        longest = int(max(src.max(initial=0), tgt.max(initial=0))) + 1
        if max_len is not None and longest > max_len:
            raise UserError(
                f"model.max_len={max_len}: the {split} split has a sentence of {longest} pieces with its EOS; raise "
                "model.max_len, or drop long pairs with data.filters.max_chars"
            )


@dataclass
class Prepared:
    """An update's batches, padded on the host and copied to the device, and its host-side counts."""

    update: Update
    parts: list[list[int]]  # this rank's micro-batches (sentence indices)
    batches: list[Batch]  # on the host
    on_device: list[Batch]
    local_tokens: int  # this rank's target tokens
    flops: float  # useful FLOPs of this rank's share (0 where no MFU is logged)
