"""Decoding with a forced target prefix (decode_corpus's ``prefix``, make translate's ``translate.prefix``): on real
models of every family each hypothesis begins with its prefix, beam search scores the prefix's pieces at their log p,
sentences without one decode as before, and a prefix may run past the usual length limit (against CTranslate2's
target_prefix: tests/test_export.py; the command: tests/test_cli_end_to_end.py)."""

import pytest
import torch
from test_beam_search import FAMILIES, real_model

from app.config.commands import DecodeConfig
from app.decode.passes import decode_corpus, forced_pass
from app.decode.search import length_limits
from app.run.errors import UserError

CPU = torch.device("cpu")


def sources_and_prefixes(count: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(3)
    src = [torch.randint(4, 30, (n,), generator=generator).tolist() for n in torch.randint(1, 9, (count,)).tolist()]
    # every third sentence free; the others forced to begin with 1-5 pieces
    prefix = [
        [] if i % 3 == 0 else torch.randint(4, 30, (1 + i % 5,), generator=generator).tolist() for i in range(count)
    ]
    return src, prefix


@pytest.mark.parametrize("family", FAMILIES)
def test_every_hypothesis_begins_with_its_prefix_scored_at_its_log_p(family):
    """Beam 4, 3 best, α = 0: each begins with the prefix, and its score is the forced pass's log p of the whole
    hypothesis, the prefix's pieces included (to 1e-4); sentences without a prefix decode as without any."""
    model, (src, prefix) = real_model(family), sources_and_prefixes()
    decode = DecodeConfig(beam_size=4, n_best=3, length_penalty=0.0)
    hyps, free = decode_corpus(model, src, CPU, decode, prefix=prefix), decode_corpus(model, src, CPU, decode)
    lengths = torch.tensor([len(s) + 1 for s in src])
    limits = length_limits(
        lengths, decode.max_len_ratio, decode.max_len_extra, None, torch.tensor(list(map(len, prefix)))
    )
    flat = [(i, tokens, score) for i, nbest in enumerate(hyps.nbest) for tokens, score in nbest]
    assert all(tokens[: len(prefix[i])] == prefix[i] for i, tokens, _ in flat)
    pairs = [src[i] for i, _, _ in flat], [t for _, t, _ in flat]
    forced = {k: logp for k, logp, _ in forced_pass(model, *pairs, CPU, 100)}  # in length order: by index
    for k, (i, tokens, score) in enumerate(flat):
        logp = forced[k] if len(tokens) < limits[i] else forced[k][:-1]  # one cut at the limit has no EOS term
        assert logp.sum().item() == pytest.approx(score, abs=1e-4), (i, tokens)
    assert [hyps.nbest[i] for i in range(0, len(src), 3)] == [free.nbest[i] for i in range(0, len(src), 3)]
    assert sum(hyps.tokens[i] != free.tokens[i] for i in range(len(src)) if prefix[i]) >= 6


@pytest.mark.parametrize("family", FAMILIES)
def test_forcing_what_greedy_chose_changes_nothing(family):
    """Known answer: greedy search forced to begin with the first pieces of its own free hypotheses writes the same
    hypotheses, with the same attention."""
    model, (src, _) = real_model(family), sources_and_prefixes()
    free = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1), need_attention=True)
    prefix = [tokens[: i % 4] for i, tokens in enumerate(free.tokens)]
    forced = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1), need_attention=True, prefix=prefix)
    assert forced.tokens == free.tokens
    if free.attention is not None:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(forced.attention, free.attention))


def test_samples_and_banned_ngrams_keep_the_prefix():
    """A drawn hypothesis begins with its prefix; a prefix that repeats a 2-gram is forced all the same (the ban
    applies to what follows it)."""
    model, (src, _) = real_model("transformer"), sources_and_prefixes()
    prefix = [[7, 8, 7, 8, 9]] * len(src)
    for decode in (
        DecodeConfig(beam_size=1, sampling=True, sampling_topk=5, sampling_seed=3),
        DecodeConfig(beam_size=1, no_repeat_ngram_size=2),
        DecodeConfig(beam_size=3, no_repeat_ngram_size=2),
    ):
        hyps = decode_corpus(model, src, CPU, decode, prefix=prefix)
        assert all(tokens[:5] == prefix[0] for tokens in hyps.tokens), decode


def test_a_prefix_past_the_length_limit_leaves_room_after_it():
    """One source piece and its EOS allow 2 × 1.5 + 2 = 5 output pieces; a 7-piece prefix raises the limit to 7 + 2."""
    model, prefix = real_model("transformer"), [9, 10, 11, 12, 13, 14, 15]
    for decode in (DecodeConfig(beam_size=1, max_len_extra=2), DecodeConfig(beam_size=3, max_len_extra=2)):
        hyps = decode_corpus(model, [[5]], CPU, decode, prefix=[prefix])
        assert hyps.tokens[0][:7] == prefix and 7 <= len(hyps.tokens[0]) <= 9
        assert len(decode_corpus(model, [[5]], CPU, decode).tokens[0]) <= 5


def test_a_prefix_longer_than_the_model_takes_is_refused():
    model = real_model("transformer")
    model.max_positions = 8
    with pytest.raises(UserError, match="translation prefix 2 has 8 subword tokens; this model takes at most 7"):
        decode_corpus(model, [[5], [6]], CPU, DecodeConfig(beam_size=1), prefix=[[4], [9] * 8])
