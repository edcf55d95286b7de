"""make heads (app/evaluation/head_importance.py): a head's gate is that head's slice of W^O, its gradient the
derivative of the loss, masking one head or several the loss of the model without them; the model as it was after
(make heads through the CLI: tests/test_cli_end_to_end.py)."""

import copy

import pytest
import torch
from conftest import Vocab, model_config
from torch.nn.utils import parametrize

from app.config.schema import DecodeConfig
from app.data.batching import Batcher
from app.data.corpus import ParallelData
from app.decode.passes import decode_corpus
from app.evaluation.head_importance import HeadGates, head_importance, rank_correlation
from app.evaluation.split import mean_loss
from app.models import build_model, sequence_loss

CPU = torch.device("cpu")


def tiny_transformer(**settings):
    torch.manual_seed(0)
    cfg = dict(d_model=16, heads=4, enc_layers=2, dec_layers=2, ff_dim=32, dropout=0.1, attention_dropout=0.1)
    return build_model(model_config(**{**cfg, **settings}), Vocab(30, 30)).train()


def tiny_data(n: int = 12) -> ParallelData:
    generator = torch.Generator().manual_seed(1)
    src = [
        torch.randint(4, 30, (int(k),), generator=generator).tolist()
        for k in torch.randint(3, 9, (n,), generator=generator)
    ]
    tgt = [
        torch.randint(4, 30, (int(k),), generator=generator).tolist()
        for k in torch.randint(3, 9, (n,), generator=generator)
    ]
    ids = [str(i) for i in range(n)]
    return ParallelData(ids, ids, ids, src, tgt)


def without_head(model, kind: str, layer: int, head: int):
    """A copy of ``model`` with head ``head``'s columns of that attention's W^O zeroed: the head masked by hand."""
    other = copy.deepcopy(model)
    stack, name = {
        "encoder": ("encoder", "self_attn"),
        "decoder": ("decoder", "self_attn"),
        "cross": ("decoder", "cross_attn"),
    }[kind]
    attention = getattr(getattr(other, stack)[layer], name)
    with torch.no_grad():
        attention.out_proj.weight[:, head * attention.d_head : (head + 1) * attention.d_head] = 0.0
    return other


def loss_of(model, data) -> float:
    model.eval()
    return mean_loss(model, data, 4000, CPU, None)


def out_projections(model) -> list:
    return [m.out_proj for m in model.modules() if hasattr(m, "out_proj") and hasattr(m, "d_head")]


@pytest.mark.parametrize("kind,layer,head", [("encoder", 0, 1), ("decoder", 1, 3), ("cross", 0, 2)])
def test_a_closed_gate_is_the_head_masked_and_the_gates_go_with_the_context(kind, layer, head):
    model, data = tiny_transformer(kv_heads=2), tiny_data()
    weights = [p.weight for p in out_projections(model)]
    before = loss_of(model, data)
    gates = HeadGates(model, CPU)
    gates.gates[kind][layer, head] = 0.0
    with gates.applied():
        masked = loss_of(model, data)
    assert masked == pytest.approx(loss_of(without_head(model, kind, layer, head), data), abs=1e-6)
    assert masked != pytest.approx(before, abs=1e-4)
    assert loss_of(model, data) == before  # the trained weights back, the very parameters
    assert [p.weight for p in out_projections(model)] == weights
    assert not any(parametrize.is_parametrized(p) for p in out_projections(model))


def nbest_scores(model, data, decode: DecodeConfig) -> list[float]:
    hyps = decode_corpus(model, data.src, CPU, decode)
    assert hyps.nbest is not None
    return [score for n in hyps.nbest for _, score in n]


@pytest.mark.parametrize("kind,layer,head", [("decoder", 1, 3), ("cross", 0, 2)])
def test_a_closed_gate_masks_the_head_in_decoding_steps_too(kind, layer, head):
    """Decoding steps read the decoder's projections from the weights (app/models/decoder_state.py's StepWeights), not
    through the modules: the gate is on the weight, so a beam search with the head gated is that of the model without
    the head (a hook on out_proj's input would have gated the teacher-forced passes only)."""
    model, data = tiny_transformer(), tiny_data()
    model.eval()
    decode = DecodeConfig(beam_size=3, n_best=3)
    before = nbest_scores(model, data, decode)
    gates = HeadGates(model, CPU)
    gates.gates[kind][layer, head] = 0.0
    with gates.applied():
        gated = nbest_scores(model, data, decode)
    masked = nbest_scores(without_head(model, kind, layer, head), data, decode)
    assert gated == pytest.approx(masked, abs=1e-5)
    assert gated != pytest.approx(before, abs=1e-3)
    assert nbest_scores(model, data, decode) == before


def test_the_gradient_is_the_derivative_of_the_loss_in_the_gate():
    model, data = tiny_transformer(), tiny_data()
    model.double().eval()
    batch = Batcher(data.src, data.tgt)(list(range(len(data))))
    tgt_in, tgt_out = batch.targets
    gates = HeadGates(model, CPU)
    cross = gates.gates["cross"]
    with gates.applied():
        cross.requires_grad_()
        mean_loss(model, data, 100_000, CPU, None, grads=[cross])  # one batch: |∂ loss sum / ∂ξ|
        analytic = cross.grad[1, 2].item()
        cross.requires_grad_(False)
        sums, at = [], []
        with torch.no_grad():
            for step in (1e-4, -1e-4):  # central differences, in float64 (the gate a float32: the step it holds)
                cross[1, 2] = 1.0 + step
                at.append(cross[1, 2].item())
                sums.append(sequence_loss(model(batch.src, tgt_in, src_lengths=batch.src_lengths), tgt_out).item())
    assert analytic == pytest.approx(abs(sums[0] - sums[1]) / (at[0] - at[1]), rel=1e-5)


def test_every_heads_ablation_is_the_loss_without_it_and_pruning_keeps_a_head_in_each_attention():
    model, data = tiny_transformer(), tiny_data()
    found = head_importance(model, data, 4000, CPU, None, prune_steps=4, progress=False)
    assert model.training  # its mode restored
    assert len(found.ablation) == len(found.gradient) == 3 * 2 * 4 and found.sentences == 12
    base = loss_of(model, data)
    assert found.base_loss == pytest.approx(base, abs=1e-6)
    for head in [found.ranked()[0], found.ranked()[-1]]:
        alone = loss_of(without_head(model, head.kind, head.layer, head.head), data)
        assert found.ablation[head] == pytest.approx(alone - base, abs=1e-6)
    curve = found.pruning
    assert curve[0] == {"heads_masked": 0, "share": 0.0, "loss": pytest.approx(base, abs=1e-6)}
    assert [p["heads_masked"] for p in curve] == [0, 5, 9, 14, 18]  # all but one head of each of the 6 attentions
    assert curve[-1]["loss"] != pytest.approx(base, abs=1e-3)  # (untrained: lower or higher)
    assert loss_of(model, data) == pytest.approx(base, abs=1e-7)  # every gate open again, no hook left


def test_the_pruning_curve_decodes_with_the_heads_it_masked():
    """With a figure of decoding (here the beam's best log p, summed: what BLEU reads, the hypotheses), each point of
    the pruning curve decodes with its heads masked: the first is the model's own, the last the model with only the
    most important head of each attention (the curve kept each attention's least important one before this test)."""
    model, data = tiny_transformer(), tiny_data()
    decode = DecodeConfig(beam_size=2)

    def decoded() -> float:
        return sum(score for n in decode_corpus(model, data.src, CPU, decode).nbest or [] for _, score in n[:1])

    model.eval()
    own = decoded()
    found = head_importance(model, data, 4000, CPU, None, prune_steps=2, progress=False, bleu=decoded)
    curve = found.pruning
    assert [p["heads_masked"] for p in curve] == [0, 9, 18] and all("bleu" in p for p in curve)
    assert curve[0]["bleu"] == pytest.approx(own, abs=1e-4)
    kept = {(h.kind, h.layer): h for h in found.ranked()[::-1]}  # each attention's most important head stays
    pruned = model
    for head in set(found.ablation) - set(kept.values()):
        pruned = without_head(pruned, head.kind, head.layer, head.head)
    model = pruned.eval()
    assert curve[-1]["bleu"] == pytest.approx(decoded(), abs=1e-4) and curve[-1]["bleu"] != pytest.approx(own)


def test_rank_correlation_known_answers():
    assert rank_correlation([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert rank_correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert rank_correlation([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(0.8)
