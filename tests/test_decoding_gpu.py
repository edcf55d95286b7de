"""Captured decoding steps on CUDA (decode.cuda_graphs): the models of tests/test_decoding_reference.py decoded
with every step replayed from a CUDA graph give the hypotheses of the same steps run eagerly, in float32 and
under bf16 autocast, and graphs are what ran. Skipped without CUDA (``pytest -m gpu`` on a GPU machine)."""

import pytest
import torch
from test_decoding_reference import TRANSFORMERS, reference, trained  # noqa: F401  (reference: a fixture)

from app.beam import BeamSearch
from app.config import DecodeConfig
from app.data.batching import Batcher
from app.decoding import decode_corpus
from app.search import GreedySearch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captured decoding steps are CUDA graphs"),
]
CUDA = torch.device("cuda")


def run(search_type, model, src, graphs: bool, **settings):
    search = search_type(model, src, graphs=graphs, **settings)
    hyps = search.run()
    return hyps, search


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TRANSFORMERS)
def test_captured_steps_decode_as_eager_ones(reference, name, amp):  # noqa: F811
    saved, _ = reference
    model = trained(saved, name).to(CUDA)
    src = Batcher(saved["src"])(list(range(len(saved["src"])))).src.to(CUDA)
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None), torch.no_grad():
        eager, _ = run(GreedySearch, model, src, False)
        captured, search = run(GreedySearch, model, src, True)
        assert search.static is not None and search.static.captured > 0
        assert captured.tokens == eager.tokens
        eager, _ = run(BeamSearch, model, src, False, beam_size=5, n_best=5)
        captured, search = run(BeamSearch, model, src, True, beam_size=5, n_best=5)
        assert search.static.captured > 0
        assert [[t for t, _ in n] for n in captured.nbest] == [[t for t, _ in n] for n in eager.nbest]
        for a, b in zip(captured.nbest, eager.nbest):
            assert [s for _, s in a] == pytest.approx([s for _, s in b], rel=1e-3 if amp else 1e-5, abs=1e-4)


def test_a_replayed_step_computes_what_an_eager_step_does(reference):  # noqa: F811
    """Step by step: the logits a graph's replay leaves equal those of the same fixed-shape step run eagerly
    on a copy of the state, across span buckets (16, 32, ...) and a reorder between steps."""
    saved, _ = reference
    model = trained(saved, "transformer_rope_gqa_rmsnorm_post").to(CUDA)
    src = Batcher(saved["src"][:8])(list(range(8))).src.to(CUDA)
    with torch.no_grad():
        captured = BeamSearch(model, src, beam_size=4, graphs=True)
        eager = BeamSearch(model, src, beam_size=4, graphs=True)
        eager.static.capture = False  # the same fixed-shape steps, not captured
        steps = min(40, captured.steps - 1)  # within the cache laid out for the batch
        for _ in range(steps):
            done = captured.step(check=False), eager.step(check=False)
            assert done == (False, False)
            assert torch.equal(captured.prev, eager.prev)
            assert torch.allclose(captured.scores, eager.scores, atol=1e-5)
        assert captured.static.captured == (1 if steps <= 16 else 2 if steps <= 32 else 3)  # spans 16, 32, 64


def test_decode_corpus_with_graphs_is_decode_corpus_without(reference):  # noqa: F811
    saved, _ = reference
    model = trained(saved, "transformer").to(CUDA)
    plain = decode_corpus(model, saved["src"], CUDA, DecodeConfig(beam_size=5, cuda_graphs=False))
    graphs = decode_corpus(model, saved["src"], CUDA, DecodeConfig(beam_size=5, cuda_graphs=True))
    assert graphs.tokens == plain.tokens
