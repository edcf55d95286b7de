"""decode.sampling: known answers of the top-k and nucleus cuts; draws whose frequencies are the distribution's;
sampling in the search on a model whose probabilities are set by hand and on real models of every family (settings
out of range: tests/test_bad_input.py; against CTranslate2's sampling: tests/test_export.py)."""

import dataclasses

import pytest
import torch
from test_beam_search import FAMILIES, SRC, MarkovModel, real_model

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import decode_corpus
from app.decode.sampling import Sampler, epsilon_filter, make_sampler, top_p_filter
from app.decode.search import describe

A, B, C = 4, 5, 6
CPU = torch.device("cpu")
PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])


def kept(logp: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logp[0].tolist()) if v != float("-inf")]


def narrowed(
    logp: torch.Tensor, topk: int = 0, topp: float = 1.0, temperature: float = 1.0, epsilon: float = 0.0
) -> dict[int, float]:
    """The sampling distribution of ``Sampler.narrowed``: token -> probability, for one row."""
    scores, ids = Sampler(topk, topp, temperature, torch.Generator(), epsilon).narrowed(logp)
    ids = torch.arange(scores.size(-1))[None] if ids is None else ids
    return {i: p for i, p in zip(ids[0].tolist(), scores.softmax(-1)[0].tolist()) if p > 0}


def test_top_k_keeps_the_k_most_probable_tokens_and_renormalizes():
    assert narrowed(PROBS.log(), topk=1) == {1: 1.0}
    assert narrowed(PROBS.log(), topk=2) == pytest.approx({1: 0.5 / 0.8, 3: 0.3 / 0.8})
    assert narrowed(PROBS.log(), topk=3) == pytest.approx({1: 0.5 / 0.95, 2: 0.15 / 0.95, 3: 0.3 / 0.95})
    assert narrowed(PROBS.log(), topk=0) == pytest.approx({0: 0.05, 1: 0.5, 2: 0.15, 3: 0.3})  # 0: all
    assert narrowed(PROBS.log(), topk=4) == narrowed(PROBS.log(), topk=0)
    # then the nucleus, among the k; the temperature before both
    assert narrowed(PROBS.log(), topk=3, topp=0.7) == pytest.approx({1: 0.5 / 0.8, 3: 0.3 / 0.8})
    cold = narrowed(PROBS.log(), topk=3, temperature=0.5)  # p² renormalized
    assert cold == pytest.approx({1: 0.25 / 0.3625, 2: 0.0225 / 0.3625, 3: 0.09 / 0.3625})


def test_top_p_keeps_the_fewest_most_probable_tokens_that_reach_p():
    logp = PROBS.log()
    assert kept(top_p_filter(logp, 0.4)) == [1]  # 0.5 alone reaches 0.4
    assert kept(top_p_filter(logp, 0.5)) == [1]
    assert kept(top_p_filter(logp, 0.7)) == [1, 3]  # 0.5 + 0.3
    assert kept(top_p_filter(logp, 0.85)) == [1, 2, 3]  # 0.5 + 0.3 + 0.15 = 0.95
    assert kept(top_p_filter(logp, 0.96)) == [0, 1, 2, 3]
    assert kept(top_p_filter(logp, 0.01)) == [1]  # the most probable always
    # the tokens kept reach p exactly (sums a float holds exactly): not one token more (two were kept, then three)
    for split, p, want in (
        ([0.5, 0.4, 0.1], 0.5, [0]),
        ([0.25, 0.5, 0.25], 0.75, [0, 1]),
        ([0.125, 0.5, 0.375], 0.875, [1, 2]),
    ):
        assert kept(top_p_filter(torch.tensor([split]).log(), p)) == want, split
    # rows are cut each on its own, and the scores kept are unchanged
    rows = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]).log()
    cut = top_p_filter(rows, 0.6)
    assert (cut[0] > float("-inf")).tolist() == [True, False, False, False]
    assert (cut[1] > float("-inf")).sum() == 3 and torch.equal(cut[1][cut[1] > float("-inf")], rows[1, :3])


def test_epsilon_drops_the_tokens_less_probable_than_it_but_never_the_most_probable():
    logp = PROBS.log()  # 0.05, 0.5, 0.15, 0.3
    assert kept(epsilon_filter(logp, 0.1)) == [1, 2, 3]
    assert kept(epsilon_filter(logp, 0.2)) == [1, 3]
    assert kept(epsilon_filter(logp, 0.9)) == [1]
    assert narrowed(logp, epsilon=0.2) == pytest.approx({1: 0.5 / 0.8, 3: 0.3 / 0.8})
    # after the temperature: p² renormalized is 0.007, 0.685, 0.062, 0.247; then top-k among what is left
    assert narrowed(logp, temperature=0.5, epsilon=0.1) == pytest.approx({1: 0.25 / 0.34, 3: 0.09 / 0.34})
    assert narrowed(logp, topk=1, epsilon=0.1) == {1: 1.0}
    draws = Sampler(0, 1.0, 1.0, torch.Generator().manual_seed(0), 0.2)(logp.expand(100_000, -1).contiguous())
    assert (torch.bincount(draws, minlength=4) / draws.numel()).tolist() == pytest.approx(
        [0, 0.625, 0, 0.375], abs=0.01
    )


@pytest.mark.parametrize(
    "topk,topp,temperature",
    [(0, 1.0, 1.0), (2, 1.0, 1.0), (0, 0.85, 1.0), (0, 1.0, 0.5), (0, 1.0, 2.0), (3, 0.7, 0.5)],
)
def test_draws_are_as_frequent_as_the_narrowed_distribution_says(topk, topp, temperature):
    """100,000 draws per setting: each token's share within 0.01 of its probability (4 standard deviations at p =
    0.5): the temperature sharpens or flattens, the cuts leave out what they cut and renormalize the rest."""
    logp = PROBS.log()
    sampler = Sampler(topk, topp, temperature, torch.Generator().manual_seed(0))
    draws = sampler(logp.expand(100_000, -1).contiguous())
    shares = torch.bincount(draws, minlength=4).double() / draws.numel()
    scaled = (logp / temperature).softmax(-1)[0]
    order = scaled.argsort(descending=True).tolist()
    keep = order[:topk] if topk else order
    keep = [t for i, t in enumerate(keep) if scaled[keep[:i]].sum() < topp]  # the nucleus of what top-k kept
    expected = torch.zeros(4, dtype=torch.double)
    expected[keep] = scaled[keep].double() / scaled[keep].sum()
    assert torch.allclose(shares, expected, atol=0.01), (shares, expected)
    assert shares[expected == 0].sum() == 0  # what a cut left out is never drawn


def test_the_same_seed_draws_the_same_tokens():
    logp = PROBS.log().expand(1000, -1).contiguous()
    draws = [Sampler(0, 1.0, 1.0, torch.Generator().manual_seed(seed))(logp) for seed in (7, 7, 8)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert make_sampler(DecodeConfig(beam_size=1), CPU) is None  # not asked to sample


# BOS -> A (0.6) or B (0.4), then EOS: greedy always writes A
FORK = MarkovModel({BOS: {A: 0.6, B: 0.4}, A: {EOS: 1.0}, B: {EOS: 1.0}})


def test_a_sampled_corpus_holds_each_hypothesis_as_often_as_the_model_gives_it():
    src = [SRC[0, :-1].tolist()] * 4000
    greedy = decode_corpus(FORK, src, CPU, DecodeConfig(beam_size=1)).tokens
    assert greedy == [[A]] * len(src)
    sampled = decode_corpus(FORK, src, CPU, DecodeConfig(beam_size=1, sampling=True, batch_tokens=2000)).tokens
    assert set(map(tuple, sampled)) == {(A,), (B,)}
    assert sampled.count([B]) / len(src) == pytest.approx(0.4, abs=0.03)  # 4 standard deviations
    # top-k 1 is greedy again; a low temperature all but greedy
    narrowed = DecodeConfig(beam_size=1, sampling=True, sampling_topk=1)
    assert decode_corpus(FORK, src[:100], CPU, narrowed).tokens == [[A]] * 100
    cold = decode_corpus(FORK, src, CPU, DecodeConfig(beam_size=1, sampling=True, sampling_temperature=0.25)).tokens
    assert cold.count([B]) / len(src) == pytest.approx(0.4**4 / (0.4**4 + 0.6**4), abs=0.02)


def sources(count: int = 24) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 10, (count,), generator=generator).tolist()
    return [torch.randint(4, 30, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_on_real_models(family):
    """Top-k 1 gives greedy's hypotheses (and attention); the whole distribution gives others, the same for the
    same seed, never <pad> or <s>, within the length limit, and without the n-grams a ban forbids."""
    model, src = real_model(family), sources()
    greedy = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1), need_attention=True)
    top1 = DecodeConfig(beam_size=1, sampling=True, sampling_topk=1, sampling_seed=5)
    first = decode_corpus(model, src, CPU, top1, need_attention=True)
    assert first.tokens == greedy.tokens
    for ours, theirs in zip(first.attention or [], greedy.attention or []):
        assert torch.equal(ours, theirs)
    free = DecodeConfig(beam_size=1, sampling=True, sampling_seed=5)
    drawn = [decode_corpus(model, src, CPU, free).tokens for _ in range(2)]
    assert drawn[0] == drawn[1] and drawn[0] != greedy.tokens
    other_seed = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1, sampling=True, sampling_seed=6)).tokens
    assert other_seed != drawn[0]
    for tokens, source in zip(drawn[0], src):
        assert not {PAD, BOS, EOS} & set(tokens) and len(tokens) <= int((len(source) + 1) * 1.5) + 10
    banned = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1, sampling=True, no_repeat_ngram_size=1)).tokens
    assert all(len(set(tokens)) == len(tokens) for tokens in banned)  # no token twice


def test_how_it_decodes_is_said_in_words():
    assert describe(DecodeConfig()) == "beam 5, length penalty 1.0"
    assert describe(DecodeConfig(beam_size=1, no_repeat_ngram_size=3)) == "greedy, no repeated 3-grams"
    drawn = DecodeConfig(beam_size=1, sampling=True)
    assert describe(drawn) == "sampling the whole distribution, seed 0"
    narrowed = dataclasses.replace(
        drawn, sampling_topk=10, sampling_topp=0.9, sampling_temperature=0.7, sampling_seed=3
    )
    assert describe(narrowed) == "sampling top-k 10, top-p 0.9, temperature 0.7, seed 3"
    assert describe(narrowed.greedy()) == "greedy"  # validation: greedy, whatever decode.* says
