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


def test_local_m_attends_within_the_window_around_its_own_position():
    """Luong's local-m, known answers: p_t = t (the last source word where t passes it), the window D = 1 around it,
    the softmax of the scores within it, exactly 0 outside and at the padding."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 0.0]]])  # S = 5
    query = torch.tensor([[[1.0, 2.0]] * 7])  # seven target positions, the same query
    mask = torch.tensor([[True] * 4 + [False]])  # four source words
    attention = rnn_attention("dot", 2, 2, 2, local_window=1, monotonic=True)
    assert not list(attention.parameters())  # dot scores, and no position to predict
    context, weights = attention(query, keys, keys, mask, torch.arange(7))
    scores = [1.0, 2.0, 3.0, 2.0]
    for t in range(7):
        p = min(t, 3)
        inside = [s for s in range(4) if abs(s - p) <= 1]
        expected = [0.0] * 5
        for s, w in zip(inside, softmax([scores[s] for s in inside])):
            expected[s] = w
        assert weights[0, t].tolist() == pytest.approx(expected, abs=1e-6), t
        assert [w == 0 for w in weights[0, t].tolist()] == [e == 0 for e in expected]
    with pytest.raises(ValueError, match="target positions"):
        attention(query, keys, keys, mask)


def test_local_p_attends_around_its_predicted_position_with_a_gaussian():
    """Luong's local-p, known answers: v_p = 0 predicts the middle, p_t = (S_x - 1) / 2; the window D = 1 holds the
    source words within 1 of it, their dot scores lowered by (s - p_t)² / 2σ² (σ = D / 2), renormalized; the
    words outside the window and the padding get exactly 0."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 0.0]]])  # S = 5
    query = torch.tensor([[[1.0, 2.0]]])
    attention = rnn_attention("dot", 2, 2, 2, local_window=1)
    set_linear(attention.v_p, [[0.0, 0.0]])
    scores = [1.0, 2.0, 3.0, 2.0, 0.0]
    for mask, p in [(torch.tensor([[True] * 5]), 2.0), (torch.tensor([[True] * 4 + [False]]), 1.5)]:
        context, weights = attention(query, attention.prepare(keys), keys, mask)
        inside = [s for s in range(5) if abs(s - p) <= 1 and mask[0, s]]
        expected = [0.0] * 5
        for s, w in zip(inside, softmax([scores[s] - (s - p) ** 2 / (2 * 0.5**2) for s in inside])):
            expected[s] = w
        assert weights[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
        assert [w == 0 for w in weights[0, 0].tolist()] == [e == 0 for e in expected]
        assert context[0, 0].tolist() == pytest.approx((torch.tensor(expected) @ keys[0]).tolist(), abs=1e-6)
    # a predicted position follows v_p: sigmoid(+large) puts it on the last source word
    set_linear(attention.W_p, [[1.0, 0.0], [0.0, 1.0]])
    set_linear(attention.v_p, [[50.0, 50.0]])  # 50 (tanh 1 + tanh 2) = 86
    _, weights = attention(query, attention.prepare(keys), keys, torch.tensor([[True] * 5]))
    assert weights[0, 0, :3].tolist() == [0.0, 0.0, 0.0] and weights[0, 0, 3:].sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["dot", "general", "concat"])
def test_local_p_gradients_reach_the_predicted_position(kind):
    torch.manual_seed(0)
    attention = rnn_attention(kind, 6, 6, 5, local_window=2).double()
    states = torch.randn(2, 7, 6, dtype=torch.double, requires_grad=True)
    query = torch.randn(2, 3, 6, dtype=torch.double, requires_grad=True)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    context, weights = attention(query, attention.prepare(states), states, mask)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3, dtype=torch.double)) and torch.all(weights[1, :, 4:] == 0)
    assert ((weights > 0).sum(-1) <= 5).all()  # 2D + 1 source words at most
    context.sum().backward()
    for name, p in attention.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    fn = lambda q, s: attention(q, attention.prepare(s), s, mask)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (query.detach().requires_grad_(), states.detach().requires_grad_()))
