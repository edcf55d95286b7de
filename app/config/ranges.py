"""Numeric settings within what they mean, checked once when their section is built: one rule per setting, the
first one broken is the error, one line naming the setting, its value and what it takes."""

from __future__ import annotations

from typing import Any

from app.run.errors import UserError


def check_rules(rules: dict[str, bool]) -> None:
    """Each setting's rule (its message, naming the setting, its value and what it takes: whether it is broken);
    the first one broken is the error."""
    for rule in (rule for rule, broken in rules.items() if broken):
        raise UserError(rule)


MODEL_SIZES = {  # the sizes check_model_ranges checks, and what each counts
    "d_model": "the width of every layer",
    "heads": "attention heads",
    "enc_layers": "encoder layers",
    "dec_layers": "decoder layers",
    "ff_dim": "the feed-forward's width",
    "emb_dim": "the embeddings' width",
    "hidden": "the RNN's state width",
}


def check_model_ranges(model: Any, sizes: tuple[str, ...]) -> None:
    """A model's sizes (widths, heads, layers) at least 1, and each of its dropout probabilities in [0, 1)
    (1 would drop every unit); an RNN's unset activation_dropout is model.dropout's."""
    for name in sizes:
        value = getattr(model, name)
        if value < 1:
            raise UserError(f"model.{name}={value} must be at least 1 ({MODEL_SIZES[name]})")
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        value = getattr(model, name)
        if value is not None and not 0 <= value < 1:
            raise UserError(f"model.{name}={value} must be in [0, 1): a probability of dropping, 0 for none")
