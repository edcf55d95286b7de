"""Parts of a model left untrained (``train.freeze``): the token embeddings, the encoder, the decoder, as each family
names them (its ``parts()``).

Fine-tuning a trained model on a small corpus can forget what the large one taught; freezing the parts that
carry it keeps them as loaded and trains the rest (e.g. the encoder of a source language the new domain
shares, or embeddings trained on more text than the new corpus has). OpenNMT-py's ``freeze_encoder`` /
``freeze_decoder`` do the same. A frozen weight gets no gradient, AdamW holds no moments for it (nor decays it),
clipping does not count it, and the bf16 compute copy (app/train/master_weights.py) keeps its copy as made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import nn

from app.config.ranges import FREEZABLE
from app.models import Family


def parameter_parts(model: Family) -> dict[str, list[nn.Parameter]]:
    """Each part's parameters, every parameter in exactly one: a weight two parts share (an output projection
    tied to the embeddings) is the embeddings'. A parameter in no part is a family's bug (ValueError)."""
    taken: set[int] = set()
    parts: dict[str, list[nn.Parameter]] = {}
    named = model.parts()
    for part in FREEZABLE:  # embeddings first: what is tied to them is theirs
        parts[part] = []
        for module in named[part]:
            for p in module.parameters():
                if id(p) not in taken:
                    taken.add(id(p))
                    parts[part].append(p)
    if left := [name for name, p in model.named_parameters() if id(p) not in taken]:
        raise ValueError(f"{type(model).__name__}.parts() leaves out {', '.join(left)}")
    return parts


def freeze(model: nn.Module, names: Sequence[str]) -> None:
    """Turns off the gradients of the parts ``names`` (train.freeze) of a family's ``model``."""
    if names:
        parts = parameter_parts(cast(Family, model))
        for p in (p for name in names for p in parts[name]):
            p.requires_grad_(False)


def frozen_note(model: nn.Module, names: Sequence[str]) -> str:
    """What train.freeze froze, for the log's model line: "19.4 M frozen: train.freeze=[encoder]" ("": nothing)."""
    return f"{frozen_parameters(model) / 1e6:.1f} M frozen: train.freeze=[{','.join(names)}]" if names else ""


def frozen_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)
