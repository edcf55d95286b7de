"""Corpus sources behind one interface: each returns parallel pairs per split.

- ``bible``: two SWORD Bible modules paired by OSIS verse reference (their markup read and cleaned by
  app/data/osis.py).
- ``files``: local TSV / JSONL / pair of plain-text files, read line by line (``text_lines``).
- ``hf``: any dataset ``datasets.load_dataset`` can open (hub name, local folder, saved dataset).

A split a source does not provide is ``None``; prepare.py carves it out of train.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Any, Optional

from app.config.schema import DataConfig
from app.data.links import check_within, link_words, reversed_links
from app.data.osis import clean_osis, shared_verses
from app.data.strongs import pharaoh_line, strong_links, tagged_words
from app.data.text_files import check_file, text_lines
from app.run.errors import UserError

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Pair:
    id: str
    src: str
    tgt: str
    links: Optional[str] = None  # reference word links in the Pharaoh format (app.data.links.read_pharaoh)
    # the id is the pair's place (file:line, split:row), not its own: a split carved out of train is drawn from its
    # text instead, so that copies of a pair land in one split (train's are deduplicated), never in train and test
    numbered: bool = field(default=False, compare=False)


Splits = dict[str, Optional[Iterable[Pair]]]  # each split read lazily, once


def reversed_pair(pair: Pair) -> Pair:
    """The pair the other way round (data.reverse): target and source swapped, each link ``i-j`` (``i?j``) as
    ``j-i`` (``j?i``); its id, and so its split, stay."""
    links = None if pair.links is None else reversed_links(pair.links)
    return Pair(pair.id, pair.tgt, pair.src, links, pair.numbered)


def read_source(cfg: DataConfig) -> Splits:
    readers = {"bible": read_bible, "files": read_files, "hf": read_hf}
    if cfg.source not in readers:
        raise UserError(f"data.source={cfg.source!r} is unknown; choose one of {sorted(readers)}")
    if cfg.train_align and (cfg.source == "bible" or cfg.streaming):
        raise UserError(
            f"data.train_align links the lines of data.train: it does not apply to data.source="
            f"{cfg.source}{' with data.streaming=true' if cfg.streaming else ''}"
        )
    splits = readers[cfg.source](cfg)
    train = splits["train"]
    if cfg.train_align and train is not None:  # (every source has a train split)
        splits["train"] = with_links(train, cfg.train_align)
    return splits


def with_links(pairs: Iterable[Pair], path: str) -> Iterator[Pair]:
    """The pairs, each with the links of its line of ``path`` (Pharaoh ``i-j`` sure / ``i?j`` possible,
    over whitespace words, one line per pair); a malformed line or a count that differs is an error."""
    check_file(path, f"data.train_align={path!r}")
    lines = (line for _, line in text_lines(path))
    for n, (pair, line) in enumerate(zip_longest(pairs, lines), start=1):
        if pair is None or line is None:
            raise UserError(
                f"{path}: {'more' if pair is None else 'fewer'} lines than data.train has pairs "
                f"(they differ from line {n} on)"
            )
        links = [link_words(link, f"{path}:{n}") for link in line.split()]
        check_within(f"{path}:{n}", links, pair.src, pair.tgt)
        yield replace(pair, links=" ".join(line.split()))


# --- bible ---------------------------------------------------------------------------------------


def read_bible(cfg: DataConfig) -> Splits:
    """Verse pairs by OSIS reference; with data.reference_links, each with the links between words that
    carry the same Strong's number (app/data/strongs.py)."""
    src, tgt = shared_verses(cfg.sword_path, cfg.src_module, cfg.tgt_module)

    def pair(ref: str) -> Pair:
        if not cfg.reference_links:
            return Pair(ref, clean_osis(src[ref]), clean_osis(tgt[ref]))
        (src_text, src_tags), (tgt_text, tgt_tags) = tagged_words(src[ref]), tagged_words(tgt[ref])
        return Pair(ref, src_text, tgt_text, pharaoh_line(*strong_links(src_tags, tgt_tags)))

    return {"train": (pair(ref) for ref in src), "dev": None, "test": None}


# --- local files ---------------------------------------------------------------------------------


def _pair_id(value: str, where: str) -> str:
    if any(c in value for c in "\t\r\n"):  # the prepared splits are TSV files: one line, three fields
        raise UserError(f"{where}: the id {value!r} holds a tab or a line break (\\t, \\r or \\n)")
    return value


def _read_tsv(path: str) -> Iterator[Pair]:
    """``src\ttgt`` or ``id\tsrc\ttgt`` rows; the first row decides which for the whole file, so a stray tab in
    one row is refused instead of turning its source into an id and its target into its source."""
    name, layout = os.path.basename(path), None
    for line_no, row in text_lines(path):
        if not row.strip():
            continue
        cols = row.split("\t")
        if len(cols) not in (2, 3):
            cr = " (it holds a lone \\r: lines end at \\n only)" if "\r" in row else ""
            raise UserError(
                f"{path}:{line_no}: expected 2 (src, tgt) or 3 (id, src, tgt) tab-separated columns, "
                f"got {len(cols)}{cr}"
            )
        if layout is None:
            layout = (len(cols), line_no)
        elif len(cols) != layout[0]:
            first = "2 (src, tgt)" if layout[0] == 2 else "3 (id, src, tgt)"
            raise UserError(
                f"{path}:{line_no}: {len(cols)} tab-separated columns, but line {layout[1]} has {first}: "
                "one layout per file (a tab inside a sentence, or at the end of a line?)"
            )
        if len(cols) == 2:
            yield Pair(f"{name}:{line_no}", cols[0], cols[1], numbered=True)
        else:
            yield Pair(_pair_id(cols[0], f"{path}:{line_no}"), cols[1], cols[2])


def _json_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    """(number, where, row) of a JSON Lines file (number: the line), or of a file holding one JSON array
    (number: the item); text that is not JSON is a UserError naming file and line."""
    lines = text_lines(path)
    for line_no, line in lines:
        if not line.strip():
            continue
        if line.lstrip().startswith("["):  # one array over the whole file, not JSON Lines
            items = _json("\n".join([line, *(rest for _, rest in lines)]), path, line_no)
            yield from ((k, f"{path}: item {k} of its array", row) for k, row in enumerate(items, start=1))
            return
        yield line_no, f"{path}:{line_no}", _json(line, path, line_no)


def _json(text: str, path: str, first_line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        line_no = first_line + err.lineno - 1
        raise UserError(f"{path}:{line_no}: not valid JSON: {err.msg} (column {err.colno})") from None


def _json_kind(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _text(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        shown = json.dumps(value, ensure_ascii=False, default=str)
        shown = shown if len(shown) <= 40 else shown[:39] + "…"
        raise UserError(f"{where}: {field} holds {_json_kind(value)} ({shown}), not a string")
    return value


def _read_jsonl(path: str, src_lang: str, tgt_lang: str) -> Iterator[Pair]:
    name = os.path.basename(path)
    for number, where, row in _json_rows(path):
        fields, prefix, keys = row, "", ("src", "tgt")
        if isinstance(row, dict) and isinstance(row.get("translation"), dict):
            fields, prefix, keys = row["translation"], "translation.", (src_lang, tgt_lang)
        if not (isinstance(fields, dict) and all(key in fields for key in keys)):
            got = f"keys {sorted(row)}" if isinstance(row, dict) else _json_kind(row)
            raise UserError(
                f'{where}: expected {{"src", "tgt"}} or {{"translation": {{"{src_lang}", "{tgt_lang}"}}}}, got {got}'
            )
        src, tgt = (_text(fields[key], f'"{prefix}{key}"', where) for key in keys)
        given = row.get("id")
        yield Pair(_pair_id(str(given or f"{name}:{number}"), where), src, tgt, numbered=not given)


def _read_text_pair(src_path: str, tgt_path: str) -> Iterator[Pair]:
    name = os.path.basename(src_path)
    src_rows, tgt_rows = text_lines(src_path), text_lines(tgt_path)
    for i, (s, t) in enumerate(zip_longest(src_rows, tgt_rows), start=1):  # None past a file's end
        if s is None or t is None:
            n_src = i - 1 + (s is not None) + sum(1 for _ in src_rows)
            n_tgt = i - 1 + (t is not None) + sum(1 for _ in tgt_rows)
            raise UserError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: they must be parallel")
        yield Pair(f"{name}:{i}", s[1], t[1], numbered=True)


def read_parallel_file(spec: str, src_lang: str = "src", tgt_lang: str = "tgt", setting: str = "") -> Iterator[Pair]:
    """``a.tsv`` | ``a.jsonl`` | ``a.es,a.en`` (two line-aligned plain-text files), read lazily; the
    paths are checked at once, the contents while the pairs are read. ``setting``: the one that gave ``spec``
    (data.train), which its errors name."""
    paths = spec.split(",")
    for path in paths:
        if not path.strip():
            given = f"{setting}={spec!r}" if setting else repr(spec)
            raise UserError(f"{given}: an empty file name; give one .tsv/.jsonl file or two plain-text files, a,b")
        check_file(path)
        if os.path.getsize(path) == 0:
            raise UserError(f"{path}: file is empty")
    if len(paths) == 2:
        return _read_text_pair(*paths)
    if len(paths) != 1:
        raise UserError(f"{spec!r}: give one .tsv/.jsonl file or two plain-text files separated by a comma")
    if spec.endswith((".jsonl", ".json")):
        return _read_jsonl(spec, src_lang, tgt_lang)
    return _read_tsv(spec)


def read_files(cfg: DataConfig) -> Splits:
    if not cfg.train:
        raise UserError("data.train is not set: give a .tsv, .jsonl or 'src.txt,tgt.txt' path")
    return {
        split: read_parallel_file(spec, cfg.src_lang, cfg.tgt_lang, f"data.{split}")
        if (spec := getattr(cfg, split))
        else None
        for split in SPLITS
    }


# --- Hugging Face datasets -----------------------------------------------------------------------


def _field(row: dict, dotted: str, where: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UserError(
                f"{where}: field {dotted!r} not found (row keys: {sorted(row)}); set data.src_field / data.tgt_field"
            )
        value = value[key]
    return value


def read_hf(cfg: DataConfig) -> Splits:
    """A hub dataset (downloaded into the ``datasets`` Arrow cache, or streamed with data.streaming=true),
    a local dataset folder or a dataset saved with ``save_to_disk``."""
    import datasets

    datasets.disable_progress_bars()
    if not cfg.hf_path:
        raise UserError("data.hf_path is not set: give a hub dataset name or a local dataset folder")
    saved_to_disk = os.path.isdir(cfg.hf_path) and any(
        os.path.exists(os.path.join(cfg.hf_path, marker)) for marker in ("dataset_dict.json", "state.json")
    )
    try:
        if saved_to_disk:
            dataset = datasets.load_from_disk(cfg.hf_path)
        else:
            dataset = datasets.load_dataset(cfg.hf_path, cfg.hf_config, streaming=cfg.streaming)
    except Exception as err:
        raise UserError(f"data.hf_path={cfg.hf_path!r}: cannot load dataset: {str(err).splitlines()[0]}") from None
    if isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):  # a single split: it is the train split
        dataset = {cfg.train or "train": dataset}
    splits: Splits = {}
    for split in SPLITS:
        split_name = getattr(cfg, split)
        if not split_name:
            splits[split] = None
            continue
        if split_name not in dataset:
            raise UserError(f"data.{split}={split_name!r}: dataset {cfg.hf_path!r} has splits {sorted(dataset)}")
        rows = dataset[split_name]
        if cfg.id_field and rows.column_names is not None and cfg.id_field not in rows.column_names:
            raise UserError(
                f"data.id_field={cfg.id_field!r} not found in {cfg.hf_path}[{split_name}] "
                f"(columns: {rows.column_names})"
            )
        if cfg.streaming and split == "train":  # a bounded buffer: the whole stream never sits in memory
            rows = rows.shuffle(seed=0, buffer_size=cfg.shuffle_buffer)
        splits[split] = _hf_pairs(rows, cfg, split_name)
    return splits


def _hf_pairs(rows, cfg: DataConfig, split_name: str) -> Iterator[Pair]:
    where = f"{cfg.hf_path}[{split_name}]"
    for i, row in enumerate(rows):
        if cfg.id_field and cfg.id_field not in row:
            raise UserError(f"data.id_field={cfg.id_field!r} not found in {where} (columns: {sorted(row)})")
        given = row[cfg.id_field] if cfg.id_field else None  # a null id: the row is numbered, as in JSON Lines
        src, tgt = (_hf_text(row, field, f"{where} row {i}") for field in (cfg.src_field, cfg.tgt_field))
        yield Pair(
            _pair_id(str(given), f"{where} row {i}") if given is not None else f"{split_name}:{i}",
            src,
            tgt,
            numbered=given is None,
        )


def _hf_text(row: dict, field: str, where: str) -> str:
    """A text field of a hub row; a null one is empty text, which the filters drop and count as ``empty`` (a hub
    dataset is not the user's to mend, as a JSON Lines file is), never the sentence "None"."""
    value = _field(row, field, where)
    return "" if value is None else _text(value, repr(field), where)
