"""How beam search scores an ended hypothesis beyond its log p (GNMT: Wu et al. 2016, eq. 14): the length penalty
that its log p is divided by (``decode.length_penalty``, α), and the coverage penalty added to it
(``decode.coverage_penalty``, β), for every engine (app/decode/beam.py, app/decode/ct2_engine.py)."""

from __future__ import annotations

import torch


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty (Wu et al. 2016, eq. 14): lp(Y) = ((5 + |Y|) / 6)^α."""
    return ((5 + length) / 6) ** alpha


def coverage_penalty(coverage: torch.Tensor, beta: float) -> torch.Tensor:
    """GNMT's coverage penalty (Wu et al. 2016, eq. 14), per row of ``coverage`` (rows, source positions: the
    attention each position got, summed over the target steps): cp = β Σ_i log(min(Σ_j p_ij, 1)), ≤ 0, lowest for
    a hypothesis that leaves source positions unread. Positions never attended count 0, as CTranslate2's
    coverage_penalty counts them (GNMT's log 0 is −∞): padding, and with local attention the words outside every
    window."""
    read = coverage.clamp(max=1.0).log().masked_fill_(coverage <= 0, 0.0)
    return beta * read.sum(-1)
