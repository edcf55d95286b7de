"""Terminology constraints (app/decode/constraints.py; decode_corpus's ``constraints``, make translate's
``translate.constraints``): known answers of the tracking on hand-set token sequences and of greedy and beam search
on a model whose probabilities are set by hand; every hypothesis of every family meets every constraint; beam
search constrained to its own best hypothesis keeps it; the refusals through the CLI (the API: tests/test_serve.py)."""

import math

import pytest
import torch
from conftest import run_cli, trained_tiny_run
from test_beam_search import FAMILIES, A, B, MarkovModel, real_model

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS
from app.decode.constraints import PhraseConstraints, automaton, needed
from app.decode.passes import decode_corpus
from app.run.errors import UserError

CPU = torch.device("cpu")


def track(phrases: list[list[int]], tokens: list[int]) -> tuple[list[list[bool]], list[int]]:
    """One hypothesis fed to the tracker piece by piece: after each piece, which phrases are met, and how many
    constraint pieces it has met (its bank in beam search)."""
    tracker, met, banks = PhraseConstraints([phrases], 1, CPU), [], []
    for token in tokens:
        tracker.step(torch.tensor([token]))
        met.append(tracker.met[0].tolist())
        banks.append(int(tracker.total[0] - needed(tracker.state, tracker.met, tracker.lengths)[0]))
    return met, banks


def contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i : i + len(phrase)] == phrase for i in range(len(tokens) - len(phrase) + 1))


def test_a_phrase_is_met_once_its_pieces_appear_contiguously():
    met, banks = track([[7, 8]], [5, 7, 8, 9])
    assert met == [[False], [False], [True], [True]] and banks == [0, 1, 2, 2]


def test_a_phrase_split_by_another_piece_is_not_met():
    met, banks = track([[7, 8]], [7, 9, 8])
    assert met == [[False]] * 3 and banks == [1, 0, 0]


def test_a_phrase_met_twice_counts_once_and_one_given_twice_is_one():
    met, banks = track([[7, 8]], [7, 8, 5, 7, 8])
    assert [m[0] for m in met] == [False, True, True, True, True] and banks == [1, 2, 2, 2, 2]
    twice = PhraseConstraints([[[7, 8], [7, 8]]], 1, CPU)
    assert twice.total.tolist() == [2] and twice.count == 1


def test_two_phrases_sharing_a_piece():
    # "7 8" and "8 9" share 8: "7 8 9" meets both (after 8: the first met, one piece of the second)
    met, banks = track([[7, 8], [8, 9]], [7, 8, 9])
    assert met == [[False, False], [True, False], [True, True]] and banks == [1, 3, 4]
    # "7 8" and "7 9" share their first piece: "7 8 9" meets the first only, "7 8 7 9" both
    assert track([[7, 8], [7, 9]], [7, 8, 9])[0][-1] == [True, False]
    assert track([[7, 8], [7, 9]], [7, 8, 7, 9])[0][-1] == [True, True]


def test_a_broken_partial_match_falls_back_to_what_still_matches():
    """ "7 7 8" in "7 7 7 8": the third 7 breaks the match "7 7 ?" but still ends "7 7"; a tracker that started over
    would miss it."""
    assert automaton([7, 7, 8]) == [[1, 1, 0], [2, 2, 0], [2, 2, 3]]
    met, banks = track([[7, 7, 8]], [7, 7, 7, 8])
    assert [m[0] for m in met] == [False, False, False, True] and banks == [1, 2, 2, 3]


def test_greedy_writes_a_phrase_it_would_never_choose_at_the_last_place_it_fits():
    """Every piece but B follows with p 0.9 A, 0.1 EOS; B never (p 1e-9). The limit is 4 × 1 + 2 = 6 pieces: free,
    greedy writes A six times; it must contain B (or "B A"), so it writes A until only room for the phrase is left,
    then the phrase, and ends (EOS is allowed only once the phrase is met)."""
    model = MarkovModel({}, default={A: 0.9, EOS: 0.1})
    decode = DecodeConfig(beam_size=1, max_len_ratio=1.0, max_len_extra=2)
    assert decode_corpus(model, [[A, B, A]], CPU, decode).tokens == [[A] * 6]
    assert decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[[[B]]]).tokens == [[A] * 5 + [B]]
    assert decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[[[B, A]]]).tokens == [[A] * 4 + [B, A]]
    beam = decode_corpus(model, [[A, B, A]], CPU, DecodeConfig(beam_size=2, n_best=2), constraints=[[[B]]])
    assert len(beam.nbest[0]) == 2 and all(B in tokens for tokens, _ in beam.nbest[0])


def test_greedy_writes_a_phrase_where_the_model_would_end_and_then_the_rest_of_it():
    """Free, greedy writes "A" and ends (EOS 0.9). Constrained to "B", it writes B where it would have ended, then
    ends; to "B A", B there and then A, although after B the model prefers UNK (0.9): a phrase once begun is written
    to its end. Sampling draws the same way (only the phrase's pieces are left to draw from)."""
    UNK = 1
    model = MarkovModel({BOS: {A: 0.6, EOS: 0.4}, A: {EOS: 0.9, A: 0.1}, B: {UNK: 0.9, A: 0.05, EOS: 0.05}})
    decode = DecodeConfig(beam_size=1)
    assert decode_corpus(model, [[A, B, A]], CPU, decode).tokens == [[A]]
    assert decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[[[B]]]).tokens == [[A, B, UNK]]
    assert decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[[[B, A]]]).tokens == [[A, B, A]]
    sampled = DecodeConfig(beam_size=1, sampling=True, sampling_topk=1)
    assert decode_corpus(model, [[A, B, A]], CPU, sampled, constraints=[[[B, A]]]).tokens == [[A, B, A]]


# the model of test_beam_search: free, beam search's best is "A" (0.6 × 0.9 = 0.54)
MARKOV = {BOS: {A: 0.6, B: 0.4}, A: {EOS: 0.9, B: 0.05, A: 0.05}, B: {EOS: 0.9, A: 0.05, B: 0.05}}


@pytest.mark.parametrize(
    "phrases,best,p",
    [
        ([[A]], [A], 0.6 * 0.9),  # the unconstrained best: the same hypothesis and score
        ([[B]], [B], 0.4 * 0.9),
        ([[A, B]], [A, B], 0.6 * 0.05 * 0.9),
        ([[B, A]], [B, A], 0.4 * 0.05 * 0.9),
        ([[A], [B]], [A, B], 0.6 * 0.05 * 0.9),  # "B A" has 0.4 × 0.05 × 0.9
    ],
)
def test_beam_search_finds_the_best_hypothesis_that_meets_the_constraints(phrases, best, p):
    model, decode = MarkovModel(MARKOV), DecodeConfig(beam_size=2, n_best=2, length_penalty=0.0)
    free = decode_corpus(model, [[A, B, A]], CPU, decode)
    hyps = decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[phrases])
    assert hyps.tokens == [best] and hyps.nbest[0][0][1] == pytest.approx(math.log(p), abs=1e-6)
    assert all(contains(tokens, phrase) for tokens, _ in hyps.nbest[0] for phrase in phrases)
    if best == free.tokens[0]:
        assert hyps.nbest[0][0] == free.nbest[0][0]


def test_the_beam_keeps_a_slot_for_a_hypothesis_that_has_met_more():
    """Dynamic beam allocation: with 2 beams, "B" (p 0.2) ranks third after "A" (0.5) and UNK (0.3), and a beam
    ranked by score alone drops it and must fit B in later ("A B": 0.5 × 0.05 × 0.9). The beam shared by banks keeps
    "B", which has met the phrase, beside the best that has not, and ends it at 0.2 × 0.9."""
    UNK = 1
    after = {EOS: 0.9, A: 0.05, B: 0.05}
    model = MarkovModel({BOS: {A: 0.5, UNK: 0.3, B: 0.2}, A: after, UNK: after, B: after})
    decode = DecodeConfig(beam_size=2, length_penalty=0.0)
    assert decode_corpus(model, [[A, B, A]], CPU, decode).tokens == [[A]]
    hyps = decode_corpus(model, [[A, B, A]], CPU, decode, constraints=[[[B]]])
    assert hyps.tokens == [[B]] and hyps.nbest[0][0][1] == pytest.approx(math.log(0.2 * 0.9), abs=1e-6)


def random_constraints(count: int, seed: int = 4) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Sources, and per sentence 0-2 phrases of 1-3 random pieces (every third sentence free)."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=generator))  # noqa: E731
    src = [torch.randint(4, 30, (draw(1, 9),), generator=generator).tolist() for _ in range(count)]
    phrase = lambda: torch.randint(4, 30, (draw(1, 4),), generator=generator).tolist()  # noqa: E731
    phrases = [[phrase() for _ in range(0 if i % 3 == 0 else draw(1, 3))] for i in range(count)]
    return src, phrases


DECODINGS = {
    "greedy": DecodeConfig(beam_size=1),
    "beam": DecodeConfig(beam_size=4, n_best=3),
    "beam, no repeated 2-grams": DecodeConfig(beam_size=3, n_best=3, no_repeat_ngram_size=2),
    "sampling": DecodeConfig(beam_size=1, sampling=True, sampling_topk=5, sampling_seed=2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_hypothesis_of_every_family_meets_every_constraint(family):
    """Random constraints on a random model (which would write none of them): 100 % met by every hypothesis of
    greedy search, beam search (its n-best), with an n-gram ban, sampling, and after a prefix; the sentences without
    constraints decode as they do without any."""
    model, (src, phrases) = real_model(family), random_constraints(18)
    prefix = [[9, 10] if i % 2 else [] for i in range(len(src))]
    for name, decode in DECODINGS.items():
        for begin in (None, prefix):
            hyps = decode_corpus(model, src, CPU, decode, prefix=begin, constraints=phrases)
            nbest = hyps.nbest or [[(tokens, None)] for tokens in hyps.tokens]
            for i, hypotheses in enumerate(nbest):
                assert len(hypotheses) == min(decode.n_best, decode.beam_size) or decode.beam_size == 1
                for tokens, _ in hypotheses:
                    assert all(contains(tokens, phrase) for phrase in phrases[i]), (name, i, tokens, phrases[i])
                    assert begin is None or tokens[: len(begin[i])] == begin[i]
            if begin is None and not decode.sampling:  # (the draws of a batch depend on its other rows' steps)
                free = decode_corpus(model, src, CPU, decode)
                free_nbest = free.nbest or [[(tokens, None)] for tokens in free.tokens]
                free_rows = [(i, j) for i in range(0, len(src), 3) for j in range(len(free_nbest[i]))]
                assert [nbest[i][j][0] for i, j in free_rows] == [free_nbest[i][j][0] for i, j in free_rows]
                # scores within float rounding: a batch of other lengths sums in another order
                scores = [nbest[i][j][1] for i, j in free_rows if nbest[i][j][1] is not None]
                free_scores = [free_nbest[i][j][1] for i, j in free_rows if free_nbest[i][j][1] is not None]
                assert scores == pytest.approx(free_scores, rel=1e-5)
                assert all(len(nbest[i]) == len(free_nbest[i]) for i in range(0, len(src), 3))


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_constrained_to_its_own_best_hypothesis_keeps_it(family):
    """Constrained to contain its whole unconstrained best hypothesis Y, beam search never scores below Y (the
    prefixes of Y hold the furthest bank alone, so Y ends as it did): it returns Y, with Y's score, or one
    containing Y that the free search missed. With no room after a forced phrase (decode.max_len_extra=0), Y does not
    raise the length limit."""
    model, (src, _) = real_model(family), random_constraints(30, seed=5)
    # the free search's own choices, an empty one included (then no phrase): not the one decode.min_len would force,
    # whose EOS these untrained models rank among near ties
    decode = DecodeConfig(beam_size=4, max_len_extra=0, min_len=0)
    free = decode_corpus(model, src, CPU, decode)
    kept = [i for i, tokens in enumerate(free.tokens) if tokens]
    whole = decode_corpus(model, [src[i] for i in kept], CPU, decode, constraints=[[free.tokens[i]] for i in kept])
    same = 0
    for j, i in enumerate(kept):
        (tokens, score), (free_tokens, free_score) = whole.nbest[j][0], free.nbest[i][0]
        assert contains(tokens, free_tokens) and score >= free_score - 1e-5, (i, tokens, free_tokens)
        same += tokens == free_tokens and score == pytest.approx(free_score, abs=1e-5)
    assert len(kept) >= 3 and same >= 0.75 * len(kept)


@pytest.mark.parametrize("beam", [1, 3])
def test_the_ngram_ban_never_blocks_a_phrases_next_piece(beam):
    """A phrase that repeats a 2-gram ("7 8 7 8") is written whole under decode.no_repeat_ngram_size=2, which
    would ban its last piece."""
    model, phrase = real_model("transformer"), [7, 8, 7, 8]
    decode = DecodeConfig(beam_size=beam, n_best=beam, no_repeat_ngram_size=2)
    hyps = decode_corpus(model, [[5, 6], [9]], CPU, decode, constraints=[[phrase], [phrase]])
    assert all(
        contains(tokens, phrase) for nbest in hyps.nbest or [[(t, 0)] for t in hyps.tokens] for tokens, _ in nbest
    )


def test_a_constraint_past_the_length_limit_raises_it():
    """One source piece and its EOS allow 2 × 1.5 + 2 = 5 pieces; a 7-piece phrase raises the limit to 7 + 2."""
    model, phrase = real_model("transformer"), [9, 10, 11, 12, 13, 14, 15]
    for decode in (DecodeConfig(beam_size=1, max_len_extra=2), DecodeConfig(beam_size=3, max_len_extra=2)):
        tokens = decode_corpus(model, [[5]], CPU, decode, constraints=[[phrase]]).tokens[0]
        assert contains(tokens, phrase) and len(tokens) <= 9, tokens


def test_constraints_longer_than_the_model_takes_are_refused():
    model = real_model("transformer")
    model.max_positions = 8
    with pytest.raises(UserError, match="constrained translation 2 has 8 subword tokens; this model takes at most 7"):
        decode_corpus(model, [[5], [6]], CPU, DecodeConfig(), prefix=[[4], [4, 5, 6]], constraints=[[], [[9] * 5]])


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_asking_less_often_whether_all_are_done_changes_nothing(family, monkeypatch):
    """Sentences leave the batch at other steps (every step or every 8, as on a GPU): their constraint states
    leave with them, and the hypotheses are the same."""
    model, (src, phrases) = real_model(family), random_constraints(12)
    results = []
    for every in (1, 8):
        monkeypatch.setattr("app.decode.search.done_check_interval", lambda device, every=every: every)
        beam = decode_corpus(model, src, CPU, DecodeConfig(beam_size=3, n_best=3), constraints=phrases)
        greedy = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1), constraints=phrases)
        results.append(([[tokens for tokens, _ in n] for n in beam.nbest], greedy.tokens))
    assert results[0] == results[1]


# ---- through the CLI ----
@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    return trained_tiny_run(tmp_path_factory, corpus_tsv, "constraints")


LINES = "En el principio creó Dios los cielos y la tierra.\nY dijo Dios: Sea la luz.\nY fue la tarde.\n"


@pytest.mark.slow
def test_translate_meets_each_lines_phrases_and_refuses_bad_files_in_one_line(workdir, tmp_path):
    """translate.constraints: every hypothesis (greedy, and beam's 3-best) contains its line's phrases (an empty line
    leaves it free); a file of another length, an empty phrase and the CTranslate2 engine are refused in one line."""
    path = tmp_path / "terms.txt"
    path.write_text("waters\tthe morning\n\nGod\n", encoding="utf-8")
    base = ("command=translate", "name=tiny", "device=cpu", f"translate.constraints={path}")
    phrases = [["waters", "the morning"], [], ["God"]]
    for more in (("decode.beam_size=1",), ("decode.n_best=3",)):
        result = run_cli(workdir, *base, *more, stdin=LINES)
        assert result.returncode == 0, result.stderr[-2000:]
        assert ", 2 with translate.constraints\n" in result.stderr
        rows = [line.split(" ||| ") for line in result.stdout.splitlines()]
        rows = (
            [(int(r[0]), r[1]) for r in rows] if more == ("decode.n_best=3",) else list(enumerate(r[0] for r in rows))
        )
        assert len(rows) == (9 if more == ("decode.n_best=3",) else 3)
        for i, text in rows:
            assert all(phrase in text for phrase in phrases[i]), (i, text)
    for text, error in [
        ("God\n", f"error: translate.constraints='{path}' has 1 line and standard input 3: one line of tab-separated"),
        ("God\t \tlight\n\n\n", f"error: translate.constraints='{path}' line 1, phrase 2: the phrase ' ' is empty"),
    ]:
        path.write_text(text, encoding="utf-8")
        refused = run_cli(workdir, *base, stdin=LINES)
        assert refused.returncode != 0 and refused.stderr.startswith(error), refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    ct2 = run_cli(workdir, *base, "translate.engine=ct2", stdin=LINES)
    assert ct2.stderr.strip() == (
        f"error: translate.constraints='{path}': CTranslate2 has no constrained decoding; translate.engine=torch has"
    )
