"""The model families behind one API (encode / decode / step / state.select), built from a
model configuration and the tokenizer whose vocabularies they embed."""

from __future__ import annotations

from typing import Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn

from app.config.schema import MODEL_SCHEMAS, ModelConfig, RNNConfig, TransformerConfig
from app.data.tokenizer import PAD
from app.models.rnn import RNNSeq2Seq
from app.models.transformer import Transformer
from app.run.errors import UserError


class Vocabularies(Protocol):
    """What a model needs of its tokenizer (app.data.tokenizer.Tokenizer has it)."""

    @property
    def src_vocab_size(self) -> int: ...

    @property
    def tgt_vocab_size(self) -> int: ...

    @property
    def joint(self) -> bool: ...


Family = Union[Transformer, RNNSeq2Seq]  # a model of one family; each satisfies app.models.api.Seq2Seq


def build_model(cfg: ModelConfig, tokenizer: Vocabularies) -> Family:
    families = {"transformer": Transformer, "rnn": RNNSeq2Seq}
    if cfg.arch not in families:
        raise UserError(f"model.arch={cfg.arch!r} is unknown; available: {sorted(families)}")
    if not isinstance(cfg, MODEL_SCHEMAS[cfg.arch]):
        raise UserError(
            f"model.arch={cfg.arch!r} does not match the {type(cfg).__name__} settings given: "
            "choose the family with a model= preset (model=transformer, model=rnn_bahdanau, ...)"
        )
    vocab = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    try:
        return Transformer(cfg, *vocab) if isinstance(cfg, TransformerConfig) else RNNSeq2Seq(cfg, *vocab)
    except ValueError as err:
        raise UserError(str(err)) from None


def has_attention(cfg: ModelConfig) -> bool:
    """Whether the family attends over the source: every Transformer, an RNN unless model.attention=none."""
    return not isinstance(cfg, RNNConfig) or cfg.attention != "none"


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sequence_loss(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed (label-smoothed) cross-entropy of a model's logits over the non-padding target tokens."""
    return F.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=PAD, label_smoothing=label_smoothing, reduction="sum"
    )


@torch.no_grad()
def unsmoothed_loss(
    smoothed: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, label_smoothing: float
) -> torch.Tensor:
    """The summed cross-entropy without label smoothing (whose exp is the perplexity), from ``sequence_loss``'s
    smoothed one. Smoothing aims at q = (1 - ε)·onehot(y) + ε/V (Szegedy et al. 2016, torch's label_smoothing), so
    S = (1 - ε)·NLL + ε·U with U = Σ_i mean_v(-log p_iv); log-softmax's normalizer cancels in NLL - U =
    Σ_i (mean_v z_iv - z_iy) for logits z, so NLL = S + ε·Σ_i (mean_v z_iv - z_iy): a pass over the logits, no
    second softmax."""
    if not label_smoothing:
        return smoothed
    gap = logits.mean(-1, dtype=torch.float32) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.add(smoothed, (gap * (target != PAD)).sum(), alpha=label_smoothing)  # few operators: one per update
