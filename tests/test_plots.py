"""The one plotting path for every attention type, and the alignment scores it logs."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from app.evaluation.views import (
    attention_entropy,
    attention_shape,
    attention_views,
    figure_views,
    monotonicity,
    plotted_view,
    reattention,
)
from app.report.plots import (
    MAP_LEVELS,
    PALETTE,
    READABLE_PT,
    TENSORBOARD_WIDTH,
    alignment_figure,
    draw_pngs,
    figures,
    png_bytes,
    stacked_figure,
    tensorboard_tokens,
)


def decoded(png: bytes) -> np.ndarray:
    """A PNG's pixels as (height, width, 3) colours."""
    with Image.open(io.BytesIO(png)) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def test_rnn_attention_gives_one_labelled_map():
    weights = torch.softmax(torch.randn(3, 4), -1)
    figs = figures(figure_views(weights), ["a", "b", "c", "</s>"], ["x", "y", "</s>"])
    assert list(figs) == ["alignment"]
    picture = figs["alignment"]
    assert picture.src_tokens == ["a", "b", "c", "</s>"] and picture.tgt_tokens == ["x", "y", "</s>"]
    assert [panel.title for panel in picture.panels] == ["attention"]
    pixels = decoded(png_bytes(picture))
    assert pixels.shape[1] > 200 and (pixels == picture.rgb()).all()  # the PNG holds the picture, losslessly


def test_transformer_attention_gives_layer_and_head_views_named_once():
    attention = torch.softmax(torch.randn(3, 2, 5, 6), -1)  # layers, heads, tgt, src
    name, weights = plotted_view(attention, layer=-1)
    assert name == "layer 2 mean" and np.allclose(weights, attention[2].mean(0).numpy())
    names, maps = attention_views(attention, [1])
    assert names == ["layer 1 head 0", "layer 1 head 1", "layer 0 mean", "layer 1 mean", "layer 2 mean"]
    assert np.allclose(maps[1], attention[1, 1].numpy()) and np.allclose(maps[3], attention[1].mean(0).numpy())
    figs = figures(figure_views(attention, layer=0), list("abcdef"), list("vwxyz"))
    assert set(figs) == {"alignment", "layers", "heads_layer0"}
    assert [p.title for p in figs["alignment"].panels] == ["layer 0 mean"]  # the name every reader gives it
    assert [p.title for p in figs["layers"].panels] == [f"layer {i} mean" for i in range(3)]
    assert [p.title for p in figs["heads_layer0"].panels] == ["layer 0 head 0", "layer 0 head 1"]
    every = figures(figure_views(attention, layer=0, every_layer=True), list("abcdef"), list("vwxyz"))
    assert set(every) == {"alignment", "layers", "heads_layer0", "heads_layer1", "heads_layer2"}
    assert [p.title for p in every["heads_layer2"].panels] == ["layer 2 head 0", "layer 2 head 1"]
    with pytest.raises(ValueError, match="expected"):
        plotted_view(torch.rand(2, 3, 4))


def cell_colours(picture, panel) -> np.ndarray:
    """The colour at the centre of each cell of a panel: (tgt, src, 3)."""
    cell = panel.width / len(picture.src_tokens)
    xs = panel.x + ((np.arange(len(picture.src_tokens)) + 0.5) * cell).astype(int)
    ys = panel.y + ((np.arange(len(picture.tgt_tokens)) + 0.5) * cell).astype(int)
    return picture.rgb()[ys[:, None], xs[None, :]]


def viridis(weights) -> np.ndarray:
    return PALETTE[np.clip((np.asarray(weights) * MAP_LEVELS).astype(int), 0, MAP_LEVELS - 1)]


def is_ink(rgb: np.ndarray) -> np.ndarray:
    """Dark grey or black: text, ticks and frames (a map's darkest viridis is blue-purple, not grey)."""
    rgb = rgb.astype(int)
    return (rgb.max(-1) < 160) & (rgb.max(-1) - rgb.min(-1) < 8)


def test_every_panel_shows_its_own_map_and_colour_scale():
    """Each panel's cells have the colour of their weight (viridis, 0..1), beside a colour bar from 1
    (yellow, top) to 0 (purple, bottom): a figure that lost or swapped a panel fails."""
    maps = torch.softmax(torch.randn(3, 5, 7) * 3, -1).numpy()
    picture = stacked_figure(maps, list("abcdefg"), list("vwxyz"), ["first", "second", "third"], TENSORBOARD_WIDTH)
    assert [p.title for p in picture.panels] == ["first", "second", "third"]
    for panel, weights in zip(picture.panels, maps):
        assert (cell_colours(picture, panel) == viridis(weights)).all(), panel.title
        bar = picture.rgb()[panel.y : panel.y + panel.height, panel.x + panel.width + 6]
        assert (bar[0] == viridis(1.0)).all() and (bar[-1] == viridis(0.0)).all(), panel.title


def test_every_token_label_and_title_is_drawn_where_it_belongs():
    """Ink below each source column and left of each target row, as long as its token: a figure drawn
    without its labels (or with them misplaced) fails. And a title above each panel."""
    src = ["a" * n for n in range(1, 7)]  # labels of growing length
    tgt = ["b" * n for n in range(1, 5)]
    maps = np.full((2, len(tgt), len(src)), 0.5)
    picture = stacked_figure(maps, src, tgt, ["one", "two"])
    pixels = picture.rgb()
    cell = picture.panels[0].width / len(src)
    for panel in picture.panels:
        below = pixels[panel.y + panel.height + 6 : panel.y + panel.height + 65]  # past the ticks, above the next title
        extents = []
        for i in range(len(src)):
            column = is_ink(below[:, panel.x + int(i * cell) + 2 : panel.x + int((i + 1) * cell) - 2]).any(1)
            extents.append(int(column.sum()))
        assert all(0 < a < b for a, b in zip(extents, extents[1:])), extents
        left = pixels[:, : panel.x - 8]  # past the ticks
        extents = []
        for t in range(len(tgt)):
            row = is_ink(left[panel.y + int(t * cell) + 2 : panel.y + int((t + 1) * cell) - 2]).any(0)
            extents.append(int(row.sum()))
        assert all(0 < a < b for a, b in zip(extents, extents[1:])), extents
        assert is_ink(pixels[panel.y - 20 : panel.y - 3, panel.x : panel.x + panel.width]).sum() > 20  # the title
    blank = stacked_figure(maps, [""] * len(src), [""] * len(tgt), ["", ""])
    panel = blank.panels[0]
    assert not is_ink(blank.rgb()[panel.y + panel.height + 6 : panel.y + panel.height + 65, panel.x :]).any()
    assert not is_ink(blank.rgb()[panel.y : panel.y + panel.height, : panel.x - 8]).any()


def test_reference_links_are_outlined_over_their_cells():
    weights = np.full((3, 4), 0.25)
    sure, possible = [(0, 1)], [(2, 3)]
    picture = alignment_figure(weights, list("abcd"), list("xyz"), "forced", links=[sure, possible])
    panel, rgb = picture.panels[0], picture.rgb()
    cell = panel.width / 4
    red = (rgb == (255, 0, 0)).all(-1)

    outlines = np.zeros_like(red)

    def edge(t, s):  # the outline pixels of a cell (marked in ``outlines``)
        x0, y0 = panel.x + round(s * cell), panel.y + round(t * cell)
        x1, y1 = panel.x + round((s + 1) * cell), panel.y + round((t + 1) * cell)
        ring = np.ones((y1 - y0, x1 - x0), bool)
        ring[1:-1, 1:-1] = False
        outlines[y0:y1, x0:x1] |= ring
        return red[y0:y1, x0:x1][ring]

    assert edge(0, 1).all()  # solid
    assert 0.3 < edge(2, 3).mean() < 0.7  # dotted
    assert not edge(1, 1).any() and not (red & ~outlines).any()  # nowhere else
    assert (cell_colours(picture, panel)[1] == viridis(0.25)).all()


def test_drawn_pngs_are_the_figures_pngs():
    """What a worker process draws from numbers and strings is the figure drawn here."""
    maps = torch.softmax(torch.randn(2, 4, 5), -1).numpy()
    args = (maps, list("abcde"), list("wxyz"), ["h0", "h1"], TENSORBOARD_WIDTH)
    [(png, size)] = draw_pngs({"tag": args}).values()
    picture = stacked_figure(*args)
    assert png == png_bytes(picture) and size == picture.size == (TENSORBOARD_WIDTH, decoded(png).shape[0])


def test_entropy_and_monotonicity_known_answers():
    one_hot = torch.eye(3)
    assert attention_entropy(one_hot) == pytest.approx(0.0, abs=1e-6)
    assert attention_entropy(torch.full((2, 4), 0.25)) == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert monotonicity(one_hot) == 1.0  # diagonal
    assert monotonicity(torch.eye(3).flip(0)) == -1.0  # anti-diagonal: every pair in reverse order
    # Kendall's tau over attended positions 0, 2, 1: 2 pairs in order, 1 reversed
    assert monotonicity(torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]])) == pytest.approx(1 / 3)


def test_attention_shape_averages_the_plotted_map_over_sentences():
    """Eval's metrics.json and the dev scalars: the mean over sentences of the map plots show."""
    diagonal, uniform = torch.eye(3), torch.full((2, 4), 0.25)
    rnn = attention_shape([diagonal, uniform])
    assert rnn["view"] == "attention"
    assert rnn["entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item() / 2, abs=1e-6)
    assert rnn["monotonicity"] == 0.5  # the diagonal's 1 and the uniform map's 0 (no order)
    # re-attention: the diagonal's 0; the uniform map's second row pays 0.25 to each piece the first did: 1 / 2
    assert rnn["reattention"] == pytest.approx(0.25)
    layers = torch.stack([torch.eye(3).flip(0).expand(2, 3, 3), torch.eye(3).expand(2, 3, 3)])  # (layers, heads, t, s)
    plotted = dict(entropy=0.0, reattention=0.0)
    assert attention_shape([layers], layer=0) == {"view": "layer 0 mean", "monotonicity": -1.0, **plotted}
    assert attention_shape([layers], layer=-1) == {"view": "layer 1 mean", "monotonicity": 1.0, **plotted}


def test_reattention_known_answers():
    """See et al.'s coverage loss per row: 0 for each piece attended once, in any order; a map stuck on one column
    pays each later row's whole attention again."""
    assert reattention(torch.eye(3)) == 0.0
    assert reattention(torch.eye(4)[[2, 0, 3, 1]]) == 0.0
    assert reattention(torch.eye(3)[[0, 0, 0, 0]]) == pytest.approx(3 / 4)
    # rows (0.5, 0.5), (1, 0): the second pays min(1, 0.5) = 0.5 again: 0.5 / 2 rows
    assert reattention(torch.tensor([[0.5, 0.5], [1.0, 0.0]])) == pytest.approx(0.25)
    assert reattention(np.zeros((0, 3), dtype=np.float32)) == 0.0
    with pytest.raises(ValueError, match="expected \\(tgt, src\\)"):
        reattention(torch.zeros(2, 2, 3))


@pytest.mark.parametrize("n_src", [5, 12, tensorboard_tokens()])
def test_tensorboard_figures_are_its_width_with_readable_labels_and_every_head_as_large_as_one_map(n_src):
    """TensorBoard's IMAGES tab shows every image 350 px wide: drawn that wide, it is shown pixel for
    pixel; stacked in one column, each head keeps the size of the single map."""
    src, tgt = [f"▁s{i}" for i in range(n_src - 1)] + ["</s>"], [f"▁t{i}" for i in range(9)] + ["</s>"]
    attention = torch.softmax(torch.randn(2, 4, len(tgt), len(src)), -1)
    figs = figures(figure_views(attention, layer=-1), src, tgt, width_px=TENSORBOARD_WIDTH)
    for name, picture in figs.items():
        assert decoded(png_bytes(picture)).shape[1] == TENSORBOARD_WIDTH, name
    single = figs["alignment"].panels[0]
    heads = figs["heads_layer1"].panels
    assert len(heads) == 4
    for head in heads:
        assert head.width >= single.width - 1 and head.height >= single.height - 1
    assert figs["alignment"].fontsize >= READABLE_PT
    assert figs["alignment"].src_tokens == src


def test_a_file_is_drawn_at_a_fixed_size_per_token():
    short, long = (
        figures(figure_views(torch.softmax(torch.randn(4, n), -1)), list("a" * n), list("wxyz")) for n in (5, 40)
    )
    width = lambda figs: decoded(png_bytes(figs["alignment"])).shape[1]  # noqa: E731
    assert width(long) - width(short) == pytest.approx(35 * 22, abs=2)  # 0.22 in at 100 dpi per source token
