"""Alignment heatmaps for every attention type, one plotting path: attention tensor -> matplotlib
figure -> PNG bytes (files) or TensorBoard image.

Accepted shapes, from the model API: (tgt, src) for RNN attention, (layers, heads, tgt, src) for
Transformer cross-attention. Rows are target tokens (y axis), columns source tokens (x axis).

Sizes. A file is drawn at a fixed size per token. TensorBoard's IMAGES tab shows every image
``TENSORBOARD_WIDTH`` pixels wide, scaling it to fit: a figure for it is drawn that wide, so that it is
shown pixel for pixel, and several maps (the heads of a layer, the layers) are stacked in one column,
each as large as a single map. Token labels stay readable when the source has at most
``tensorboard_tokens()`` pieces (validation picks such sentences; app/validation.py).
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from app.alignment import layer_views  # noqa: E402

DPI = 100
TENSORBOARD_WIDTH = 350  # px: the width TensorBoard's IMAGES tab gives every image (measured, TensorBoard 2.21)
FILE_CELL = 0.22  # inches per token in a file
LABEL_PT = 7  # token label size; at DPI 100, 7 pt is 9.7 px
READABLE_PT = 6  # the smallest label a TensorBoard-sized map uses for a long source (8.3 px)
MARGIN_X, MARGIN_Y = 1.25, 1.0  # inches around a map: target labels and colour bar / source labels and title


def tensorboard_tokens() -> int:
    """The most source pieces a TensorBoard-sized map labels readably: one label height per column."""
    return int((TENSORBOARD_WIDTH / DPI - MARGIN_X) / (READABLE_PT / 72))


def _cell(n_src: int, width_px: int | None) -> float:
    """Inches per token: fixed for files; what fits ``width_px`` for TensorBoard."""
    return FILE_CELL if width_px is None else (width_px / DPI - MARGIN_X) / max(n_src, 1)


def _draw(ax, weights: np.ndarray, src_tokens: list[str], tgt_tokens: list[str], title: str, fontsize: float):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=fontsize)
    ax.set_title(title, fontsize=fontsize + 1)
    return image


def stacked_figure(maps, src_tokens: list[str], tgt_tokens: list[str], names: list[str], width_px: int | None = None):
    """(tgt, src) maps stacked in one column, each with its token labels and title, all at the size of
    a single map; ``width_px``: the figure's width in pixels (None: a fixed size per token)."""
    maps = np.asarray(maps, dtype=np.float32)
    cell = _cell(len(src_tokens), width_px)
    fontsize = min(LABEL_PT, cell * 72)  # a label no taller than its column is wide
    width = len(src_tokens) * cell + MARGIN_X
    panel = len(tgt_tokens) * cell + MARGIN_Y
    fig, axes = plt.subplots(len(maps), 1, figsize=(width, panel * len(maps)), dpi=DPI, squeeze=False)
    for ax, weights, name in zip(axes[:, 0], maps, names):
        image = _draw(ax, weights, src_tokens, tgt_tokens, name, fontsize)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02).ax.tick_params(labelsize=fontsize)
    # margins in inches, whatever the size: room for the labels (title above, source labels below,
    # MARGIN_Y in all), and the same map size in every panel
    height = panel * len(maps)
    top, bottom = 0.3, MARGIN_Y - 0.3
    fig.subplots_adjust(
        left=0.9 / width,
        right=1 - 0.35 / width,
        top=1 - top / height,
        bottom=bottom / height,
        hspace=MARGIN_Y / (len(tgt_tokens) * cell),
    )
    return fig


def alignment_figure(
    weights, src_tokens: list[str], tgt_tokens: list[str], title: str = "", links=None, width_px: int | None = None
):
    """One (tgt, src) map with token labels and a colour bar; ``links``: (sure, possible) lists of
    (target, source) cells outlined over it (reference word links, app.alignment.piece_links)."""
    fig = stacked_figure([weights], src_tokens, tgt_tokens, [title], width_px)
    ax = fig.axes[0]
    for cells, style in zip(links or (), ("-", ":")):
        for t, s in cells:
            ax.add_patch(
                plt.Rectangle((s - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.0, linestyle=style)
            )
    if links:
        ax.set_xlabel("reference links: solid sure, dotted possible", fontsize=ax.title.get_fontsize() - 1)
    return fig


def figures(
    attention: torch.Tensor,
    src_tokens: list[str],
    tgt_tokens: list[str],
    layer: int = -1,
    every_layer: bool = False,
    width_px: int | None = None,
) -> dict:
    """name -> figure for one sentence: the alignment map; for Transformers also the head average of
    every layer (one column) and the heads of the chosen layer (``heads_layerN``; of every layer with
    ``every_layer``), each layer's heads in one figure."""
    views = layer_views(attention, layer)
    if "head_weights" not in views:
        return {"alignment": alignment_figure(views["weights"], src_tokens, tgt_tokens, "attention", width_px=width_px)}
    chosen, attention = views["layer"], attention.float()
    layers, heads = attention.shape[:2]
    out = {
        "alignment": alignment_figure(
            views["weights"], src_tokens, tgt_tokens, f"layer {chosen}, mean of heads", width_px=width_px
        ),
        "layers": stacked_figure(
            views["layer_means"], src_tokens, tgt_tokens, [f"layer {i}, mean of heads" for i in range(layers)], width_px
        ),
    }
    for i in range(layers) if every_layer else [chosen]:
        names = [f"layer {i}, head {h}" for h in range(heads)]
        out[f"heads_layer{i}"] = stacked_figure(attention[i], src_tokens, tgt_tokens, names, width_px)
    return out


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
