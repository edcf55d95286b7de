"""Reference word links and the words a sentence's pieces make up.

Link files use the Pharaoh format: one line per sentence pair, ``i-j`` for a sure link between source word
i and target word j (0-based, whitespace words: ``str.split()``'s), ``i?j`` for a possible one. The functions
that read links from attention take each piece's word number, which the tokenizer gives from the text the pieces
spell (app.data.tokenizer.span_words: ``src_words``/``tgt_words`` of a text, ``hyp_words`` of a hypothesis), not
from SentencePiece's ``▁`` marks: its normalization puts a ``▁`` where the text has none (a ZWNJ inside a word).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from app.data.text_files import text_lines
from app.run.errors import UserError


def read_pharaoh(path: str) -> list[tuple[set, set]]:
    """Per line: (sure links, possible links); possible includes sure, as AER requires. A file that is missing,
    a folder or not UTF-8, or a line that is not links, is a UserError (lines as app.data.text_files.text_lines
    reads them)."""
    gold = []
    for line_no, line in text_lines(path):
        sure, possible = set(), set()
        for link in line.split():
            i, j = link_words(link, f"{path}:{line_no}")
            possible.add((i, j))
            if link_sign(link) == "-":
                sure.add((i, j))
        gold.append((sure, possible))
    return gold


def link_words(link: str, where: str) -> tuple[int, int]:
    """The word numbers (i, j) of a Pharaoh link ``i-j`` or ``i?j``, in ASCII digits only (``int`` also reads
    ``1_0`` as 10, and ``str.isdigit`` passes ``²``); else a UserError naming ``where`` (file:line)."""
    i, sep, j = link.partition(link_sign(link))
    if not (sep and i.isascii() and i.isdigit() and j.isascii() and j.isdigit()):
        raise UserError(f"{where}: {link!r} is not an i-j or i?j alignment link")
    return int(i), int(j)


def link_sign(link: str) -> str:
    """A Pharaoh link's separator: ``-`` for a sure link (``i-j``), ``?`` for a possible one (``i?j``)."""
    return "-" if "-" in link else "?"


def reversed_links(line: str) -> str:
    """A Pharaoh line of the other direction: each link ``i-j`` (``i?j``) as ``j-i`` (``j?i``)."""
    swapped = []
    for link in line.split():
        sep = link_sign(link)
        i, j = link.split(sep, 1)
        swapped.append(f"{j}{sep}{i}")
    return " ".join(swapped)


def check_within(where: str, links: Iterable[tuple[int, int]], src: str, tgt: str) -> None:
    """Every link (source word, target word) within the pair's whitespace words, else a UserError at ``where``
    (file:line): a link past the end would be scored as a miss, or trained towards a word that is not there."""
    n_src, n_tgt = len(src.split()), len(tgt.split())
    for i, j in sorted(links):
        if i >= n_src or j >= n_tgt:
            raise UserError(
                f"{where}: link {i}-{j} is past the end of the pair's words ({n_src} source, {n_tgt} target)"
            )


def pharaoh_line(links: set[tuple[int, int]]) -> str:
    """(source word, target word) links as one Pharaoh line, ``i-j`` in the order of the target words."""
    return " ".join(f"{i}-{j}" for i, j in sorted(links, key=lambda link: (link[1], link[0])))


def pieces_to_words(words: Sequence[int]) -> np.ndarray:
    """(words, pieces) 0/1 matrix: which pieces make up each whitespace word, from each piece's word number
    (-1: of none, such as ``</s>``)."""
    numbers = np.asarray(words, dtype=np.intp)
    return (np.arange(max(numbers.max(initial=-1) + 1, 0))[:, None] == numbers[None, :]).astype(np.float64)


def piece_links(
    links: set[tuple[int, int]], src_words: Sequence[int], tgt_words: Sequence[int]
) -> list[tuple[int, int]]:
    """(source word, target word) links -> the (target piece, source piece) cells of those words, given each
    piece's word number."""
    src, tgt = (np.asarray(words, dtype=np.intp) for words in (src_words, tgt_words))
    linked = np.zeros((tgt.max(initial=-1) + 2, src.max(initial=-1) + 2), dtype=bool)  # row/col -1: none
    for s, t in links:
        if 0 <= s < linked.shape[1] - 1 and 0 <= t < linked.shape[0] - 1:
            linked[t, s] = True
    cells = np.nonzero(linked[tgt[:, None], src[None, :]])  # row-major: by target piece, then source
    return list(zip(cells[0].tolist(), cells[1].tolist()))


def word_attention(maps, src_words: Sequence[int], tgt_words: Sequence[int]) -> np.ndarray:
    """Attention maps (views, tgt pieces, src pieces) -> (views, target words, source words): pieces summed into
    words (pieces of no word, such as ``</s>``, left out)."""
    to_src, to_tgt = pieces_to_words(src_words), pieces_to_words(tgt_words)
    return to_tgt @ np.asarray(maps, dtype=np.float64) @ to_src.T


def most_attended(maps, src_words: Sequence[int], tgt_words: Sequence[int]) -> np.ndarray:
    """Attention maps (views, tgt pieces, src pieces) -> (views, target words): the most attended source word of
    every target word, pieces summed into words (no columns where either side has no word)."""
    merged = word_attention(maps, src_words, tgt_words)
    if not merged.shape[1] or not merged.shape[2]:
        return np.zeros((len(maps), 0), dtype=np.int64)
    return merged.argmax(-1)


def word_probabilities(maps, src_words: Sequence[int], tgt_words: Sequence[int]) -> np.ndarray:
    """Attention maps (views, tgt pieces, src pieces) -> (views, target words, source words): each target word's
    attention over the source words, pieces summed into words, as a distribution (a row that attends to no word,
    only to ``</s>``, stays zeros)."""
    merged = word_attention(maps, src_words, tgt_words)
    rows = merged.sum(-1, keepdims=True)
    return np.divide(merged, rows, out=np.zeros_like(merged), where=rows > 0)


def word_links(best) -> set[tuple[int, int]]:
    """One view's ``most_attended`` row as (source word, target word) links."""
    return {(int(i), j) for j, i in enumerate(best)}


def hard_alignments(maps, src_words: Sequence[int], tgt_words: Sequence[int]) -> list[set[tuple[int, int]]]:
    """Attention maps (views, tgt pieces, src pieces) -> per view {(source word, target word)}: pieces
    summed into words, then the most attended source word for every target word."""
    return [word_links(best) for best in most_attended(maps, src_words, tgt_words)]


def hard_alignment(weights, src_words: Sequence[int], tgt_words: Sequence[int]) -> set[tuple[int, int]]:
    """``hard_alignments`` of one (tgt pieces, src pieces) map."""
    return hard_alignments(np.asarray(weights, dtype=np.float64)[None], src_words, tgt_words)[0]


def reference_links(data_dir: str, split: str) -> Optional[str]:
    """``<data_dir>/<split>.align`` when the corpus has reference links for the split (app/data/prepare.py)."""
    path = os.path.join(data_dir, f"{split}.align")
    return path if os.path.exists(path) else None
