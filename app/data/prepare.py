"""Corpus preparation: source -> cleaned, filtered, split ``data/<name>/{train,dev,test}.tsv``.

Cached: the output folder records a hash of the settings and of the source's fingerprint, and a
second run with the same inputs does nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from typing import Optional

from tqdm import tqdm

from app.config.schema import DataConfig, FilterConfig
from app.data.aligner import check_aligner, write_aligner_links
from app.data.cache import cached, mark_done
from app.data.extra_pairs import HeldOut, check_extra_train, extra_pairs
from app.data.osis import CLEAN_VERSION as OSIS_CLEAN_VERSION
from app.data.sources import SPLITS, Pair, read_source, reversed_pair
from app.run.errors import UserError
from app.run.files import atomic_open, stable_hash

log = logging.getLogger(__name__)
PREPARE_VERSION = 2  # bump when cleaning/splitting logic changes, to invalidate old caches (2: NFC text)


WHOLE = FilterConfig(min_chars=1, max_chars=sys.maxsize, max_ratio=0.0, dedup=False)  # only an empty side is dropped


def normalize(text: str) -> str:
    """One space between words, and Unicode's composed form (NFC): a copy of a sentence typed with combining
    accents (``e`` + U+0301) is the same sentence to the split rule, to the duplicate and held-out checks, to
    SentencePiece (which normalizes too) and to BLEU's references."""
    return " ".join(unicodedata.normalize("NFC", text).replace("\u00a0", " ").split())


def split_key(pair: Pair) -> str:
    """What a pair's split is drawn from: its id, or where the id is only its place in a file (``numbered``), its
    cleaned text, so that copies of a pair share a split (a copy in test and another in train would be scored
    on a sentence trained on)."""
    return f"{normalize(pair.src)}\t{normalize(pair.tgt)}" if pair.numbered else pair.id


def split_of(pair_id: str, dev_fraction: float, test_fraction: float) -> str:
    """Deterministic split from the id alone, so filtering or reordering never moves a pair."""
    u = int.from_bytes(hashlib.sha1(pair_id.encode("utf-8")).digest()[:8], "big") / 2**64
    if u < dev_fraction:
        return "dev"
    if u < dev_fraction + test_fraction:
        return "test"
    return "train"


class PairFilter:
    """The cleaning rules, one pair at a time: returns the normalized pair or None, counting drops per
    rule. Duplicates are found by an 8-byte digest of the pair, so memory grows by a few dozen bytes per
    distinct pair, not by its text."""

    def __init__(self, rules: FilterConfig, dedup: bool):
        self.rules, self.dedup = rules, dedup
        self.seen: set[bytes] = set()
        self.dropped: Counter[str] = Counter()

    def __call__(self, pair: Pair) -> Optional[Pair]:
        rules = self.rules
        src, tgt = normalize(pair.src), normalize(pair.tgt)
        short, long = sorted((len(src), len(tgt)))
        reason = None
        if short == 0:
            reason = "empty"
        elif short < rules.min_chars:
            reason = "min_chars"
        elif long > rules.max_chars:
            reason = "max_chars"
        elif rules.max_ratio and long / short > rules.max_ratio:
            reason = "max_ratio"
        elif self.dedup:
            digest = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest()
            if digest in self.seen:
                reason = "duplicate"
            self.seen.add(digest)
        if reason:
            self.dropped[reason] += 1
            return None
        return Pair(pair.id, src, tgt, pair.links)  # whitespace words unchanged: the links still hold


def filter_pairs(pairs: Iterable[Pair], rules: FilterConfig, dedup: bool) -> tuple[list[Pair], Counter]:
    """Apply cleaning rules; returns the kept pairs and how many each rule dropped."""
    keep = PairFilter(rules, dedup)
    kept = [clean for pair in pairs if (clean := keep(pair)) is not None]
    return kept, keep.dropped


def _fingerprint(cfg: DataConfig) -> dict:
    """What identifies the raw inputs: file sizes and mtimes, SWORD module configs, hub names."""
    paths = []
    if cfg.source == "files":
        paths = [p for split in SPLITS if getattr(cfg, split) for p in getattr(cfg, split).split(",")]
    elif cfg.source == "bible":
        paths = [os.path.join(cfg.sword_path, "mods.d", f"{m.lower()}.conf") for m in (cfg.src_module, cfg.tgt_module)]
    elif cfg.source == "hf" and cfg.hf_path and os.path.exists(cfg.hf_path):  # a local dataset: every file in it
        paths = (
            [cfg.hf_path]
            if os.path.isfile(cfg.hf_path)
            else sorted(os.path.join(folder, name) for folder, _, names in os.walk(cfg.hf_path) for name in names)
        )
    paths += [cfg.train_align] if cfg.train_align else []  # a link file joins any source's train split
    paths += cfg.extra_train.split(",") if cfg.extra_train else []
    return {p: (os.path.getsize(p), os.stat(p).st_mtime_ns) if os.path.exists(p) else None for p in paths}


def cache_key(cfg: DataConfig) -> str:
    settings = asdict(cfg)
    settings.pop("num_proc", None)  # how many processes tokenize does not change the prepared splits
    for flag, off in (
        ("aligner", "none"),
        ("reverse", False),
        ("extra_train", None),
        ("extra_tag", None),
    ):  # corpora prepared before the setting stay as they are
        if settings.get(flag) == off:
            settings.pop(flag)
    key = {"version": PREPARE_VERSION, "settings": settings, "inputs": _fingerprint(cfg)}
    if cfg.source == "bible":  # the verse texts are what app/data/osis.py makes of the modules' markup
        key["osis"] = OSIS_CLEAN_VERSION
    else:  # pairs without an id of their own are split by their text (split_key): corpora split by place redone
        key["split_key"] = "text"
    return stable_hash(key)


def read_tsv(path: str) -> list[Pair]:
    with open(path, encoding="utf-8") as f:
        rows = (line.rstrip("\n").split("\t") for line in f)
        return [Pair(pair_id, src, tgt) for pair_id, src, tgt in rows]


def prepare(cfg: DataConfig, verify: bool = False) -> dict:
    """Make sure ``cfg.dir`` holds the prepared splits, as they were written (``verify``: by their content
    hashes, app/data/cache.py); returns the preparation report."""
    report_path = os.path.join(cfg.dir, "prepare.json")
    key = cache_key(cfg)
    outputs = [os.path.join(cfg.dir, f"{s}.tsv") for s in SPLITS]
    report = cached(report_path, key, outputs, verify)
    if report and all(os.path.exists(os.path.join(cfg.dir, f"{s}.align")) for s in report.get("aligned", [])):
        log.info("data: %s is up to date (%s)", cfg.dir, _counts_text(report))
        return report

    check_aligner(cfg.aligner)
    check_extra_train(cfg)
    log.info("data: preparing %s from source %r", cfg.dir, cfg.source)
    raw = read_source(cfg)
    # Splits the source does not provide are carved out of train by the id hash.
    dev_fraction = cfg.dev_fraction if raw["dev"] is None else 0.0
    test_fraction = cfg.test_fraction if raw["test"] is None else 0.0
    # Dev/test keep duplicates: they are what the user asked to be scored on. A dev or test set the source gives is
    # kept whole but for pairs with an empty side (counted), as sacrebleu, fairseq and JoeyNMT score one: the length
    # rules clean training pairs, and the splits carved out of them.
    filters = {
        s: PairFilter(
            cfg.filters if s == "train" or raw[s] is None else WHOLE, dedup=cfg.filters.dedup and s == "train"
        )
        for s in SPLITS
    }
    kept: Counter[str] = Counter()
    held_out = HeldOut()  # what extra training pairs must not hold
    full = lambda split: split == "train" and 0 < cfg.max_train_pairs <= kept["train"]  # noqa: E731
    with contextlib.ExitStack() as files:  # pairs stream from the source into the split files
        out = {s: files.enter_context(atomic_open(os.path.join(cfg.dir, f"{s}.tsv"), "w")) for s in SPLITS}
        aligned = {}  # split -> its .align file, line for line with the .tsv: for sources that give links

        def write(split: str, pair: Pair) -> None:
            clean = filters[split](reversed_pair(pair) if cfg.reverse else pair)
            if clean is None or full(split):
                return
            if kept[split] and (clean.links is not None) != (split in aligned):  # the first pair decides
                raise UserError(f"data: the {split} split mixes pairs with and without reference links")
            if clean.links is not None and split not in aligned:
                aligned[split] = files.enter_context(atomic_open(os.path.join(cfg.dir, f"{split}.align"), "w"))
            out[split].write(f"{clean.id}\t{clean.src}\t{clean.tgt}\n")
            if split != "train":
                held_out.add(clean)
            if clean.links is not None:  # then the split's file is open (the first pair decided)
                aligned[split].write(clean.links + "\n")
            kept[split] += 1

        for pair in tqdm(raw["train"], desc="preparing", unit=" pairs", mininterval=2, leave=False, disable=None):
            write(split_of(split_key(pair), dev_fraction, test_fraction), pair)
            if cfg.streaming and full("train") and raw["dev"] is not None and raw["test"] is not None:
                break  # a stream may be endless: stop once the sample is taken
        for split in ("dev", "test"):
            for pair in raw[split] or ():
                write(split, pair)
        extra = PairFilter(cfg.filters, dedup=cfg.filters.dedup)
        extra.seen = filters["train"].seen  # a copy of a corpus pair is a duplicate
        if cfg.extra_train:
            split_of_id = lambda pair_id: split_of(pair_id, dev_fraction, test_fraction)  # noqa: E731
            kept["extra"] = _write_pairs(extra_pairs(cfg, held_out, extra, extra.dropped, split_of_id), out["train"])
            if not kept["extra"]:
                raise UserError(f"data.extra_train={cfg.extra_train}: every pair was dropped ({dict(extra.dropped)})")
        for split in SPLITS:
            if not kept[split]:
                raise UserError(
                    f"data: the {split} split of {cfg.name!r} is empty after filtering "
                    f"(dropped: {dict(filters[split].dropped)})"
                )
    for split in SPLITS:
        log.info("data: %s: %d pairs kept, dropped %s", split, kept[split], dict(filters[split].dropped) or "none")
        stale = os.path.join(cfg.dir, f"{split}.align")
        if split not in aligned and os.path.exists(stale):  # links of an earlier preparation
            os.remove(stale)
    if cfg.extra_train:
        tagged = f", tagged {cfg.extra_tag}" if cfg.extra_tag else ""
        dropped = dict(extra.dropped) or "none"
        log.info(
            "data: train: %d extra pairs from %s kept%s, dropped %s", kept["extra"], cfg.extra_train, tagged, dropped
        )
    linked = [os.path.join(cfg.dir, f"{split}.align") for split in sorted(aligned)]
    if cfg.aligner != "none":  # train.align from the aligner, in place of any reference links of the train split
        linked = sorted(set(linked) | set(write_aligner_links(cfg.dir, cfg.aligner, SPLITS)))
    return mark_done(
        report_path,
        key,
        outputs + linked,
        source=cfg.source,
        dropped={s: dict(filters[s].dropped) for s in SPLITS},
        pairs={s: kept[s] + kept["extra"] * (s == "train") for s in SPLITS},
        **({"extra": {"pairs": kept["extra"], "dropped": dict(extra.dropped)}} if cfg.extra_train else {}),
        aligned=sorted({*aligned, *(["train"] if cfg.aligner != "none" else [])}),
    )


def _write_pairs(pairs: Iterable[Pair], out) -> int:
    written = 0
    for pair in tqdm(pairs, desc="extra pairs", unit=" pairs", mininterval=2, leave=False, disable=None):
        out.write(f"{pair.id}\t{pair.src}\t{pair.tgt}\n")
        written += 1
    return written


def _counts_text(report: dict) -> str:
    extra = f" (of which {report['extra']['pairs']} extra)" if "extra" in report else ""
    return ", ".join(f"{split} {n}{extra * (split == 'train')}" for split, n in report["pairs"].items())
