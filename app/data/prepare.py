"""Corpus preparation: source -> cleaned, filtered, split ``data/<name>/{train,dev,test}.tsv``.

Cached: the output folder records a hash of the settings and of the source's fingerprint, and a
second run with the same inputs does nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter


from app.config import DataConfig, FilterConfig
from app.data.sources import SPLITS, Pair, read_source
from app.errors import UserError
from app.utils import atomic_write_text, stable_hash, to_plain

log = logging.getLogger(__name__)
PREPARE_VERSION = 1  # bump when cleaning/splitting logic changes, to invalidate old caches


def normalize(text: str) -> str:
    return " ".join(text.replace("\u00a0", " ").split())


def split_of(pair_id: str, dev_fraction: float, test_fraction: float) -> str:
    """Deterministic split from the id alone, so filtering or reordering never moves a pair."""
    u = int.from_bytes(hashlib.sha1(pair_id.encode("utf-8")).digest()[:8], "big") / 2**64
    if u < dev_fraction:
        return "dev"
    if u < dev_fraction + test_fraction:
        return "test"
    return "train"


def filter_pairs(pairs: list[Pair], rules: FilterConfig, dedup: bool) -> tuple[list[Pair], Counter]:
    """Apply cleaning rules; returns the kept pairs and how many each rule dropped."""
    kept, dropped, seen = [], Counter(), set()
    for pair in pairs:
        src, tgt = normalize(pair.src), normalize(pair.tgt)
        short, long = sorted((len(src), len(tgt)))
        if short == 0:
            dropped["empty"] += 1
        elif short < rules.min_chars:
            dropped["min_chars"] += 1
        elif long > rules.max_chars:
            dropped["max_chars"] += 1
        elif rules.max_ratio and long / short > rules.max_ratio:
            dropped["max_ratio"] += 1
        elif dedup and (src, tgt) in seen:
            dropped["duplicate"] += 1
        else:
            seen.add((src, tgt))
            kept.append(Pair(pair.id, src, tgt))
    return kept, dropped


def _fingerprint(cfg: DataConfig) -> dict:
    """What identifies the raw inputs: file sizes and mtimes, SWORD module configs, hub names."""
    paths = []
    if cfg.source == "files":
        paths = [p for split in SPLITS if getattr(cfg, split) for p in getattr(cfg, split).split(",")]
    elif cfg.source == "bible":
        paths = [os.path.join(cfg.sword_path, "mods.d", f"{m.lower()}.conf") for m in (cfg.src_module, cfg.tgt_module)]
    elif cfg.source == "hf" and cfg.hf_path and os.path.exists(cfg.hf_path):  # a local dataset: every file in it
        paths = [cfg.hf_path] if os.path.isfile(cfg.hf_path) else sorted(
            os.path.join(folder, name) for folder, _, names in os.walk(cfg.hf_path) for name in names
        )
    return {p: (os.path.getsize(p), os.stat(p).st_mtime_ns) if os.path.exists(p) else None for p in paths}


def cache_key(cfg: DataConfig) -> str:
    settings = to_plain(cfg)
    return stable_hash({"version": PREPARE_VERSION, "settings": settings, "inputs": _fingerprint(cfg)})


def write_tsv(path: str, pairs: list[Pair]) -> None:
    atomic_write_text(path, "".join(f"{p.id}\t{p.src}\t{p.tgt}\n" for p in pairs))


def read_tsv(path: str) -> list[Pair]:
    with open(path, encoding="utf-8") as f:
        return [Pair(*line.rstrip("\n").split("\t")) for line in f]


def prepare(cfg: DataConfig) -> dict:
    """Make sure ``cfg.dir`` holds the prepared splits; returns the preparation report."""
    report_path = os.path.join(cfg.dir, "prepare.json")
    key = cache_key(cfg)
    if os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
        if report.get("key") == key and all(os.path.exists(os.path.join(cfg.dir, f"{s}.tsv")) for s in SPLITS):
            log.info("data: %s is up to date (%s)", cfg.dir, _counts_text(report))
            return report

    log.info("data: preparing %s from source %r", cfg.dir, cfg.source)
    raw = read_source(cfg)
    # Splits the source does not provide are carved out of train by the id hash.
    dev_fraction = cfg.dev_fraction if raw["dev"] is None else 0.0
    test_fraction = cfg.test_fraction if raw["test"] is None else 0.0
    splits: dict[str, list[Pair]] = {s: list(raw[s] or []) for s in SPLITS}
    splits["train"] = []
    for pair in raw["train"]:
        splits[split_of(pair.id, dev_fraction, test_fraction)].append(pair)

    report = {"key": key, "source": cfg.source, "dropped": {}, "pairs": {}}
    for split in SPLITS:
        # Dev/test keep duplicates: they are what the user asked to be scored on.
        kept, dropped = filter_pairs(splits[split], cfg.filters, dedup=cfg.filters.dedup and split == "train")
        if split == "train" and cfg.max_train_pairs:
            kept = kept[: cfg.max_train_pairs]
        if not kept:
            raise UserError(f"data: the {split} split of {cfg.name!r} is empty after filtering (dropped: {dict(dropped)})")
        report["dropped"][split] = dict(dropped)
        report["pairs"][split] = len(kept)
        write_tsv(os.path.join(cfg.dir, f"{split}.tsv"), kept)
        log.info("data: %s: %d pairs kept, dropped %s", split, len(kept), dict(dropped) or "none")
    atomic_write_text(report_path, json.dumps(report, indent=2))
    return report


def _counts_text(report: dict) -> str:
    return ", ".join(f"{split} {n}" for split, n in report["pairs"].items())
