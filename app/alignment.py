"""What attention says about alignment: the views of a sentence's attention that plots and files
use, its entropy and monotonicity, and hard word alignments scored against gold alignments with AER
(Och & Ney 2003).

Gold files use the Pharaoh format: one line per sentence pair, ``i-j`` for a sure link between
source word i and target word j (0-based, whitespace words), ``i?j`` for a possible one.
"""

from __future__ import annotations

import numpy as np
import torch

from app.errors import UserError


def layer_views(attention: torch.Tensor, layer: int = -1) -> dict:
    """The views of one sentence's attention that plots and alignment files use.

    RNN (tgt, src): ``weights`` is the map itself. Transformer (layers, heads, tgt, src): ``weights``
    is the head average of ``layer``, ``head_weights`` its heads, ``layer_means`` every layer's head average.
    """
    attention = attention.float()
    if attention.dim() == 2:
        return {"weights": attention}
    if attention.dim() != 4:
        raise ValueError(
            f"attention of shape {tuple(attention.shape)}: expected (tgt, src) or (layers, heads, tgt, src)"
        )
    layer = layer % attention.size(0)
    return {
        "weights": attention[layer].mean(0),
        "head_weights": attention[layer],
        "layer": layer,
        "layer_means": attention.mean(1),
    }


def attention_entropy(weights: torch.Tensor) -> float:
    """Mean entropy (nats) of the attention rows: low when each target token looks at few source tokens."""
    w = weights.float().clamp_min(1e-12)
    return float(-(w * w.log()).sum(-1).mean())


def monotonicity(weights: torch.Tensor) -> float:
    """Share of target tokens whose most-attended source position does not move backwards: a
    diagonality score of an alignment (1.0 for a monotone one)."""
    argmax = weights.argmax(-1)
    if argmax.numel() < 2:
        return 1.0
    return float((argmax[1:] >= argmax[:-1]).float().mean())


WORD_START = "▁"  # SentencePiece marks the first piece of each whitespace word


def read_pharaoh(path: str) -> list[tuple[set, set]]:
    """Per line: (sure links, possible links); possible includes sure, as AER requires."""
    gold = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            sure, possible = set(), set()
            for link in line.split():
                sep = "-" if "-" in link else "?"
                try:
                    i, j = (int(x) for x in link.split(sep))
                except ValueError:
                    raise UserError(f"{path}:{line_no}: {link!r} is not an i-j or i?j alignment link") from None
                possible.add((i, j))
                if sep == "-":
                    sure.add((i, j))
            gold.append((sure, possible))
    return gold


def word_index(pieces: list[str]) -> list[int]:
    """Word number of every subword piece; -1 for special tokens such as </s>."""
    out, word = [], -1
    for piece in pieces:
        if piece.startswith("<") and piece.endswith(">"):
            out.append(-1)
            continue
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        out.append(word)
    return out


def hard_alignment(weights, src_pieces: list[str], tgt_pieces: list[str]) -> set[tuple[int, int]]:
    """Attention (tgt pieces, src pieces) -> {(source word, target word)}: pieces summed into words,
    then the most attended source word for every target word."""
    weights = np.asarray(weights, dtype=np.float64)
    src_words, tgt_words = word_index(src_pieces), word_index(tgt_pieces)
    n_src, n_tgt = max(src_words) + 1, max(tgt_words) + 1
    if n_src == 0 or n_tgt == 0:
        return set()
    merged = np.zeros((n_tgt, n_src))
    for t, tw in enumerate(tgt_words):
        for s, sw in enumerate(src_words):
            if tw >= 0 and sw >= 0:
                merged[tw, sw] += weights[t, s]
    return {(int(merged[j].argmax()), j) for j in range(n_tgt)}


def alignment_error_rate(predicted: list[set], gold: list[tuple[set, set]]) -> dict:
    """AER = 1 - (|A∩S| + |A∩P|) / (|A| + |S|); precision = |A∩P| / |A|; recall = |A∩S| / |S|."""
    if len(predicted) != len(gold):
        raise UserError(f"{len(predicted)} sentences to align but the gold file has {len(gold)} lines")
    a = s = a_s = a_p = 0
    for links, (sure, possible) in zip(predicted, gold):
        a, s = a + len(links), s + len(sure)
        a_s, a_p = a_s + len(links & sure), a_p + len(links & possible)
    return {
        "aer": round(1 - (a_s + a_p) / max(a + s, 1), 4),
        "precision": round(a_p / max(a, 1), 4),
        "recall": round(a_s / max(s, 1), 4),
        "links": a,
    }
