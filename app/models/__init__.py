"""The model families behind one API (encode / decode / step / state.select), built from a
model configuration and the tokenizer whose vocabularies they embed."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from app.config import MODEL_SCHEMAS, ModelConfig
from app.errors import UserError
from app.models.rnn import RNNSeq2Seq
from app.models.transformer import Transformer


class Vocabularies(Protocol):
    """What a model needs of its tokenizer (app.data.tokenizer.Tokenizer has it)."""

    src_vocab_size: int
    tgt_vocab_size: int
    joint: bool


def build_model(cfg: ModelConfig, tokenizer: Vocabularies) -> nn.Module:
    families = {"transformer": Transformer, "rnn": RNNSeq2Seq}
    if cfg.arch not in families:
        raise UserError(f"model.arch={cfg.arch!r} is unknown; available: {sorted(families)}")
    if not isinstance(cfg, MODEL_SCHEMAS[cfg.arch]):
        raise UserError(
            f"model.arch={cfg.arch!r} does not match the {type(cfg).__name__} settings given: "
            "choose the family with a model= preset (model=transformer, model=rnn_bahdanau, ...)"
        )
    try:
        return families[cfg.arch](cfg, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    except ValueError as err:
        raise UserError(str(err)) from None


def has_attention(cfg: ModelConfig) -> bool:
    """Whether the family attends over the source: every Transformer, an RNN unless model.attention=none."""
    return cfg.arch != "rnn" or cfg.attention != "none"


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
