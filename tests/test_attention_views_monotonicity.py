"""Known answers of app.evaluation.views.monotonicity, the explorer's M: the rank correlation (Kendall's
tau-b) of the target pieces' positions and the source positions they attend, over the rows that are not flat.
1 for a diagonal, -1 for a reversed one, 0 where the map shows no order (flat, or stuck on one column)."""

import math

import numpy as np
import pytest
import torch

from app.evaluation.views import monotonicity


def one_hot(columns, n_src: int) -> np.ndarray:
    """A (len(columns), n_src) map, row i all on source column columns[i]."""
    return np.eye(n_src, dtype=np.float32)[list(columns)]


def test_a_diagonal_is_1():
    assert monotonicity(np.eye(6, dtype=np.float32)) == 1.0
    assert monotonicity(torch.eye(2)) == 1.0


def test_a_reversed_diagonal_is_minus_1():
    assert monotonicity(np.eye(6, dtype=np.float32)[::-1]) == -1.0
    assert monotonicity(torch.eye(2).flip(0)) == -1.0


def test_a_flat_map_is_0():
    """The untrained model's map: every row spread over the whole source, its argmax meaningless."""
    assert monotonicity(np.full((7, 9), 1 / 9, dtype=np.float32)) == 0.0
    nearly_flat = torch.softmax(0.1 * torch.randn(30, 40, generator=torch.Generator().manual_seed(0)), -1)
    assert monotonicity(nearly_flat) == 0.0


def test_a_map_stuck_on_one_column_is_0():
    assert monotonicity(one_hot([3] * 8, 10)) == 0.0
    stuck = np.full((8, 10), 0.02, dtype=np.float32)
    stuck[:, -1] = 0.82  # every row on </s>, as a model early in training does
    assert monotonicity(stuck) == 0.0


def test_flat_rows_do_not_count():
    """Rows spread evenly have no attended position: a diagonal with flat rows between is still a diagonal,
    whatever column an argmax of the flat rows would pick."""
    weights = np.full((8, 8), 1 / 8, dtype=np.float32)
    weights[::2] = np.eye(8, dtype=np.float32)[::2]
    assert monotonicity(weights) == 1.0
    weights[::2] = np.eye(8, dtype=np.float32)[::-2]
    assert monotonicity(weights) == -1.0


def test_a_noisy_near_diagonal_is_high():
    rng = np.random.default_rng(0)
    n = 40
    jitter = np.clip(np.arange(n) + rng.integers(-2, 3, n), 0, n - 1)  # the path off the diagonal by up to 2
    logits = -np.abs(np.arange(n)[None] - jitter[:, None]) + rng.normal(0, 0.5, (n, n))
    weights = torch.softmax(torch.as_tensor(3 * logits), -1)
    assert monotonicity(weights) > 0.8


def test_a_random_map_over_many_rows_is_near_0():
    rng = np.random.default_rng(1)
    weights = torch.softmax(torch.as_tensor(rng.normal(0, 3, (300, 50))), -1)  # peaked rows, random peaks
    assert abs(monotonicity(weights)) < 0.1


def test_rectangular_maps():
    """Without padding, target and source lengths differ: a monotone path over fewer target pieces is 1; over
    more target pieces, some share a source piece, and tau-b counts those tied pairs as neither order."""
    assert monotonicity(one_hot([0, 2, 4, 6], 7)) == 1.0
    assert monotonicity(one_hot([6, 4, 2, 0], 7)) == -1.0
    staircase = one_hot([0, 0, 1, 1, 2, 2, 3, 3], 4)
    # 28 pairs of target pieces, 24 in order, 4 sharing a source piece: 24 / sqrt(28 * 24)
    assert monotonicity(staircase) == pytest.approx(math.sqrt(24 / 28), abs=1e-6)
    assert monotonicity(staircase[::-1]) == pytest.approx(-math.sqrt(24 / 28), abs=1e-6)


def test_fewer_than_2_rows_is_0():
    assert monotonicity(np.eye(5, dtype=np.float32)[:1]) == 0.0
    assert monotonicity(np.zeros((0, 5), dtype=np.float32)) == 0.0
    one_peaked = np.full((5, 5), 0.2, dtype=np.float32)
    one_peaked[2] = np.eye(5)[4]  # one row not flat: no pair to order
    assert monotonicity(one_peaked) == 0.0


def test_tensor_dtypes_agree():
    rng = np.random.default_rng(2)
    weights = torch.softmax(torch.as_tensor(rng.normal(0, 2, (12, 15))) + 4 * torch.eye(12, 15), -1)
    expected = monotonicity(weights.numpy())
    assert -1.0 <= expected <= 1.0
    assert monotonicity(weights.half()) == pytest.approx(expected, abs=1e-6)
    assert monotonicity(weights.float()) == pytest.approx(expected, abs=1e-6)
    assert monotonicity(weights.tolist()) == pytest.approx(expected, abs=1e-6)
