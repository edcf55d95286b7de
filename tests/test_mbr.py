"""decode.mbr_candidates: the pairwise utilities are sacrebleu's sentence scores exactly; the candidate that agrees
most with the others wins; on real models, the choice among samples and among a beam's best (through the CLI:
tests/test_cli_end_to_end.py)."""

import dataclasses

import pytest
import torch
from sacrebleu.metrics import BLEU, CHRF
from test_beam_search import real_model, sources

from app.config.commands import DecodeConfig
from app.decode.mbr import draw_candidates, merged, minimum_bayes_risk
from app.decode.mbr_utility import PairwiseUtility, ranked
from app.decode.passes import decode_corpus
from app.decode.search import describe
from app.run.errors import UserError

CPU = torch.device("cpu")
PUBLIC = {"chrf": CHRF(), "bleu": BLEU(effective_order=True)}  # sacrebleu's sentence scores, called one by one


def public_utility(name: str, hypothesis: str, reference: str) -> float:
    return PUBLIC[name].sentence_score(hypothesis, [reference]).score


@pytest.mark.parametrize("name", ["chrf", "bleu"])
def test_the_pairwise_utility_is_sacrebleus_sentence_score(name, genesis_pairs):
    texts = [english for _, _, english in genesis_pairs[:24]]
    texts += ["", "a", ".", "And God", "And God said", texts[0], texts[0].lower()]  # short, empty, twice, cased
    u = PairwiseUtility(name).matrix(texts)
    for i, hypothesis in enumerate(texts):
        for j, reference in enumerate(texts):
            assert u[i][j] == public_utility(name, hypothesis, reference), (hypothesis, reference)
    assert any(u[i][j] != u[j][i] for i in range(len(texts)) for j in range(i))  # chrF and BLEU are not symmetric


def test_the_candidate_that_agrees_most_with_the_others_wins():
    texts = ["the cat sat down", "a dog ran off", "the cat sat down", "the cat sat"]
    order = ranked(texts, PairwiseUtility("chrf"))
    expected = {
        i: sum(public_utility("chrf", texts[i], y) for y in texts) / len(texts) for i in (0, 1, 3)
    }  # a candidate drawn twice is one candidate, and two of the pseudo-references
    assert [i for i, _ in order] == [0, 3, 1]
    assert dict(order) == pytest.approx(expected, abs=1e-12)


def test_ties_go_to_the_earlier_candidate():
    order = ranked(["x y", "p q"], PairwiseUtility("bleu"))  # nothing shared: each agrees only with itself
    assert order[0][1] == order[1][1] and [i for i, _ in order] == [0, 1]


def words(rows: list[list[int]]) -> list[str]:
    """A detokenizer of ids: one word per id."""
    return [" ".join(f"w{t}" for t in row) for row in rows]


def corpus_search(model):
    return lambda src, decode, prefix, constraints: decode_corpus(model, src, CPU, decode, prefix=prefix)


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_minimum_bayes_risk_picks_the_sample_of_highest_expected_utility(family):
    model, src = real_model(family), [row[row > 3].tolist() for row in sources()]
    decode = DecodeConfig(beam_size=1, sampling=True, sampling_seed=3, mbr_candidates=6, n_best=3, max_len_extra=4)
    search = corpus_search(model)
    candidates = draw_candidates(search, src, decode)
    assert [len(c) for c in candidates] == [6] * len(src)
    assert any(len({tuple(t) for t in c}) > 1 for c in candidates)  # the samples differ
    hyps = minimum_bayes_risk(search, src, decode, words)
    assert hyps.tokens == minimum_bayes_risk(search, src, decode, words).tokens  # the same seed: the same choice
    for tokens, chosen, nbest in zip(candidates, hyps.tokens, hyps.nbest):
        texts = words(tokens)
        expected = [sum(public_utility("chrf", h, y) for y in texts) / len(texts) for h in texts]
        assert chosen in tokens and max(expected) == pytest.approx(expected[tokens.index(chosen)], abs=1e-9)
        assert nbest[0] == (chosen, pytest.approx(max(expected), abs=1e-9))
        assert [score for _, score in nbest] == sorted((score for _, score in nbest), reverse=True)
        assert len({tuple(t) for t, _ in nbest}) == len(nbest) == min(3, len(set(texts)))
    assert hyps.mbr["candidates"] == 6 and hyps.mbr["sentences"] == len(src)


def test_the_candidates_of_a_beam_are_its_n_best():
    model, src = real_model("transformer"), [row[row > 3].tolist() for row in sources()]
    decode = DecodeConfig(beam_size=4, mbr_candidates=4, mbr_utility="bleu", max_len_extra=4)
    beam = decode_corpus(model, src, CPU, dataclasses.replace(decode, mbr_candidates=0, n_best=4))
    assert draw_candidates(corpus_search(model), src, decode) == [[t for t, _ in n] for n in beam.nbest]
    hyps = minimum_bayes_risk(corpus_search(model), src, decode, words)
    assert hyps.nbest is None and all(t in [c for c, _ in n] for t, n in zip(hyps.tokens, beam.nbest))


def test_the_host_worker_ranks_half_of_the_sentences_as_this_process_would():
    model, src = real_model("transformer"), [row[row > 3].tolist() for row in sources()]
    decode = DecodeConfig(beam_size=1, sampling=True, mbr_candidates=5, n_best=2, max_len_extra=4)
    alone = minimum_bayes_risk(corpus_search(model), src, decode, words, worker_from=len(src) + 1)
    shared = minimum_bayes_risk(corpus_search(model), src, decode, words, worker_from=len(src))
    assert (alone.mbr["utility_processes"], shared.mbr["utility_processes"]) == (1, 2)
    assert shared.tokens == alone.tokens and shared.nbest == alone.nbest


def test_the_settings_say_how_it_decodes_and_greedy_validation_turns_it_off():
    d = DecodeConfig(beam_size=1, sampling=True, sampling_epsilon=0.02, mbr_candidates=16)
    assert describe(d) == "minimum Bayes risk (chrF) of 16 candidates, the samples: sampling epsilon 0.02, seed 0"
    beam = DecodeConfig(beam_size=8, mbr_candidates=8, mbr_utility="bleu")
    assert describe(beam).startswith("minimum Bayes risk (BLEU) of 8 candidates, the best of the beam: beam 8")
    assert d.greedy().mbr_candidates == 0 and describe(d.greedy()) == "greedy"
    with pytest.raises(UserError, match="decode.mbr_candidates=8 chooses among the beam's 8 best"):
        dataclasses.replace(beam, beam_size=5)


def test_the_figures_of_several_windows_add_up():
    one = {"sentences": 2, "candidates": 4, "utility": "chrf", "distinct_per_sentence": 3.0}
    figures = merged(
        [
            {**one, "candidate_seconds": 1.0, "utility_seconds": 0.5},
            {**one, "sentences": 6, "distinct_per_sentence": 4.0, "candidate_seconds": 2.0, "utility_seconds": 1.0},
        ]
    )
    assert figures == {
        **one,
        "sentences": 8,
        "distinct_per_sentence": 3.75,
        "candidate_seconds": 3.0,
        "utility_seconds": 1.5,
    }
