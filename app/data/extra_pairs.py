"""Extra training pairs (``data.extra_train``): back-translations of monolingual target text (Sennrich et al.
2016, "Improving Neural Machine Translation Models with Monolingual Data"), a teacher's translations of the
sources (sequence-level knowledge distillation, Kim & Rush 2016), or any other pairs meant for training only.

They join the train split after the corpus's own pairs, through the same cleaning, filters and de-duplication,
and never bring a held-out sentence into training: a pair is dropped when its source or target is a dev or
test sentence's, or when its id (where it has one of its own) is one that the split rule carves out for dev or
test. ``data.extra_tag`` puts a word before each extra source (tagged back-translation, Caswell et al. 2019,
"Tagged Back-Translation"): the model can tell synthetic sources from real ones, and the tokenizer keeps the
word as one piece.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Optional

from app.config.schema import DataConfig
from app.data.sources import Pair, read_parallel_file, reversed_pair
from app.data.text_files import check_file
from app.run.errors import UserError


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


class HeldOut:
    """The sources and targets of the dev and test splits, as 8-byte digests of their cleaned text."""

    def __init__(self) -> None:
        self.sentences: set[bytes] = set()

    def add(self, pair: Pair) -> None:
        self.sentences.update((_digest(pair.src), _digest(pair.tgt)))

    def holds(self, pair: Pair) -> bool:
        return _digest(pair.src) in self.sentences or _digest(pair.tgt) in self.sentences


def check_extra_train(cfg: DataConfig) -> None:
    """Refuses, before any reading, a file that is not there and what extra pairs cannot join: a train split with
    reference links (an extra pair has none to give guided alignment)."""
    for path in cfg.extra_train.split(",") if cfg.extra_train else ():
        check_file(path, f"data.extra_train: {path}")
    if cfg.extra_train and (cfg.reference_links or cfg.train_align):
        given = "data.reference_links=true" if cfg.reference_links else f"data.train_align={cfg.train_align}"
        raise UserError(
            f"data.extra_train={cfg.extra_train}: its pairs have no reference links, and {given} links every train "
            "pair: not together (data.aligner=eflomal links them all)"
        )


def extra_pairs(
    cfg: DataConfig,
    held_out: HeldOut,
    clean: Callable[[Pair], Optional[Pair]],
    dropped: Counter[str],
    split_of_id: Callable[[str], str],
) -> Iterator[Pair]:
    """The pairs of ``data.extra_train`` that may join the train split, cleaned by ``clean`` (the train split's
    filters; sharing its record of pairs seen, a copy of a corpus pair is a duplicate), turned round with the corpus
    (``data.reverse``) and tagged (``data.extra_tag``). ``dropped``, the counter ``clean`` fills, gains the pairs
    dropped here, by reason."""
    for pair in read_parallel_file(str(cfg.extra_train), cfg.src_lang, cfg.tgt_lang, "data.extra_train"):
        if not pair.numbered and split_of_id(pair.id) != "train":
            dropped["held-out id"] += 1
            continue
        cleaned = clean(reversed_pair(pair) if cfg.reverse else pair)
        if cleaned is None:
            continue
        if held_out.holds(cleaned):
            dropped["held-out sentence"] += 1
            continue
        source = f"{cfg.extra_tag} {cleaned.src}" if cfg.extra_tag else cleaned.src
        yield replace(cleaned, id=f"extra:{cleaned.id}", src=source)
