"""Guided alignment (Garg et al. 2019, "Jointly Learning to Align and Translate with Transformer
Models", §4.2): the attention of one cross-attention head (``model.align_layer``, head 0; an RNN's
attention) is trained towards reference word links, with

    L_a = −(1/|R|) Σ_{t∈R} Σ_s G_ts log A_ts,

where G spreads each target piece's links evenly over the source pieces of the words it is linked to
(every row with a link sums to 1) and R are the target pieces that have a link. Training minimizes
the cross-entropy plus ``train.align_weight`` · L_a. Links are read from the train split's
``train.align`` (Strong's numbers for a tagged Bible, or ``data.train_align``); dev and test links
never enter training.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from app.config.schema import Config
from app.data.links import CONTROL, WORD_START, read_pharaoh
from app.data.tokenizer import Tokenizer
from app.models import has_attention
from app.run.errors import UserError


def piece_words(pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per vocabulary id: does its piece start a whitespace word, is it a control piece (<pad>, </s>...: of no
    word)."""
    special = np.array([p in CONTROL for p in pieces])
    return np.array([p.startswith(WORD_START) for p in pieces]) & ~special, special


def word_numbers(ids: np.ndarray, starts: np.ndarray, special: np.ndarray) -> np.ndarray:
    """The word number of each piece of a sentence (-1 for special tokens and padding), as
    app.data.links.word_index gives for its pieces: a word starts at a ▁ piece or at the first piece. (Not
    for a lone ▁ before another word, which word_index leaves out: encoded text never holds one, as
    SentencePiece removes extra spaces; only a model's output can.)"""
    real = ~special[ids]
    start = starts[ids].copy()
    if real.any():
        start[np.argmax(real)] = True
    return np.where(real, np.cumsum(start) - 1, -1)


class AlignmentTargets:
    """The row-normalized link matrices G of training batches, from the train split's links."""

    def __init__(self, links: list[set[tuple[int, int]]], tokenizer: Tokenizer):
        self.links = links
        self.src_words = piece_words(tokenizer.src_pieces(list(range(tokenizer.src_vocab_size))))
        self.tgt_words = piece_words(tokenizer.tgt_pieces(list(range(tokenizer.tgt_vocab_size))))

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
            for s, t in self.links[i]:
                if s <= src_word.max() and t <= tgt_word.max():
                    linked[t, s] = 1.0
            targets[b] = linked[tgt_word][:, src_word]
        rows = targets.sum(-1, keepdims=True)
        return torch.from_numpy(np.divide(targets, rows, out=np.zeros_like(targets), where=rows > 0))


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
    return AlignmentTargets(links, tokenizer)
