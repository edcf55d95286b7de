"""Prepared splits, tokenized once into a memory-mapped Arrow cache (Hugging Face ``datasets``).

``data/<corpus>/tokenized/<tokenizer>/<split>/`` holds the split's ids, texts and subword ids. It is
built with ``data.num_proc`` processes the first time a split is read with a tokenizer and reused as
long as the split file and the tokenizer are unchanged. Training reads sentences straight from the
mapped file, so a corpus of many GB does not sit in Python lists.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache

import pyarrow as pa

from app.config.schema import Config, TokenizerConfig
from app.data.cache import cached, mark_done
from app.data.prepare import prepare
from app.data.sources import SPLITS
from app.data.tokenizer import Tokenizer, build_tokenizer, model_paths
from app.run.errors import UserError
from app.run.files import file_hash, stable_hash
from app.run.folder_lock import owning

log = logging.getLogger(__name__)
PARALLEL_ABOVE = 50_000  # pairs: smaller splits tokenize faster in one process than the workers start


@dataclass
class ParallelData:
    """A split in memory: what validation, evaluation and plots read (dev and test are small)."""

    ids: list[str]
    src_texts: list[str]
    tgt_texts: list[str]
    src: list[list[int]]  # subword ids, without BOS/EOS
    tgt: list[list[int]]

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: int) -> ParallelData:
        if not n or n >= len(self):
            return self
        return self.select(range(n))

    def select(self, indices) -> ParallelData:
        """The pairs at ``indices``, in that order."""
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return ParallelData(pick(self.ids), pick(self.src_texts), pick(self.tgt_texts), pick(self.src), pick(self.tgt))


@dataclass
class TokenizedSplit:
    """A split's subword ids as memory-mapped Arrow columns: what training reads."""

    src: pa.ChunkedArray  # list<int32> per sentence, without BOS/EOS
    tgt: pa.ChunkedArray
    src_lens: list[int]
    tgt_lens: list[int]

    def __len__(self) -> int:
        return len(self.src_lens)


def prepare_data(cfg: Config, verify: bool = False) -> Tokenizer:
    """Corpus preparation, tokenizer training and the tokenized Arrow caches, each skipped when its
    inputs did not change and its outputs are as written (``verify``: their content hashes too, as
    ``make data`` checks). One process at a time works in a corpus folder: another waits for it, then
    finds the work done."""
    with owning(cfg.data.dir):
        prepare(cfg.data, verify)
        tags = (cfg.data.extra_tag,) if cfg.data.extra_tag else ()
        tokenizer = build_tokenizer(cfg.data.dir, cfg.tokenizer, verify, tags)
        for split in SPLITS:
            tokenized(cfg.data.dir, split, tokenizer, cfg.data.num_proc, verify)
    return tokenizer


def load_tokenizer(data_dir: str, cfg: TokenizerConfig) -> Tokenizer:
    return Tokenizer(*model_paths(data_dir, cfg))


def load_tokenized(data_dir: str, split: str, tokenizer: Tokenizer) -> TokenizedSplit:
    table = tokenized(data_dir, split, tokenizer).data
    return TokenizedSplit(
        table.column("src_ids"),
        table.column("tgt_ids"),
        table.column("src_len").to_pylist(),
        table.column("tgt_len").to_pylist(),
    )


def load_split(data_dir: str, split: str, tokenizer: Tokenizer, first: int = 0) -> ParallelData:
    """A split as lists (``first`` > 0: its first pairs only, the rest never read): ``datasets`` (4 and later) hands
    out a column as a lazy ``Column`` that reads Arrow at every item, and decoding, scoring, AER and the explorer
    make many passes; ``[:]`` reads it once."""
    dataset = tokenized(data_dir, split, tokenizer)
    if 0 < first < len(dataset):
        dataset = dataset.select(range(first))
    return ParallelData(*(dataset[name][:] for name in ("id", "src", "tgt", "src_ids", "tgt_ids")))


def tokenized(data_dir: str, split: str, tokenizer: Tokenizer, num_proc: int = 0, verify: bool = False):
    """The Arrow cache of ``<data_dir>/<split>.tsv`` under ``tokenizer`` (a ``datasets.Dataset``,
    memory-mapped), built when missing, stale, damaged (app/data/cache.py) or unreadable."""
    import datasets

    tsv = os.path.join(data_dir, f"{split}.tsv")
    stem = os.path.splitext(os.path.basename(tokenizer.src_path))[0]
    if os.path.abspath(os.path.dirname(tokenizer.src_path)) != os.path.abspath(data_dir):
        # another corpus's model (tokenizer.dir): its cache beside this corpus's own, never in its place
        stem = f"{stem}-{file_hash(tokenizer.src_path)[:12]}"
    cache = os.path.join(data_dir, "tokenized", stem, split)
    if split not in SPLITS or not os.path.exists(tsv):
        there = [s for s in SPLITS if os.path.exists(os.path.join(data_dir, f"{s}.tsv"))]
        raise UserError(f"{tsv}: no such split; {data_dir} has {', '.join(there) or 'none (make data prepares them)'}")
    stat = os.stat(tsv)
    key = stable_hash(
        {
            "tsv": [stat.st_size, stat.st_mtime_ns],
            "src": file_hash(tokenizer.src_path),
            "tgt": file_hash(tokenizer.tgt_path),
        }
    )
    stamp = os.path.join(cache, "key.json")
    with owning(data_dir):  # not while another process builds it
        if cached(stamp, key, [cache], verify):
            try:
                return datasets.load_from_disk(cache)
            except (OSError, ValueError, pa.ArrowException) as err:
                log.warning("%s does not load (%s): rebuilding it from %s", cache, str(err).splitlines()[0], tsv)
        return build_tokenized(tsv, cache, stamp, key, tokenizer, num_proc)


def build_tokenized(tsv: str, cache: str, stamp: str, key: str, tokenizer: Tokenizer, num_proc: int):
    import datasets

    datasets.disable_progress_bars()
    work = f"{cache}.building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    features = datasets.Features(
        {"id": datasets.Value("string"), "src": datasets.Value("string"), "tgt": datasets.Value("string")}
    )
    try:  # a build cut short (an error, a signal) leaves no half-written folder behind
        rows = datasets.Dataset.from_generator(
            _tsv_rows, features=features, gen_kwargs={"path": tsv}, cache_dir=os.path.join(work, "hf")
        )
        procs = num_proc or (min(os.cpu_count() or 1, 8) if len(rows) > PARALLEL_ABOVE else 1)
        log.info(
            "data: tokenizing %s (%d pairs, %d process%s) into %s",
            tsv,
            len(rows),
            procs,
            "es" if procs > 1 else "",
            cache,
        )
        encoded = rows.map(
            _encode_rows,
            batched=True,
            batch_size=2000,
            num_proc=procs if procs > 1 else None,
            fn_kwargs={
                "src_model": tokenizer.src_path,
                "tgt_model": tokenizer.tgt_path,
                "models": tokenizer.fingerprint(),
            },
            features=datasets.Features(
                {
                    **features,
                    "src_ids": datasets.List(datasets.Value("int32")),
                    "tgt_ids": datasets.List(datasets.Value("int32")),
                    "src_len": datasets.Value("int32"),
                    "tgt_len": datasets.Value("int32"),
                }
            ),
        )
        encoded.save_to_disk(os.path.join(work, "final"))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    del rows, encoded
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(os.path.join(work, "final"), cache)
    shutil.rmtree(work, ignore_errors=True)
    mark_done(stamp, key, [cache], tsv=tsv, tokenizer=tokenizer.src_path)
    return datasets.load_from_disk(cache)


def _tsv_rows(path: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            pair_id, src, tgt = line.rstrip("\n").split("\t")
            yield {"id": pair_id, "src": src, "tgt": tgt}


@lru_cache(maxsize=4)
def _processor(path: str, digest: str):
    """The SentencePiece model at ``path`` whose file hashes to ``digest``: a tokenizer trained again in place (the
    corpus changed, in a process that prepares twice) is loaded again, not served from the cache."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=path)


def _encode_rows(batch: dict, src_model: str, tgt_model: str, models: dict) -> dict:
    src = _processor(src_model, models["src"]).encode(batch["src"])
    tgt = _processor(tgt_model, models["tgt"]).encode(batch["tgt"])
    return {**batch, "src_ids": src, "tgt_ids": tgt, "src_len": [len(s) for s in src], "tgt_len": [len(t) for t in tgt]}
