"""Alignment heatmaps for every attention type, one plotting path: attention tensor -> matplotlib
figure -> PNG bytes (files) or TensorBoard image.

Accepted shapes, from the model API: (tgt, src) for RNN attention, (layers, heads, tgt, src) for
Transformer cross-attention. Rows are target tokens (y axis), columns source tokens (x axis).
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from app.alignment import layer_views  # noqa: E402


def _draw(ax, weights: np.ndarray, src_tokens: list[str], tgt_tokens: list[str], title: str, labels: bool = True):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    if labels:
        ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=7)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title(title, fontsize=8)
    return image


def alignment_figure(weights, src_tokens: list[str], tgt_tokens: list[str], title: str = "", links=None):
    """One (tgt, src) map with token labels and a colour bar; ``links``: (sure, possible) lists of
    (target, source) cells outlined over it (reference word links, app.alignment.piece_links)."""
    weights = np.asarray(weights, dtype=np.float32)
    width = min(2.5 + 0.22 * len(src_tokens), 24)
    height = min(2.0 + 0.22 * len(tgt_tokens), 24)
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    image = _draw(ax, weights, src_tokens, tgt_tokens, title)
    for cells, style in zip(links or (), ({"linestyle": "-"}, {"linestyle": ":"})):
        for t, s in cells:
            ax.add_patch(plt.Rectangle((s - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.0, **style))
    ax.set_xlabel("source" + ("  (reference links: solid sure, dotted possible)" if links else ""))
    ax.set_ylabel("target")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    return fig


def grid_figure(maps, src_tokens: list[str], tgt_tokens: list[str], names: list[str], title: str = ""):
    """Several (tgt, src) maps, e.g. every head of a layer or every layer's head average, in a grid."""
    maps = np.asarray(maps, dtype=np.float32)
    cols = min(4, len(maps))
    rows = (len(maps) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), dpi=100, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(maps):
            image = _draw(ax, maps[i], src_tokens, tgt_tokens, names[i], labels=len(src_tokens) <= 30)
        else:
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.colorbar(image, ax=axes, fraction=0.02, pad=0.02)
    return fig


def figures(attention: torch.Tensor, src_tokens: list[str], tgt_tokens: list[str], layer: int = -1) -> dict:
    """name -> figure for one sentence: the alignment map; for Transformers also the head average of
    every layer (one grid) and every head of the chosen layer (one grid)."""
    views = layer_views(attention, layer)
    if "head_weights" not in views:
        return {"alignment": alignment_figure(views["weights"], src_tokens, tgt_tokens, "attention")}
    chosen = views["layer"]
    layers, heads = len(views["layer_means"]), len(views["head_weights"])
    return {
        "alignment": alignment_figure(views["weights"], src_tokens, tgt_tokens, f"layer {chosen}, mean of heads"),
        "layers": grid_figure(
            views["layer_means"],
            src_tokens,
            tgt_tokens,
            [f"layer {i}" for i in range(layers)],
            "mean of heads, every layer",
        ),
        "heads": grid_figure(
            views["head_weights"],
            src_tokens,
            tgt_tokens,
            [f"head {h}" for h in range(heads)],
            f"layer {chosen}, every head",
        ),
    }


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
