"""The training loss and its perplexity: the objective is label-smoothed (train.label_smoothing), the perplexity
TensorBoard shows as train/ppl is the exp of the cross-entropy alone, as dev/ppl is (fairseq's nll_loss), read
from the smoothed loss without a second softmax (app/models.unsmoothed_loss)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import Vocab, model_config

from app.config.schema import Config
from app.data.batching import Batch
from app.data.tokenizer import PAD
from app.models import build_model, sequence_loss, unsmoothed_loss
from app.train.metrics_window import MetricsWindow
from app.train.update import StepResult, device_update, make_optimizer


def plain_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum")


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_unsmoothed_loss_is_the_cross_entropy_without_smoothing(smoothing, dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 7, 50, generator=gen)).to(dtype)
    target = torch.randint(1, 50, (4, 7), generator=gen)
    target[0, 4:] = PAD  # padding counts for neither
    target[2, 1:] = PAD
    logits.scatter_add_(-1, target.unsqueeze(-1), torch.full(target.shape, 4.0, dtype=dtype).unsqueeze(-1))  # learnt
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):  # as training takes it: fp32
        smoothed = sequence_loss(logits, target, smoothing)
    assert smoothed.dtype == torch.float32
    assert smoothed > plain_loss(logits, target) * 1.05  # smoothing adds what matters here
    exact = unsmoothed_loss(smoothed, logits, target, smoothing)
    assert exact.item() == pytest.approx(
        plain_loss(logits, target).item(), rel=1e-5 if dtype == torch.float32 else 1e-3
    )
    # the same from log-probabilities (the pointer-generator's output: app/models/copy.py)
    logp = torch.log_softmax(logits.float(), -1)
    assert unsmoothed_loss(sequence_loss(logp, target, smoothing), logp, target, smoothing).item() == pytest.approx(
        plain_loss(logits, target).item(), rel=1e-5
    )
    unsmoothed = plain_loss(logits, target)
    assert unsmoothed_loss(unsmoothed, logits, target, 0.0) is unsmoothed  # nothing to take off: no operator more


def test_an_update_reports_the_perplexity_of_the_cross_entropy_not_of_the_smoothed_loss():
    """Two micro-batches of a tiny Transformer under train.label_smoothing=0.1: the window's train/ppl was the exp
    of the smoothed loss, 40 % above the perplexity on a model of 200 steps (3.97 against 3.62 nats a piece)."""
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    cfg = Config(
        model=model_config(arch="transformer", d_model=16, heads=2, ff_dim=32, enc_layers=2, dec_layers=2, **no_dropout)
    )
    cfg.train.label_smoothing = 0.1
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocab(30, 30))
    optimizer, _ = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for n, s, t in [(3, 6, 5), (2, 9, 8)]:
        src, tgt = torch.randint(4, 30, (n, s), generator=gen), torch.randint(4, 30, (n, t + 1), generator=gen)
        tgt[0, -2:] = PAD
        batches.append(Batch(src, torch.arange(n), tgt[:, :-1], tgt[:, 1:], (src != PAD).sum(-1)))
    tokens = sum(int((b.tgt_out != PAD).sum()) for b in batches)
    with torch.no_grad():  # the weights the update's forward passes see
        outputs = [model(b.src, b.tgt_in, src_lengths=b.src_lengths) for b in batches]
        plain = sum(plain_loss(o, b.tgt_out) for o, b in zip(outputs, batches)).item()
        smoothed = sum(sequence_loss(o, b.tgt_out, 0.1) for o, b in zip(outputs, batches)).item()
    result = device_update(model, batches, tokens, optimizer, cfg, None)
    assert result.nll_sum.item() == pytest.approx(plain, rel=1e-5)
    assert result.loss_sum.item() == pytest.approx(smoothed, rel=1e-5) and smoothed > plain
    window = MetricsWindow(torch.device("cpu"))
    window.add(result, local_tokens=tokens, update_tokens=tokens)
    values = window.summary()
    assert values["nll_loss"] == pytest.approx(plain / tokens, rel=1e-5)
    assert values["ppl"] == pytest.approx(math.exp(plain / tokens), rel=1e-5)
    assert values["loss"] == pytest.approx(smoothed / tokens, rel=1e-5)


def test_the_windows_speed_leaves_out_the_validation_it_holds(monkeypatch):
    """Tokens per second and MFU over the seconds the window trained: a validation inside it (the run's
    eval_seconds grew) is left out, as train_summary.json leaves it out; the next window starts afresh."""
    import app.train.metrics_window as metrics_window

    now, validations = [100.0], [0.0]
    monkeypatch.setattr(metrics_window.time, "time", lambda: now[0])
    window = MetricsWindow(torch.device("cpu"), peak_flops=1e3, paused=lambda: validations[0])
    zero = torch.zeros(())
    result = StepResult(zero, zero, torch.tensor(True), zero, None, zero)
    window.add(result, local_tokens=500, update_tokens=500, flops=2e3)
    now[0] += 3.0  # 1 s of the update, then a 2 s validation
    validations[0] += 2.0
    values = window.summary()
    assert values["tgt_tokens_per_s"] == pytest.approx(500.0) and values["mfu"] == pytest.approx(2.0)
    window.reset()
    window.add(result, local_tokens=500, update_tokens=500, flops=2e3)
    now[0] += 0.5
    assert window.summary()["tgt_tokens_per_s"] == pytest.approx(1000.0)
