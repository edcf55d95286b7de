"""Alignment heatmaps for every attention type, one drawing path: attention -> its views -> a ``Picture``
(the figure's pixels) -> PNG bytes, for files and for TensorBoard (app/report/board.py).

Accepted shapes, from the model API: (tgt, src) for RNN attention, (layers, heads, tgt, src) for
Transformer cross-attention. Rows are target tokens (y axis), columns source tokens (x axis).

Sizes. A file is drawn at a fixed size per token. TensorBoard's IMAGES tab shows every image
``TENSORBOARD_WIDTH`` pixels wide, scaling it to fit: a figure for it is drawn that wide, so that it is
shown pixel for pixel, and several maps (the heads of a layer, the layers) are stacked in one column,
each as large as a single map. Token labels stay readable when the source has at most
``tensorboard_tokens()`` pieces (validation picks such sentences; app/train/validation.py).

How. A figure is composed in numpy rather than by matplotlib's Axes, whose tick machinery cost most of a
second per figure: a panel's token labels, ticks, frame and colour bar are drawn once per figure and
copied to each panel, each map is its weights repeated to its cells' pixels, and the pixels are indices
into one 256-colour palette (matplotlib's viridis for the maps, grey levels for text), which PNG stores
at one byte a pixel. Text is rendered by matplotlib's FreeType engine in its default font, each string
once per process. A panel costs what its pixels cost.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import get_hinting_flag
from matplotlib.font_manager import FontProperties, findfont, get_font
from PIL import Image

DPI = 100
TENSORBOARD_WIDTH = 350  # px: the width TensorBoard's IMAGES tab gives every image (measured, TensorBoard 2.21)
FILE_CELL = 0.22  # inches per token in a file
LABEL_PT = 7  # token label size; at DPI 100, 7 pt is 9.7 px
READABLE_PT = 6  # the smallest label a TensorBoard-sized map uses for a long source (8.3 px)
MARGIN_X, MARGIN_Y = 1.25, 1.0  # inches around a map: target labels and colour bar / source labels and title
LEFT, TOP = 0.9, 0.3  # inches of those margins left of a map (target labels) and above it (title)
TICK, PAD = 4, 3  # px: tick length, and the gap between a tick and its label

# the palette: MAP_LEVELS viridis colours for weights 0..1, then grey levels from INK (black) to PAPER (white)
# for text and its anti-aliasing, then the colour of reference links
MAP_LEVELS, GREY_LEVELS = 200, 32
INK, PAPER = MAP_LEVELS, MAP_LEVELS + GREY_LEVELS - 1
LINK = PAPER + 1
PALETTE = np.zeros((256, 3), np.uint8)
PALETTE[:MAP_LEVELS] = np.round(colormaps["viridis"]((np.arange(MAP_LEVELS) + 0.5) / MAP_LEVELS)[:, :3] * 255)
PALETTE[INK : PAPER + 1] = np.round(np.linspace(0, 255, GREY_LEVELS))[:, None]
PALETTE[LINK] = (255, 0, 0)


def tensorboard_tokens() -> int:
    """The most source pieces a TensorBoard-sized map labels readably: one label height per column."""
    return int((TENSORBOARD_WIDTH / DPI - MARGIN_X) / (READABLE_PT / 72))


@dataclass
class Panel:
    """One map of a figure: its title and the box of its cells in the picture's pixels."""

    title: str
    x: int
    y: int
    width: int
    height: int


@dataclass
class Picture:
    """A drawn figure: ``pixels`` (height, width) are indices into ``PALETTE``; ``panels`` the maps stacked in
    it, top to bottom, each labelled with ``src_tokens`` (below, one per column) and ``tgt_tokens`` (left,
    one per row) at ``fontsize`` points."""

    pixels: np.ndarray
    panels: list[Panel]
    src_tokens: list[str]
    tgt_tokens: list[str]
    fontsize: float

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.pixels.shape[1], self.pixels.shape[0]

    def rgb(self) -> np.ndarray:
        """The pixels as (height, width, 3) colours."""
        return PALETTE[self.pixels]


@functools.lru_cache(maxsize=1)
def _font():
    return get_font(findfont(FontProperties()))  # matplotlib's default font, as its Axes would use


@functools.lru_cache(maxsize=16)
def _line_box(size: float) -> tuple[int, int]:
    """(ascent, descent) in px of a line of text at ``size`` points: every string is drawn in a box this
    high, its baseline ``ascent`` from the top, so that labels of one axis line up."""
    font = _font()
    scale = size * DPI / 72 / font.units_per_EM
    return int(np.ceil(font.ascender * scale)), int(np.ceil(-font.descender * scale))


@functools.lru_cache(maxsize=16384)
def _text(text: str, size: float) -> np.ndarray:
    """``text`` at ``size`` points on one line box, as palette greys (PAPER where there is no ink)."""
    ascent, descent = _line_box(size)
    font = _font()
    font.clear()
    font.set_size(size, DPI)
    font.set_text(text, 0.0, flags=get_hinting_flag())
    font.draw_glyphs_to_bitmap(antialiased=True)
    coverage = np.asarray(font.get_image())
    height, width = coverage.shape
    line = np.zeros((ascent + descent, width if text else 0), np.uint8)
    # the bitmap's bottom row is the string's own descent below the baseline
    top = ascent - height + round(font.get_descent() / 64)
    src, dst = max(0, -top), max(0, top)
    rows = min(height - src, line.shape[0] - dst)
    if rows > 0 and text:
        line[dst : dst + rows] = coverage[src : src + rows]
    out = (PAPER - (line.astype(np.uint16) * (GREY_LEVELS - 1) + 127) // 255).astype(np.uint8)
    out.flags.writeable = False
    return out


def _ink(canvas: np.ndarray, image: np.ndarray, x: int, y: int) -> None:
    """Put text ``image`` (greys) on ``canvas`` with its top-left corner at (x, y), clipped to the canvas;
    overlapping text keeps the darker grey."""
    h, w = image.shape
    x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + w, canvas.shape[1]), min(y + h, canvas.shape[0])
    if x1 > x0 and y1 > y0:
        region = canvas[y0:y1, x0:x1]
        np.minimum(region, image[y0 - y : y1 - y, x0 - x : x1 - x], out=region)


def _edges(n: int, cell: float) -> np.ndarray:
    """Pixel boundaries of ``n`` cells of ``cell`` px (whole pixels; cells differ by one at most)."""
    return np.round(np.arange(n + 1) * cell).astype(int)


def _colour_indices(maps: np.ndarray) -> np.ndarray:
    """Weights (clipped to 0..1) -> viridis indices of the palette."""
    maps = np.nan_to_num(np.asarray(maps, dtype=np.float32), nan=0.0)
    return np.clip((maps * MAP_LEVELS).astype(np.int32), 0, MAP_LEVELS - 1).astype(np.uint8)


def _colour_bar(canvas: np.ndarray, x: int, y: int, height: int, fontsize: float) -> None:
    """The 0..1 colour scale, ``height`` px high, left edge at x, top at y, ticks and labels on its right."""
    width = 6
    levels = np.round(np.linspace(MAP_LEVELS - 1, 0, height)).astype(np.uint8)  # 1 at the top, 0 at the bottom
    canvas[y : y + height, x : x + width] = levels[:, None]
    canvas[y - 1, x - 1 : x + width + 1] = canvas[y + height, x - 1 : x + width + 1] = INK
    canvas[y - 1 : y + height + 1, x - 1] = canvas[y - 1 : y + height + 1, x + width] = INK
    line = sum(_line_box(fontsize))
    step = next((s for s in (0.2, 0.5, 1.0) if height * s >= 1.3 * line), 1.0)
    for value in np.arange(0.0, 1.0 + step / 2, step):
        row = y + round((1 - value) * (height - 1))
        canvas[row, x + width + 1 : x + width + 3] = INK
        _ink(canvas, _text(f"{value:.1f}", fontsize), x + width + 5, row - line // 2)


def _panel_template(
    src_tokens: list[str], tgt_tokens: list[str], cols: np.ndarray, rows: np.ndarray, fontsize: float, note: str
) -> tuple[np.ndarray, int, int]:
    """One panel without its map and title: frame, ticks, token labels, colour bar (and ``note`` under the
    source labels). Returns it with the map's left and top offsets."""
    left, right, top = round(LEFT * DPI), round((MARGIN_X - LEFT) * DPI), round(TOP * DPI)
    map_w, map_h = cols[-1], rows[-1]
    x_labels = [np.rot90(_text(token, fontsize)) for token in src_tokens]  # read upwards, ending at the axis
    label_room = 1 + TICK + PAD + max((image.shape[0] for image in x_labels), default=0)
    note_image = _text(note, fontsize) if note else None
    if note_image is not None:
        label_room += PAD + note_image.shape[0]
    bottom = max(round((MARGIN_Y - TOP) * DPI), label_room + PAD)
    canvas = np.full((top + map_h + bottom, left + map_w + right), PAPER, np.uint8)
    canvas[top - 1, left - 1 : left + map_w + 1] = canvas[top + map_h, left - 1 : left + map_w + 1] = INK
    canvas[top - 1 : top + map_h + 1, left - 1] = canvas[top - 1 : top + map_h + 1, left + map_w] = INK
    line = sum(_line_box(fontsize))
    for token, start, end in zip(tgt_tokens, rows[:-1], rows[1:]):
        centre = top + (start + end) // 2
        canvas[centre, left - 1 - TICK : left - 1] = INK
        image = _text(token, fontsize)
        _ink(canvas, image, left - 1 - TICK - PAD - image.shape[1], centre - line // 2)
    for image, start, end in zip(x_labels, cols[:-1], cols[1:]):
        centre = left + (start + end) // 2
        canvas[top + map_h + 1 : top + map_h + 1 + TICK, centre] = INK
        _ink(canvas, image, centre - image.shape[1] // 2, top + map_h + 1 + TICK + PAD)
    if note_image is not None:
        _ink(
            canvas,
            note_image,
            left + (map_w - note_image.shape[1]) // 2,
            top + map_h + label_room - note_image.shape[0],
        )
    _colour_bar(canvas, left + map_w + 4, top, map_h, fontsize)
    return canvas, left, top


def stacked_figure(
    maps, src_tokens: list[str], tgt_tokens: list[str], names: list[str], width_px: int | None = None, note: str = ""
) -> Picture:
    """(tgt, src) maps stacked in one column, each with its token labels, colour bar and title, all at the
    size of a single map; ``width_px``: the figure's width in pixels (None: a fixed size per token)."""
    indices = _colour_indices(maps)
    n_src = max(len(src_tokens), 1)
    cell = FILE_CELL * DPI if width_px is None else (width_px - MARGIN_X * DPI) / n_src
    fontsize = min(LABEL_PT, cell / DPI * 72)  # a label no taller than its column is wide
    cols, rows = _edges(len(src_tokens), cell), _edges(len(tgt_tokens), cell)
    template, left, top = _panel_template(src_tokens, tgt_tokens, cols, rows, fontsize, note)
    map_h, map_w = rows[-1], cols[-1]
    canvas = np.empty((len(indices), *template.shape), np.uint8)
    canvas[:] = template
    canvas[:, top : top + map_h, left : left + map_w] = np.repeat(
        np.repeat(indices, np.diff(rows), axis=1), np.diff(cols), axis=2
    )
    panels = []
    for i, name in enumerate(names):
        title = _text(name, fontsize + 1)
        _ink(canvas[i], title, left + (map_w - title.shape[1]) // 2, top - PAD - 3 - title.shape[0])
        panels.append(Panel(name, left, i * template.shape[0] + top, map_w, map_h))
    return Picture(canvas.reshape(-1, template.shape[1]), panels, list(src_tokens), list(tgt_tokens), fontsize)


def _outline(pixels: np.ndarray, x0: int, y0: int, x1: int, y1: int, dotted: bool) -> None:
    """A one-pixel rectangle in the links' colour on the box [x0, x1) x [y0, y1); dotted: every other pair."""
    for side in (pixels[y0, x0:x1], pixels[y1 - 1, x0:x1], pixels[y0:y1, x0], pixels[y0:y1, x1 - 1]):
        if dotted:
            side[(np.arange(len(side)) // 2) % 2 == 0] = LINK
        else:
            side[:] = LINK


def alignment_figure(
    weights, src_tokens: list[str], tgt_tokens: list[str], title: str = "", links=None, width_px: int | None = None
) -> Picture:
    """One (tgt, src) map with token labels and a colour bar; ``links``: (sure, possible) lists of
    (target, source) cells outlined over it (reference word links, app.data.links.piece_links)."""
    note = "reference links: solid sure, dotted possible" if links else ""
    picture = stacked_figure(np.asarray(weights)[None], src_tokens, tgt_tokens, [title], width_px, note)
    panel = picture.panels[0]
    cell = panel.width / max(len(src_tokens), 1)
    cols, rows = _edges(len(src_tokens), cell) + panel.x, _edges(len(tgt_tokens), cell) + panel.y
    for cells, dotted in zip(links or (), (False, True)):
        for t, s in cells:
            _outline(picture.pixels, cols[s], rows[t], cols[s + 1], rows[t + 1], dotted)
    return picture


def figures(
    views: dict[str, tuple[np.ndarray, list[str]]],
    src_tokens: list[str],
    tgt_tokens: list[str],
    width_px: int | None = None,
) -> dict[str, Picture]:
    """name -> picture for one sentence: the figures of ``views`` (app.evaluation.views.figure_views),
    labelled with its tokens."""
    return {
        name: stacked_figure(maps, src_tokens, tgt_tokens, titles, width_px) for name, (maps, titles) in views.items()
    }


def draw_pngs(specs: dict) -> dict[str, tuple[bytes, tuple[int, int]]]:
    """key -> ``stacked_figure`` arguments (maps, src_tokens, tgt_tokens, titles, width_px) ==> key -> (PNG,
    its (width, height)): drawing that needs nothing but numbers and strings, so a worker process can do it."""
    out = {}
    for key, args in specs.items():
        picture = stacked_figure(*args)
        out[key] = png_bytes(picture), picture.size
    return out


def png_bytes(picture: Picture) -> bytes:
    """The picture as a palette PNG (zlib level 1: a map's flat cells compress well at any level)."""
    image = Image.fromarray(picture.pixels)
    image.putpalette(PALETTE.tobytes())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
