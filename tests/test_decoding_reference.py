"""Decoding outputs against a record of the decoder as it was before the inference-engine rework (commit
6f6219a: a key/value cache extended by concatenation, reordered whole at every step, memory copied per
beam, no sentence leaving its batch). tests/data/make_decoding_reference.py trained the models on
Genesis 1-45 (Spanish -> English) and recorded what that decoder output for 120 held-out verses: greedy and
beam 5 hypotheses (the n-best lists with their scores), where their attention peaks, and beam 4 with
α = 0.6 through ``decode_corpus``'s batches. Every model family and the Transformer variants of
docs/transformer_variants.md (RoPE, ALiBi, GQA, MQA, window, RMSNorm, post-norm); the hypotheses must be
the same, token for token, through oneDNN's matrix multiplies and MKL's."""

import io
import json
import lzma
import os

import pytest
import torch
from conftest import Vocab, model_config

from app.config.commands import DecodeConfig
from app.data.batching import Batcher
from app.decode.passes import beam_search, decode_corpus, greedy_decode
from app.models import build_model

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


# as recorded (and a shared 2-core machine runs one thread's share faster than two's)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(DATA, "decoding_reference.pt.xz"), "rb") as f:
        saved = torch.load(io.BytesIO(lzma.decompress(f.read())))
    with open(os.path.join(DATA, "decoding_reference.json"), encoding="utf-8") as f:
        recorded = json.load(f)
    return saved, recorded


def trained(saved: dict, name: str) -> torch.nn.Module:
    model = build_model(model_config(**saved["settings"][name]), Vocab(saved["vocab"], saved["vocab"]))
    model.load_state_dict({k: v.float() for k, v in saved["weights"][name].items()})
    return model.eval()


def attention_peaks(hyps, sentences: int) -> list:
    """Per target row of each sentence's attention (averaged over layers and heads), the source position it peaks at."""
    if hyps.attention is None:
        return [None] * sentences
    return [a.reshape(-1, *a.shape[-2:]).mean(0).argmax(-1).tolist() for a in hyps.attention[:sentences]]


TRANSFORMERS = ["transformer", "transformer_rope_gqa_rmsnorm_post", "transformer_alibi_mqa_window"]
RNNS = ["rnn_bahdanau", "rnn_luong_lstm"]  # their steps take no oneDNN path
CASES = [(name, True) for name in TRANSFORMERS + RNNS] + [
    pytest.param(name, False, marks=pytest.mark.slow)
    for name in TRANSFORMERS  # MKL, as training multiplies
]


@pytest.mark.parametrize("name, onednn", CASES)
def test_hypotheses_are_those_recorded(reference, name, onednn):
    saved, recorded = reference
    expected, sentences = recorded["outputs"][name], recorded["attention_sentences"]
    model = trained(saved, name)
    src = Batcher(saved["src"])(list(range(len(saved["src"])))).src

    greedy = greedy_decode(model, src, need_attention=True, onednn=onednn)
    assert greedy.tokens == expected["greedy"]
    assert attention_peaks(greedy, sentences) == expected["greedy_attention_argmax"]

    beam = beam_search(model, src, beam_size=5, alpha=1.0, n_best=5, need_attention=True, onednn=onednn)
    assert [[tokens for tokens, _ in nbest] for nbest in beam.nbest] == expected["beam5_nbest"]
    for nbest, scores in zip(beam.nbest, expected["beam5_scores"]):
        assert [score for _, score in nbest] == pytest.approx(scores, rel=1e-5, abs=1e-6)
    assert attention_peaks(beam, sentences) == expected["beam5_attention_argmax"]

    decode = DecodeConfig(beam_size=4, length_penalty=0.6, batch_tokens=1200, cpu_onednn=onednn)
    assert decode_corpus(model, saved["src"], torch.device("cpu"), decode).tokens == expected["corpus_beam4_alpha0.6"]
