"""The operators an eager training step of the default Transformer dispatches: the host's work per update
(docs/benchmarking.md, "A training step's host work"). The count depends on the layers, heads and parameters,
not on the widths, so narrow widths stand in for the default's. Before the projections were fused and the
residual stream kept in rows (99c1301) the same step counted 1,738 operators, 1,360 without attention dropout;
a change that brings back a per-use reshape, a separate projection or a per-layer mask fails here."""

import pytest
import torch
from conftest import Vocab

from app.bench.profiling import count_ops
from app.config.schema import Config
from app.data.batching import Batch
from app.models import build_model
from app.train.update import make_optimizer, train_step


def operators_per_step(attention_dropout: float, pos: str = "sinusoidal") -> float:
    torch.manual_seed(0)
    cfg = Config()  # the default Transformer: 6 + 6 layers, 8 heads, its dropouts
    cfg.model.d_model, cfg.model.ff_dim, cfg.model.attention_dropout = 64, 64, attention_dropout
    cfg.model.pos = pos
    model = build_model(cfg.model, Vocab(64, 64))
    optimizer, scheduler = make_optimizer(model, cfg)
    src, tgt = torch.randint(4, 64, (2, 6)), torch.randint(4, 64, (2, 6))
    batch = Batch(src, torch.arange(2), tgt[:, :-1], tgt[:, 1:], torch.full((2,), 6))
    step = lambda: train_step(model, [batch], 10, optimizer, scheduler, cfg, None)  # noqa: E731
    step()  # the first update creates the optimizer's state
    return count_ops(step, 2, torch.device("cpu"), dispatch=False)["ops"]


@pytest.mark.parametrize(
    "attention_dropout, at_most",
    [
        # 11 of each: the cross-entropy without label smoothing, whose exp train/ppl is (app/models.unsmoothed_loss)
        (0.1, 1331),  # the CPU's SDPA runs attention with dropout through its math kernels (~21 operators each)
        (0.0, 953),  # its fused kernel, as CUDA's runs attention with or without dropout: the H100's fp32 count + 11
    ],
)
def test_the_default_transformer_steps_with_no_more_operators_than_measured(attention_dropout, at_most):
    assert operators_per_step(attention_dropout) <= at_most


def test_rope_adds_few_operators_to_a_step():
    """RoPE turns the queries and keys of each self-attention in one rotation of three kernels: 192 operators more
    than sinusoidal positions per step here. Rotating queries and keys apart, each by splitting its feature pairs
    and stacking four products, took 568 more."""
    assert operators_per_step(0.0, "rope") - operators_per_step(0.0) <= 200
