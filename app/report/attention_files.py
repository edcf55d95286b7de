"""The attention files of an evaluation: ``alignments.npz`` (each sentence's views of its attention, uint8; of a
Transformer's also of its encoder's and decoder's self-attention, when kept) beside its index
``alignments.jsonl``, and the helper that reads a sentence's maps back."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from typing import Union

import numpy as np

from app.evaluation.views import SCALE, SELF_ATTENTION, StoredAttention
from app.run.errors import UserError
from app.run.files import atomic_open, atomic_write_text

INDEX, ARCHIVE = "alignments.jsonl", "alignments.npz"


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
