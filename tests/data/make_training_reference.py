"""Records tests/data/training_reference.json: the per-step losses and gradient norms of a few fp32 training
updates of small Transformers (the default variant, and RoPE with grouped-query attention and a sliding
window), dropout on, from fixed seeds and batches. tests/test_training_reference.py checks that the training
step of today computes the same function.

The recorded figures are those of the training step before its projections were fused and its residual
stream kept in rows (commit 99c1301): rerun it only on a training step whose math is known to be right.
Run from the repository root:

    .venv/bin/python tests/data/make_training_reference.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # conftest
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # app

from conftest import Vocab, model_config  # noqa: E402

from app.config.schema import Config  # noqa: E402
from app.data.batching import Batch  # noqa: E402
from app.models import build_model  # noqa: E402
from app.train.update import make_optimizer, train_step  # noqa: E402

REFERENCE = os.path.join(HERE, "training_reference.json")
VOCAB, STEPS = 60, 4
VARIANTS = {
    "default": dict(d_model=32, heads=4, enc_layers=2, dec_layers=2, ff_dim=64),
    "rope_gqa_window": dict(
        d_model=32, heads=4, kv_heads=2, pos="rope", window=2, enc_layers=2, dec_layers=2, ff_dim=64
    ),
}


def batches() -> list[Batch]:
    """Three batches of other shapes, with padding on both sides."""
    gen, out = torch.Generator().manual_seed(0), []
    for n, s, t in [(4, 9, 7), (3, 6, 10), (5, 11, 5)]:
        src, tgt = torch.randint(4, VOCAB, (n, s), generator=gen), torch.randint(4, VOCAB, (n, t + 1), generator=gen)
        src[1, s - 3 :] = 0
        tgt[2, t - 2 :] = 0
        out.append(Batch(src, torch.arange(n), tgt[:, :-1], tgt[:, 1:], (src != 0).sum(-1)))
    return out


def run(variant: str) -> dict:
    """Losses and gradient norms of STEPS fp32 updates, one batch each (cycling), dropout on."""
    torch.manual_seed(1)
    cfg = Config(model=model_config(**VARIANTS[variant]))
    model = build_model(cfg.model, Vocab(VOCAB, VOCAB))
    optimizer, scheduler = make_optimizer(model, cfg)
    torch.manual_seed(2)
    data, figures = batches(), {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        batch = data[step % len(data)]
        result = train_step(model, [batch], int((batch.tgt_out != 0).sum()), optimizer, scheduler, cfg, None)
        figures["loss"].append(float(result.loss_sum))
        figures["grad_norm"].append(float(result.grad_norm))
    return figures


if __name__ == "__main__":
    with open(REFERENCE, "w") as f:
        json.dump({variant: run(variant) for variant in VARIANTS}, f, indent=1)
    print(f"wrote {REFERENCE}")
