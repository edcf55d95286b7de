"""train.freeze: each family's parts cover every parameter once; a frozen part stays bit for bit as loaded through
real updates (fp32 and bf16 on fp32 masters, with weight decay) while the rest trains; the FLOP count drops what a
frozen weight's backward does not compute; bad settings are one line; fine-tuning with a frozen encoder through the
CLI, and a resume that would change what is frozen refused."""

import json
import os
import re
import sys

import pytest
import torch
from conftest import TINY, Vocab, compose_config, model_config, run_cli, trained_tiny_run

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))

import make_training_reference as reference  # noqa: E402

from app.config.schema import Config  # noqa: E402
from app.models import build_model  # noqa: E402
from app.models.flops import FlopCounter, matmul_parameters  # noqa: E402
from app.run.errors import UserError  # noqa: E402
from app.train.freeze import freeze, frozen_note, parameter_parts  # noqa: E402
from app.train.master_weights import MasterWeights  # noqa: E402
from app.train.update import make_optimizer, train_step  # noqa: E402

SMALL = dict(d_model=32, heads=4, enc_layers=2, dec_layers=2, ff_dim=64)
SMALL_RNN = dict(arch="rnn", emb_dim=32, hidden=32)
FAMILIES = {
    "transformer": SMALL,
    "transformer, untied, learned positions, copying": dict(
        SMALL, tie_embeddings=False, pos="learned", copy_attention=True
    ),
    "rnn bahdanau, coverage": dict(SMALL_RNN, attention="bahdanau", coverage=True),
    "rnn luong, copying": dict(SMALL_RNN, attention="luong", copy_attention=True),
    "rnn without attention, untied": dict(SMALL_RNN, attention="none", tie_embeddings=False),
}


def small_model(**settings):
    torch.manual_seed(0)
    return build_model(model_config(**settings), Vocab(reference.VOCAB, reference.VOCAB))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_parts_hold_every_parameter_once_and_the_embeddings_hold_the_token_tables(family):
    model = small_model(**FAMILIES[family])
    parts = parameter_parts(model)
    ids = [id(p) for params in parts.values() for p in params]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings == 60]
    assert tables and {id(t) for t in tables} <= {id(p) for p in parts["embeddings"]}
    assert parts["encoder"] and parts["decoder"]


def test_a_part_missing_from_a_familys_parts_is_a_bug_said_by_name():
    model = small_model(**SMALL)
    model.parts = lambda: {"embeddings": [model.src_embed], "encoder": [model.encoder], "decoder": [model.decoder]}
    with pytest.raises(
        ValueError,
        match=r"Transformer.parts\(\) leaves out enc_norm.weight, enc_norm.bias, dec_norm.weight, dec_norm.bias$",
    ):
        parameter_parts(model)


def updated(model, parts: list[str], weight_decay: float = 0.1, bf16: bool = False):
    """``model`` after three real updates with ``parts`` frozen, and its weights before them."""
    cfg = Config(model=model.cfg)
    cfg.train.weight_decay, cfg.train.freeze = weight_decay, parts
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = make_optimizer(model, cfg)  # freezes train.freeze's parts first
    said = frozen_note(model, parts)
    master = MasterWeights(model, torch.bfloat16 if bf16 else None)
    torch.manual_seed(2)
    for batch in reference.batches()[:3]:
        n = int((batch.tgt_out != 0).sum())
        dtype = torch.bfloat16 if bf16 else None
        result = train_step(master.compute, [batch], n, optimizer, scheduler, cfg, dtype, master=master)
        assert torch.isfinite(result.loss_sum)
    return before, optimizer, master, said


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16 on fp32 masters"])
@pytest.mark.parametrize("parts", [["encoder"], ["embeddings"], ["decoder", "embeddings"]])
def test_frozen_weights_stay_bit_for_bit_and_the_rest_trains(parts, bf16):
    model = small_model(**SMALL)
    before, optimizer, master, said = updated(model, parts, bf16=bf16)
    frozen = {id(p) for part in parts for p in parameter_parts(model)[part]}
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        changed = not torch.equal(p, before[names[id(p)]])
        assert changed != (id(p) in frozen), (names[id(p)], changed)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in trained} == {id(p) for p in model.parameters()} - frozen  # no moments, no decay
    assert all(p.grad is None for p in model.parameters() if id(p) in frozen)
    if bf16:  # the compute copy: frozen copies as made, the trained ones refreshed from their masters
        assert len(master.pairs) == sum(1 for m, _ in master.pairs if id(m) not in frozen)
        copy = dict(master.compute.named_parameters())
        assert torch.equal(
            copy["encoder.0.self_attn.qkv_proj.weight"], model.encoder[0].self_attn.qkv_proj.weight.bfloat16()
        )
    share = sum(p.numel() for p in model.parameters() if id(p) in frozen)
    assert said == f"{share / 1e6:.1f} M frozen: train.freeze=[{','.join(parts)}]"


def test_without_freeze_every_parameter_trains_and_nothing_is_said():
    model = small_model(**SMALL)
    before, optimizer, _, said = updated(model, [])
    assert said == "" and len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_the_flop_count_drops_what_a_frozen_weights_backward_does_not_compute():
    """6 FLOPs per weight and token when it trains; 4 when frozen below a part that trains (forward and its input's
    gradient); 2 when nothing below it trains (forward only), attention then 4 per pair and width, not 12. The
    cross-attention's [K V] projections read the encoder's states once per source token, their input's gradient
    computed only where the encoder or the embeddings train."""
    src, tgt = [7, 9], [8, 6]
    model = small_model(**SMALL)
    full = FlopCounter(model)(src, tgt)
    p_enc, p_dec = matmul_parameters(model.encoder), matmul_parameters(model) - matmul_parameters(model.encoder)
    kv = sum(layer.cross_attn.kv_proj.weight.numel() for layer in model.decoder)
    p_dec -= kv
    width, pairs_ss, pairs_tt, pairs_ts = 32, 7 * 7 + 9 * 9, 8 * 9 / 2 + 6 * 7 / 2, 7 * 8 + 9 * 6
    attention = lambda enc, dec: width * (2 * enc * pairs_ss + 2 * dec * (pairs_tt + pairs_ts))  # noqa: E731
    assert full == pytest.approx(6 * (p_enc * 16 + kv * 16 + p_dec * 14) + attention(12, 12))
    freeze(model, ["encoder"])  # the embeddings below it train: its input's gradient is still computed
    assert FlopCounter(model)(src, tgt) == pytest.approx(
        4 * p_enc * 16 + 6 * kv * 16 + 6 * p_dec * 14 + attention(12, 12)
    )
    freeze(model, ["embeddings"])  # now nothing below the encoder trains: forward only, [K V] without input grads
    tied = model.out_proj.weight.numel()  # tied to the embeddings: frozen with them, below the trained decoder
    expected = 2 * p_enc * 16 + 4 * kv * 16 + (6 * (p_dec - tied) + 4 * tied) * 14 + attention(4, 12)
    assert FlopCounter(model)(src, tgt) == pytest.approx(expected)
    decoder_frozen = small_model(**SMALL)
    freeze(decoder_frozen, ["decoder"])  # the encoder below trains: the decoder's input gradients are computed
    assert FlopCounter(decoder_frozen)(src, tgt) == pytest.approx(
        6 * p_enc * 16 + 4 * kv * 16 + (4 * (p_dec - tied) + 6 * tied) * 14 + attention(12, 12)
    )


@pytest.mark.parametrize(
    "given, said",
    [
        (
            "train.freeze=[encoder,attention]",
            "train.freeze=[encoder,attention]: 'attention' is not a part of a model; "
            "the parts: embeddings, encoder, decoder",
        ),
        (
            "train.freeze=[embeddings,encoder,decoder]",
            "train.freeze=[embeddings,encoder,decoder] freezes every part of the model: nothing would train",
        ),
    ],
)
def test_bad_parts_are_one_line(given, said):
    with pytest.raises(UserError) as refused:
        compose_config(given)
    assert str(refused.value) == said


@pytest.mark.slow
def test_fine_tuning_with_a_frozen_encoder_through_the_cli(tmp_path_factory, corpus_tsv):
    """The fine-tuned run's encoder is its parent's bit for bit, its decoder is not; the log and train_summary.json
    say what was frozen; a resume that would change it is refused in one line."""
    root = trained_tiny_run(tmp_path_factory, corpus_tsv, "freeze")

    args = [
        *TINY,
        "name=ft",
        "train.init_from=tiny",
        "train.max_steps=6",
        "train.freeze=[encoder]",
    ]
    result = run_cli(root, "command=train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = (root / "checkpoints/ft/train.log").read_text(encoding="utf-8")
    assert re.search(r"model: transformer, [\d.]+ M parameters \([\d.]+ M frozen: train.freeze=\[encoder\]\)", logged)
    parent = torch.load(root / "checkpoints/tiny/best.pt", map_location="cpu", weights_only=True)["model"]
    encoder = [k for k in parent if k.startswith(("encoder.", "enc_norm."))]
    decoder = [k for k in parent if k.startswith(("decoder.", "dec_norm."))]
    saved = torch.load(root / "checkpoints/ft/last.pt", map_location="cpu", weights_only=True)
    best = torch.load(root / "checkpoints/ft/best.pt", map_location="cpu", weights_only=True)["model"]
    for tuned in (saved["trained_model"], saved["model"], best):  # trained, their moving average, what eval reads
        assert encoder and all(torch.equal(parent[k], tuned[k]) for k in encoder)
        assert any(not torch.equal(parent[k], tuned[k]) for k in decoder)
    summary = json.loads((root / "checkpoints/ft/train_summary.json").read_text())
    frozen = sum(parent[k].numel() for k in encoder)
    assert summary["frozen"] == {"parts": ["encoder"], "parameters": frozen}
    again = run_cli(root, "command=train", *args, "train.resume=true", "train.freeze=[embeddings]", "train.max_steps=8")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().startswith(
        f"error: {root}/checkpoints/ft/last.pt: train.freeze=[embeddings] here, [encoder] there: AdamW's state is"
    ), again.stderr[-2000:]
