"""The views of one sentence's attention, named once for every reader (plots, TensorBoard, AER, the
attention files, the explorer), three numbers read from a view (entropy, monotonicity, re-attention), and the views an
evaluation keeps of a sentence's attention (``store_attention``: uint8, what the attention files hold).

An RNN's attention (tgt, src) has one view, ``attention``. A Transformer's cross-attention (layers, heads,
tgt, src) has ``layer L head H`` for each head and ``layer L mean`` for each layer's mean of heads; the
view plots show is ``layer viz.layer mean``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from app.models.coverage import coverage_loss

RNN_VIEW = "attention"


def as_array(weights) -> np.ndarray:
    """Attention (a torch tensor on any device, or an array) as float32 numpy, without a copy where it can.
    Per-sentence arithmetic is done in numpy: torch's small ops wait on its second thread when the
    cores are busy (docs/benchmarking.md#measurements-behind-the-code)."""
    if isinstance(weights, torch.Tensor):
        return weights.detach().float().cpu().numpy()
    return np.asarray(weights, dtype=np.float32)


def check_shape(attention: np.ndarray) -> np.ndarray:
    if attention.ndim not in (2, 4):
        raise ValueError(f"attention of shape {attention.shape}: expected (tgt, src) or (layers, heads, tgt, src)")
    return attention


def head_name(layer: int, head: int) -> str:
    return f"layer {layer} head {head}"


def mean_name(layer: int) -> str:
    return f"layer {layer} mean"


def attention_views(attention, heads_of: Union[str, Sequence[int]] = "all") -> tuple[list[str], np.ndarray]:
    """(names, maps (views, tgt, src)) of one sentence's attention: an RNN's one map; of a Transformer, the
    heads of the layers ``heads_of`` (a list of layers, or "all"), then every layer's mean of heads."""
    attention = check_shape(as_array(attention))
    if attention.ndim == 2:
        return [RNN_VIEW], attention[None]
    layers, heads = attention.shape[:2]
    kept = list(range(layers)) if heads_of == "all" else [layer % layers for layer in heads_of]
    names = [head_name(n, h) for n in kept for h in range(heads)] + [mean_name(n) for n in range(layers)]
    return names, np.concatenate([attention[kept].reshape(-1, *attention.shape[2:]), attention.mean(1)])


def named_view(attention, name: str) -> np.ndarray:
    """The map of one sentence's attention that ``attention_views`` names ``name``."""
    names, maps = attention_views(attention)
    return maps[names.index(name)]


def plotted_view(attention, layer: int = -1) -> tuple[str, np.ndarray]:
    """The view plots show and entropy and monotonicity read: an RNN's map, a Transformer's ``layer`` mean of
    heads (computed alone: the other views are not needed)."""
    attention = check_shape(as_array(attention))
    if attention.ndim == 2:
        return RNN_VIEW, attention
    layer %= attention.shape[0]
    return mean_name(layer), attention[layer].mean(0)


def figure_views(attention, layer: int = -1, every_layer: bool = False) -> dict[str, tuple[np.ndarray, list[str]]]:
    """figure name -> (maps, their titles) for the pictures of one sentence's attention: ``alignment`` (the
    plotted view); for Transformers also ``layers`` (every layer's mean of heads, one column) and
    ``heads_layerN`` (the heads of layer ``layer``, of every layer with ``every_layer``)."""
    attention = check_shape(as_array(attention))
    if attention.ndim == 2:
        return {"alignment": (attention[None], [RNN_VIEW])}
    layers, heads = attention.shape[:2]
    layer %= layers
    shown = list(range(layers)) if every_layer else [layer]
    names, maps = attention_views(attention, shown)
    means = len(shown) * heads
    out = {
        "alignment": (maps[means + layer][None], [names[means + layer]]),
        "layers": (maps[means:], names[means:]),
    }
    for n, kept in enumerate(shown):
        out[f"heads_layer{kept}"] = (maps[n * heads : (n + 1) * heads], names[n * heads : (n + 1) * heads])
    return out


def self_attention_axes(kind: str, src_pieces: list[str], tgt_pieces: list[str]) -> tuple[list[str], list[str]]:
    """(rows, columns) of a Transformer's self-attention map of ``kind``, given the source's and the target's pieces
    (each with its ``</s>``): the encoder's source over the source; the decoder's positions, named by the piece
    each writes, over the inputs they read (``<s>`` and the target's pieces before the last)."""
    if kind == "encoder":
        return src_pieces, src_pieces
    return tgt_pieces, ["<s>", *tgt_pieces[:-1]]


def attention_entropy(weights) -> float:
    """Mean entropy (nats) of the attention rows: low when each target token looks at few source tokens."""
    w = np.maximum(as_array(weights), np.float32(1e-12))
    return float(-(w * np.log(w)).sum(-1).mean())


def monotonicity(weights) -> float:
    """How diagonal a (tgt, src) map is: Kendall's tau-b (Kendall 1945, Biometrika 33(3)) between each target
    piece's position and the source position it attends (its row's argmax; the mean column where several tie),
    over the rows that are not flat (the peak at least twice the mean of the other S - 1 weights). 1 for a
    diagonal, -1 for a reversed one, 0 where there is no order: a flat map, one stuck on one column (fewer than
    2 counted rows or one attended position: 0). Several target pieces on one source piece are ties, so a
    staircase scores a little under 1. Kendall rather than Spearman: its definition handles ties, and a few
    stray rows move it less (Croux & Dehon 2010)."""
    w = as_array(weights)
    if w.ndim != 2:
        raise ValueError(f"attention map of shape {w.shape}: expected (tgt, src)")
    w = w.astype(np.float64)
    n_src = w.shape[1]
    if w.shape[0] < 2 or n_src == 0:
        return 0.0
    peak, total = w.max(-1), w.sum(-1)
    counted = (total > 0) & (peak * (n_src + 1) >= 2 * total)
    if counted.sum() < 2:
        return 0.0
    at_peak = w[counted] == peak[counted, None]
    attended = (at_peak @ np.arange(n_src, dtype=np.float64)) / at_peak.sum(-1)
    n = attended.size
    order = np.sign(attended[None, :] - attended[:, None])  # [i, j]: +1 where j > i attends further on
    pairs = n * (n - 1) // 2
    tied = (int((order == 0).sum()) - n) // 2
    if tied == pairs:
        return 0.0
    return float(np.triu(order, 1).sum() / np.sqrt(pairs * (pairs - tied)))


def reattention(weights) -> float:
    """How much attention a (tgt, src) map pays again to source pieces earlier rows attended: See et al.'s coverage
    loss per target piece (app/models/coverage.py), mean over rows of Σ_j min(α_tj, Σ_{t'<t} α_t'j). 0 when each
    source piece is attended once in all (a diagonal, however long), near 1 when every row attends where earlier
    ones did (a map stuck on one column; a model that repeats itself)."""
    w = as_array(weights)
    if w.ndim != 2:
        raise ValueError(f"attention map of shape {w.shape}: expected (tgt, src)")
    if w.shape[0] == 0:
        return 0.0
    return float(coverage_loss(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))) / w.shape[0]


def attention_shape(attentions: list, layer: int = -1) -> dict:
    """Mean entropy, monotonicity and re-attention over sentences of the plotted view: how sharp and how diagonal
    attention is, and how much of it goes back to pieces already attended, one number each."""
    views = [plotted_view(a, layer) for a in attentions]
    mean = lambda measure: round(sum(measure(m) for _, m in views) / len(views), 6)  # noqa: E731
    return {
        "view": views[0][0],
        "entropy": mean(attention_entropy),
        "monotonicity": mean(monotonicity),
        "reattention": mean(reattention),
    }


SCALE = 255  # stored value v means weight v / 255 (within 1/510 of the weight)
SELF_ATTENTION = ("encoder", "decoder")  # a Transformer's self-attention: source over source, target over target


@dataclass
class StoredAttention:
    """What the attention files and the explorer keep of one sentence's attention: named views
    (``attention_views`` names) as uint8 maps (views, rows, src), and the attention's own shape."""

    names: list[str]
    maps: np.ndarray  # uint8: weight = value / SCALE
    layers: int  # 0 for an RNN's (or CTranslate2's) single map
    heads: int
    head_layers: list[int]  # the layers whose heads are kept
    entropy: float  # mean row entropy (nats) of the whole attention, every head of every layer
    monotonicity: float  # of the plotted view (layer ``layer``'s mean of heads, an RNN's map), before quantizing
    reattention: float  # of the plotted view, before quantizing


def store_attention(attention, layer: int = -1, keep: str = "layer") -> StoredAttention:
    """The views of ``attention`` (tgt, src) or (layers, heads, tgt, src) that ``keep`` keeps: an RNN's one
    map; of a Transformer, the heads of layer ``layer`` ("layer") or of every layer ("all"), then every
    layer's mean of heads. Quantized to uint8 (rounded, so within 1/510 of the weight)."""
    attention = check_shape(as_array(attention))
    layers, heads = attention.shape[:2] if attention.ndim == 4 else (0, 0)
    kept = (list(range(layers)) if keep == "all" else [layer % layers]) if layers else []
    names, maps = attention_views(attention, kept)
    quantized = np.rint(np.clip(maps, 0.0, 1.0) * SCALE).astype(np.uint8)
    plotted = plotted_view(attention, layer)[1]
    return StoredAttention(
        names, quantized, layers, heads, kept, attention_entropy(attention), monotonicity(plotted), reattention(plotted)
    )
