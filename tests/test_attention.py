"""Known-answer checks for scaled dot-product multi-head attention."""

import math

import pytest
import torch

from app.models.attention import MultiHeadAttention, attention_weights


def test_attention_weights_hand_computed():
    scores = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    weights = attention_weights(scores, mask)
    e1, e2 = math.exp(1.0), math.exp(2.0)
    assert weights[0, 0].item() == pytest.approx(e1 / (e1 + e2))
    assert weights[0, 1].item() == pytest.approx(e2 / (e1 + e2))
    assert weights[0, 2].item() == 0.0  # exactly zero, not merely small


def make_mha(d_model=8, heads=2, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, heads).eval()


def test_single_head_identity_projections_match_hand_computation():
    mha = MultiHeadAttention(2, 1).eval()
    with torch.no_grad():
        for proj in (mha.q_proj, mha.out_proj):
            proj.weight.copy_(torch.eye(2))
        mha.kv_proj.weight.copy_(torch.cat([torch.eye(2), torch.eye(2)]))  # [W^K; W^V]
        for proj in (mha.q_proj, mha.kv_proj, mha.out_proj):
            proj.bias.zero_()
    q = torch.tensor([[[1.0, 0.0]]])  # one query
    kv = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # two keys, values equal keys
    out, weights = mha(q, kv, need_weights=True)
    # scores = q·k / sqrt(2) = [1/sqrt2, 0]
    a = math.exp(1 / math.sqrt(2))
    expected_w = torch.tensor([a / (a + 1), 1 / (a + 1)])
    assert torch.allclose(weights[0, 0, 0], expected_w, atol=1e-6)
    assert torch.allclose(out[0, 0], expected_w, atol=1e-6)  # context = weights @ V with V = I
    fast, _ = mha(q, kv)
    assert torch.allclose(fast, out, atol=1e-6)


def test_padded_keys_get_exactly_zero_weight_and_rows_sum_to_one():
    mha = make_mha()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    _, weights = mha(x, x, mask=mask, need_weights=True)
    assert weights.shape == (2, 2, 5, 5)
    assert torch.all(weights[1, :, :, 3:] == 0)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 5), atol=1e-6)


def test_padding_does_not_change_outputs_for_real_tokens():
    mha = make_mha()
    x = torch.randn(1, 3, 8)
    padded = torch.cat([x, torch.randn(1, 2, 8) * 100], dim=1)
    mask = torch.tensor([[True, True, True, False, False]])[:, None, None, :]
    out_short, _ = mha(x, x)
    out_padded, _ = mha(padded, padded, mask=mask)
    assert torch.allclose(out_short, out_padded[:, :3], atol=1e-5)


def test_causal_mask_blocks_the_future():
    mha = make_mha()
    x = torch.randn(1, 4, 8)
    _, weights = mha(x, x, causal=True, need_weights=True)
    upper = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    assert torch.all(weights[0, :, upper] == 0)
    # changing a later token leaves earlier outputs unchanged
    y = x.clone()
    y[0, 3] += 5
    out_x, _ = mha(x, x, causal=True)
    out_y, _ = mha(y, y, causal=True)
    assert torch.allclose(out_x[0, :3], out_y[0, :3], atol=1e-6)
    assert not torch.allclose(out_x[0, 3], out_y[0, 3])


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_path_equals_explicit_softmax_reference(causal):
    mha = make_mha(d_model=16, heads=4)
    q, kv = torch.randn(3, 6, 16), torch.randn(3, 6, 16)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 4, 2])[:, None])[:, None, None, :]
    fast, none = mha(q, kv, mask=mask, causal=causal)
    slow, weights = mha(q, kv, mask=mask, causal=causal, need_weights=True)
    assert none is None
    assert torch.allclose(fast, slow, atol=1e-5)
    # an independent reference: softmax(QK^T / sqrt(d)) V per head, written out
    Q = mha.q_proj(q).view(3, 6, 4, 4).transpose(1, 2)
    K, V = (p.view(3, 6, 4, 4).transpose(1, 2) for p in mha.kv_proj(kv).chunk(2, dim=-1))
    scores = Q @ K.transpose(-1, -2) / 2.0
    full_mask = mask.expand(3, 4, 6, 6)
    if causal:
        full_mask = full_mask & torch.ones(6, 6, dtype=torch.bool).tril()
    ref_w = torch.softmax(scores.masked_fill(~full_mask, float("-inf")), dim=-1)
    ref = mha.out_proj((ref_w @ V).transpose(1, 2).reshape(3, 6, 16))
    assert torch.allclose(weights, ref_w, atol=1e-6)
    assert torch.allclose(fast, ref, atol=1e-5)


def test_gradients_reach_every_parameter():
    mha = make_mha()
    x = torch.randn(2, 5, 8, requires_grad=True)
    out, _ = mha(x, x)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_gradcheck_double_precision():
    mha = make_mha(d_model=4, heads=2).double()
    x = torch.randn(1, 3, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mha(t, t, need_weights=True)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: mha(t, t)[0], (x,))


def test_heads_must_divide_model_dim():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
