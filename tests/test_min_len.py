"""decode.min_len: no EOS before that many pieces, but for an empty source. Known answers of greedy and beam search
on a model whose probabilities are set by hand; on real models of every family, every hypothesis that long, a
corpus decoded in batches the same as each sentence alone (CTranslate2's min_decoding_length: tests/test_export.py;
a negative one: tests/test_bad_input.py)."""

import math

import pytest
import torch
from test_beam_search import MarkovModel, real_model

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import beam_search, decode_corpus, greedy_decode
from app.decode.search import describe

A, B = 4, 5
# EOS first at every step: with nothing held back, an empty translation
EAGER = MarkovModel({BOS: {EOS: 0.5, A: 0.3, B: 0.2}, A: {EOS: 0.6, B: 0.4}, B: {EOS: 0.7, A: 0.3}})
SRC = torch.tensor([[A, B, A, EOS]])


@pytest.mark.parametrize("min_len,tokens", [(0, []), (1, [A]), (2, [A, B]), (3, [A, B, A])])
def test_greedy_holds_back_eos_for_min_len_pieces(min_len, tokens):
    assert greedy_decode(EAGER, SRC, min_len=min_len).tokens == [tokens]


def test_beam_search_ranks_only_hypotheses_of_min_len_pieces():
    hyps = beam_search(EAGER, SRC, beam_size=3, alpha=0.0, n_best=3, min_len=2)
    # p(A B) = .3 · .4 · .7, p(B A) = .2 · .3 · .6, p(A B A) = .3 · .4 · .3 · .6: the shorter ones are out
    expected = [([A, B], 0.3 * 0.4 * 0.7), ([B, A], 0.2 * 0.3 * 0.6), ([A, B, A], 0.3 * 0.4 * 0.3 * 0.6)]
    assert [tokens for tokens, _ in hyps.nbest[0]] == [tokens for tokens, _ in expected]
    assert all(math.isclose(score, math.log(p), rel_tol=1e-5) for (_, score), (_, p) in zip(hyps.nbest[0], expected))
    assert [tokens for tokens, _ in beam_search(EAGER, SRC, beam_size=3, alpha=0.0, n_best=3).nbest[0]] == [
        [],
        [A],
        [B],
    ]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_an_empty_source_still_translates_to_nothing_beside_one_that_is_held_back(beam_size):
    """The empty source ends at once and leaves the batch; the other keeps its own least length."""
    src = torch.tensor([[EOS, PAD, PAD, PAD], [A, B, A, EOS]])
    if beam_size == 1:
        hyps = greedy_decode(EAGER, src, min_len=2)
    else:
        hyps = beam_search(EAGER, src, beam_size=beam_size, alpha=0.0, min_len=2)
    assert hyps.tokens == [[], [A, B]]


class EndsEarly(torch.nn.Module):
    """A real model with ``boost`` added to its EOS logit at every step: an untrained one ends some sentences
    early."""

    def __init__(self, model, boost: float):
        super().__init__()
        self.model, self.boost = model, boost
        self.max_positions = getattr(model, "max_positions", None)

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def start(self, memory, beam, steps, onednn=False):
        return self.model.start(memory, beam, steps, onednn=onednn)

    def step(self, memory, prev, state, need_attention=False):
        logits, attention, state = self.model.step(memory, prev, state, need_attention)
        logits[..., EOS] += self.boost
        return logits, attention, state


def test_a_min_len_that_no_repeat_ngram_size_leaves_no_pieces_for_ends_short_instead_of_padding():
    """decode.no_repeat_ngram_size=1 with six tokens leaves three pieces to output (UNK, A, B: never PAD or BOS, and
    none twice): min_len=5 cannot be met, and once they are spent the row ends, not with PAD, nor in an IndexError."""
    UNK = 1
    greedy = greedy_decode(EAGER, SRC, no_repeat_ngram_size=1, min_len=5).tokens
    assert greedy == [[A, B, UNK]]  # each step's likeliest piece that is not a repeat, then EOS: nothing else is left
    hyps = beam_search(EAGER, SRC, beam_size=3, alpha=0.0, n_best=3, no_repeat_ngram_size=1, min_len=5)
    assert hyps.tokens[0] in ([A, B, UNK], [B, A, UNK])
    assert all(sorted(tokens) == [UNK, A, B] and score > float("-inf") for tokens, score in hyps.nbest[0])


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau", "rnn_plain"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_every_hypothesis_of_a_model_has_min_len_pieces_however_it_is_batched(family, beam_size):
    model = EndsEarly(real_model(family), 4.0)
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 12, (12,), generator=generator).tolist()
    src = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in lengths]
    cpu, least = torch.device("cpu"), 6
    decode = DecodeConfig(beam_size=beam_size, n_best=beam_size, min_len=least, max_len_ratio=1.0, max_len_extra=8)
    hyps = decode_corpus(model, src, cpu, decode)
    limits = [int(len(s) + 1) + 8 for s in src]
    assert all(len(t) >= min(least, limit) for t, limit in zip(hyps.tokens, limits))
    if beam_size > 1:
        assert all(len(t) >= least for n in hyps.nbest for t, _ in n)
    alone = [decode_corpus(model, [s], cpu, decode).tokens[0] for s in src]
    assert hyps.tokens == alone
    free = decode_corpus(model, src, cpu, DecodeConfig(beam_size=beam_size, min_len=0, max_len_ratio=1.0))
    assert any(len(t) < least for t in free.tokens)  # else nothing was held back


def test_the_decoding_says_a_min_len_other_than_the_default():
    assert describe(DecodeConfig()) == "beam 5, length penalty 1.0"
    assert describe(DecodeConfig(beam_size=1, min_len=0)) == "greedy, empty translations allowed"
    assert describe(DecodeConfig(beam_size=1, min_len=3)) == "greedy, at least 3 pieces"
