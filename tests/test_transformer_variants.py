"""Transformer variants (model.pos, model.norm_type, model.kv_heads, model.window): known answers for
each mechanism, agreement of every fast path with its explicit reference, cached decoding, and runs
on a toy task past the lengths seen in training."""

import pytest
import torch
from conftest import Vocab, model_config

from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import greedy_decode
from app.models import build_model
from app.models.attention import MultiHeadAttention, band_mask, causal_mask
from app.models.positions import ALiBi, Rotary
from app.run.errors import UserError

VOCAB = 23
HEADS, D_MODEL = 4, 16  # d_head 4

# (pos, norm_type, kv_heads, window, norm): every value of every switch, in a few combinations
VARIANTS = [
    ("sinusoidal", "rmsnorm", 2, 1, "pre"),
    ("learned", "layernorm", 1, 0, "pre"),
    ("learned", "rmsnorm", 4, 2, "post"),
    ("rope", "layernorm", 0, 0, "pre"),
    ("rope", "rmsnorm", 1, 3, "pre"),
    ("rope", "layernorm", 2, 2, "post"),
    ("alibi", "layernorm", 0, 2, "pre"),
    ("alibi", "rmsnorm", 2, 0, "pre"),
    ("alibi", "layernorm", 1, 1, "post"),
]


def variant(
    pos="sinusoidal", norm_type="layernorm", kv_heads=0, window=0, norm="pre", seed=0, tie=True, max_len=64, layers=2
):
    torch.manual_seed(seed)
    cfg = model_config(
        d_model=D_MODEL,
        heads=HEADS,
        enc_layers=layers,
        dec_layers=layers,
        ff_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        norm=norm,
        norm_type=norm_type,
        pos=pos,
        kv_heads=kv_heads,
        window=window,
        tie_embeddings=tie,
        max_len=max_len,
    )
    return build_model(cfg, Vocab(VOCAB, VOCAB)).eval()


def batch():
    src = torch.tensor([[5, 6, 7, 8, 9, 10, EOS], [9, 10, 11, EOS, PAD, PAD, PAD]])
    tgt_in = torch.tensor([[BOS, 11, 12, 13, 14], [BOS, 14, 15, PAD, PAD]])
    return src, tgt_in


def ids(v):
    return "-".join(map(str, v))


# ---- the whole model, every variant ----


@pytest.mark.parametrize("v", VARIANTS, ids=ids)
def test_shapes_padding_and_both_attention_paths(v):
    model = variant(*v)
    src, tgt_in = batch()
    memory = model.encode(src)
    logits, attention = model.decode(memory, tgt_in, need_attention=True)
    assert logits.shape == (2, 5, VOCAB)
    assert attention.shape == (2, 2, HEADS, 5, 7)  # query heads, whatever kv_heads is
    assert torch.all(attention[1, ..., 4:] == 0)
    assert torch.allclose(attention.sum(-1), torch.ones(2, 2, HEADS, 5), atol=1e-5)
    fast, _ = model.decode(memory, tgt_in)  # SDPA everywhere
    assert torch.isfinite(fast).all() and torch.allclose(fast, logits, atol=1e-5)
    # source padding changes nothing for the real tokens (window masks and biases included)
    short = model.decode(model.encode(src[1:, :4]), tgt_in[1:])[0]
    assert torch.allclose(short, fast[1:], atol=1e-5)


@pytest.mark.parametrize("v", VARIANTS, ids=ids)
def test_cached_steps_equal_teacher_forced_decoding(v):
    model = variant(*v)
    src, tgt_in = batch()
    memory = model.encode(src)
    full_logits, full_attention = model.decode(memory, tgt_in, need_attention=True)
    state = None
    for t in range(tgt_in.size(1)):
        logits, attention, state = model.step(memory, tgt_in[:, t], state, need_attention=t % 2 == 0)
        assert torch.allclose(logits, full_logits[:, t], atol=1e-5), t
        if attention is not None:
            assert torch.allclose(attention[..., 0, :], full_attention[..., t, :], atol=1e-5), t


@pytest.mark.parametrize("v", VARIANTS[1::2], ids=ids)
def test_runs_under_bf16_autocast(v):
    """The GPU training precision: rotations and biases must come back in the activations' dtype."""
    model = variant(*v)
    src, tgt_in = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = model(src, tgt_in)
        slow, attention = model.decode(model.encode(src), tgt_in, need_attention=True)
    assert fast.dtype == torch.bfloat16 and torch.isfinite(fast).all()
    assert torch.allclose(fast.float(), slow.float(), atol=0.1)
    assert torch.allclose(attention.float().sum(-1), torch.ones(2, 2, HEADS, 5), atol=1e-2)


@pytest.mark.parametrize("pos", ["learned", "rope", "alibi"])
def test_gradients_reach_every_parameter(pos):
    model = variant(pos, "rmsnorm", kv_heads=2, window=2, tie=False).train()
    src, tgt_in = batch()
    model(src, tgt_in).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_default_variant_keeps_parameter_names_and_has_no_position_parameters():
    names = set(variant().state_dict())
    assert "encoder.0.attn_block.norm.bias" in names and "encoder.0.self_attn.qkv_proj.weight" in names
    assert not any("positions" in n or "rotary" in n or "alibi" in n for n in names)  # old checkpoints load
    assert {n for n in variant("rope").state_dict()} == names  # RoPE: no parameter, no stored buffer
    assert set(variant("learned").state_dict()) == names | {"positions.table.weight"}
    assert not any(n.endswith("norm.bias") for n in variant(norm_type="rmsnorm").state_dict())


def test_norm_type_selects_the_norm_everywhere():
    model = variant(norm_type="rmsnorm")
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert norms and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    assert len(norms) == 2 * 2 + 3 * 2 + 2  # encoder and decoder blocks, final norms of the pre-norm stacks


def test_bad_settings_name_the_setting():
    for setting, match in [
        ({"pos": "relative"}, "model.pos='relative'.*rope"),
        ({"norm_type": "batchnorm"}, "model.norm_type='batchnorm'.*rmsnorm"),
        ({"kv_heads": 3}, "model.kv_heads=3"),
        ({"kv_heads": 8}, "model.kv_heads=8"),
        ({"kv_heads": -1}, "model.kv_heads=-1"),
        ({"window": -2}, "model.window=-2"),
    ]:
        with pytest.raises(UserError, match=match):
            build_model(model_config(d_model=16, heads=4, **setting), Vocab(VOCAB, VOCAB))
    with pytest.raises(UserError, match="model.pos=rope.*even"):
        build_model(model_config(d_model=12, heads=4, pos="rope"), Vocab(VOCAB, VOCAB))


# ---- grouped-query / multi-query attention ----


def mha(kv_heads=0, d_model=D_MODEL, heads=HEADS, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, heads, kv_heads=kv_heads).eval()


def test_kv_heads_equal_to_heads_is_plain_multi_head_attention():
    plain, same = mha(0), mha(HEADS)
    same.load_state_dict(plain.state_dict())
    x, mask = torch.randn(2, 5, D_MODEL), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    for kwargs in [dict(mask=mask), dict(causal=True), dict(mask=mask, need_weights=True)]:
        assert torch.equal(plain(x, x, **kwargs)[0], same(x, x, **kwargs)[0])
    a, b = variant(kv_heads=0), variant(kv_heads=HEADS)
    src, tgt_in = batch()
    assert torch.equal(a(src, tgt_in), b(src, tgt_in))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_equals_multi_head_with_repeated_key_value_heads(kv_heads):
    grouped, plain = mha(kv_heads), mha(0, seed=1)
    group, d_head = HEADS // kv_heads, D_MODEL // HEADS
    with torch.no_grad():
        plain.q_proj.load_state_dict(grouped.q_proj.state_dict())
        plain.out_proj.load_state_dict(grouped.out_proj.state_dict())
        # query head h reads key/value head h // group: give each plain head a copy of that head's rows
        rows = torch.cat([(h // group) * d_head + torch.arange(d_head) for h in range(HEADS)])
        kv_rows = torch.cat([rows, rows + kv_heads * d_head])  # kv_proj is [W^K; W^V]
        plain.kv_proj.weight.copy_(grouped.kv_proj.weight[kv_rows])
        plain.kv_proj.bias.copy_(grouped.kv_proj.bias[kv_rows])
    x = torch.randn(2, 6, D_MODEL)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    rotation, bias = Rotary(d_head)(0, 6), ALiBi(HEADS)(0, 6, 6)
    for kwargs in [
        {},
        dict(mask=mask),
        dict(causal=True),
        dict(causal=True, rotation=rotation),
        dict(mask=mask, bias=bias),
        dict(causal=True, bias=bias, rotation=rotation),
    ]:
        expected, expected_w = plain(x, x, need_weights=True, **kwargs)
        fast, _ = grouped(x, x, **kwargs)
        slow, weights = grouped(x, x, need_weights=True, **kwargs)
        assert torch.allclose(fast, expected, atol=1e-5), kwargs
        assert torch.allclose(slow, expected, atol=1e-5) and torch.allclose(weights, expected_w, atol=1e-6), kwargs
    k, v = grouped.project_kv(x)
    assert k.shape == v.shape == (2, kv_heads, 6, d_head)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_cache_shrinks_by_kv_heads_over_heads(kv_heads):
    src, tgt_in = batch()
    sizes = {}
    for n in (0, kv_heads):
        model = variant("rope", kv_heads=n)
        memory, state = model.encode(src), None
        for t in range(tgt_in.size(1)):
            state = model.step(memory, tgt_in[:, t], state)[2]
        assert all(k.size(1) == (n or HEADS) for kv in state.self_kv + state.cross_kv for k in kv)
        sizes[n] = state.cache_bytes()
    assert sizes[kv_heads] * HEADS == sizes[0] * kv_heads
    # greedy search reports the cache it ended with: layers × (k, v) × B × kv_heads × (S + steps) × d_head × 4 bytes
    hyps = greedy_decode(variant("alibi", kv_heads=kv_heads, seed=2), src, max_len_ratio=1.0, max_len_extra=2)
    steps = max(len(tokens) + 1 for tokens in hyps.tokens)
    assert hyps.kv_cache_bytes == 2 * 2 * 2 * kv_heads * (src.size(1) + steps) * (D_MODEL // HEADS) * 4


# ---- RoPE ----


def test_attention_with_bias_and_rotation_matches_an_explicit_reference():
    attn = mha(2)
    x = torch.randn(2, 5, D_MODEL)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    rotary, bias = Rotary(4)(0, 5), ALiBi(HEADS)(0, 5, 5)
    fast, _ = attn(x, x, mask=mask, causal=True, rotation=rotary, bias=bias)
    _, weights = attn(x, x, mask=mask, causal=True, rotation=rotary, bias=bias, need_weights=True)
    Q = rotary(attn.q_proj(x).view(2, 5, HEADS, 4).transpose(1, 2))
    K, V = (p.view(2, 5, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for p in attn.kv_proj(x).chunk(2, dim=-1))
    K = rotary(K)
    allowed = mask & causal_mask(5, x.device)
    ref_w = torch.softmax((Q @ K.transpose(-1, -2) / 2.0 + bias).masked_fill(~allowed, float("-inf")), dim=-1)
    assert torch.allclose(weights, ref_w, atol=1e-6)
    assert torch.all(weights[~allowed.expand_as(weights)] == 0)
    assert torch.allclose(weights.sum(-1), torch.ones(2, HEADS, 5), atol=1e-6)
    assert torch.allclose(fast, attn.out_proj((ref_w @ V).transpose(1, 2).reshape(2, 5, D_MODEL)), atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_with_rope_alibi_and_grouped_heads(need_weights):
    attn = mha(2, d_model=8, heads=4).double()
    rotation = Rotary(2).double()(1, 3)
    rotation.cos, rotation.sin = rotation.cos.double(), rotation.sin.double()
    bias = ALiBi(4)(0, 3, 3).double()
    mask = torch.tensor([True, True, False])
    x = torch.randn(1, 3, 8, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: attn(t, t, mask=mask, causal=True, rotation=rotation, bias=bias, need_weights=need_weights)[0], (x,)
    )


# ---- sliding window ----


def test_window_mask_hand_computed():
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(band_mask(4, 1, torch.device("cpu")), expected)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope", "alibi"])
def test_window_as_long_as_the_sentence_is_full_attention(pos):
    src, _ = batch()
    full = variant(pos).encode(src).states
    for window in (src.size(1) - 1, src.size(1), 100):
        assert torch.equal(variant(pos, window=window).encode(src).states, full)
    assert not torch.allclose(variant(pos, window=1).encode(src).states, full)


@pytest.mark.parametrize("window", [1, 2])
def test_window_gives_exactly_zero_weight_beyond_its_distance(window):
    attn = mha(2)
    x = torch.randn(1, 6, D_MODEL)
    band = band_mask(6, window, x.device)
    _, weights = attn(x, x, mask=band, need_weights=True)
    far = ~band.expand_as(weights)
    assert torch.all(weights[far] == 0) and torch.all(weights[~far] > 0)
    # in a one-layer encoder, a token farther than the window does not change another's output
    model = variant("rope", window=window, layers=1)
    src = torch.tensor([[5, 6, 7, 8, 9, 10, EOS]])
    changed = src.clone()
    changed[0, 0] = 15
    a, b = model.encode(src).states, model.encode(changed).states
    assert torch.equal(a[0, window + 1 :], b[0, window + 1 :])
    assert not torch.allclose(a[0, : window + 1], b[0, : window + 1])


def test_window_leaves_every_query_a_key_to_attend_to():
    """A query row with every key masked is NaN on some kernels (the GPU memory-efficient one) and
    spreads through the next layer: padding positions far from every real token must keep a key."""
    model = variant(window=1)
    masks = []
    model.encoder[0].self_attn.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs["mask"]), with_kwargs=True
    )
    src, _ = batch()  # sentence 2: 4 tokens, then 3 padding positions
    model.encode(src)
    assert masks[0].shape == (2, 1, 7, 7) and bool(masks[0].any(-1).all())
    assert torch.equal(masks[0][1, 0, :4], band_mask(7, 1, src.device)[:4] & (src[1] != PAD))


# ---- lengths beyond training ----


def test_rope_cache_holds_keys_rotated_by_their_own_positions():
    model = variant("rope", kv_heads=2)
    src, tgt_in = batch()
    memory, state = model.encode(src), None
    for t in range(tgt_in.size(1)):
        state = model.step(memory, tgt_in[:, t], state)[2]
    layer = model.decoder[0]  # pre-norm: its self-attention reads norm(embeddings)
    embedded = model.embed(model.tgt_embed, tgt_in).view(*tgt_in.shape, -1)
    keys, values = layer.self_attn.project_kv(layer.self_block.norm(embedded))
    assert torch.allclose(state.self_kv[0][0], model.rotary(0, tgt_in.size(1))(keys), atol=1e-6)
    assert torch.allclose(state.self_kv[0][1], values, atol=1e-6)  # values are not rotated
    assert not torch.allclose(state.self_kv[0][0], keys, atol=1e-3)


def test_positions_past_max_len():
    long_src = torch.randint(4, VOCAB, (1, 20))
    for pos in ("rope", "alibi"):  # relative schemes have no table: they run at any length
        model = variant(pos, max_len=16)
        assert torch.isfinite(model(long_src, long_src)).all()
    for pos in ("sinusoidal", "learned"):
        with pytest.raises(ValueError, match="20 tokens exceeds model.max_len=16"):
            variant(pos, max_len=16)(long_src, long_src)
