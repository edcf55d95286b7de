"""A Transformer's self-attention, read by a teacher-forced pass (``model.self_attention``, app.decode.passes.
forced_self_attention): known answers, masks, what the layers compute with it, and the attention files that
keep it."""

import math

import numpy as np
import pytest
import torch
from conftest import Vocab, model_config

from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import forced_self_attention
from app.evaluation.views import store_attention
from app.models import build_model
from app.report.attention_files import read_attention, write_attention_files

VOCAB = 23


def tiny_model(seed=0, **settings):
    torch.manual_seed(seed)
    cfg = model_config(
        **{
            "d_model": 16,
            "heads": 4,
            "enc_layers": 2,
            "dec_layers": 3,
            "ff_dim": 32,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "max_len": 64,
            **settings,
        }
    )
    return build_model(cfg, Vocab(VOCAB, VOCAB)).eval()


SRC = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
TGT_IN = torch.tensor([[BOS, 11, 12, 13], [BOS, 14, PAD, PAD]])


def blind_queries(model) -> None:
    """Every self-attention's queries made zero (W^Q = 0, b^Q = 0): all its scores are 0, so each query spreads
    its weight evenly over the keys it may see."""
    with torch.no_grad():
        for layer in (*model.encoder, *model.decoder):
            attention = layer.self_attn
            rows = attention.heads * attention.d_head
            attention.qkv_proj.weight[:rows] = 0
            attention.qkv_proj.bias[:rows] = 0


@pytest.mark.parametrize(
    "settings", [{}, {"pos": "rope"}, {"kv_heads": 1}, {"norm": "post"}], ids=["sinusoidal", "rope", "mqa", "postnorm"]
)
def test_queries_that_see_nothing_spread_evenly_over_what_they_may_see(settings):
    """Known answers: an encoder row is 1/n over the sentence's n tokens (0 on padding); the decoder's row t is
    1/(t+1) over the inputs 0..t (0 on later ones: causal)."""
    model = tiny_model(**settings)
    blind_queries(model)
    weights = model.self_attention(SRC, TGT_IN)
    assert weights.encoder.shape == (2, 2, 4, 5, 5) and weights.decoder.shape == (2, 3, 4, 4, 4)
    lengths = [5, 3]
    for b, n in enumerate(lengths):
        expected = torch.zeros(5, 5)
        expected[:, :n] = 1 / n
        assert torch.allclose(weights.encoder[b], expected.expand(2, 4, 5, 5), atol=1e-6), b
    causal = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5)[:, None]
    assert torch.allclose(weights.decoder[0], causal.expand(3, 4, 4, 4), atol=1e-6)


def test_an_encoder_window_keeps_each_query_within_its_distance():
    model = tiny_model(window=1)
    blind_queries(model)
    encoder = model.self_attention(SRC[:1], TGT_IN[:1]).encoder[0, 0, 0]
    band = torch.tensor([[1 / 2, 1 / 2, 0, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0, 0], [0, 1 / 3, 1 / 3, 1 / 3, 0]])
    assert torch.allclose(encoder[:3], band, atol=1e-6)


def test_the_first_encoder_layers_weights_are_softmax_of_scaled_query_key_products():
    """Vaswani et al. eq. 1 computed here from the layer's own weights: softmax(Q Kᵀ / √d_k) per head, with the
    padding keys of the second sentence at zero."""
    model = tiny_model()
    weights = model.self_attention(SRC, TGT_IN).encoder[:, 0]  # (batch, heads, S, S)
    layer = model.encoder[0]
    with torch.no_grad():
        x = model.src_embed(SRC) * math.sqrt(16) + model.positions(0, 5)
        h = layer.attn_block.norm(x)  # pre-norm
        w, bias = layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias
        q, k = (h @ w[i * 16 : (i + 1) * 16].T + bias[i * 16 : (i + 1) * 16] for i in range(2))
        q, k = (t.view(2, 5, 4, 4).transpose(1, 2) for t in (q, k))  # 4 heads of 4
        scores = q @ k.transpose(-2, -1) / 2.0  # √d_k = √4
        scores[1, :, :, 3:] = float("-inf")
        expected = scores.softmax(-1)
    assert torch.allclose(weights, expected, atol=1e-5)


@pytest.mark.parametrize("settings", [{}, {"pos": "alibi"}, {"kv_heads": 2}, {"window": 2}])
def test_rows_are_distributions_and_reading_them_changes_nothing(settings):
    model = tiny_model(**settings)
    weights = model.self_attention(SRC, TGT_IN)
    assert torch.allclose(weights.encoder[0].sum(-1), torch.ones(2, 4, 5), atol=1e-5)
    assert torch.allclose(weights.decoder[0].sum(-1), torch.ones(3, 4, 4), atol=1e-5)
    assert torch.all(weights.encoder[1, ..., 3:] == 0) and torch.all(torch.triu(weights.decoder, 1) == 0)
    with torch.no_grad():  # the decoder's output is the same whether its weights are read or not
        memory = model.encode(SRC)
        fast = model.decoder_pass(memory, TGT_IN, lambda i: False)[0]
        read = model.decoder_pass(memory, TGT_IN, lambda i: False, need_self_weights=True)[0]
    assert torch.allclose(fast, read, atol=1e-5)


def test_a_pass_over_a_corpus_gives_each_pair_its_own_maps_whatever_its_batch():
    """forced_self_attention in length-sorted batches: each pair's maps cut to its tokens + EOS (source) and its
    target + EOS (decoder rows: BOS and the target as inputs) equal those of the pair alone."""
    model = tiny_model(pos="rope")
    src = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    tgt = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]
    together = {i: (e, d) for i, e, d in forced_self_attention(model, src, tgt, torch.device("cpu"), 64)}
    assert sorted(together) == [0, 1, 2]
    for i in range(3):
        alone = model.self_attention(torch.tensor([src[i] + [EOS]]), torch.tensor([[BOS] + tgt[i]]))
        encoder, decoder = together[i]
        assert encoder.shape == (2, 4, len(src[i]) + 1, len(src[i]) + 1)
        assert decoder.shape == (3, 4, len(tgt[i]) + 1, len(tgt[i]) + 1)
        assert torch.allclose(encoder, alone.encoder[0], atol=1e-5)
        assert torch.allclose(decoder, alone.decoder[0], atol=1e-5)
    assert model.training is False


def test_attention_files_keep_the_self_attention_beside_the_cross_attention(tmp_path):
    rng = np.random.default_rng(0)

    def maps(*shape):
        w = rng.random(shape).astype(np.float32)
        return w / w.sum(-1, keepdims=True)

    cross, encoder, decoder = maps(3, 4, 5, 6), maps(2, 4, 6, 6), maps(3, 4, 5, 5)
    entry = {"index": 0, "id": "Gen.1.1", "src_tokens": ["s"] * 6, "hyp_tokens": ["t"] * 5}
    own = {"encoder": store_attention(encoder, -1), "decoder": store_attention(decoder, -1)}
    write_attention_files(
        str(tmp_path), [(entry, store_attention(cross, -1), own), ({**entry, "index": 1}, store_attention(cross, -1))]
    )
    first, second = read_attention(str(tmp_path), 0), read_attention(str(tmp_path), 1)
    assert first["encoder"]["views"] == [f"layer 1 head {h}" for h in range(4)] + ["layer 0 mean", "layer 1 mean"]
    assert first["encoder"]["maps"].shape == (6, 6, 6) and first["decoder"]["maps"].shape == (7, 5, 5)
    assert np.abs(first["encoder"]["maps"][:4] - encoder[1]).max() <= 1 / 510 + 1e-7
    assert np.abs(first["decoder"]["maps"][-1] - decoder[2].mean(0)).max() <= 1 / 510 + 1e-7
    assert "encoder" not in second and second["maps"].shape == (7, 5, 6)
    with np.load(tmp_path / "alignments.npz") as archive:  # numpy alone reads them, under the names the index gives
        assert sorted(archive.files) == ["0", "0.decoder", "0.encoder", "1"]


def test_tensorboards_figures_of_a_sentence_add_each_layers_mean_of_its_self_attention():
    from app.evaluation.records import SentenceRecord
    from app.report.board import alignment_figures

    rng = np.random.default_rng(1)
    # cross-attention (2 layers, 4 heads, 4 target, 3 source pieces); a 3-layer encoder's, the decoder's (causal)
    cross, encoder = rng.random((2, 4, 4, 3)), rng.random((3, 4, 3, 3))
    decoder = np.tril(rng.random((2, 4, 4, 4)))
    cross, encoder, decoder = (a / a.sum(-1, keepdims=True) for a in (cross, encoder, decoder))
    record = SentenceRecord(
        0, "Gen.1.1", ["▁a", "▁b", "</s>"], ["▁x", "▁y", "▁z", "</s>"], [0, 1, -1], [0, 1, 2, -1], cross
    )
    record.self_attention = {"encoder": store_attention(encoder), "decoder": store_attention(decoder)}
    specs = alignment_figures("eval/test/alignment", [record], -1)
    assert {"eval/test/alignment/0/encoder_self", "eval/test/alignment/0/decoder_self"} <= set(specs)
    maps, columns, rows, titles, _ = specs["eval/test/alignment/0/decoder_self"]
    assert (columns, rows) == (["<s>", "▁x", "▁y", "▁z"], record.hyp_pieces)
    assert titles == ["decoder self-attention, layer 0 mean", "decoder self-attention, layer 1 mean"]
    assert np.abs(maps - decoder.mean(1)).max() <= 1 / 510 + 1e-6
    maps, columns, rows, titles, _ = specs["eval/test/alignment/0/encoder_self"]
    assert columns == rows == record.src_pieces and maps.shape == (3, 3, 3)
    assert np.abs(maps - encoder.mean(1)).max() <= 1 / 510 + 1e-6


def test_head_roles_know_a_positional_head_from_a_diffuse_one():
    """Known answers (app/evaluation/head_roles.py): a head putting all of each piece's weight on the piece before
    (the first piece on itself) is positional at -1 for 19 of 20 pieces, with confidence 1; a head spreading each
    row evenly over the 4 pieces after 16 others has confidence 1/4 and no position of its own."""
    from app.evaluation.head_roles import HeadRoles, summary

    pieces = 20
    previous = np.eye(pieces)[np.maximum(np.arange(pieces) - 1, 0)]
    spread = np.zeros((pieces, pieces))
    for i in range(pieces):
        spread[i, [(i + k) % pieces for k in (5, 6, 7, 8)]] = 1 / 4
    roles = HeadRoles()
    roles.add(np.stack([previous, spread])[None])  # (1 layer, 2 heads, pieces, pieces)
    roles.add(np.stack([previous, spread])[None])  # a second sentence: the same counts again
    [[first, second]] = roles.result()
    assert first == {"confidence": 1.0, "offsets": {"-1": 0.95, "0": 0.05, "+1": 0.0}, "positional": -1}
    assert second["confidence"] == 0.25 and second["positional"] is None
    assert summary(roles.result()) == "confidence 0.62; positional: layer 0 head 0 (-1, 95%)"
    assert HeadRoles().result() == []


def test_make_evals_pass_counts_every_head_of_both_stacks():
    from app.evaluation.records import SentenceRecord, add_self_attention

    model = tiny_model()
    src = [[5, 6, 7, 8], [9, 10]]
    hyps = [[11, 12, 13], [14]]
    records = [SentenceRecord(i, str(i), [], [], [], []) for i in range(2)]
    roles = add_self_attention(records, model, src, hyps, torch.device("cpu"), 64)
    assert (roles["encoder"].pieces, roles["decoder"].pieces) == (5 + 3, 4 + 2)  # each with its </s>
    encoder, decoder = roles["encoder"].result(), roles["decoder"].result()
    assert (len(encoder), len(encoder[0]), len(decoder), len(decoder[0])) == (2, 4, 3, 4)
    assert all(h["offsets"]["+1"] == 0.0 for row in decoder for h in row)  # causal: never the next input
    assert all(set(r.self_attention) == {"encoder", "decoder"} for r in records)
