"""Where a corpus is prepared: ``data/<name><suffixes>``, a folder per distinct input, so that one corpus's
prepared splits and tokenizer never replace another's."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional, Protocol


class CorpusSettings(Protocol):
    """The data settings a corpus's folder is named by (app.config.schema.DataConfig)."""

    source: str
    name: str
    src_module: str
    tgt_module: str
    hf_path: Optional[str]
    hf_config: Optional[str]
    train: Optional[str]
    dev: Optional[str]
    test: Optional[str]
    reverse: bool
    aligner: str
    extra_train: Optional[str]
    extra_tag: Optional[str]


def _digest(*parts: str) -> str:
    return hashlib.sha1(" ".join(parts).encode()).hexdigest()[:6]


def _paths(spec: str) -> list[str]:
    return [os.path.abspath(p) for p in spec.split(",")]


def corpus_name(cfg: CorpusSettings) -> str:
    """A folder name for a corpus given without data.name: distinct inputs get distinct names."""
    if cfg.source == "bible":
        name = f"bible_{cfg.src_module}_{cfg.tgt_module}"
    elif cfg.source == "hf":
        name = "_".join(filter(None, ["hf", os.path.basename(str(cfg.hf_path).rstrip("/")), cfg.hf_config]))
    else:  # local files: the train file's stem and a digest of where all the files are
        paths = [p for split in (cfg.train, cfg.dev, cfg.test) if split for p in _paths(split)]
        stem = os.path.splitext(os.path.basename(paths[0]))[0] if paths else cfg.source
        name = f"{stem}_{_digest(*paths)}"
    return re.sub(r"[^\w.-]+", "_", name)


def corpus_folder(cfg: CorpusSettings) -> str:
    """``data/<name>``, with a suffix for each setting that changes what the corpus holds: ``_reverse``, the
    aligner's name, and ``_plus_<stem>_<digest>`` for extra training pairs (their files and tag)."""
    suffix = "_reverse" * cfg.reverse + ("" if cfg.aligner == "none" else f"_{cfg.aligner}")
    if cfg.extra_train:
        paths = _paths(cfg.extra_train)
        stem = re.sub(r"[^\w.-]+", "_", os.path.splitext(os.path.basename(paths[0]))[0])
        suffix += f"_plus_{stem}_{_digest(*paths, cfg.extra_tag or '')}"
    return os.path.join("data", str(cfg.name) + suffix)
