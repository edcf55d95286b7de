"""decode.no_repeat_ngram_size: no n-gram twice in a hypothesis. Known answers of the ban itself and of greedy and
beam search on a model whose probabilities are set by hand; on real models of every family, hypotheses without a
repeated n-gram, whichever way the corpus is batched (a negative size: tests/test_bad_input.py)."""

import pytest
import torch
from test_beam_search import SRC, MarkovModel, real_model

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS
from app.decode.passes import beam_search, decode_corpus, greedy_decode
from app.decode.search import block_repeated_ngrams

A, B, C = 4, 5, 6


def banned(history: list[int], n: int, vocab: int = 8) -> set[int]:
    logp = torch.zeros(1, vocab)
    block_repeated_ngrams(logp, torch.tensor([history]), n)
    return {i for i, v in enumerate(logp[0].tolist()) if v == float("-inf")}


def test_the_ban_is_the_tokens_that_would_end_an_ngram_seen_before():
    assert banned([A, B, C, A, B], 3) == {C}  # "A B" was followed by C
    assert banned([A, B, C, A, B], 2) == {C}  # "B" was followed by C
    assert banned([A, B, C, A, B], 1) == {A, B, C}  # no token twice
    assert banned([A, B, C, A, B], 4) == set()  # "C A B" has not been seen
    assert banned([A, B, A, B, A], 2) == {B}
    assert banned([A, A, A], 2) == {A}
    assert banned([A, B], 3) == set()  # shorter than an n-gram
    assert banned([], 2) == set()


def test_a_token_banned_by_several_ngrams_stays_banned_and_the_others_keep_their_scores():
    logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0], [-1.0] * 7])
    history = torch.tensor([[A, B, A, B, A], [B, C, C, B, C]])
    block_repeated_ngrams(logp, history, 2)
    assert logp[0].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0, float("-inf"), -7.0]
    assert logp[1].tolist() == [-1.0] * 5 + [float("-inf")] * 2  # after C: C (C C) and B (C B)


# A and B follow each other: unblocked, both searches alternate them up to the length limit
LOOP = MarkovModel({BOS: {A: 0.9, EOS: 0.1}, A: {B: 0.9, EOS: 0.1}, B: {A: 0.9, EOS: 0.1}})


def test_greedy_ends_where_the_loop_would_repeat_an_ngram():
    limit = dict(max_len_ratio=1.0, max_len_extra=2)  # 6 tokens
    assert greedy_decode(LOOP, SRC, **limit).tokens == [[A, B, A, B, A, B]]
    assert greedy_decode(LOOP, SRC, **limit, no_repeat_ngram_size=2).tokens == [[A, B, A]]
    assert greedy_decode(LOOP, SRC, **limit, no_repeat_ngram_size=3).tokens == [[A, B, A, B]]


def test_beam_search_ranks_only_hypotheses_without_a_repeated_ngram():
    limit = dict(max_len_ratio=1.0, max_len_extra=2, alpha=0.0)
    assert beam_search(LOOP, SRC, beam_size=3, **limit).tokens == [[A, B, A, B, A, B]]
    hyps = beam_search(LOOP, SRC, beam_size=3, n_best=3, no_repeat_ngram_size=2, **limit)
    # "A B A" then EOS is the longest left: p = 0.9^3 · 0.1; "A B" + EOS and "A" + EOS are shorter and better
    assert [tokens for tokens, _ in hyps.nbest[0]] == [[], [A], [A, B]]  # α = 0: the shortest first
    longest = beam_search(LOOP, SRC, beam_size=3, n_best=3, no_repeat_ngram_size=2, **{**limit, "alpha": 5.0})
    assert longest.tokens == [[A, B, A]]


def repeats(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


# the families of test_beam_search whose untrained models write long outputs (its Bahdanau one ends at once)
@pytest.mark.parametrize("family", ["transformer", "rnn_luong_lstm", "rnn_plain"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_no_hypothesis_of_a_model_repeats_an_ngram_however_it_is_batched(family, beam_size):
    """An untrained model repeats bigrams in some hypotheses; blocked, none does,
    and a corpus decoded in batches that lose their finished sentences gives what each sentence alone does."""
    model = real_model(family)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 12, (12,), generator=generator).tolist()
    src = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in lengths]
    free, blocked = DecodeConfig(beam_size=beam_size), DecodeConfig(beam_size=beam_size, no_repeat_ngram_size=2)
    cpu = torch.device("cpu")
    assert sum(repeats(h, 2) for h in decode_corpus(model, src, cpu, free).tokens) >= 2  # else nothing to block
    together = decode_corpus(model, src, cpu, blocked).tokens
    assert not any(repeats(h, 2) for h in together)
    alone = [decode_corpus(model, [s], cpu, blocked).tokens[0] for s in src]
    assert together == alone


def test_beam_of_one_is_greedy_under_the_ban():
    model = real_model("transformer")
    src = torch.randint(4, 30, (6, 9), generator=torch.Generator().manual_seed(2))
    src[:, -1] = EOS
    greedy = greedy_decode(model, src, no_repeat_ngram_size=3)
    beam = beam_search(model, src, beam_size=1, alpha=0.0, no_repeat_ngram_size=3)
    assert greedy.tokens == beam.tokens
