"""Position schemes (app/models/positions.py): RoPE and ALiBi against their papers' equations, the
table limit of absolute schemes, and extrapolation past the trained lengths on a toy task."""

import math
from contextlib import contextmanager

import pytest
import torch
from conftest import Vocab, model_config
from toy_tasks import SYMBOLS, reversal_data, train_on_reversal

from app.data.batching import Batcher
from app.decode.passes import greedy_decode
from app.models import build_model
from app.models.positions import ALiBi, Rotary, alibi_slopes


def test_rope_scores_depend_only_on_the_offset():
    rotary = Rotary(8).double()
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.double), torch.randn(1, 1, 1, 8, dtype=torch.double)

    def score(m, n):
        return float((rotary(m, 1)(q) * rotary(n, 1)(k)).sum())

    for m, n in [(0, 0), (3, 1), (2, 7), (40, 5)]:
        for shift in (1, 9, 200):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)  # ...and does depend on it
    assert torch.allclose(rotary(0, 1)(q), q)  # position 0: no rotation
    x = torch.randn(2, 3, 5, 8)
    assert torch.allclose(rotary(4, 5)(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_rope_rotates_feature_pairs_by_position_times_frequency():
    rotary = Rotary(4)  # θ = 10000^(-0/4), 10000^(-2/4) = 1, 1/100
    x = torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4)
    rotated = rotary(3, 1)(x).flatten()
    expected = torch.tensor([math.cos(3), math.sin(3), -math.sin(0.03), math.cos(0.03)])
    assert torch.allclose(rotated, expected, atol=1e-6)


# ---- ALiBi ----


def test_alibi_slopes_are_the_papers_geometric_sequence():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))  # 1/2 .. 1/256
    assert torch.allclose(alibi_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]))


def test_alibi_bias_hand_computed():
    bias = ALiBi(4)(0, 3, 3)
    distance = torch.tensor([[0.0, 1, 2], [1, 0, 1], [2, 1, 0]])  # |i - j|: symmetric in the encoder
    slopes = [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    for h, m in enumerate(slopes):
        assert torch.allclose(bias[h], -m * distance)
    step = ALiBi(4)(2, 1, 3)  # decoding step: the query at position 2 against keys 0, 1, 2
    assert torch.allclose(step[:, 0], -torch.tensor(slopes)[:, None] * torch.tensor([2.0, 1, 0]))


@contextmanager
def one_thread():
    """Models this small gain nothing from threads, and a busy machine makes them wait (~7x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@one_thread()
def test_relative_positions_extrapolate_past_the_trained_lengths():
    """Train on 3-8 symbols, decode 12-16: every scheme learns the task and runs past the trained
    lengths with finite scores, and only the relative ones (RoPE, ALiBi) stay above chance there
    (measured symbol accuracy on 12-16: sinusoidal 0.06, learned 0.07, RoPE 0.21, ALiBi 0.33; chance 1/12)."""
    accuracy = {}
    for pos in ("sinusoidal", "learned", "rope", "alibi"):
        torch.manual_seed(0)
        cfg = model_config(
            d_model=32,
            heads=4,
            enc_layers=1,
            dec_layers=1,
            ff_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            pos=pos,
            max_len=32,
        )
        model = build_model(cfg, Vocab(20, 20))
        train_on_reversal(model, steps=300)
        for low, high in [(3, 8), (12, 16)]:
            src, tgt = reversal_data(100, seed=99, min_len=low, max_len=high)
            data = Batcher(src, tgt)(list(range(100)))
            memory = model.encode(data.src)
            assert torch.isfinite(model.decode(memory, data.tgt_in)[0]).all()
            hyps = greedy_decode(model, data.src, max_len_ratio=1.0, max_len_extra=2)
            accuracy[pos, high] = (
                sum(sum(a == b for a, b in zip(h, t)) / len(t) for h, t in zip(hyps.tokens, tgt)) / 100
            )
        assert accuracy[pos, 8] > 0.3, accuracy  # chance is 1/12
    chance = 1 / SYMBOLS
    relative, absolute = (
        [accuracy[p, 16] for p in ("rope", "alibi")],
        [accuracy[p, 16] for p in ("sinusoidal", "learned")],
    )
    assert min(relative) > 1.5 * chance and min(relative) > max(absolute) + 0.05, accuracy


def test_an_odd_width_is_refused_for_sinusoidal_positions_in_one_line():
    """Sines and cosines come in pairs: model.d_model=33 with model.pos=sinusoidal was a RuntimeError traceback from
    the table's shapes; other schemes take the width."""
    from app.run.errors import UserError

    with pytest.raises(UserError, match=r"^model.pos=sinusoidal pairs .*model.d_model=33 must be even"):
        build_model(model_config(d_model=33, heads=3, pos="sinusoidal"), Vocab(20, 20))
    assert build_model(model_config(d_model=33, heads=3, pos="learned"), Vocab(20, 20)) is not None
