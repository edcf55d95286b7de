"""The one plotting path for every attention type, and the alignment scores it logs."""

import io

import pytest
import torch
from PIL import Image

from app.alignment import attention_entropy, attention_shape, layer_views, monotonicity
from app.plots import READABLE_PT, TENSORBOARD_WIDTH, figures, png_bytes, tensorboard_tokens


@pytest.fixture(autouse=True)
def close_figures():
    """The figures a test only measures are not saved (which closes them): close them after it."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


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
    assert set(figs) == {"alignment", "layers", "heads_layer0"}
    assert len([ax for ax in figs["layers"].axes if ax.get_title()]) == 3  # one panel per layer (+ colour bars)
    every = figures(attention, list("abcdef"), list("vwxyz"), layer=0, every_layer=True)
    assert set(every) == {"alignment", "layers", "heads_layer0", "heads_layer1", "heads_layer2"}
    with pytest.raises(ValueError, match="expected"):
        layer_views(torch.rand(2, 3, 4))


def test_entropy_and_monotonicity_known_answers():
    one_hot = torch.eye(3)
    assert attention_entropy(one_hot) == pytest.approx(0.0, abs=1e-6)
    assert attention_entropy(torch.full((2, 4), 0.25)) == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert monotonicity(one_hot) == 1.0  # diagonal
    assert monotonicity(torch.eye(3).flip(0)) == 0.0  # anti-diagonal: always moving back
    assert monotonicity(torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]])) == 0.5


def test_attention_shape_averages_the_plotted_map_over_sentences():
    """Eval's metrics.json and the dev scalars: the mean over sentences of the map plots show."""
    diagonal, uniform = torch.eye(3), torch.full((2, 4), 0.25)
    rnn = attention_shape([diagonal, uniform])
    assert rnn["view"] == "attention"
    assert rnn["entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item() / 2, abs=1e-6)
    assert rnn["monotonicity"] == 1.0  # the uniform map's argmax never moves
    layers = torch.stack([torch.eye(3).flip(0).expand(2, 3, 3), torch.eye(3).expand(2, 3, 3)])  # (layers, heads, t, s)
    assert attention_shape([layers], layer=0) == {"view": "layer 0 mean", "entropy": 0.0, "monotonicity": 0.0}
    assert attention_shape([layers], layer=-1) == {"view": "layer 1 mean", "entropy": 0.0, "monotonicity": 1.0}


def panels(fig) -> list:
    """The heatmap axes of a figure (not its colour bars), with their size in pixels."""
    fig.canvas.draw()
    return [ax.get_window_extent() for ax in fig.axes if ax.get_title()]


@pytest.mark.parametrize("n_src", [5, 12, tensorboard_tokens()])
def test_tensorboard_figures_are_its_width_with_readable_labels_and_every_head_as_large_as_one_map(n_src):
    """TensorBoard's IMAGES tab shows every image 350 px wide: drawn that wide, it is shown pixel for
    pixel; stacked in one column, each head keeps the size of the single map."""
    src, tgt = [f"▁s{i}" for i in range(n_src - 1)] + ["</s>"], [f"▁t{i}" for i in range(9)] + ["</s>"]
    attention = torch.softmax(torch.randn(2, 4, len(tgt), len(src)), -1)
    figs = figures(attention, src, tgt, layer=-1, width_px=TENSORBOARD_WIDTH)
    for name, fig in figs.items():
        with Image.open(io.BytesIO(png_bytes(fig))) as image:
            assert image.size[0] == TENSORBOARD_WIDTH, name
    single = panels(figures(attention, src, tgt, width_px=TENSORBOARD_WIDTH)["alignment"])[0]
    heads = panels(figures(attention, src, tgt, width_px=TENSORBOARD_WIDTH)["heads_layer1"])
    assert len(heads) == 4
    for head in heads:
        assert head.width >= single.width - 1 and head.height >= single.height - 1
    labels = figures(attention, src, tgt, width_px=TENSORBOARD_WIDTH)["alignment"].axes[0].get_xticklabels()
    assert min(label.get_fontsize() for label in labels) >= READABLE_PT
    assert [label.get_text() for label in labels] == src


def test_a_file_is_drawn_at_a_fixed_size_per_token():
    short, long = (figures(torch.softmax(torch.randn(4, n), -1), list("a" * n), list("wxyz")) for n in (5, 40))
    width = lambda figs: Image.open(io.BytesIO(png_bytes(figs["alignment"]))).size[0]  # noqa: E731
    assert width(long) - width(short) == pytest.approx(35 * 22, abs=2)  # 0.22 in at 100 dpi per source token
