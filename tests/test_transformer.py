"""The Transformer behind the model API: shapes, masking, cached decoding, gradients."""

import pytest
import torch
from conftest import Vocab, model_config

from app.config.schema import TransformerConfig
from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import greedy_decode
from app.models import build_model
from app.models.transformer_layers import Sublayer
from app.run.errors import UserError

VOCAB = 23


def tiny_model(norm="pre", tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = model_config(
        d_model=16,
        heads=2,
        enc_layers=2,
        dec_layers=2,
        ff_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        norm=norm,
        tie_embeddings=tie,
        max_len=64,
    )
    return build_model(cfg, Vocab(VOCAB, VOCAB)).eval()


def batch():
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    tgt_in = torch.tensor([[BOS, 11, 12, 13], [BOS, 14, PAD, PAD]])
    return src, tgt_in


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_decode_shapes_and_cross_attention_distribution(norm):
    model = tiny_model(norm)
    src, tgt_in = batch()
    memory = model.encode(src, src != PAD)
    logits, attention = model.decode(memory, tgt_in, need_attention=True)
    assert logits.shape == (2, 4, VOCAB)
    assert attention.shape == (2, 2, 2, 4, 5)  # (batch, layers, heads, tgt, src)
    assert torch.all(attention[1, ..., 3:] == 0)  # padded source positions
    assert torch.allclose(attention.sum(-1), torch.ones(2, 2, 2, 4), atol=1e-5)
    fast, none = model.decode(memory, tgt_in)
    assert none is None and torch.allclose(fast, logits, atol=1e-5)
    no_logits, same = model.decode(memory, tgt_in, need_attention=True, need_logits=False)  # what forced passes ask
    assert no_logits is None and torch.equal(same, attention)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_residual_block_puts_the_norm_where_its_name_says(norm):
    """Known answer: pre-norm x + f(LN(x)), post-norm LN(x + f(x)) (Vaswani et al. 2017, sec. 5.4; Xiong et al.
    2020, eq. 1-2), in training's forward and in decoding's residual path."""
    torch.manual_seed(0)
    block = Sublayer(model_config(d_model=8, heads=2, dropout=0.0, norm=norm)).eval()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    x, w = torch.randn(3, 8), torch.randn(8, 8)

    def ln(v):
        return torch.nn.functional.layer_norm(v, (8,), block.norm.weight, block.norm.bias, 1e-5)

    expected = ln(x + x @ w) if norm == "post" else x + ln(x) @ w
    out, _ = block(x, lambda h: (h @ w, None))
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(block.residual(x, lambda h, residual: residual + h @ w), expected, atol=1e-5)


def test_source_padding_does_not_change_translation_scores():
    model = tiny_model()
    src = torch.tensor([[9, 10, EOS]])
    padded = torch.tensor([[9, 10, EOS, PAD, PAD]])
    tgt_in = torch.tensor([[BOS, 14, 15]])
    a = model.decode(model.encode(src), tgt_in)[0]
    b = model.decode(model.encode(padded), tgt_in)[0]
    assert torch.allclose(a, b, atol=1e-5)


def test_cached_step_equals_full_decode():
    model = tiny_model()
    src, tgt_in = batch()
    memory = model.encode(src)
    full_logits, full_attention = model.decode(memory, tgt_in, need_attention=True)
    state = None
    for t in range(tgt_in.size(1)):
        logits, attention, state = model.step(memory, tgt_in[:, t], state, need_attention=True)
        assert torch.allclose(logits, full_logits[:, t], atol=1e-5), t
        assert torch.allclose(attention[..., 0, :], full_attention[..., t, :], atol=1e-5), t


def test_greedy_decode_matches_argmax_of_full_recomputation():
    model = tiny_model(seed=3)
    src, _ = batch()
    hyps = greedy_decode(model, src, max_len_ratio=1.0, max_len_extra=4, need_attention=True)
    for i in range(src.size(0)):
        prefix = [BOS]
        memory = model.encode(src[i : i + 1])
        expected = []
        limit = int((src[i] != PAD).sum()) + 4
        for t in range(limit + 1):
            logits = model.decode(memory, torch.tensor([prefix]))[0][0, -1]
            logits[[PAD, BOS]] = float("-inf")  # never outputs
            token = EOS if t >= limit else int(logits.argmax())
            if token == EOS:
                break
            expected.append(token)
            prefix.append(token)
        assert hyps.tokens[i] == expected
        n_src = int((src[i] != PAD).sum())
        assert hyps.attention[i].shape == (2, 2, len(expected) + 1, n_src)
        assert torch.allclose(hyps.attention[i].sum(-1), torch.ones(2, 2, len(expected) + 1), atol=1e-4)


def test_gradients_reach_every_parameter():
    model = tiny_model(tie=False).train()
    src, tgt_in = batch()
    model(src, tgt_in).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_tied_embeddings_share_one_matrix():
    model = tiny_model(tie=True)
    assert model.out_proj.weight is model.tgt_embed.weight is model.src_embed.weight


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="model.norm"):
        build_model(model_config(norm="middle"), Vocab(VOCAB, VOCAB))
    with pytest.raises(UserError, match="model.arch='lstm9000' is unknown"):
        build_model(TransformerConfig(arch="lstm9000"), Vocab(VOCAB, VOCAB))
    with pytest.raises(UserError, match="model.arch='rnn' does not match the TransformerConfig settings"):
        build_model(TransformerConfig(arch="rnn"), Vocab(VOCAB, VOCAB))


def largest_copy(run) -> int:
    """Elements of the largest tensor ``aten::copy_`` writes while ``run()`` runs (the profiler's input shapes)."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        run()
    shapes = [e.input_shapes[0] for e in prof.events() if e.name == "aten::copy_" and e.input_shapes]
    return max((torch.Size(shape).numel() for shape in shapes), default=0)


@pytest.mark.parametrize("beam", [1, 4])
def test_a_step_keeping_attention_copies_no_source_keys_or_values(beam):
    """A decoding step that keeps the cross-attention weights (as make eval does) multiplies by each sentence's
    source keys and values where they are: nothing it copies is as large as one layer's source keys (copying
    every layer's source keys and values at every step made a greedy step cost what a beam step does)."""
    from app.decode.beam import BeamSearch
    from app.decode.search import GreedySearch

    model, sentences, length = tiny_model(), 6, 40
    src = torch.randint(5, VOCAB, (sentences, length))
    with torch.no_grad():
        search = (
            BeamSearch(model, src, beam, need_attention=True)
            if beam > 1
            else GreedySearch(model, src, need_attention=True)
        )
        search.step(check=False)
        copied = largest_copy(lambda: search.step(check=False))
    keys = sentences * length * model.d_model  # one layer's source keys, all heads
    assert 0 < copied < keys
