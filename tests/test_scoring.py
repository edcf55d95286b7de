"""make score's log-probabilities (app.decode.passes.forced_pass): on real models of every family they are
the terms beam search adds up for its own hypotheses, they do not depend on how pairs are batched, and their mean
is the dev loss validation reports (against CTranslate2's score_batch: tests/test_export.py; the command:
tests/test_cli_end_to_end.py)."""

import math

import pytest
import torch
from test_beam_search import FAMILIES, real_model

from app.config.commands import DecodeConfig
from app.data.corpus import ParallelData
from app.decode.likelihood import score_line
from app.decode.passes import decode_corpus, forced_attention, forced_pass
from app.decode.search import length_limits
from app.evaluation.split import teacher_forced_loss

CPU = torch.device("cpu")


def pairs(count: int = 16) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(5)
    src = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in torch.randint(1, 9, (count,)).tolist()]
    tgt = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in torch.randint(0, 9, (count,)).tolist()]
    return src, tgt


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hypothesis_scores_what_beam_search_scored_it(family):
    """With α = 0 a beam's score is log p(Y|X), the sum of the log p scoring reads: for each of the 3 best of every
    sentence, to 1e-4. (Hypotheses cut at the length limit end without an EOS term: their sum leaves it out.)"""
    model, (src, _) = real_model(family), pairs()
    decode = DecodeConfig(beam_size=4, n_best=3, length_penalty=0.0)
    hyps = decode_corpus(model, src, CPU, decode)
    limits = length_limits(torch.tensor([len(s) + 1 for s in src]), decode.max_len_ratio, decode.max_len_extra, None)
    flat = [(i, tokens, score) for i, nbest in enumerate(hyps.nbest) for tokens, score in nbest]
    forced = {
        i: logp for i, logp, _ in forced_pass(model, [src[i] for i, _, _ in flat], [t for _, t, _ in flat], CPU, 100)
    }
    for k, (i, tokens, score) in enumerate(flat):
        logp = forced[k] if len(tokens) < limits[i] else forced[k][:-1]
        assert logp.sum().item() == pytest.approx(score, abs=1e-4), (i, tokens)


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_scores_do_not_depend_on_the_batch(family):
    model, (src, tgt) = real_model(family), pairs()
    together = {i: logp for i, logp, _ in forced_pass(model, src, tgt, CPU, batch_tokens=10_000)}
    for i in range(len(src)):
        ((_, alone, _),) = forced_pass(model, [src[i]], [tgt[i]], CPU, batch_tokens=10_000)
        assert alone.shape == (len(tgt[i]) + 1,) and torch.allclose(alone, together[i], atol=1e-5)


def test_the_mean_log_p_of_a_split_is_its_dev_loss():
    """What make score says of a split (log p per piece) is minus the dev loss validation logs for it."""
    model, (src, tgt) = real_model("transformer"), pairs()
    dev = ParallelData([str(i) for i in range(len(src))], [""] * len(src), [""] * len(src), src, tgt)
    logp = [p for _, p, _ in forced_pass(model, src, tgt, CPU, batch_tokens=64)]
    mean = torch.cat(logp).mean().item()
    loss = teacher_forced_loss(model, dev, 64, CPU, None)
    assert -mean == pytest.approx(loss["loss"], abs=1e-5) and math.exp(-mean) == pytest.approx(loss["ppl"], rel=1e-5)


def test_a_score_line_is_the_sum_the_count_and_the_mean():
    assert score_line([-1.0, -2.0, -0.5], None) == "-3.5000\t3\t-1.1667\n"
    pieces = score_line([-1.0, -2.0, -0.5], ["▁In", "▁the"])
    assert pieces == "-3.5000\t3\t-1.1667\t▁In:-1.0000 ▁the:-2.0000 </s>:-0.5000\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_reading_the_attention_changes_no_log_p(family):
    """One pass gives both: the log p of a pass that also returns the attention (the Transformer's slower kernels
    that keep the weights) are those of the fast pass, and its attention is forced_attention's."""
    model, (src, tgt) = real_model(family), pairs()
    fast = {i: logp for i, logp, _ in forced_pass(model, src, tgt, CPU, batch_tokens=100)}
    both = {i: (logp, weights) for i, logp, weights in forced_pass(model, src, tgt, CPU, 100, attention=True)}
    alone = dict(forced_attention(model, src, tgt, CPU, batch_tokens=100))
    for i in range(len(src)):
        assert torch.allclose(both[i][0], fast[i], atol=1e-5)
        if family == "rnn_plain":
            assert both[i][1] is None and not alone
        else:
            assert both[i][1].shape[-2:] == (len(tgt[i]) + 1, len(src[i]) + 1)
            assert torch.allclose(both[i][1], alone[i], atol=1e-6)
