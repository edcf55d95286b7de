"""ensemble=: several models behind the model API decode as one. Known answers of the averaged distribution; one
model alone, or twice, decodes as itself; models of different families decode together, and beam search's scores of
their hypotheses are the teacher-forced log p of the ensemble (state.select and the step path agree with the
forced pass); the attention is the members' mean where it can be (the CLI: tests/test_cli_end_to_end.py)."""

import copy
import math

import pytest
import torch
from test_beam_search import FAMILIES, real_model
from test_scoring import pairs

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS
from app.decode.ensemble import Ensemble
from app.decode.passes import decode_corpus, forced_attention, forced_pass
from app.decode.search import length_limits

CPU = torch.device("cpu")


def other(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = real_model(family)
    with torch.no_grad():  # another model of the family: its weights perturbed
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def test_a_step_gives_the_log_of_the_members_mean_probability():
    a, b = other("transformer", 1), other("transformer", 2)
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    prev = torch.full((2,), BOS)
    logp = []
    for model in (a, b):
        logits, _, _ = model.step(model.encode(src), prev, None)
        logp.append(logits.log_softmax(-1))
    ensemble = Ensemble([a, b])
    memory = ensemble.encode(src)
    mixed, _, _ = ensemble.step(memory, prev, ensemble.start(memory))
    expected = ((logp[0].exp() + logp[1].exp()) / 2).log()
    assert torch.allclose(mixed, expected, atol=1e-5) and torch.allclose(mixed.exp().sum(-1), torch.ones(2))


@pytest.mark.parametrize("family", FAMILIES)
def test_one_model_alone_or_twice_decodes_as_itself(family):
    model, (src, _) = real_model(family), pairs()
    decode = DecodeConfig(beam_size=3, n_best=2)
    alone = decode_corpus(model, src, CPU, decode, need_attention=True)
    for ensemble in (Ensemble([model]), Ensemble([model, copy.deepcopy(model)])):
        together = decode_corpus(ensemble, src, CPU, decode, need_attention=True)
        assert together.tokens == alone.tokens
        scores = [torch.tensor([[s for _, s in n] for n in hyps.nbest]) for hyps in (together, alone)]
        assert torch.allclose(*scores, atol=1e-5)
        for mine, theirs in zip(together.attention or [], alone.attention or []):
            assert torch.allclose(mine, theirs, atol=1e-5)


def test_models_of_three_families_decode_together_as_their_forced_pass_scores_them():
    """A Transformer, a Bahdanau RNN and an RNN without attention (each its own state, selected at every reorder and
    compaction): the beam's score of each hypothesis (α = 0) is the sum of the ensemble's teacher-forced log p."""
    ensemble = Ensemble([other("transformer", 1), other("rnn_bahdanau", 2), other("rnn_plain", 3)])
    (src, _), decode = pairs(), DecodeConfig(beam_size=4, n_best=3, length_penalty=0.0, batch_tokens=60)
    hyps = decode_corpus(ensemble, src, CPU, decode)
    alone = decode_corpus(ensemble.members[0], src, CPU, decode)
    assert hyps.tokens != alone.tokens  # the other members count
    limits = length_limits(torch.tensor([len(s) + 1 for s in src]), decode.max_len_ratio, decode.max_len_extra, None)
    flat = [(i, tokens, score) for i, nbest in enumerate(hyps.nbest) for tokens, score in nbest]
    forced = {k: p for k, p, _ in forced_pass(ensemble, [src[i] for i, _, _ in flat], [t for _, t, _ in flat], CPU, 90)}
    for k, (i, tokens, score) in enumerate(flat):
        logp = forced[k] if len(tokens) < limits[i] else forced[k][:-1]
        assert logp.sum().item() == pytest.approx(score, abs=1e-4), (i, tokens)


def test_the_attention_is_the_members_mean_where_their_maps_have_one_shape():
    (src, tgt), a, b = pairs(), other("transformer", 1), other("transformer", 2)
    maps = [dict(forced_attention(m, src, tgt, CPU, 100)) for m in (a, b, Ensemble([a, b]))]
    for i in range(len(src)):
        assert torch.allclose(maps[2][i], (maps[0][i] + maps[1][i]) / 2, atol=1e-6)
    mixed = dict(forced_attention(Ensemble([other("rnn_bahdanau", 4), a]), src, tgt, CPU, 100))
    bahdanau = dict(forced_attention(other("rnn_bahdanau", 4), src, tgt, CPU, 100))
    assert all(torch.allclose(mixed[i], bahdanau[i]) for i in range(len(src)))  # shapes differ: the first's
    assert math.isclose(Ensemble([a, b]).max_positions, min(a.max_positions, b.max_positions))
