"""Guided alignment (Garg et al. 2019, "Jointly Learning to Align and Translate with Transformer
Models", §4.2): the attention of one cross-attention head (``model.align_layer``, head 0; an RNN's
attention) is trained towards reference word links, with

    L_a = −(1/|R|) Σ_{t∈R} Σ_s G_ts log A_ts,

where G spreads each target piece's links evenly over the source pieces of the words it is linked to
(every row with a link sums to 1) and R are the target pieces that have a link. A batch's pieces may be a
sampled segmentation (train.subword_alpha), so its words are SentencePiece's, which every segmentation of a
text numbers alike (a word starts at each ``▁``); the links, over the text's whitespace words, are turned into
links between SentencePiece's words once per pair (a text word whose characters SentencePiece's normalization
makes a space, such as a ZWNJ inside a Persian word, is two of them). Training minimizes
the cross-entropy plus ``train.align_weight`` · L_a. Links are read from the train split's
``train.align`` (Strong's numbers for a tagged Bible, or ``data.train_align``); dev and test links
never enter training.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from app.config.schema import Config
from app.data.corpus import tokenized
from app.data.links import read_pharaoh
from app.data.tokenizer import Tokenizer
from app.models import has_attention
from app.run.errors import UserError

WORD_START = "▁"  # SentencePiece marks the first piece of each of its words
CONTROL = frozenset({"<pad>", "<s>", "</s>"})  # the pieces of no word; <unk> and byte pieces are of one


def piece_words(pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per vocabulary id: does its piece start a whitespace word, is it a control piece (<pad>, </s>...: of no
    word)."""
    special = np.array([p in CONTROL for p in pieces])
    return np.array([p.startswith(WORD_START) for p in pieces]) & ~special, special


def word_numbers(ids: np.ndarray, starts: np.ndarray, special: np.ndarray) -> np.ndarray:
    """SentencePiece's word number of each piece of a sentence (-1 for special tokens and padding): a word starts
    at a ▁ piece or at the first piece. On encoded text whose whitespace is SentencePiece's these are the text's
    whitespace words (app.data.tokenizer.span_words)."""
    real = ~special[ids]
    start = starts[ids].copy()
    if real.any():
        start[np.argmax(real)] = True
    return np.where(real, np.cumsum(start) - 1, -1)


class AlignmentTargets:
    """The row-normalized link matrices G of training batches, from the train split's links (over whitespace
    words) and its texts (``texts``: source and target, random access; without them the links are taken to number
    SentencePiece's words already)."""

    def __init__(
        self,
        links: list[set[tuple[int, int]]],
        tokenizer: Tokenizer,
        texts: Optional[tuple[Sequence[str], Sequence[str]]] = None,
    ):
        self.links, self.tokenizer, self.texts = links, tokenizer, texts
        self.src_words = piece_words(tokenizer.src_pieces(list(range(tokenizer.src_vocab_size))))
        self.tgt_words = piece_words(tokenizer.tgt_pieces(list(range(tokenizer.tgt_vocab_size))))
        self.alike = np.zeros(len(links), dtype=bool)  # pairs whose text and SentencePiece's words are the same
        self.turned: dict[int, set[tuple[int, int]]] = {}  # the links of the others, between SentencePiece's words

    def pair_links(self, i: int) -> set[tuple[int, int]]:
        """Pair ``i``'s links between SentencePiece's words: each link (i, j) of text words becomes every link
        between the SentencePiece words of text word i and those of text word j. Found once, the first time the
        pair is in a batch (in the prefetch thread); a pair whose texts are printable ASCII, which SentencePiece's
        normalization leaves as they are, numbers both alike."""
        if self.texts is None or self.alike[i]:
            return self.links[i]
        if (turned := self.turned.get(i)) is not None:
            return turned
        src, tgt = self.texts[0][i], self.texts[1][i]
        turned = self.links[i]
        if not all(text.isascii() and text.isprintable() for text in (src, tgt)):
            t = self.tokenizer
            sides = ((src, t.src_words, t.encode_src, self.src_words), (tgt, t.tgt_words, t.encode_tgt, self.tgt_words))
            of_src, of_tgt = (
                sentencepiece_words(words([text])[0], word_numbers(np.asarray(encode([text])[0], np.intp), *flags))
                for text, words, encode, flags in sides
            )
            turned = {(s, u) for a, b in self.links[i] for s in of_src.get(a, ()) for u in of_tgt.get(b, ())}
        if turned == self.links[i]:
            self.alike[i] = True
        else:
            self.turned[i] = turned
        return turned

    def __call__(self, indices: list[int], src: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        """G (batch, target pieces, source pieces) for the sentences ``indices`` of a padded batch:
        rows are the pieces the decoder outputs (tgt_out), columns the source pieces (EOS included). The
        batch's empty sentences after ``indices`` (app/data/shapes.py) get no links."""
        src_ids, tgt_ids = src.numpy(), tgt_out.numpy()
        targets = np.zeros((len(src_ids), tgt_ids.shape[1], src_ids.shape[1]), dtype=np.float32)
        for b, i in enumerate(indices):
            src_word = word_numbers(src_ids[b], *self.src_words)
            tgt_word = word_numbers(tgt_ids[b], *self.tgt_words)
            linked = np.zeros((tgt_word.max() + 2, src_word.max() + 2), dtype=np.float32)  # last row/col: -1
            for s, t in self.pair_links(i):
                if s <= src_word.max() and t <= tgt_word.max():
                    linked[t, s] = 1.0
            targets[b] = linked[tgt_word][:, src_word]
        rows = targets.sum(-1, keepdims=True)
        return torch.from_numpy(np.divide(targets, rows, out=np.zeros_like(targets), where=rows > 0))


def sentencepiece_words(text_words: Sequence[int], piece_words: np.ndarray) -> dict[int, list[int]]:
    """Text word -> the SentencePiece words it holds, from each piece's number of both (-1: none)."""
    held: dict[int, list[int]] = {}
    for text_word, word in zip(text_words, piece_words.tolist()):
        if text_word >= 0 and word >= 0 and word not in held.setdefault(text_word, []):
            held[text_word].append(word)
    return held


def guided_alignment_loss(attention: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_a over one batch: attention and targets (batch, target pieces, source pieces); rows of the
    targets without a link count for nothing. No host sync."""
    attention = attention.to(torch.promote_types(attention.dtype, torch.float32))  # bf16 under autocast
    nll = -(targets * attention.clamp_min(1e-9).log()).sum(-1)
    rows = targets.sum(-1) > 0
    return (nll * rows).sum() / rows.sum().clamp_min(1)


def alignment_targets(cfg: Config, tokenizer: Tokenizer, train_pairs: int) -> AlignmentTargets | None:
    """The targets for training with ``train.align_weight`` > 0 (else None), checked against the model
    and the train split."""
    if cfg.train.align_weight <= 0:
        return None
    if not has_attention(cfg.model):
        raise UserError("train.align_weight needs attention to guide: model.attention=none has none")
    path = os.path.join(cfg.data.dir, "train.align")
    if not os.path.exists(path):
        raise UserError(
            f"train.align_weight={cfg.train.align_weight} needs reference links of the train split, "
            f"{path}: data.reference_links=true for a tagged Bible (data=bible_es_kjv), "
            "data.aligner=eflomal or data.train_align=<file> for any corpus"
        )
    links = [possible for _, possible in read_pharaoh(path)]  # possible includes sure
    if len(links) != train_pairs:
        raise UserError(f"{path} has {len(links)} lines for {train_pairs} train pairs: prepare the data again")
    table = tokenized(cfg.data.dir, "train", tokenizer).data  # memory-mapped: a pair's texts read when it is needed
    return AlignmentTargets(links, tokenizer, (ArrowTexts(table.column("src")), ArrowTexts(table.column("tgt"))))


class ArrowTexts(Sequence[str]):
    """A memory-mapped Arrow column of strings, read one item at a time."""

    def __init__(self, column):
        self.column = column

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, i):  # an index only
        return self.column[i].as_py()
