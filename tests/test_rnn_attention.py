"""Known-answer checks for the RNN attention scores (Bahdanau additive; Luong dot / general / concat)."""

import math

import pytest
import torch

from app.models.attention import AdditiveAttention, ConcatAttention, DotAttention, GeneralAttention, rnn_attention

KEYS = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # (B=1, S=3, 2); values = keys
QUERY = torch.tensor([[[1.0, 2.0]]])  # (B=1, T=1, 2)
ALL = torch.tensor([[True, True, True]])
FIRST_TWO = torch.tensor([[True, True, False]])


def softmax(xs):
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def check(attention, expected_scores, mask=ALL):
    keys = attention.prepare(KEYS)
    context, weights = attention(QUERY, keys, KEYS, mask)
    n = int(mask.sum())
    expected = softmax(expected_scores[:n]) + [0.0] * (3 - n)
    assert weights.shape == (1, 1, 3)
    assert weights[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert all(weights[0, 0, n:] == 0)  # masked: exactly zero
    expected_context = [sum(w * KEYS[0, j, d].item() for j, w in enumerate(expected)) for d in range(2)]
    assert context[0, 0].tolist() == pytest.approx(expected_context, abs=1e-6)


def set_linear(linear, rows):
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(rows, dtype=torch.float32))


@pytest.mark.parametrize("mask", [ALL, FIRST_TWO])
def test_dot(mask):
    check(DotAttention(), [1.0, 2.0, 3.0], mask)  # q·h_j


@pytest.mark.parametrize("mask", [ALL, FIRST_TWO])
def test_general(mask):
    attention = GeneralAttention(2, 2)
    set_linear(attention.W_a, [[2.0, 0.0], [0.0, -1.0]])  # W_a h = (2 h1, -h2)
    check(attention, [2.0, -2.0, 0.0], mask)  # q·W_a h_j = 1*2h1 + 2*(-h2)


@pytest.mark.parametrize("cls", [AdditiveAttention, ConcatAttention])
@pytest.mark.parametrize("mask", [ALL, FIRST_TWO])
def test_additive_and_concat(cls, mask):
    attention = cls(2, 2, 2)
    set_linear(attention.W, [[1.0, 0.0], [0.0, 0.5]])  # W q = (1, 1)
    set_linear(attention.U, [[1.0, 0.0], [0.0, 1.0]])  # U h = h
    set_linear(attention.v, [[1.0, -1.0]])
    # e_j = v·tanh(W q + U h_j) = tanh(1 + h_j1) - tanh(1 + h_j2)
    expected = [math.tanh(1 + h1) - math.tanh(1 + h2) for h1, h2 in KEYS[0].tolist()]
    check(attention, expected, mask)


@pytest.mark.parametrize("kind", ["bahdanau", "dot", "general", "concat"])
def test_many_queries_rows_sum_to_one_and_gradients_flow(kind):
    torch.manual_seed(0)
    attention = rnn_attention(kind, 6, 6, 5)
    states = torch.randn(2, 4, 6, requires_grad=True)
    query = torch.randn(2, 3, 6, requires_grad=True)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    context, weights = attention(query, attention.prepare(states), states, mask)
    assert context.shape == (2, 3, 6) and weights.shape == (2, 3, 4)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3))
    assert torch.all(weights[1, :, 2:] == 0)
    context.sum().backward()
    assert query.grad.abs().sum() > 0 and states.grad.abs().sum() > 0
    for name, p in attention.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dot_needs_equal_sizes():
    with pytest.raises(ValueError, match="equal"):
        rnn_attention("dot", 4, 6, 4)


@pytest.mark.parametrize("kind", ["bahdanau", "dot", "general", "concat"])
def test_attention_dropout_drops_context_weights_in_training_only(kind):
    """model.attention_dropout: while training, the context is made of dropped (and rescaled) weights; the weights
    returned, which plots and alignments read, are the softmax's; in evaluation nothing is dropped."""
    torch.manual_seed(0)
    attention = rnn_attention(kind, 2, 2, 4, dropout=0.5)
    keys, values = attention.prepare(KEYS), torch.randn(1, 3, 8)
    queries, mask = torch.randn(1, 64, 2), ALL
    context, weights = attention(queries, keys, values, mask)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 64))  # not dropped
    assert not torch.allclose(context, weights @ values)  # the context is
    # each weight is dropped or kept ×2 (p = 0.5): every context is one of the 8 such mixtures of the values
    subsets = torch.tensor([[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)], dtype=torch.float32)
    mixtures = (2 * weights[0, :, None, :] * subsets) @ values[0]  # (64, 8, 8)
    assert (mixtures - context[0, :, None, :]).abs().amax(-1).amin(-1).max() < 1e-5
    attention.eval()
    context, weights = attention(queries, keys, values, mask)
    assert torch.allclose(context, weights @ values)
