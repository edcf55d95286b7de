"""Beam search: known answers on a model whose probabilities are set by hand, and agreement with
greedy search on real models of every family."""

import math

import pytest
import torch
from conftest import Vocab, model_config

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS, PAD
from app.decode.passes import beam_search, decode_corpus, greedy_decode
from app.decode.penalties import length_penalty
from app.models import build_model

A, B = 4, 5
VOCAB = 6
TINY = 1e-9


class MarkovModel(torch.nn.Module):
    """p(next token | last token) from a fixed table: a model whose sequence probabilities are known."""

    class Memory:
        def __init__(self, n):
            self.n = n

        def select(self, index):
            return MarkovModel.Memory(len(index))

    class State:
        def select(self, index):
            return self

    def __init__(self, table: dict[int, dict[int, float]], default: dict[int, float] = {EOS: 1.0}):  # noqa: B006
        super().__init__()
        self.table, self.default = table, default

    def encode(self, src, src_mask=None):
        return self.Memory(src.size(0))

    def start(self, memory, beam=1, steps=None, onednn=False):
        return self.State()

    def step(self, memory, prev_tokens, state, need_attention=False):
        rows = []
        for token in prev_tokens.tolist():
            probs = torch.full((VOCAB,), TINY)
            for nxt, p in self.table.get(token, self.default).items():
                probs[nxt] = p
            rows.append(probs.log())
        return torch.stack(rows), None, self.State()


SRC = torch.tensor([[A, B, A, EOS]])  # length limit ratio 1 + extra: plenty


def test_beam_finds_the_best_sequence_greedy_misses():
    # greedy: A (0.6) then EOS (0.4) -> p = 0.24; the best is B (0.4) then EOS (0.9) -> p = 0.36
    model = MarkovModel({BOS: {A: 0.6, B: 0.4}, A: {EOS: 0.4, A: 0.3, B: 0.3}, B: {EOS: 0.9, A: 0.05, B: 0.05}})
    assert greedy_decode(model, SRC).tokens == [[A]]
    hyps = beam_search(model, SRC, beam_size=2, alpha=0.0, n_best=2)
    assert hyps.tokens == [[B]]
    (best, best_score), (second, second_score) = hyps.nbest[0]
    assert (best, second) == ([B], [A])
    assert best_score == pytest.approx(math.log(0.36), abs=1e-6)
    assert second_score == pytest.approx(math.log(0.24), abs=1e-6)


def test_length_penalty_changes_the_ranking():
    # "" (EOS at once): p = 0.5; "A": p = 0.5 * 0.9 = 0.45. Without a penalty the empty output wins.
    model = MarkovModel({BOS: {EOS: 0.5, A: 0.5 - 2 * TINY}, A: {EOS: 0.9, A: 0.1}})
    assert beam_search(model, SRC, beam_size=2, alpha=0.0).tokens == [[]]
    with_penalty = beam_search(model, SRC, beam_size=2, alpha=1.0, n_best=2)
    assert with_penalty.tokens == [[A]]
    scores = [score for _, score in with_penalty.nbest[0]]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] == pytest.approx(math.log(0.45) / length_penalty(2, 1.0), abs=1e-6)


def test_length_limit_ends_every_beam():
    # would never stop on its own: every token is followed by A, and EOS is far less likely than any other
    model = MarkovModel({}, default={A: 1.0, EOS: 1e-30})
    hyps = beam_search(model, SRC, beam_size=2, alpha=0.0, max_len_ratio=1.0, max_len_extra=2)
    assert hyps.tokens == [[A] * 6]  # 4 source tokens * 1.0 + 2


FAMILIES = {
    "transformer": dict(
        arch="transformer", d_model=16, heads=2, enc_layers=2, dec_layers=2, ff_dim=32, attention_dropout=0.0
    ),
    "rnn_bahdanau": dict(arch="rnn", emb_dim=16, hidden=32, attention="bahdanau"),
    "rnn_luong_lstm": dict(arch="rnn", emb_dim=16, hidden=32, attention="luong", cell="lstm", tie_embeddings=False),
    "rnn_luong_local_p": dict(
        arch="rnn",
        emb_dim=16,
        hidden=32,
        attention="luong",
        local_window=2,
        local_alignment="predictive",
        tie_embeddings=False,
    ),
    "rnn_luong_local_m": dict(
        arch="rnn",
        emb_dim=16,
        hidden=32,
        attention="luong",
        local_window=1,
        input_feeding=False,
        tie_embeddings=False,
    ),
    "rnn_plain": dict(arch="rnn", emb_dim=16, hidden=32, attention="none"),
    # the pointer-generator (model.copy_attention): log P in place of logits, per row its sentence's source
    "transformer_copy": dict(
        arch="transformer",
        d_model=16,
        heads=2,
        enc_layers=2,
        dec_layers=2,
        ff_dim=32,
        attention_dropout=0.0,
        copy_attention=True,
    ),
    "rnn_bahdanau_copy": dict(arch="rnn", emb_dim=16, hidden=32, attention="bahdanau", copy_attention=True),
    # the coverage mechanism (model.coverage): the state carries each source piece's attention so far
    "rnn_bahdanau_coverage": dict(arch="rnn", emb_dim=16, hidden=32, attention="bahdanau", coverage=True),
    "rnn_luong_concat_local_coverage": dict(
        arch="rnn",
        emb_dim=16,
        hidden=32,
        attention="luong",
        score="concat",
        input_feeding=False,
        local_window=2,
        coverage=True,
        tie_embeddings=False,
    ),
}


def real_model(family):
    torch.manual_seed(0)
    return build_model(model_config(dropout=0.0, **FAMILIES[family]), Vocab(30, 30)).eval()


def sources():
    torch.manual_seed(1)
    src = torch.randint(4, 30, (6, 7))
    src[:, -1] = EOS
    src[3, 3], src[3, 4:] = EOS, PAD
    return src


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_size_one_without_length_penalty_is_greedy(family):
    """With α > 0 a single beam may go on past an EOS that a longer, better-normalized hypothesis beats;
    without the penalty it stops where greedy does."""
    model, src = real_model(family), sources()
    greedy = greedy_decode(model, src, 1.0, 3, need_attention=True)
    beam = beam_search(model, src, beam_size=1, alpha=0.0, max_len_ratio=1.0, max_len_extra=3, need_attention=True)
    assert beam.tokens == greedy.tokens
    if greedy.attention is None:
        assert beam.attention is None
    else:
        for g, b in zip(greedy.attention, beam.attention):
            assert torch.allclose(g, b, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_outputs_are_well_formed(family):
    model, src = real_model(family), sources()
    hyps = beam_search(model, src, beam_size=4, max_len_ratio=1.0, max_len_extra=3, n_best=3, need_attention=True)
    src_lens = (src != PAD).sum(-1).tolist()
    for i, nbest in enumerate(hyps.nbest):
        assert len(nbest) == 3 and nbest[0][0] == hyps.tokens[i]
        assert [s for _, s in nbest] == sorted((s for _, s in nbest), reverse=True)
        if hyps.attention is not None:
            weights = hyps.attention[i]
            assert weights.shape[-2:] == (len(hyps.tokens[i]) + 1, src_lens[i])
            assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-4)


def test_decode_corpus_restores_input_order_with_beams():
    model = real_model("transformer")
    src = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    one_by_one = [beam_search(model, torch.tensor([s + [EOS]]), beam_size=3).tokens[0] for s in src]
    together = decode_corpus(model, src, torch.device("cpu"), DecodeConfig(batch_tokens=30, beam_size=3))
    assert together.tokens == one_by_one


def test_a_batch_out_of_memory_is_decoded_in_halves(monkeypatch, caplog):
    """A decoding budget too large for the device: the batch is split until it fits, the hypotheses those of
    decoding in small batches from the start, in input order, and the user told once which setting to lower."""
    import app.decode.passes

    model = real_model("transformer")
    src = [[5 + (i * 7 + j) % 25 for j in range(1 + i % 6)] for i in range(12)]
    decode = DecodeConfig(batch_tokens=10_000, beam_size=3, n_best=2)
    small = decode_corpus(model, src, torch.device("cpu"), DecodeConfig(batch_tokens=3, beam_size=3, n_best=2))
    real, sizes = app.decode.passes.searcher, []

    def runs_out_above_three_sentences(model, src, *args, **kwargs):
        sizes.append(src.size(0))
        if src.size(0) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(app.decode.passes, "searcher", runs_out_above_three_sentences)
    with caplog.at_level("WARNING", logger="app.decode.passes"):
        split = decode_corpus(model, src, torch.device("cpu"), decode)
    assert sorted(s for s in sizes if s > 3) == [6, 6, 12] and sum(s for s in sizes if s <= 3) == 12
    assert split.tokens == small.tokens and [[t for t, _ in n] for n in split.nbest] == [
        [t for t, _ in n] for n in small.nbest
    ]
    warnings = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(warnings) == 1 and "batch of 12 sentences" in warnings[0] and "decode.batch_tokens" in warnings[0]
    monkeypatch.setattr(
        app.decode.passes, "searcher", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("x"))
    )
    with pytest.raises(torch.OutOfMemoryError):  # a single sentence that does not fit is not hidden
        decode_corpus(model, src[:1], torch.device("cpu"), decode)


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_asking_less_often_whether_all_are_done_changes_nothing(family, monkeypatch):
    """Decoding runs on past a finished sentence until it next checks (on a GPU, every 8 steps: a host
    sync), and only then drops it from the batch; the extra steps must not change any hypothesis. Scores and
    attention rows agree to float rounding: a batch that sheds its finished sentences sooner multiplies
    matrices of fewer rows."""
    model, src = real_model(family), sources()
    results = {}
    for every in (1, 8):
        monkeypatch.setattr("app.decode.search.done_check_interval", lambda device, every=every: every)
        results[every] = (
            beam_search(model, src, beam_size=3, n_best=3, need_attention=True),
            greedy_decode(model, src, need_attention=True),
        )
    (beam_1, greedy_1), (beam_8, greedy_8) = results[1], results[8]
    assert greedy_1.tokens == greedy_8.tokens
    for nbest_1, nbest_8 in zip(beam_1.nbest, beam_8.nbest):
        assert [tokens for tokens, _ in nbest_1] == [tokens for tokens, _ in nbest_8]
        assert [score for _, score in nbest_1] == pytest.approx([score for _, score in nbest_8], rel=1e-6)
    for a, b in zip(beam_1.attention + greedy_1.attention, beam_8.attention + greedy_8.attention):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6)


def test_no_hypothesis_ends_after_its_sentence_is_done(monkeypatch):
    """A sentence done at step 1 stays done while the loop runs on to its next check: "B A A" ends at
    the limit (step 3) with a better normalized score than "B", but must not join the n-best."""
    model = MarkovModel({BOS: {EOS: 0.5, B: 0.365, A: 0.135}, B: {EOS: 0.6, A: 0.4}, A: {A: 1.0}})
    results = []
    for every in (1, 8):
        monkeypatch.setattr("app.decode.search.done_check_interval", lambda device, every=every: every)
        results.append(beam_search(model, SRC, beam_size=2, alpha=1.0, n_best=2, max_len_ratio=0.5, max_len_extra=1))
    assert [tokens for tokens, _ in results[0].nbest[0]] == [[], [B]]
    assert results[1].nbest == results[0].nbest


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_greedy_attention_is_that_of_its_hypothesis_fed_back(family):
    """Greedy keeps each step's attention in segments, one per batch between two compactions, and puts each
    sentence's together at the end: it is the attention of the model fed that hypothesis (teacher forcing),
    from BOS to EOS, over the sentence's own source tokens."""
    from app.decode.search import GreedySearch

    model, src = real_model(family), sources()
    search = GreedySearch(model, src, need_attention=True)
    hyps = search.run()
    assert len(search.attention) > 1 and len({len(t) for t in hyps.tokens}) > 1  # sentences left in turns
    for i, tokens in enumerate(hyps.tokens):
        _, forced = model.decode(model.encode(src[i : i + 1]), torch.tensor([[BOS, *tokens]]), need_attention=True)
        length = int((src[i] != PAD).sum())
        assert hyps.attention[i].shape == forced[0, ..., :length].shape
        assert torch.allclose(hyps.attention[i], forced[0, ..., :length], atol=1e-5)
