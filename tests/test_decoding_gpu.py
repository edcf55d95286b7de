"""Decoding on CUDA: the models of tests/test_decoding_reference.py, trained and recorded on the CPU, decode on
the GPU in float32 to the same hypotheses, greedy with attention kept (as ``make eval`` keeps it) and beam 5
with its n-best lists, one batch at a time and through ``decode_corpus`` with CUDA's batch budget (the whole
set in one batch, done sentences checked every 8 steps). Skipped without CUDA (``pytest -m gpu`` on a GPU
machine)."""

import pytest
import torch
from test_decoding_reference import RNNS, TRANSFORMERS, attention_peaks, reference, trained  # noqa: F401  (a fixture)

from app.config.commands import DecodeConfig
from app.data.batching import Batcher
from app.decode.passes import beam_search, decode_corpus, greedy_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: decoding on the GPU"),
]
CUDA = torch.device("cuda")


@pytest.fixture
def float32_matmuls():
    """Float32 as the CPU computes it: no TF32 in matrix multiplies or cuDNN's recurrent cells."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("name", TRANSFORMERS + RNNS)
def test_cuda_decodes_the_recorded_hypotheses(reference, name, float32_matmuls):  # noqa: F811
    saved, recorded = reference
    expected, sentences = recorded["outputs"][name], recorded["attention_sentences"]
    model = trained(saved, name).to(CUDA)
    src = Batcher(saved["src"])(list(range(len(saved["src"])))).src.to(CUDA)

    greedy = greedy_decode(model, src, need_attention=True)
    assert greedy.tokens == expected["greedy"]
    assert attention_peaks(greedy, sentences) == expected["greedy_attention_argmax"]

    beam = beam_search(model, src, beam_size=5, alpha=1.0, n_best=5)
    assert [[tokens for tokens, _ in nbest] for nbest in beam.nbest] == expected["beam5_nbest"]
    for nbest, scores in zip(beam.nbest, expected["beam5_scores"]):
        assert [score for _, score in nbest] == pytest.approx(scores, rel=1e-4, abs=1e-5)

    whole = decode_corpus(model, saved["src"], CUDA, DecodeConfig(beam_size=1), need_attention=True)
    assert whole.tokens == expected["greedy"]
    assert (
        decode_corpus(model, saved["src"], CUDA, DecodeConfig(beam_size=4, length_penalty=0.6)).tokens
        == (expected["corpus_beam4_alpha0.6"])
    )
