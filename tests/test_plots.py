"""The one plotting path for every attention type, and the alignment scores it logs."""

import io

import pytest
import torch
from PIL import Image

from app.alignment import attention_entropy, layer_views, monotonicity
from app.plots import figures, png_bytes


def test_rnn_attention_gives_one_labelled_map():
    weights = torch.softmax(torch.randn(3, 4), -1)
    figs = figures(weights, ["a", "b", "c", "</s>"], ["x", "y", "</s>"])
    assert list(figs) == ["alignment"]
    ax = figs["alignment"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "</s>"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y", "</s>"]
    with Image.open(io.BytesIO(png_bytes(figs["alignment"]))) as image:
        assert image.format == "PNG" and image.size[0] > 200


def test_transformer_attention_gives_layer_and_head_views():
    attention = torch.softmax(torch.randn(3, 2, 5, 6), -1)  # layers, heads, tgt, src
    views = layer_views(attention, layer=-1)
    assert views["layer"] == 2
    assert torch.allclose(views["weights"], attention[2].mean(0))
    assert views["head_weights"].shape == (2, 5, 6) and views["layer_means"].shape == (3, 5, 6)
    figs = figures(attention, list("abcdef"), list("vwxyz"), layer=0)
    assert set(figs) == {"alignment", "layers", "heads"}
    assert len([ax for ax in figs["layers"].axes if ax.get_title()]) == 3  # one panel per layer (+ colour bar)
    with pytest.raises(ValueError, match="expected"):
        layer_views(torch.rand(2, 3, 4))


def test_entropy_and_monotonicity_known_answers():
    one_hot = torch.eye(3)
    assert attention_entropy(one_hot) == pytest.approx(0.0, abs=1e-6)
    assert attention_entropy(torch.full((2, 4), 0.25)) == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert monotonicity(one_hot) == 1.0  # diagonal
    assert monotonicity(torch.eye(3).flip(0)) == 0.0  # anti-diagonal: always moving back
    assert monotonicity(torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]])) == 0.5
