"""Subword regularization: train on sampled segmentations of the train split (``train.subword_alpha``).

Kudo (2018) trains on a segmentation sampled anew for each sentence from the unigram language model,
``P(x | X) ∝ P(x)^α`` over the ``l`` best segmentations (SentencePiece's ``nbest_size``; -1: over all of
them, by forward-filtering and backward-sampling); with a BPE model SentencePiece drops each merge with
probability α instead (BPE-dropout, Provilkov et al. 2020). Dev and test keep the single best segmentation,
and so does decoding: the model learns that one word has several spellings in pieces, and stops leaning on
one of them.

SentencePiece's sampling does not repeat across processes, even from one seed, and a resumed run and every
rank must train on the same pieces. So ``train.subword_variants`` segmentations of every pair are sampled
once per corpus, tokenizer and setting into an Arrow cache beside the train split's; each epoch then draws
one of them per pair from (seed, epoch) alone. With α = 0 the split's own segmentation is the one variant.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from app.config.schema import TrainConfig
from app.data.cache import cached, mark_done
from app.data.corpus import TokenizedSplit, tokenized
from app.data.tokenizer import Tokenizer
from app.run.files import stable_hash
from app.run.folder_lock import owning

log = logging.getLogger(__name__)


@dataclass
class TrainSegmentations:
    """The segmentations training draws from: ``variants`` rows per pair, variant v of pair i at row
    ``v * pairs + i``, and which of them each epoch trains on."""

    src: pa.ChunkedArray  # list<int32> per row, without BOS/EOS
    tgt: pa.ChunkedArray
    src_lens: np.ndarray  # per row
    tgt_lens: np.ndarray
    pairs: int
    variants: int
    seed: int
    best_pieces: tuple[float, float] = (0.0, 0.0)  # mean source and target pieces of the best segmentation
    _epochs: dict = field(default_factory=dict, repr=False)  # the last epochs' rows and lengths

    def __len__(self) -> int:
        return self.pairs

    def rows(self, epoch: int) -> np.ndarray:
        """The row each pair trains on in ``epoch``: a variant drawn per pair from (seed, epoch)."""
        return self._epoch(epoch)[0]

    def lengths(self, epoch: int, keep: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Source and target pieces of every pair as ``epoch`` segments it (what its batches are cut by);
        ``keep=False``: an epoch only counted (app/data/schedule.py), drawn without displacing the kept ones."""
        return self._epoch(epoch, keep)[1:]

    def rows_of(self, epoch: int, indices: list[int]) -> list[int]:
        """The rows of these pairs in ``epoch`` (the pairs themselves when there is one variant)."""
        return indices if self.variants == 1 else self.rows(epoch)[indices].tolist()

    def _epoch(self, epoch: int, keep: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if epoch in self._epochs:
            return self._epochs[epoch]
        pairs = np.arange(self.pairs)
        if self.variants > 1:
            # train.seed may be negative (seed_everything takes it modulo 2**32); numpy's seeds may not
            drawn = np.random.default_rng([self.seed % 2**32, epoch]).integers(self.variants, size=self.pairs)
            pairs = drawn * self.pairs + pairs
        segmented = pairs, self.src_lens[pairs], self.tgt_lens[pairs]
        if keep:  # the prefetch thread may cut the next epoch while the loop trains on this one: keep both
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = segmented
        return segmented

    @classmethod
    def single(cls, split: TokenizedSplit, seed: int) -> TrainSegmentations:
        """The split's own (best) segmentation, every epoch."""
        src_lens, tgt_lens = np.asarray(split.src_lens, dtype=np.int64), np.asarray(split.tgt_lens, dtype=np.int64)
        return cls(split.src, split.tgt, src_lens, tgt_lens, len(split), 1, seed, mean_pieces(split))

    def stats(self) -> dict:
        """Pieces per pair over every variant, and against the best segmentation's."""
        sampled = (float(self.src_lens.mean()), float(self.tgt_lens.mean()))
        return {
            "variants": self.variants,
            "src_pieces_per_pair": round(sampled[0], 2),
            "tgt_pieces_per_pair": round(sampled[1], 2),
            "src_pieces_vs_best": round(sampled[0] / max(self.best_pieces[0], 1e-9), 3),
            "tgt_pieces_vs_best": round(sampled[1] / max(self.best_pieces[1], 1e-9), 3),
        }

    def describe(self) -> str:
        """What the log says of the sampling."""
        s = self.stats()
        return (
            f"{self.variants} sampled segmentations per pair, {s['src_pieces_vs_best']:.2f}x (source) and "
            f"{s['tgt_pieces_vs_best']:.2f}x (target) the pieces of the best one"
        )


def train_segmentations(
    data_dir: str, tokenizer: Tokenizer, split: TokenizedSplit, t: TrainConfig
) -> TrainSegmentations:
    """The segmentations a run trains on: the split's own with ``train.subword_alpha`` = 0, else the cached
    samples (built here when missing, stale or damaged: one process at a time per corpus folder)."""
    if t.subword_alpha <= 0:
        return TrainSegmentations.single(split, t.seed)
    import datasets

    source = tokenized(data_dir, "train", tokenizer)
    folder = os.path.dirname(source.cache_files[0]["filename"])
    setting = {"alpha": t.subword_alpha, "nbest": t.subword_nbest, "variants": t.subword_variants}
    cache = f"{folder}.sampled-a{t.subword_alpha:g}-n{t.subword_nbest}-v{t.subword_variants}"
    # the split's own cache key covers its pairs and the tokenizer models
    key = stable_hash({"split": source_key(folder), **setting})
    stamp = os.path.join(cache, "key.json")
    with owning(data_dir):
        if not cached(stamp, key, [cache]):
            build(source, cache, stamp, key, tokenizer, t)
        table = datasets.load_from_disk(cache).data
    src, tgt = table.column("src_ids"), table.column("tgt_ids")
    if len(src) != len(split) * t.subword_variants:  # a cache of another split that the stamp did not catch
        raise RuntimeError(f"{cache}: {len(src)} rows for {len(split)} pairs × {t.subword_variants} variants")
    src_lens, tgt_lens = (pc.list_value_length(column).to_numpy().astype(np.int64) for column in (src, tgt))
    return TrainSegmentations(src, tgt, src_lens, tgt_lens, len(split), t.subword_variants, t.seed, mean_pieces(split))


def mean_pieces(split: TokenizedSplit) -> tuple[float, float]:
    """Mean source and target pieces per pair of the split's own (best) segmentation."""
    return (float(np.mean(split.src_lens)), float(np.mean(split.tgt_lens))) if len(split) else (0.0, 0.0)


def source_key(folder: str) -> str:
    with open(os.path.join(folder, "key.json"), encoding="utf-8") as f:
        return json.load(f)["key"]


def build(source, cache: str, stamp: str, key: str, tokenizer: Tokenizer, t: TrainConfig) -> None:
    """Sample ``train.subword_variants`` segmentations of every pair, both sides, into ``cache``."""
    import datasets

    datasets.disable_progress_bars()
    started = time.time()
    texts = {"src": source["src"][:], "tgt": source["tgt"][:]}
    models = {"src": tokenizer.src, "tgt": tokenizer.tgt}
    rows: dict[str, list] = {"src_ids": [], "tgt_ids": []}
    for _ in tqdm(range(t.subword_variants), desc="sampling segmentations", unit="variant", leave=False):
        for side in ("src", "tgt"):
            rows[f"{side}_ids"] += models[side].encode(
                texts[side],
                num_threads=os.cpu_count() or 1,
                enable_sampling=True,
                alpha=t.subword_alpha,
                nbest_size=t.subword_nbest,
            )
    ids = datasets.List(datasets.Value("int32"))
    table = datasets.Dataset.from_dict(rows, features=datasets.Features({"src_ids": ids, "tgt_ids": ids}))
    work = f"{cache}.building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    table.save_to_disk(work)
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(work, cache)
    mark_done(stamp, key, [cache], pairs=len(source), variants=t.subword_variants)
    log.info(
        "subword sampling: %d segmentations of %d pairs (train.subword_alpha=%g, train.subword_nbest=%d) in %.1f s, "
        "cached in %s",
        t.subword_variants,
        len(source),
        t.subword_alpha,
        t.subword_nbest,
        time.time() - started,
        cache,
    )
