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


FREEZABLE = ("embeddings", "encoder", "decoder")  # the parts train.freeze may name (each family's parts())


def train_rules(t: Any) -> dict[str, bool]:
    """train.*'s numbers within what they mean (each rule's message: whether it is broken); 0 is off (or none, or
    all) where training reads it so; train.freeze's parts."""
    betas, smoothing = list(t.adam_betas), t.label_smoothing
    frozen, unknown = f"train.freeze=[{','.join(t.freeze)}]", next((p for p in t.freeze if p not in FREEZABLE), None)
    return {  # the first one broken is the error
        f"{frozen}: {unknown!r} is not a part of a model; the parts: {', '.join(FREEZABLE)}": unknown is not None,
        f"{frozen} freezes every part of the model: nothing would train": set(t.freeze) >= set(FREEZABLE),
        f"train.max_steps={t.max_steps} must be >= 0: updates in all": t.max_steps < 0,
        f"train.max_minutes={t.max_minutes} must be >= 0 (0: no time budget)": not t.max_minutes >= 0,
        f"train.batch_tokens={t.batch_tokens} must be >= 1: tokens of a batch, padding included": (t.batch_tokens < 1),
        f"train.tokens_per_update={t.tokens_per_update} must be >= 0 (0: train.accum_steps decides)": (
            t.tokens_per_update < 0
        ),
        f"train.lr={t.lr} must be > 0: the peak learning rate": not t.lr > 0,
        f"train.warmup_steps={t.warmup_steps} must be >= 0 (0: no warm-up)": t.warmup_steps < 0,
        f"train.max_epochs={t.max_epochs} must be >= 0 (0: no limit)": t.max_epochs < 0,
        f"train.lr_floor={t.lr_floor} must be in [0, 1]: where a decay ends, × train.lr": not (0 <= t.lr_floor <= 1),
        f"train.lr_patience={t.lr_patience} must be >= 0: validations without a gain before a cut": t.lr_patience < 0,
        f"train.lr_decay={t.lr_decay} must be in (0, 1): what a plateau's cut multiplies the rate by": not (
            0 < t.lr_decay < 1
        ),
        f"train.adam_betas={betas}: each must be in [0, 1)": not all(0 <= beta < 1 for beta in betas),
        f"train.weight_decay={t.weight_decay} must be >= 0 (0: none)": not t.weight_decay >= 0,
        f"train.clip_norm={t.clip_norm} must be > 0: every update's gradient is clipped to this norm": not (
            t.clip_norm > 0
        ),
        f"train.label_smoothing={smoothing} must be in [0, 1) (0: none)": not 0 <= smoothing < 1,
        f"train.eval_every={t.eval_every} must be >= 0 (0: no validation)": t.eval_every < 0,
        f"train.save_every={t.save_every} must be >= 0 (0: saved at the end only)": t.save_every < 0,
        f"train.log_every={t.log_every} must be >= 1: updates between log lines": t.log_every < 1,
        f"train.patience={t.patience} must be >= 0 (0: never stop early)": t.patience < 0,
        f"train.keep_last={t.keep_last} must be >= 0 (0: no snapshots)": t.keep_last < 0,
        f"train.keep_best={t.keep_best} must be >= 0 (0: none)": t.keep_best < 0,
        f"train.max_bad_steps={t.max_bad_steps} must be >= 0 (0: never abort)": t.max_bad_steps < 0,
        f"train.coverage_weight={t.coverage_weight} must be >= 0 (0: no coverage loss)": not t.coverage_weight >= 0,
        f"train.max_dev_sentences={t.max_dev_sentences} must be >= 0 (0: the whole dev split)": (
            t.max_dev_sentences < 0
        ),
    }


def rnn_rules(m: Any) -> dict[str, bool]:
    """An RNN's settings that only some of its attentions take (each rule's message: whether it is broken)."""
    additive = m.attention == "bahdanau" or (m.attention == "luong" and m.score == "concat")
    why = "model.attention=none has none" if m.attention == "none" else f"not model.score={m.score}"
    return {  # the first one broken is the error
        "model.copy_attention=true copies through the attention: model.attention=none has none": (
            m.copy_attention and m.attention == "none"
        ),
        "model.coverage=true adds the coverage to an additive score, v·tanh(W s + U h + w_c c): "
        f"model.attention=bahdanau, or luong with model.score=concat ({why})": m.coverage and not additive,
        f"model.attention_dropout={m.attention_dropout}: model.attention=none has no attention": (
            m.attention == "none" and bool(m.attention_dropout)
        ),
        f"model.local_window={m.local_window} must be >= 0 (0: global attention)": m.local_window < 0,
        f"model.local_window={m.local_window}: local attention is Luong's (model.attention=luong); "
        f"model.attention={m.attention} attends globally": bool(m.local_window) and m.attention != "luong",
        "model.local_alignment=predictive places a local window: set model.local_window (0: global attention)": (
            m.local_alignment == "predictive" and not m.local_window
        ),
    }


def check_align_layer(layer: int, layers: int) -> None:
    """``model.align_layer`` within a Transformer's ``layers`` decoder layers (negative: counted from the last; the
    default -2, the penultimate, is a one-layer decoder's one layer), else a UserError: guided alignment and the
    pointer-generator would read another layer than the one given."""
    if not -layers <= layer < layers and not (layer == -2 and layers == 1):
        raise UserError(
            f"model.align_layer={layer}: this model has {layers} decoder layer{'s' * (layers > 1)}; give {-layers} "
            f"to {layers - 1} (-2: the penultimate)"
        )


def check_layer(layer: int, model_cfg) -> None:
    """``viz.layer`` within a Transformer's decoder layers (negative: counted from the last), else a UserError: an
    export would bake a layer that is not there into its model (CTranslate2 then crashes reading it), plots
    would show another one. An RNN has one map, whatever the setting."""
    layers = getattr(model_cfg, "dec_layers", None)
    if getattr(model_cfg, "arch", None) == "transformer" and layers and not -layers <= layer < layers:
        raise UserError(
            f"viz.layer={layer}: this model has {layers} decoder layer{'s' * (layers > 1)}; "
            f"give {-layers} to {layers - 1} (-1: the last)"
        )
