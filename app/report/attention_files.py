"""The attention files of an evaluation: ``alignments.npz`` (each sentence's views of its attention, uint8; of a
Transformer's also of its encoder's and decoder's self-attention, when kept) beside its index
``alignments.jsonl``, and the helper that reads a sentence's maps back."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

import numpy as np

from app.errors import UserError
from app.report.attention_views import (
    as_array,
    attention_entropy,
    attention_views,
    check_shape,
    monotonicity,
    plotted_view,
)
from app.utils import atomic_open, atomic_write_text

SCALE = 255  # stored value v means weight v / 255 (within 1/510 of the weight)
INDEX, ARCHIVE = "alignments.jsonl", "alignments.npz"
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


def store_attention(attention, layer: int = -1, keep: str = "layer") -> StoredAttention:
    """The views of ``attention`` (tgt, src) or (layers, heads, tgt, src) that ``keep`` keeps: an RNN's one
    map; of a Transformer, the heads of layer ``layer`` ("layer") or of every layer ("all"), then every
    layer's mean of heads. Quantized to uint8 (rounded, so within 1/510 of the weight)."""
    attention = check_shape(as_array(attention))
    layers, heads = attention.shape[:2] if attention.ndim == 4 else (0, 0)
    kept = (list(range(layers)) if keep == "all" else [layer % layers]) if layers else []
    names, maps = attention_views(attention, kept)
    quantized = np.rint(np.clip(maps, 0.0, 1.0) * SCALE).astype(np.uint8)
    mono = monotonicity(plotted_view(attention, layer)[1])
    return StoredAttention(names, quantized, layers, heads, kept, attention_entropy(attention), mono)


def write_attention_files(out_dir: str, sentences: Iterable[tuple], level: int = 1) -> None:
    """``alignments.jsonl`` and ``alignments.npz`` in ``out_dir``: per sentence, its entry (index in the
    split, id, tokens ...) with its maps' array name, shape and view names as one JSON line, and the maps
    as that array of the archive (numpy's .npz: a zip of .npy files, deflated at zlib ``level``).
    ``sentences``: (entry, StoredAttention) pairs, or (entry, StoredAttention, {"encoder": ..., "decoder": ...})
    with the views of the self-attention, kept as arrays ``<array>.encoder`` and ``<array>.decoder`` and
    named in the entry's ``encoder`` and ``decoder``."""
    lines = []
    with atomic_open(os.path.join(out_dir, ARCHIVE)) as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as archive:

            def add(name: str, stored: StoredAttention) -> dict:
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, stored.maps, allow_pickle=False)
                return {"array": name, "shape": list(stored.maps.shape), "views": stored.names}

            for entry, stored, *own in sentences:
                name = str(entry["index"])
                row = {**entry, **add(name, stored)}
                for kind, views in (own[0] if own else {}).items():
                    row[kind] = add(f"{name}.{kind}", views)
                lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(os.path.join(out_dir, INDEX), "".join(line + "\n" for line in lines))


def read_attention(eval_dir: str, sentence: Union[int, str]) -> dict:
    """One sentence of an evaluation's attention files (``eval/<split>/``), by its index in the split (an
    int) or its id (a str): its ``alignments.jsonl`` entry, with ``maps`` the float32 (views, rows, src)
    weights (within 1/510 of the attention) and ``views`` their names ("layer 5 head 3", "layer 5 mean",
    or "attention" for an RNN's map); where the self-attention was kept, ``encoder`` and ``decoder`` hold their
    ``maps`` (views, src, src) and (views, tgt, tgt) the same way."""
    index, archive = os.path.join(eval_dir, INDEX), os.path.join(eval_dir, ARCHIVE)
    for path in (index, archive):
        if not os.path.exists(path):
            raise UserError(f"{path} does not exist: make eval writes it (a model with attention)")
    key = "index" if isinstance(sentence, int) else "id"
    with open(index, encoding="utf-8") as f:
        entry = next((e for e in map(json.loads, f) if e[key] == sentence), None)
    if entry is None:
        raise UserError(f"{index} has no sentence with {key} {sentence!r}")
    with np.load(archive) as arrays:
        maps = arrays[entry["array"]].astype(np.float32) / SCALE
        for kind in SELF_ATTENTION:
            if kind in entry:
                entry[kind] = {**entry[kind], "maps": arrays[entry[kind]["array"]].astype(np.float32) / SCALE}
    return {**entry, "maps": maps}
