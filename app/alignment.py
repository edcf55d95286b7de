"""What attention says about alignment: the views of a sentence's attention that plots and files
use, its entropy and monotonicity, and hard word alignments scored against gold alignments with AER
(Och & Ney 2003).

Gold files use the Pharaoh format: one line per sentence pair, ``i-j`` for a sure link between
source word i and target word j (0-based, whitespace words), ``i?j`` for a possible one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from app.data.tokenizer import EOS
from app.decoding import forced_attention
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


def attention_shape(attentions: list[torch.Tensor], layer: int = -1) -> dict:
    """Mean entropy and monotonicity over sentences of the map plots show (an RNN's attention, a
    Transformer layer's head average): how sharp and how diagonal attention is, one number each."""
    views = [layer_views(a, layer) for a in attentions]
    maps = [v["weights"] for v in views]
    return {
        "view": f"layer {views[0]['layer']} mean" if "layer" in views[0] else "attention",
        "entropy": round(sum(map(attention_entropy, maps)) / len(maps), 6),
        "monotonicity": round(sum(map(monotonicity, maps)) / len(maps), 6),
    }


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


def pieces_to_words(pieces: list[str]) -> np.ndarray:
    """(words, pieces) 0/1 matrix: which pieces make up each whitespace word (special tokens: none)."""
    words = np.asarray(word_index(pieces))
    return (np.arange(max(words.max(initial=-1) + 1, 0))[:, None] == words[None, :]).astype(np.float64)


def hard_alignments(maps, src_pieces: list[str], tgt_pieces: list[str]) -> list[set[tuple[int, int]]]:
    """Attention maps (views, tgt pieces, src pieces) -> per view {(source word, target word)}: pieces
    summed into words, then the most attended source word for every target word."""
    to_src, to_tgt = pieces_to_words(src_pieces), pieces_to_words(tgt_pieces)
    if not len(to_src) or not len(to_tgt):
        return [set() for _ in maps]
    merged = to_tgt @ np.asarray(maps, dtype=np.float64) @ to_src.T  # (views, tgt words, src words)
    return [{(int(i), j) for j, i in enumerate(best)} for best in merged.argmax(-1)]


def hard_alignment(weights, src_pieces: list[str], tgt_pieces: list[str]) -> set[tuple[int, int]]:
    """``hard_alignments`` of one (tgt pieces, src pieces) map."""
    return hard_alignments(np.asarray(weights, dtype=np.float64)[None], src_pieces, tgt_pieces)[0]


def piece_links(links: set[tuple[int, int]], src_pieces: list[str], tgt_pieces: list[str]) -> list[tuple[int, int]]:
    """(source word, target word) links -> the (target piece, source piece) cells of those words."""
    src_words, tgt_words = word_index(src_pieces), word_index(tgt_pieces)
    return [(t, s) for t, tw in enumerate(tgt_words) for s, sw in enumerate(src_words) if (sw, tw) in links]


def attention_views(attention: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Every map an alignment can be read from, named: an RNN's one map; for a Transformer (layers,
    heads, tgt, src), each head of each layer and each layer's mean of heads."""
    attention = attention.float()
    if attention.dim() == 2:
        return ["attention"], attention[None]
    layers, heads = attention.shape[:2]
    names = [f"layer {layer} head {head}" for layer in range(layers) for head in range(heads)]
    names += [f"layer {layer} mean" for layer in range(layers)]
    return names, torch.cat([attention.flatten(0, 1), attention.mean(1)])


ALIGN_SCOPES = ("all", "linked")


def align_scope(setting: Optional[str], gold_file: bool) -> str:
    """eval.align_scope, or where unset: "all" for a gold file (it annotates every word), "linked" for the
    corpus's own reference links (Strong's numbers leave function words untagged)."""
    return setting or ("all" if gold_file else "linked")


def alignment_view(a: dict) -> str:
    """Which attention an AER of metrics.json's ``alignment`` read, and over which words."""
    return f"{a['view']}, chosen on {a['chosen_on']}; {a['scope']} target words"


class AlignmentScore:
    """AER, precision and recall (Och & Ney 2003) of several views of the attention at once, over a
    corpus: AER = 1 - (|A∩S| + |A∩P|) / (|A| + |S|); precision = |A∩P| / |A|; recall = |A∩S| / |S|.

    ``scope``: "all" counts the predicted link of every target word (a gold file that annotates every
    word, a word without links being unaligned); "linked" only those of target words the gold links
    (a partial reference, such as Strong's numbers, which leave function words untagged: a link from
    "the" is then unknown, not wrong)."""

    def __init__(self, views: list[str], scope: str = "all"):
        if scope not in ALIGN_SCOPES:
            raise UserError(f"alignment scope {scope!r}: choose {' or '.join(ALIGN_SCOPES)}")
        self.views, self.scope = views, scope
        self.counts = np.zeros((len(views), 4), dtype=np.int64)  # |A|, |S|, |A∩S|, |A∩P| per view

    def add(self, links: list[set], sure: set, possible: set) -> None:
        """One sentence: each view's predicted links against the gold ones (possible includes sure)."""
        if self.scope == "linked":
            linked = {t for _, t in possible}
            links = [{(s, t) for s, t in predicted if t in linked} for predicted in links]
        for counts, predicted in zip(self.counts, links):
            counts += (len(predicted), len(sure), len(predicted & sure), len(predicted & possible))

    def result(self, view: str) -> dict:
        a, s, a_s, a_p = self.counts[self.views.index(view)].tolist()
        return {
            "aer": round(1 - (a_s + a_p) / max(a + s, 1), 4),
            "precision": round(a_p / max(a, 1), 4),
            "recall": round(a_s / max(s, 1), 4),
            "links": a,
        }

    def best(self) -> str:
        """The view with the lowest AER (the first of equals)."""
        return min(self.views, key=lambda view: self.result(view)["aer"])


def alignment_error_rate(predicted: list[set], gold: list[tuple[set, set]], scope: str = "all") -> dict:
    """AER, precision and recall of one set of predicted links per sentence."""
    if len(predicted) != len(gold):
        raise UserError(f"{len(predicted)} sentences to align but the gold file has {len(gold)} lines")
    score = AlignmentScore(["links"], scope)
    for links, (sure, possible) in zip(predicted, gold):
        score.add([links], sure, possible)
    return score.result("links")


def score_alignments(
    model,
    data,
    gold: list[tuple[set, set]],
    tokenizer,
    device,
    dtype,
    batch_tokens: int,
    keep: int = 0,
    scope: str = "all",
) -> tuple[Optional[AlignmentScore], dict]:
    """Every view of the teacher-forced attention of ``data`` (a ParallelData) scored against ``gold``
    (per pair: sure, possible links; ``scope`` as AlignmentScore's), and the attention of the first
    ``keep`` pairs (float16: for plots and the explorer). None, {} for a model without attention."""
    if len(gold) != len(data):
        raise UserError(f"{len(data)} sentences to align but the reference links have {len(gold)} lines")
    score, kept = None, {}
    for i, attention in forced_attention(model, data.src, data.tgt, device, batch_tokens, dtype):
        names, maps = attention_views(attention)
        score = score or AlignmentScore(names, scope)
        links = hard_alignments(
            maps.numpy(), tokenizer.src_pieces(data.src[i] + [EOS]), tokenizer.tgt_pieces(data.tgt[i] + [EOS])
        )
        score.add(links, *gold[i])
        if i < keep:
            kept[i] = attention.half()
    return score, kept
