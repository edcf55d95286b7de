"""SentencePiece subword tokenizer: train once per corpus (cached), encode to ids, decode to text."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Optional

import numpy as np
import sentencepiece as spm

from app.config.schema import TokenizerConfig
from app.data.cache import cached, mark_done
from app.run.errors import UserError
from app.run.files import atomic_write, file_hash, stable_hash

log = logging.getLogger(__name__)

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class Tokenizer:
    """Source and target SentencePiece models (the same object when the vocabulary is joint)."""

    def __init__(self, src_model: str, tgt_model: str):
        self.src_path, self.tgt_path = src_model, tgt_model
        self.src = _load(src_model)
        self.tgt = self.src if tgt_model == src_model else _load(tgt_model)
        self.joint = self.src is self.tgt

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        return self.src.encode(texts)

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        return self.tgt.encode(texts)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Each sequence as one line of text: the whitespace its pieces decode to is one space, as the training
        text's is (app.data.prepare.normalize). A byte piece (tokenizer.byte_fallback) can spell a line break or
        a tab, which would split one translation over lines of a file that holds one a line."""
        return [" ".join(text.split()) for text in self.tgt.decode(ids)]

    def src_pieces(self, ids: list[int]) -> list[str]:
        return [self.src.id_to_piece(i) for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_piece(i) for i in ids]

    def src_words(self, texts: list[str]) -> list[list[int]]:
        """Per text, the whitespace word (its place in ``text.split()``, what link files number) of each piece
        ``encode_src`` gives it; -1 for a piece of none (``span_words``)."""
        return [_encoded_words(text, proto) for text, proto in zip(texts, self.src.encode(texts, return_type="proto"))]

    def tgt_words(self, texts: list[str]) -> list[list[int]]:
        """``src_words`` of target texts (references, given translations), by the target model."""
        return [_encoded_words(text, proto) for text, proto in zip(texts, self.tgt.encode(texts, return_type="proto"))]

    def hyp_words(self, ids: list[list[int]]) -> list[list[int]]:
        """Per sequence of target ids (a hypothesis), the word of each piece in the text ``decode_tgt`` makes of
        it: <unk> decodes as a word of its own (" ⁇ "), a byte piece that spells whitespace as a space."""
        return _decoded_words(self.tgt, ids)

    def decoded_src_words(self, ids: list[list[int]]) -> list[list[int]]:
        """``hyp_words`` of source ids: the words of the text they decode to, SentencePiece's normalized text, for
        a caller that has the ids only (its words are the source text's but where the normalization made a
        space: ``src_words`` of the text, where there is one)."""
        return _decoded_words(self.src, ids)

    def fingerprint(self) -> dict:
        """Identifies the vocabulary a model is trained with: the SentencePiece model files' hashes."""
        return {"src": file_hash(self.src_path), "tgt": file_hash(self.tgt_path), "joint": self.joint}


def span_words(text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """The whitespace word of ``text`` (its place in ``text.split()``) of each piece, from the pieces' UTF-8 byte
    spans in it (SentencePiece's begin, end): the word of the last non-whitespace character of its span. A piece
    that spells none (an empty span, such as a ``▁`` the normalization inserted; only spaces) is of the word the
    next piece that spells something begins, where it begins one, else of none (-1). On text whose whitespace is
    SentencePiece's, this is the ``▁`` rule: a word starts at each ``▁``. Characters SentencePiece's nmt_nfkc
    normalization turns into a space (U+200C ZWNJ inside a Persian word, LRM/RLM, ``´`` as space + mark) stay
    within their word, as str.split() keeps them."""
    space = np.fromiter(map(str.isspace, text), bool, len(text))
    begins = ~space
    begins[1:] &= space[:-1]
    words = np.where(space, -1, np.cumsum(begins) - 1)
    if not text.isascii():  # per UTF-8 byte
        points = np.frombuffer(text.encode("utf-32-le"), "<u4")
        words = np.repeat(words, 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000))
    last = np.maximum.accumulate(np.concatenate(([-1], words))).tolist()  # last[e]: the last letter's word before e
    letters = np.concatenate(([0], np.cumsum(words >= 0))).tolist()
    spelled = (words >= 0).tolist()  # the byte is of a character of a word, not whitespace
    out = [-1] * len(spans)
    ahead = -1  # the word the next piece that spells something begins in, where it begins in one
    for k in range(len(spans) - 1, -1, -1):
        b, e = spans[k]
        own = last[e] if letters[e] > letters[b] else -1
        out[k] = own if own >= 0 else ahead
        if e > b:
            ahead = own if spelled[b] else -1
    return out


def _encoded_words(text: str, proto) -> list[int]:
    return span_words(text, [(p.begin, p.end) for p in proto.pieces])


def _decoded_words(sp: spm.SentencePieceProcessor, ids: list[list[int]]) -> list[list[int]]:
    protos = sp.decode(ids, return_type="proto") if ids else []
    out = []
    for proto in protos:
        words = span_words(proto.text, [(p.begin, p.end) for p in proto.pieces])
        out.append([-1 if sp.is_control(p.id) else w for p, w in zip(proto.pieces, words)])
    return out


def _load(path: str) -> spm.SentencePieceProcessor:
    if not os.path.exists(path):
        raise UserError(f"{path}: tokenizer model not found (make data recreates it)")
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except RuntimeError as err:
        raise UserError(f"{path}: not a SentencePiece model ({err}); make data rebuilds it") from None


def model_paths(data_dir: str, cfg: TokenizerConfig) -> tuple[str, str]:
    """Model files are named by their settings, so tokenizers of different sizes coexist per corpus; they are
    in the corpus folder ``data_dir``, or in ``tokenizer.dir`` where another corpus's model is used."""
    stem = os.path.join(cfg.dir or data_dir, f"spm_{cfg.model_type}{cfg.vocab_size}{'_bytes' * cfg.byte_fallback}")
    if cfg.joint:
        return f"{stem}.model", f"{stem}.model"
    return f"{stem}.src.model", f"{stem}.tgt.model"


def _column(tsv: str, *columns: int) -> Iterator[str]:
    """Column after column of an ``id \t src \t tgt`` file, one line at a time."""
    for column in columns:
        with open(tsv, encoding="utf-8") as f:
            for line in f:
                yield line.rstrip("\n").split("\t")[column]


class _Pulled:
    """Sentences that SentencePiece's C++ trainer pulls one at a time. An exception raised in Python while it
    pulls comes back from the trainer as a RuntimeError ("INTERNAL: KeyboardInterrupt"): a signal's (Ctrl-C's
    KeyboardInterrupt, SIGTERM's Terminated, training's StopNow) is kept here for the caller to raise as it was."""

    def __init__(self, sentences: Iterator[str]):
        self.sentences = sentences
        self.stopped: Optional[BaseException] = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.sentences
        except BaseException as stop:
            if not isinstance(stop, (Exception, GeneratorExit)):  # a signal's, not an error or the trainer's close
                self.stopped = stop
            raise


def _train_one(sentences: Iterator[str], path: str, cfg: TokenizerConfig, symbols: tuple[str, ...]) -> None:
    model, pulled = io.BytesIO(), _Pulled(sentences)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(pulled),
            model_writer=model,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            byte_fallback=cfg.byte_fallback,
            max_sentence_length=cfg.max_sentence_length,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            user_defined_symbols=list(symbols),  # always one piece each, never split or merged
            hard_vocab_limit=False,  # a tiny corpus gets a smaller vocabulary instead of an error
            input_sentence_size=cfg.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        if pulled.stopped is not None:
            raise pulled.stopped from None
        # the one range SentencePiece alone can check: the corpus's characters (its message: "... 5 vs 79 ...")
        if found := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err)):
            raise UserError(
                f"tokenizer.vocab_size={cfg.vocab_size} is too small for this corpus: its characters and the special "
                f"pieces{' and the 256 bytes (tokenizer.byte_fallback)' * cfg.byte_fallback} need at least "
                f"{found.group(2)}"
            ) from None
        raise
    pieces = spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size()
    if pieces < cfg.vocab_size:  # hard_vocab_limit=False: the corpus had fewer pieces to give
        log.warning(
            "tokenizer.vocab_size=%d: this corpus gives %d pieces only, what %s holds",
            cfg.vocab_size,
            pieces,
            os.path.basename(path),
        )
    atomic_write(path, lambda f: f.write(model.getvalue()))


def build_tokenizer(
    data_dir: str, cfg: TokenizerConfig, verify: bool = False, symbols: tuple[str, ...] = ()
) -> Tokenizer:
    """Train (or reuse) the SentencePiece model(s) for the prepared corpus in ``data_dir``; a model that
    is damaged (app/data/cache.py; ``verify``: by its content hash) or does not load is trained again.
    ``symbols`` are words kept as one piece each (data.extra_tag). With ``tokenizer.dir``, the model(s) there,
    as they are: another corpus's, never retrained here."""
    src_path, tgt_path = model_paths(data_dir, cfg)
    if cfg.dir:
        missing = [p for p in dict.fromkeys((src_path, tgt_path)) if not os.path.exists(p)]
        if missing:
            name = os.path.basename(missing[0])
            raise UserError(f"tokenizer.dir={cfg.dir}: no {name} there (these tokenizer settings)")
        log.info("tokenizer: %s (tokenizer.dir), not trained on %s", src_path, data_dir)
        tokenizer = Tokenizer(src_path, tgt_path)
        for symbol in symbols:
            if tokenizer.src.piece_to_id(symbol) == UNK:
                raise UserError(
                    f"data.extra_tag={symbol}: not a piece of tokenizer.dir={cfg.dir}'s model, which would split it; "
                    "a tag the model was trained with, or none"
                )
        return tokenizer
    train_path = os.path.join(data_dir, "train.tsv")
    stamp_path = f"{src_path}.json"  # joint and separate models of one size keep separate stamps
    # as before the settings dir and byte_fallback (unset): caches stay valid
    settings = {k: v for k, v in asdict(cfg).items() if k != "dir" and (k != "byte_fallback" or v)}
    settings |= {"symbols": list(symbols)} if symbols else {}
    key = stable_hash({"train": file_hash(train_path), "cfg": settings})
    if cached(stamp_path, key, [src_path, tgt_path], verify):
        try:
            tokenizer = Tokenizer(src_path, tgt_path)
            log.info("tokenizer: %s is up to date", src_path)
            return tokenizer
        except UserError as err:
            log.warning("%s: training it again", err)

    with open(train_path, encoding="utf-8") as f:
        n_pairs = sum(1 for _ in f)
    log.info(
        "tokenizer: training SentencePiece %s (vocab %d, %s) on %d pairs",
        cfg.model_type,
        cfg.vocab_size,
        "joint" if cfg.joint else "separate",
        n_pairs,
    )
    # sentences stream from the file; SentencePiece keeps a sample of input_sentence_size of them
    if cfg.joint:
        _train_one(_column(train_path, 1, 2), src_path, cfg, symbols)
    else:  # the tags are the source's
        _train_one(_column(train_path, 1), src_path, cfg, symbols)
        _train_one(_column(train_path, 2), tgt_path, cfg, ())
    mark_done(stamp_path, key, [src_path, tgt_path])
    return Tokenizer(src_path, tgt_path)
