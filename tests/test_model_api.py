"""The model API written once as a Protocol (app/models/api.py): every family and the ensemble satisfy it. mypy checks
the signatures in ``make lint`` (each family's module assigns its class to ``type[Seq2Seq[Memory, State]]``); here, at
run time, that each has the API's members, that its state reorders with ``select``, and that the optional members
(self-attention, a key/value cache) are where they belong."""

import pytest
import torch
from test_beam_search import FAMILIES, real_model, sources

from app.data.tokenizer import BOS
from app.decode.ensemble import Ensemble
from app.models.api import DecodingState, KVCached, SelfAttending, Seq2Seq


def model_of(family: str) -> torch.nn.Module:
    if family == "ensemble":  # of two families: its state holds a cache and an RNN's hidden state
        return Ensemble([real_model("transformer"), real_model("rnn_bahdanau")])
    return real_model(family)


@pytest.mark.parametrize("family", [*FAMILIES, "ensemble"])
def test_every_family_and_the_ensemble_decode_through_the_api(family):
    model, src, beam = model_of(family), sources(), 2
    assert isinstance(model, Seq2Seq)
    memory = model.encode(src)
    state = model.start(memory, beam, steps=4)
    rows = src.size(0) * beam
    logits, _, state = model.step(memory, torch.full((rows,), BOS), state)
    assert logits.shape == (rows, 30)
    assert isinstance(state, DecodingState)
    state = state.select(torch.arange(rows).flip(0))
    assert isinstance(state, DecodingState)
    assert model.step(memory, logits.argmax(-1).flip(0), state)[0].shape == (rows, 30)
    assert isinstance(model, SelfAttending) == family.startswith("transformer")
    assert isinstance(state, KVCached) == (family.startswith("transformer") or family == "ensemble")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.startswith("transformer")])
def test_a_beam_reordered_after_the_steps_it_was_started_for_keeps_its_cache(family):
    """Beam search reorders after every step, its last one included: on a GPU, which looks for finished sentences
    every 8 steps, a sentence that runs to its length limit reaches a reorder after the steps ``start`` was given.
    The cache's exact layout asked for one position more than its storage held: a RuntimeError (setStorage out of
    bounds). The state after it decodes on as one started for more steps."""
    model, src, beam = real_model(family), sources(), 2
    memory, rows = model.encode(src), src.size(0) * beam
    order = torch.arange(rows).flip(0)
    logits = {}
    for steps in (2, 4):
        state, prev = model.start(memory, beam, steps=steps), torch.full((rows,), BOS)
        for _ in range(3):
            out, _, state = model.step(memory, prev, state)
            state, prev = state.select(order), out.argmax(-1)[order]
        logits[steps] = out
    assert torch.allclose(logits[2], logits[4], atol=1e-5)


def test_a_model_missing_a_member_of_the_api_is_not_one():
    class NoStep(torch.nn.Module):
        def encode(self, src, src_mask=None):
            return src

        def decode(self, memory, tgt_in, *, need_attention=False, need_logits=True):
            return None, None

        def start(self, memory, beam=1, steps=None, onednn=False):
            return None

    assert not isinstance(NoStep(), Seq2Seq)
