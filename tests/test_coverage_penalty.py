"""decode.coverage_penalty: GNMT's coverage penalty (Wu et al. 2016, eq. 14) in beam search. Known answers of the
penalty and of a search on a model whose probabilities and attention are set by hand; on real models, each best
hypothesis scored log p / lp + cp of its own attention, and a corpus decoded in batches the same as each sentence
alone (CTranslate2: tests/test_export.py; a negative one: tests/test_bad_input.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import model_config
from test_beam_search import TINY, real_model

from app.config.commands import DecodeConfig
from app.data.tokenizer import BOS, EOS
from app.decode.passes import beam_search, decode_corpus, forced_pass
from app.decode.penalties import coverage_penalty, length_penalty
from app.decode.search import describe
from app.decode.trained import TrainedModel
from app.run.errors import UserError

A, B, C = 4, 5, 6
VOCAB = 8
CPU = torch.device("cpu")


def test_the_penalty_is_beta_times_the_log_of_each_source_pieces_capped_coverage():
    coverage = torch.tensor([[0.5, 1.5, 0.25], [1.0, 1.0, 0.0]])  # 0: a position never attended (padding)
    got = coverage_penalty(coverage, 0.2).tolist()
    assert got[0] == pytest.approx(0.2 * (math.log(0.5) + 0.0 + math.log(0.25)))
    assert got[1] == 0.0  # everything read once: no penalty


class AttendingMarkov(torch.nn.Module):
    """p(next token | last token) and the attention over 3 source positions of the step that follows it, both
    from a fixed table."""

    class State:
        def select(self, index):
            return self

    def __init__(self, table: dict[int, tuple[dict[int, float], list[float]]]):
        super().__init__()
        self.table = table

    def encode(self, src, src_mask=None):
        return None

    def start(self, memory, beam=1, steps=None, onednn=False):
        return self.State()

    def step(self, memory, prev_tokens, state, need_attention=False):
        rows, maps = [], []
        for token in prev_tokens.tolist():
            probs = torch.full((VOCAB,), TINY)
            after, attention = self.table.get(token, ({EOS: 1.0}, [1 / 3] * 3))
            for nxt, p in after.items():
                probs[nxt] = p
            rows.append(probs.log())
            maps.append(torch.tensor([attention]))
        return torch.stack(rows), torch.stack(maps) if need_attention else None, self.State()


# "A" reads the first source piece only; "B C" reads each piece once
READER = AttendingMarkov(
    {
        BOS: ({A: 0.6, B: 0.4}, [0.8, 0.1, 0.1]),
        A: ({EOS: 0.9, A: 0.1}, [0.8, 0.1, 0.1]),
        B: ({C: 0.9, EOS: 0.1}, [0.1, 0.8, 0.1]),
        C: ({EOS: 0.9, C: 0.1}, [0.1, 0.1, 0.8]),
    }
)
SRC = torch.tensor([[A, B, EOS]])


def test_the_penalty_prefers_the_hypothesis_that_reads_the_whole_source():
    assert beam_search(READER, SRC, beam_size=2, alpha=0.0).tokens == [[A]]  # log p: .6 · .9 against .4 · .9 · .9
    hyps = beam_search(READER, SRC, beam_size=2, alpha=0.0, n_best=2, coverage_penalty=0.2)
    assert [tokens for tokens, _ in hyps.nbest[0]] == [[B, C], [A]]
    (_, read_all), (_, read_one) = hyps.nbest[0]
    # "B C": coverage (1, 1, 1) with its EOS step, no penalty; "A": (1.6, 0.2, 0.2)
    assert read_all == pytest.approx(math.log(0.4 * 0.9 * 0.9), abs=1e-5)
    assert read_one == pytest.approx(math.log(0.6 * 0.9) + 0.2 * 2 * math.log(0.2), abs=1e-5)


@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_each_best_hypothesis_of_a_model_is_scored_with_its_own_coverage_however_it_is_batched(family):
    model = real_model(family)
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 12, (10,), generator=generator).tolist()
    src = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in lengths]
    decode = DecodeConfig(beam_size=4, length_penalty=0.6, coverage_penalty=2.0, n_best=2)
    hyps = decode_corpus(model, src, CPU, decode)
    assert hyps.tokens == [decode_corpus(model, [s], CPU, decode).tokens[0] for s in src]
    assert hyps.tokens != decode_corpus(model, src, CPU, DecodeConfig(beam_size=4, length_penalty=0.6)).tokens
    forced = {
        i: (logp, weights) for i, logp, weights in forced_pass(model, src, hyps.tokens, CPU, 10_000, None, True, True)
    }
    for i, tokens in enumerate(hyps.tokens):
        logp, weights = forced[i]
        view = weights if weights.dim() == 2 else weights[-1].mean(0)  # the last layer's mean of heads
        cut = len(tokens) == int((len(src[i]) + 1) * 1.5) + 10  # at the length limit: its EOS forced, log p 0
        log_p = logp[:-1].sum() if cut else logp.sum()
        expected = log_p / length_penalty(len(tokens) + 1, 0.6) + coverage_penalty(view.sum(0), 2.0)
        assert hyps.nbest[i][0][1] == pytest.approx(float(expected), abs=1e-4)


def test_a_model_without_attention_is_refused_in_one_line():
    plain = real_model("rnn_plain")
    decode = DecodeConfig(beam_size=2, coverage_penalty=0.2)
    with pytest.raises(UserError, match="^decode.coverage_penalty reads the attention: this model has none"):
        decode_corpus(plain, [[5, 6, 7]], CPU, decode)
    trained = TrainedModel(plain, None, SimpleNamespace(model=model_config(arch="rnn", attention="none")), CPU, None)
    with pytest.raises(UserError) as refused:
        trained.translate([[5, 6, 7]], decode)
    assert str(refused.value) == (
        "decode.coverage_penalty=0.2 reads the attention: this model (model.attention=none) has none; set it to 0"
    )
    trained.translate([[5, 6, 7]], DecodeConfig(beam_size=1, coverage_penalty=0.2))  # greedy: nothing to rank


def test_the_decoding_says_its_coverage_penalty():
    assert describe(DecodeConfig(coverage_penalty=0.2)) == "beam 5, length penalty 1.0, coverage penalty 0.2"
    assert describe(DecodeConfig(beam_size=1, coverage_penalty=0.2)) == "greedy"
