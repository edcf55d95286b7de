"""What each self-attention head does over a split, after Voita et al. 2019 ("Analyzing Multi-Head Self-Attention:
Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned", ACL): a head's *confidence*, the mean over the
pieces of its largest weight (theirs leaves the end of sentence out; here every piece counts), and where its
largest weight falls relative to the piece's own position (column - row: -1 the piece before, 0 the piece
itself, +1 the one after). A head whose largest weight falls on one relative position for at least 90 % of the
pieces is *positional* (their section 5.1). In the decoder, the position is that of the input a row reads: 0 is
the piece it was just given (the one written before the row's), -1 the one before that."""

from __future__ import annotations

from typing import Optional

import numpy as np

from app.evaluation.views import as_array

OFFSETS = (-1, 0, 1)
POSITIONAL = 0.9  # the share of pieces at one relative position that makes a head positional


def offset_name(offset: int) -> str:
    return f"{offset:+d}" if offset else "0"


class HeadRoles:
    """Counts, per layer and head, over the sentences ``add``ed: the sum of each piece's largest weight and how
    many pieces put it at each of OFFSETS."""

    def __init__(self) -> None:
        self.pieces = 0
        self.peaks: Optional[np.ndarray] = None  # (layers, heads)
        self.at: Optional[np.ndarray] = None  # (layers, heads, len(OFFSETS))

    def add(self, weights) -> None:
        """One sentence's self-attention, (layers, heads, pieces, pieces): row i is the piece of column i."""
        w = as_array(weights)
        where = w.argmax(-1) - np.arange(w.shape[-2])  # (layers, heads, pieces): the largest weight's offset
        peaks, at = w.max(-1).sum(-1), np.stack([(where == k).sum(-1) for k in OFFSETS], -1)
        self.peaks = peaks if self.peaks is None else self.peaks + peaks
        self.at = at if self.at is None else self.at + at
        self.pieces += w.shape[-2]

    def result(self) -> list[list[dict]]:
        """Per layer, per head: ``confidence``, ``offsets`` (the share of pieces whose largest weight is at -1, 0,
        +1) and ``positional`` (the offset of a positional head, else None)."""
        if self.peaks is None or self.at is None:  # no sentence added
            return []
        confidence, shares = self.peaks / self.pieces, self.at / self.pieces
        heads = []
        for layer in range(shares.shape[0]):
            row = []
            for head in range(shares.shape[1]):
                share = shares[layer, head]
                best = int(share.argmax())
                row.append(
                    {
                        "confidence": round(float(confidence[layer, head]), 4),
                        "offsets": {offset_name(k): round(float(s), 4) for k, s in zip(OFFSETS, share)},
                        "positional": OFFSETS[best] if share[best] >= POSITIONAL else None,
                    }
                )
            heads.append(row)
        return heads


def summary(heads: list[list[dict]]) -> str:
    """One line of ``HeadRoles.result()``: the heads' mean confidence and the positional heads, e.g.
    ``confidence 0.41; positional: layer 0 head 1 (+1, 97%)``."""
    confidence = sum(h["confidence"] for row in heads for h in row) / max(sum(map(len, heads)), 1)
    positional = [
        f"layer {layer} head {head} ({offset_name(h['positional'])}, {max(h['offsets'].values()):.0%})"
        for layer, row in enumerate(heads)
        for head, h in enumerate(row)
        if h["positional"] is not None
    ]
    return f"confidence {confidence:.2f}; positional: {', '.join(positional) or 'none'}"


def positional_count(heads: list[list[dict]]) -> str:
    """``3/48``: how many of the heads of ``HeadRoles.result()`` are positional."""
    return f"{sum(h['positional'] is not None for row in heads for h in row)}/{sum(map(len, heads))}"
