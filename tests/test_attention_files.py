"""The attention files of an evaluation (alignments.npz beside the alignments.jsonl index): what they keep of
each sentence's attention, that numpy alone reads them, and that read_attention gives the maps back within
the quantization error."""

import json
import zipfile

import numpy as np
import pytest
import torch
from test_explorer import kept_views, peaked_attention

from app.config.commands import EvalConfig
from app.data.links import piece_links
from app.evaluation.views import attention_entropy, attention_views, store_attention
from app.report.attention_files import read_attention, write_attention_files
from app.run.errors import UserError


def sentences(n: int = 5, layers: int = 3, heads: int = 4, seed: int = 0) -> list[tuple[dict, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src, tgt = int(rng.integers(3, 12)), int(rng.integers(2, 14))
        entry = {
            "index": i,
            "id": f"Gen.1.{i + 1}",
            "src_tokens": [f"▁s{k}" for k in range(src - 1)] + ["</s>"],
            "hyp_tokens": [f"▁t{k}" for k in range(tgt - 1)] + ["</s>"],
        }
        out.append((entry, peaked_attention(rng, layers, heads, tgt, src)))
    return out


def test_the_default_keeps_one_layers_heads_and_every_layers_mean():
    attention = peaked_attention(np.random.default_rng(1), 3, 4, 5, 6)
    stored = store_attention(torch.from_numpy(attention), layer=-2)
    assert stored.names == [f"layer 1 head {h}" for h in range(4)] + [f"layer {n} mean" for n in range(3)]
    assert (stored.layers, stored.heads, stored.head_layers) == (3, 4, [1])
    assert stored.maps.dtype == np.uint8 and stored.maps.shape == (4 + 3, 5, 6)
    assert np.abs(stored.maps / 255 - kept_views(attention, -2)).max() <= 1 / 510 + 1e-6
    assert stored.entropy == pytest.approx(attention_entropy(attention), abs=1e-6)  # every head of every layer


def test_every_head_on_request_is_what_aer_reads():
    attention = torch.softmax(torch.randn(2, 3, 4, 5), -1)
    stored = store_attention(attention, keep="all")
    names, maps = attention_views(attention)  # the views the AER scores, named alike
    assert stored.names == names and stored.head_layers == [0, 1]
    assert np.abs(stored.maps / 255 - maps).max() <= 1 / 510 + 1e-6


def test_an_rnn_map_is_one_view():
    weights = torch.softmax(torch.randn(4, 3), -1)
    before = weights.clone()
    stored = store_attention(weights)
    assert stored.names == ["attention"] and stored.maps.shape == (1, 4, 3) and stored.layers == 0
    assert torch.equal(weights, before)  # the caller's tensor is left as it was


def test_bad_shapes_and_settings_are_refused():
    with pytest.raises(ValueError, match=r"expected \(tgt, src\)"):
        store_attention(np.ones((2, 3, 4)) / 4)
    with pytest.raises(UserError, match="eval.attention='heads' is not a choice: choose layer or all"):
        EvalConfig(attention="heads")  # the schema checks the choice where the setting is made


def test_files_round_trip_through_numpy_alone_and_read_attention(tmp_path):
    data = sentences()
    write_attention_files(str(tmp_path), ((entry, store_attention(a, -1)) for entry, a in data))
    lines = [json.loads(line) for line in (tmp_path / "alignments.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["id"] for line in lines] == [entry["id"] for entry, _ in data]
    with np.load(tmp_path / "alignments.npz") as archive:  # numpy alone: one uint8 array per sentence
        assert sorted(archive.files, key=int) == [line["array"] for line in lines]
        for line, (entry, attention) in zip(lines, data):
            maps = archive[line["array"]]
            assert maps.dtype == np.uint8 and list(maps.shape) == line["shape"]
            assert line["shape"][1:] == [len(entry["hyp_tokens"]), len(entry["src_tokens"])]
            assert line["views"][-1] == "layer 2 mean" and line["views"][0] == "layer 2 head 0"
            assert np.abs(maps / 255 - kept_views(attention)).max() <= 1 / 510 + 1e-6
    with zipfile.ZipFile(tmp_path / "alignments.npz") as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_DEFLATED}

    by_index, by_id = read_attention(str(tmp_path), 3), read_attention(str(tmp_path), "Gen.1.4")
    assert by_index["id"] == "Gen.1.4" and by_id["index"] == 3
    assert by_index["maps"].dtype == np.float32 and np.array_equal(by_index["maps"], by_id["maps"])
    head = by_index["views"].index("layer 2 head 1")
    assert np.abs(by_index["maps"][head] - data[3][1][2, 1]).max() <= 1 / 510 + 1e-6
    rows = by_index["maps"][by_index["views"].index("layer 0 mean")].sum(-1)
    assert np.abs(rows - 1).max() <= len(data[3][0]["src_tokens"]) / 510  # rows still sum to 1, to rounding


def test_reading_what_is_not_there_is_one_line(tmp_path):
    with pytest.raises(UserError, match="alignments.jsonl does not exist"):
        read_attention(str(tmp_path), 0)
    write_attention_files(str(tmp_path), [(sentences(1)[0][0], store_attention(sentences(1)[0][1]))])
    with pytest.raises(UserError, match="has no sentence with id 'Gen.9.9'"):
        read_attention(str(tmp_path), "Gen.9.9")
    with pytest.raises(UserError, match="has no sentence with index 5"):
        read_attention(str(tmp_path), 5)


def test_the_default_is_a_fraction_of_every_head(tmp_path):
    """What the default saves on 6 layers x 8 heads: 14 maps of 48, compressed alike."""
    data = sentences(40, layers=6, heads=8)
    sizes = {}
    for keep in ("layer", "all"):
        (tmp_path / keep).mkdir()
        write_attention_files(str(tmp_path / keep), ((entry, store_attention(a, keep=keep)) for entry, a in data))
        sizes[keep] = (tmp_path / keep / "alignments.npz").stat().st_size
        assert read_attention(str(tmp_path / keep), 0)["maps"].shape[0] == {"layer": 14, "all": 54}[keep]
    assert sizes["layer"] < 0.4 * sizes["all"]


def test_piece_links_are_the_cells_of_the_linked_words():
    """The vectorized piece_links against the rule written as a loop over every cell."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        # each piece's word: a word of one or more pieces, or none (-1: </s>, a space)
        sw = (np.cumsum(rng.random(int(rng.integers(1, 9))) < 0.6) - 1).tolist() + [-1]
        tw = (np.cumsum(rng.random(int(rng.integers(0, 9))) < 0.6) - 1).tolist() + [-1]
        links = {(int(rng.integers(0, 8)), int(rng.integers(0, 8))) for _ in range(int(rng.integers(0, 6)))}
        loop = [(t, s) for t in range(len(tw)) for s in range(len(sw)) if (sw[s], tw[t]) in links]
        assert piece_links(links, sw, tw) == loop
