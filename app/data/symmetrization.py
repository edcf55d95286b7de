"""Two directions' word links made one: intersection, union and grow-diag-final-and (Koehn, Och & Marcu 2003,
"Statistical Phrase-Based Translation") as fast_align's atools grows it: each candidate of the union in turn, added
where a neighbour is linked, until none is. Koehn's pseudo-code and Moses' symal grow from each link's neighbours in
a fixed order instead, which ends elsewhere on some inputs (about one random link set in five: forward {0-1, 1-1},
reverse {0-0, 1-1} gives {0-0, 1-1} here, {0-0, 0-1, 1-1} there); atools is what eflomal's users run. And agreement of
the two directions' probabilities (Liang, Taskar & Klein 2006). What make align and make eval do with a model of
each direction (app/evaluation/extraction.py), and what eflomal's forward and reverse links become before they
guide training (app/data/aligner.py).

Links are (source word, target word) pairs, both directions' in that orientation (the reverse direction's links
turned around first)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

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


AGREEMENT = "agreement"
# the thresholds make eval and make align choose among on dev; the default where there are no dev links
AGREEMENT_THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
AGREEMENT_DEFAULT = 0.15  # between the KJV's dev choices: 0.1 unguided, 0.15 guided by eflomal's (docs/attention.md)


def agreement(forward: np.ndarray, reverse: np.ndarray, threshold: float) -> Links:
    """The links both directions' probabilities agree on, as Liang, Taskar & Klein (2006, "Alignment by
    Agreement") decode two directions' models: their posteriors multiplied, the links at or above a threshold,

        A = {(s, t) : p_fwd(s | t) · p_rev(t | s) ≥ threshold}.

    ``forward``: (target words, source words), each target word's distribution over the source words (the forward
    model's word attention); ``reverse``: (source words, target words), the reverse model's. Unlike the heuristics
    above, it reads how sure each direction is: a word may link to several words, or to none. Should the two
    models split a pair into different numbers of words (a character one tokenizer drops), their common words
    are read."""
    t_words, s_words = min(forward.shape[0], reverse.shape[1]), min(forward.shape[1], reverse.shape[0])
    product = forward[:t_words, :s_words] * reverse[:s_words, :t_words].T
    t, s = np.nonzero(product >= threshold)
    return {(int(i), int(j)) for i, j in zip(s, t)}


def symmetrize(method: str, forward: Links, reverse: Links) -> Links:
    """The links of ``method`` (a SYMMETRIZATIONS name) from a pair's forward and reverse links."""
    return SYMMETRIZATIONS[method](forward, reverse)
