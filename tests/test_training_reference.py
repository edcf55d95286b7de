"""The training step computes the function it computed before its projections were fused and its residual
stream kept in rows: fp32 losses and gradient norms equal, to fp32 rounding, to those recorded from that step
(tests/data/make_training_reference.py), dropout on; bf16 on bf16 weights from fp32 masters within bf16's
rounding of them; and a checkpoint with separate Q/K/V projections loads into the fused ones."""

import json
import os
import sys

import pytest
import torch
from conftest import Vocab, model_config

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "data"))

import make_training_reference as reference  # noqa: E402

from app.config.schema import Config  # noqa: E402
from app.models import build_model  # noqa: E402
from app.train.master_weights import MasterWeights  # noqa: E402
from app.train.update import make_optimizer, train_step  # noqa: E402

RECORDED = json.load(open(reference.REFERENCE))


@pytest.mark.parametrize("variant", sorted(RECORDED))
def test_fp32_losses_and_gradient_norms_equal_the_recorded_ones(variant):
    figures = reference.run(variant)
    assert figures["loss"] == pytest.approx(RECORDED[variant]["loss"], rel=1e-5)
    assert figures["grad_norm"] == pytest.approx(RECORDED[variant]["grad_norm"], rel=1e-4)


def bf16_run(master_weights: bool) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(1)
    cfg = Config(model=model_config(**reference.VARIANTS["default"]))
    model = build_model(cfg.model, Vocab(reference.VOCAB, reference.VOCAB))
    optimizer, scheduler = make_optimizer(model, cfg)
    master = MasterWeights(model, torch.bfloat16 if master_weights else None)
    torch.manual_seed(2)
    data, losses = reference.batches(), []
    for step in range(reference.STEPS):
        batch = data[step % len(data)]
        n = int((batch.tgt_out != 0).sum())
        result = train_step(master.compute, [batch], n, optimizer, scheduler, cfg, torch.bfloat16, master=master)
        losses.append(float(result.loss_sum))
    return losses, model


def test_bf16_on_bf16_weights_trains_as_autocast_on_fp32_weights():
    autocast, _ = bf16_run(master_weights=False)  # autocast casts each fp32 weight at every use
    master, model = bf16_run(master_weights=True)
    assert master == pytest.approx(autocast, rel=1e-2)  # bf16 rounds at 2^-8: the same function, other roundings
    assert master == pytest.approx(RECORDED["default"]["loss"], rel=2e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters, what checkpoints hold


def test_master_weights_keep_the_copy_equal_to_the_rounded_masters_and_ties_tied():
    torch.manual_seed(1)
    model = build_model(model_config(**reference.VARIANTS["default"]), Vocab(reference.VOCAB, reference.VOCAB))
    master = MasterWeights(model, torch.bfloat16)
    compute = master.compute
    assert compute.out_proj.weight is compute.tgt_embed.weight  # tied in the copy too, converted once
    assert compute.encoder[0].attn_block.norm.weight is model.encoder[0].attn_block.norm.weight  # norms shared
    with torch.no_grad():
        model.out_proj.weight.add_(1.0)
    master.refresh()
    assert torch.equal(compute.out_proj.weight, model.out_proj.weight.bfloat16())
    assert compute.encoder[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_a_checkpoint_with_separate_projections_loads_into_the_fused_ones():
    torch.manual_seed(1)
    settings = reference.VARIANTS["rope_gqa_window"]
    model = build_model(model_config(**settings), Vocab(reference.VOCAB, reference.VOCAB)).eval()
    old = {}  # the layout of checkpoints written before the fusion: q_proj, k_proj, v_proj in every attention
    for name, tensor in model.state_dict().items():
        for fused, parts in (("qkv_proj", "qkv"), ("kv_proj", "kv")):
            if f".{fused}." in name:
                attention = model.get_submodule(name.split(f".{fused}.")[0])
                sizes = attention.sizes if fused == "qkv_proj" else attention.sizes[1:]
                for part, block in zip(parts, tensor.split(sizes)):
                    old[name.replace(fused, f"{part}_proj")] = block.clone()
                break
        else:
            old[name] = tensor.clone()
    assert "encoder.0.self_attn.k_proj.weight" in old and "decoder.0.cross_attn.v_proj.bias" in old
    fresh = build_model(model_config(**settings), Vocab(reference.VOCAB, reference.VOCAB)).eval()
    fresh.load_state_dict(old)
    src, tgt = reference.batches()[0].src, reference.batches()[0].tgt_in
    assert torch.equal(fresh(src, tgt), model(src, tgt))
