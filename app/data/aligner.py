"""Word links from a statistical aligner, for guided alignment on any corpus (``data.aligner``): eflomal (Östling &
Tiedemann 2016, "Efficient Word Alignment with Markov Chain Monte Carlo"), its Python package an optional extra
(``pip install "nmt-attention[align]"``).

``make data`` aligns the train, dev and test pairs together (an unsupervised aligner reads no links; more text
makes its counts better), in both directions, joins the two by grow-diag-final-and (app/data/symmetrization.py,
as make align joins two models' directions) and writes the train split's links as ``train.align``, what
``train.align_weight`` reads (Garg et al. 2019 trained from GIZA++'s links alike). The dev and test links are
written as ``<split>.<aligner>.align``, to score the aligner itself: they never replace the corpus's reference
links (``<split>.align``), which stay the evaluation's gold.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Sequence

from app.data.links import pharaoh_line
from app.data.symmetrization import grow_diag_final_and
from app.run.errors import UserError
from app.run.files import atomic_open

log = logging.getLogger(__name__)
INSTALL = 'pip install "nmt-attention[align]" (or: .venv/bin/pip install eflomal)'
EDGES = re.compile(r"^\W+|\W+$")  # punctuation at either end of a whitespace word


def aligner_words(text: str) -> str:
    """A sentence as the aligner reads it: its whitespace words, each without the punctuation at its ends (a word of
    punctuation only kept as it is), so "tierra." and "tierra" are one word to it; the count of words is the text's,
    so its links index the text's whitespace words."""
    return " ".join(EDGES.sub("", word) or word for word in text.split())


def check_aligner(aligner: str) -> None:
    """That ``aligner`` (data.aligner) can run: before the corpus is read, not after."""
    if aligner == "eflomal":
        try:
            import eflomal  # noqa: F401
        except ImportError:
            raise UserError(f"data.aligner=eflomal needs the eflomal package: {INSTALL}") from None


def eflomal_links(src: Sequence[str], tgt: Sequence[str]) -> list[set[tuple[int, int]]]:
    """eflomal's links of every pair (``src[i]``, ``tgt[i]``: texts of whitespace words, none empty), forward and
    reverse joined by grow-diag-final-and. A missing package is a one-line error naming the install command. eflomal
    samples (Gibbs sampling, unseeded): two runs differ in a few links."""
    check_aligner("eflomal")
    import eflomal

    with tempfile.TemporaryDirectory(prefix="eflomal-") as work:
        paths = {name: os.path.join(work, name) for name in ("src", "tgt", "forward", "reverse")}
        for name, texts in (("src", src), ("tgt", tgt)):
            with open(paths[name], "w", encoding="utf-8") as f:
                f.writelines(aligner_words(text) + "\n" for text in texts)
        log.info("data: eflomal aligns %d pairs, both directions", len(src))
        aligner = eflomal.Aligner()
        with open(paths["src"], encoding="utf-8") as s, open(paths["tgt"], encoding="utf-8") as t:
            aligner.align(s, t, links_filename_fwd=paths["forward"], links_filename_rev=paths["reverse"], quiet=True)
        forward, reverse = (read_links(paths[name], len(src)) for name in ("forward", "reverse"))
    return [grow_diag_final_and(f, r) for f, r in zip(forward, reverse)]


def read_links(path: str, pairs: int) -> list[set[tuple[int, int]]]:
    """The aligner's output: a line of ``i-j`` links per pair, (source word, target word) in both directions."""
    with open(path, encoding="utf-8") as f:
        links = [{(int(i), int(j)) for i, j in (link.split("-") for link in line.split())} for line in f]
    if len(links) != pairs:
        raise UserError(f"the aligner wrote {len(links)} lines of links for {pairs} pairs")
    return links


def write_aligner_links(data_dir: str, aligner: str, splits: Sequence[str]) -> list[str]:
    """Align the pairs of ``splits`` (their ``<split>.tsv`` in ``data_dir``) with ``aligner`` and write the train
    split's links as ``train.align``, the others' as ``<split>.<aligner>.align``; returns the files written."""
    texts: dict[str, list[tuple[str, str]]] = {split: [] for split in splits}
    for split in splits:
        with open(os.path.join(data_dir, f"{split}.tsv"), encoding="utf-8") as f:
            for line in f:
                _, src, tgt = line.rstrip("\n").split("\t")
                texts[split].append((src, tgt))
    pairs = [pair for split in splits for pair in texts[split]]
    links = eflomal_links([s for s, _ in pairs], [t for _, t in pairs])
    written, at = [], 0
    for split in splits:
        name = "train.align" if split == "train" else f"{split}.{aligner}.align"
        path = os.path.join(data_dir, name)
        with atomic_open(path, "w") as f:
            f.writelines(pharaoh_line(line) + "\n" for line in links[at : at + len(texts[split])])
        at += len(texts[split])
        written.append(path)
    return written
