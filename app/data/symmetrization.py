"""Two directions' word links made one: intersection, union and grow-diag-final-and (Koehn, Och & Marcu 2003,
"Statistical Phrase-Based Translation"; the heuristic of Moses' symal and fast_align's atools). What make align
and make eval do with a model of each direction (app/evaluation/extraction.py), and what eflomal's forward and
reverse links become before they guide training (app/data/aligner.py).

Links are (source word, target word) pairs, both directions' in that orientation (the reverse direction's links
turned around first)."""

from __future__ import annotations

from collections.abc import Callable

Links = set[tuple[int, int]]

# the neighbours grow-diag looks at: the four sides and the four diagonals
NEIGHBOURS = ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))


def intersection(forward: Links, reverse: Links) -> Links:
    """The links both directions make: high precision."""
    return forward & reverse


def union(forward: Links, reverse: Links) -> Links:
    """The links either direction makes: high recall."""
    return forward | reverse


def grow_diag_final_and(forward: Links, reverse: Links) -> Links:
    """The intersection, grown by the other links of the union (grow-diag): a candidate is added when one of its
    eight neighbours (sides and diagonals) is a link already and one of its two words is still unaligned;
    candidates are tried in order of source word, then target word, again and again until a pass adds none.
    Then final-and: the links of the forward, then of the reverse direction (in the same order) whose two words
    are both still unaligned. As fast_align's atools computes it."""
    links = forward & reverse
    aligned_src, aligned_tgt = {s for s, _ in links}, {t for _, t in links}

    def add(link: tuple[int, int]) -> None:
        links.add(link)
        aligned_src.add(link[0])
        aligned_tgt.add(link[1])

    candidates = sorted((forward | reverse) - links)
    grown = True
    while grown:
        grown = False
        for s, t in candidates:
            if (s, t) in links or (s in aligned_src and t in aligned_tgt):
                continue
            if any((s + ds, t + dt) in links for ds, dt in NEIGHBOURS):
                add((s, t))
                grown = True
    for direction in (forward, reverse):
        for s, t in sorted(direction):
            if s not in aligned_src and t not in aligned_tgt:
                add((s, t))
    return links


SYMMETRIZATIONS: dict[str, Callable[[Links, Links], Links]] = {
    "intersection": intersection,
    "union": union,
    "grow-diag-final-and": grow_diag_final_and,
}


def symmetrize(method: str, forward: Links, reverse: Links) -> Links:
    """The links of ``method`` (a SYMMETRIZATIONS name) from a pair's forward and reverse links."""
    return SYMMETRIZATIONS[method](forward, reverse)
