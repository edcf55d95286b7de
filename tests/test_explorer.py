"""The HTML attention explorer: what the file holds (Python) and what a real browser shows (Chromium)."""

import io
import json
import math
import os
import re
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib import colormaps

from app.data.links import piece_links
from app.evaluation.views import attention_entropy, plotted_view, reattention
from app.report.explorer import ExplorerRecord, link_cells, text7, write_explorer

VIRIDIS = (colormaps["viridis"](np.arange(256))[:, :3] * 255).round().astype(int)


def softmax_rows(rng, *shape):
    x = np.exp(rng.normal(0, 1.5, shape))
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def peaked_attention(rng, layers: int, heads: int, tgt: int, src: int) -> np.ndarray:
    """Synthetic cross-attention shaped like a trained Transformer's: every head follows a roughly
    monotone alignment path with jitter (offset by up to one token), lower layers diffuse, upper layers
    peaked, a fifth of the heads sinking on the last source token (EOS), log-space noise on every cell."""
    path = np.clip(np.arange(tgt) * src / tgt + np.cumsum(rng.normal(0, 0.6, tgt)), 0, src - 1)
    shape = (layers, heads, 1, 1)
    lower = np.arange(layers)[:, None, None, None] < layers // 3
    sharpness = np.where(lower, rng.uniform(0.3, 1.0, shape), rng.uniform(1.5, 5.0, shape))
    offset = rng.integers(-1, 2, shape)
    distance = np.abs(np.arange(src) - path[:, None] - offset)  # (layers, heads, tgt, src)
    logits = -sharpness * distance + rng.normal(0, 0.5, distance.shape)
    logits[..., -1] += 4 * (rng.random((layers, heads, 1)) < 0.2)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)).astype(np.float32)


def marked_words(tokens: list[str]) -> list[int]:
    """The word of each synthetic piece in the text these tests make of them: one starts at each ▁; </s> none."""
    marks = np.cumsum([token.startswith("▁") for token in tokens]) - 1
    return [-1 if token == "</s>" else int(w) for token, w in zip(tokens, marks)]


def synthetic_records(
    n: int, layers: int = 6, heads: int = 8, lengths=(25, 55), seed: int = 0, forced: bool = False, own: bool = False
) -> list[ExplorerRecord]:
    """n sentences of pseudo-word pieces with peaked_attention maps (synthetic, not a model's); with
    ``forced`` also a reference of its own length, its forced attention and diagonal word links; with ``own``
    self-attention maps of the same kind (the decoder's cut to its causal part)."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"▁w{i}" for i in range(4000)] + ["s", "ed", "ing", "ly", "▁,", "▁."])
    records = []

    def text(pieces):
        return "".join(pieces[:-1]).replace("▁", " ").strip()

    for i in range(n):
        src_len = int(rng.integers(lengths[0], lengths[1] + 1))
        tgt_len = max(2, round(src_len * rng.uniform(0.85, 1.15)))
        src = list(vocab[rng.integers(len(vocab), size=src_len - 1)]) + ["</s>"]
        tgt = list(vocab[rng.integers(len(vocab), size=tgt_len - 1)]) + ["</s>"]
        record = ExplorerRecord(
            id=f"test.{i}",
            src_tokens=src,
            tgt_tokens=tgt,
            attention=peaked_attention(rng, layers, heads, tgt_len, src_len),
            source=text(src),
            hypothesis=text(tgt),
            reference=text(tgt[::-1]),
            bleu=round(float(rng.uniform(0, 60)), 2),
        )
        if forced:
            ref_len = max(2, round(src_len * rng.uniform(0.85, 1.15)))
            record.ref_tokens = list(vocab[rng.integers(len(vocab), size=ref_len - 1)]) + ["</s>"]
            record.reference = text(record.ref_tokens)
            record.ref_attention = peaked_attention(rng, layers, heads, ref_len, src_len)
            record.src_words, record.ref_words = marked_words(src), marked_words(record.ref_tokens)
            src_words, ref_words = max(record.src_words) + 1, max(record.ref_words) + 1
            sure = {(w, w) for w in range(min(src_words, ref_words)) if rng.random() < 0.7}
            maybe = {(w, w + 1) for w in range(min(src_words, ref_words - 1)) if rng.random() < 0.2}
            record.links = (sure, sure | maybe)
        if own:
            record.encoder_attention = peaked_attention(rng, layers, heads, src_len, src_len)
            causal = peaked_attention(rng, layers, heads, tgt_len, tgt_len) * np.tril(np.ones((tgt_len, tgt_len)))
            record.decoder_attention = (causal / causal.sum(-1, keepdims=True)).astype(np.float32)
        records.append(record)
    return records


def untext7(text: str) -> bytes:
    """The inverse of app.report.explorer.text7, written independently: 7 bits from each character's low bits."""
    codes = np.frombuffer(text.encode("utf-16-le"), "<u2") & 0x7F
    bits = ((codes[:, None] >> np.arange(6, -1, -1)) & 1).astype(np.uint8).ravel()
    return np.packbits(bits[: len(bits) // 8 * 8]).tobytes()


def kept_views(attention, layer: int = -1, keep: str = "layer") -> np.ndarray:
    """The views an explorer keeps of a sentence's attention, computed here with numpy alone: an RNN's one
    map; a Transformer's heads of ``layer`` (``keep="layer"``) or of every layer, then each layer's mean."""
    a = np.asarray(attention, dtype=np.float32)
    if a.ndim == 2:
        return a[None]
    kept = list(range(len(a))) if keep == "all" else [layer % len(a)]
    return np.concatenate([a[kept].reshape(-1, *a.shape[2:]), a.mean(1)])


def read_explorer(path) -> tuple[str, dict, list[dict]]:
    """(page, meta, sentences) of an explorer file, each sentence with its uint8 "maps" (views, tgt, src):
    the heads of its headLayers, then each layer's mean (an RNN: one map); and its "ref" (when it has
    forced attention) with the reference rows' "maps"; and its "own" (self-attention, when kept): the "encoder" and
    "decoder" maps (views, src, src) and (views, tgt, tgt)."""
    page = Path(path).read_text(encoding="utf-8")

    def script(name):
        return re.search(rf'<script id="{name}" type="[^"]+">(.*?)</script>', page, re.DOTALL).group(1)

    sentences, maps = json.loads(script("sentences")), script("maps")

    def decoded(at) -> np.ndarray:
        start, length = at
        return np.frombuffer(zlib.decompress(untext7(maps[start : start + length])), np.uint8)

    for sent in sentences:
        for rows in filter(None, (sent, sent["ref"])):
            views = 1 if sent["rnn"] else len(sent["headLayers"]) * sent["heads"] + sent["layers"]
            rows["maps"] = decoded(rows["at"]).reshape(views, len(rows["tgt"]), len(sent["src"]))
        for kind, side in (("encoder", len(sent["src"])), ("decoder", len(sent["tgt"]))):
            if own := (sent["own"] or {}).get(kind):
                views = len(own["headLayers"]) * sent["heads"] + own["layers"]
                own["maps"] = decoded(own["at"]).reshape(views, side, side)
    return page, json.loads(script("meta-data")), sentences


# ---- the browser test's data: maps with known answers ----
PERM = [1, 0, 3, 4]  # sentence 0, layer 1, head 2: target token t attends only to source token PERM[t]
REF_PERM = [0, 1, 1, 2]  # sentence 1's forced reference, layer 1, head 2: reference piece t -> source PERM[t]
# sentence 1's reference links over words (source "Y dijo", reference "And said" in pieces ▁And ▁sa id):
# sure Y-And, dijo-said; possible (only) dijo-And. As read_pharaoh reads them: possible includes sure.
LINKS = ({(0, 0), (1, 1)}, {(0, 0), (1, 1), (1, 0)})
SURE_CELLS, POSSIBLE_CELLS = [[0, 0], [1, 1], [2, 1]], [[0, 1]]  # (reference piece, source piece)
# sentence 2's self-attention (24 source, 22 hypothesis pieces), 3 encoder layers: encoder layer 2 head 1, each
# source piece attends to the next (the last to itself); decoder layer 1 head 0, each position to the input it reads
# last (its own column t: <s> for the first, then the piece before the one it writes)
ENC_NEXT = [min(s + 1, 23) for s in range(24)]


def causal_rows(rng, *shape) -> np.ndarray:
    """Random (..., T, T) rows over the keys 0..t only."""
    w = np.exp(rng.normal(0, 1.5, shape)) * np.tril(np.ones(shape[-2:]))
    return (w / w.sum(-1, keepdims=True)).astype(np.float32)


def known_records() -> list[ExplorerRecord]:
    rng = np.random.default_rng(7)
    first = softmax_rows(rng, 2, 3, 4, 5)
    first[1, 2] = np.eye(5)[PERM]
    second = softmax_rows(rng, 2, 3, 3, 3)
    forced = softmax_rows(rng, 2, 3, 4, 3)
    forced[1, 2] = np.eye(3)[REF_PERM]
    encoder, decoder = softmax_rows(rng, 3, 3, 24, 24), causal_rows(rng, 2, 3, 22, 22)
    encoder[2, 1], decoder[1, 0] = np.eye(24)[ENC_NEXT], np.eye(22)
    return [
        ExplorerRecord(
            "Gen.1.1",
            ["▁En", "▁el", "▁principio", "▁creó", "</s>"],
            ["▁In", "▁the", "▁beginning", "</s>"],
            first,
            "En el principio creó",
            "In the beginning",
            "In the beginning God created",
            30.0,
        ),
        ExplorerRecord(
            "Gen.1.2",
            ["▁Y", "▁dijo", "</s>"],
            ["▁And", "▁spoke", "</s>"],
            second,
            "Y dijo",
            "And spoke",
            "And said",
            10.0,
            ref_tokens=["▁And", "▁sa", "id", "</s>"],
            ref_attention=forced,
            links=LINKS,
            src_words=[0, 1, -1],
            ref_words=[0, 1, 1, -1],
        ),
        # a larger map: its text uses (nearly) every 7-bit value, the escaped three included; with self-attention
        ExplorerRecord(
            "Gen.1.10",
            [f"▁s{i}" for i in range(23)] + ["</s>"],
            [f"▁t{i}" for i in range(21)] + ["</s>"],
            softmax_rows(rng, 2, 3, 22, 24),
            "y el firmamento",
            "and the sky",
            "and the firmament",
            50.0,
            encoder_attention=encoder,
            decoder_attention=decoder,
        ),
        ExplorerRecord("Gen.1.9", ["▁a", "</s>"], ["▁b", "</s>"], softmax_rows(rng, 2, 3, 2, 2), "a", "b", "b", None),
    ]


# ---- Python level ----
def test_the_file_is_self_contained(tmp_path):
    path = tmp_path / "explorer.html"
    write_explorer(str(path), known_records(), "test", {"model": "transformer"})
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and '<meta charset="utf-8">' in page[:1024]
    for network in ("http://", "https://", "src=", "href=", "<link", "@import", "url(", "fetch(", "XMLHttpRequest"):
        assert network not in page, network
    assert len(re.findall(r"<script\b", page)) == 4  # meta, sentences, maps (data) and the one inline program
    assert not re.search(r"__[A-Z]+__", page)  # every placeholder filled


def test_maps_decode_back_within_quantization_error(tmp_path):
    records = known_records()
    rnn = ExplorerRecord(
        "rnn",
        ["▁a", "▁b", "</s>"],
        ["▁x", "</s>"],
        torch.softmax(torch.randn(2, 3), -1),
        ref_tokens=["▁y", "▁z", "</s>"],
        ref_attention=torch.softmax(torch.randn(3, 3), -1),
    )
    path = tmp_path / "explorer.html"
    write_explorer(str(path), [*records, rnn], "test", {"model": "transformer", "BLEU": 12.5})
    _, meta, sentences = read_explorer(path)
    assert meta == {"model": "transformer", "BLEU": 12.5}
    assert [s["id"] for s in sentences] == ["Gen.1.1", "Gen.1.2", "Gen.1.10", "Gen.1.9", "rnn"]
    for record, sent in zip(records, sentences):
        # layer 1's 3 heads (viz.layer -1, the default), then the 2 layers' means
        assert (sent["layers"], sent["heads"], sent["headLayers"]) == (2, 3, [1])
        assert sent["maps"].shape == (3 + 2, *record.attention.shape[2:])
        assert np.abs(sent["maps"] / 255 - kept_views(record.attention)).max() <= 1 / 510 + 1e-6
        assert (sent["src"], sent["tgt"]) == (record.src_tokens, record.tgt_tokens)
        assert (sent["source"], sent["hypothesis"], sent["reference"], sent["bleu"]) == (
            record.source,
            record.hypothesis,
            record.reference,
            record.bleu,
        )
    # the forced reference: a second blob of its own rows, decoded alike
    ref, forced = sentences[1]["ref"], records[1].ref_attention
    assert ref["tgt"] == records[1].ref_tokens and ref["maps"].shape == (5, 4, 3)
    assert np.abs(ref["maps"] / 255 - kept_views(forced)).max() <= 1 / 510 + 1e-6
    assert ref["at"][0] == sum(sentences[1]["at"])  # right after the sentence's hypothesis maps
    assert sentences[-1]["rnn"] and sentences[-1]["maps"].shape == (1, 2, 3)
    assert np.abs(sentences[-1]["maps"][0] / 255 - rnn.attention.numpy()).max() <= 1 / 510 + 1e-6
    assert sentences[-1]["ref"]["maps"].shape == (1, 3, 3) and sentences[-1]["ref"]["links"] is None
    assert np.abs(sentences[-1]["ref"]["maps"][0] / 255 - rnn.ref_attention.numpy()).max() <= 1 / 510 + 1e-6


def test_every_head_of_every_layer_on_request_and_another_layers_heads(tmp_path):
    """keep="all" (make eval's eval.attention=all) embeds every head of every layer; layer= picks the layer
    whose heads the default keeps. Fewer maps make a smaller file."""
    records = known_records()
    sizes = {}
    for keep, layer, head_layers in (("layer", -1, [1]), ("layer", 0, [0]), ("all", -1, [0, 1])):
        path = tmp_path / f"{keep}{layer}.html"
        write_explorer(str(path), records, "test", {}, layer=layer, keep=keep)
        sizes[keep, layer] = path.stat().st_size
        for record, sent in zip(records, read_explorer(path)[2]):
            assert sent["headLayers"] == head_layers
            expected = kept_views(record.attention, layer, keep)
            assert np.abs(sent["maps"] / 255 - expected).max() <= 1 / 510 + 1e-6
    assert sizes["all", -1] > sizes["layer", -1]


def test_a_sentence_without_forced_attention_has_no_reference_rows(tmp_path):
    """Its "ref" is null: the page hides the rows toggle (checked in Chromium below) and has no second blob."""
    records = known_records()
    path = tmp_path / "explorer.html"
    write_explorer(str(path), records, "test", {})
    _, _, sentences = read_explorer(path)
    assert [s["ref"] is None for s in sentences] == [True, False, True, True]
    own = [sentences[2]["own"][kind]["at"] for kind in ("encoder", "decoder")]
    blobs = [s["at"] for s in sentences] + [sentences[1]["ref"]["at"]] + own
    assert sum(length for _, length in blobs) == len(
        re.search(
            r'<script id="maps" type="text/plain">(.*?)</script>', path.read_text(encoding="utf-8"), re.DOTALL
        ).group(1)
    )


def test_self_attention_maps_follow_the_sentences_own_in_its_layers(tmp_path):
    """The encoder's (source x source, its own 3 layers) and the decoder's (hypothesis x hypothesis) self-attention:
    a blob each after the sentence's cross-attention, the views kept as of the cross-attention (viz.layer's heads of
    each stack, then every layer's mean; every head of every layer with keep="all")."""
    records = known_records()
    for keep, encoder_heads, decoder_heads in (("layer", [2], [1]), ("all", [0, 1, 2], [0, 1])):
        path = tmp_path / f"{keep}.html"
        write_explorer(str(path), records, "test", {}, keep=keep)
        sentences = read_explorer(path)[2]
        assert [s["own"] is None for s in sentences] == [True, True, False, True]
        own, record = sentences[2]["own"], records[2]
        assert (own["encoder"]["layers"], own["encoder"]["headLayers"]) == (3, encoder_heads)
        assert (own["decoder"]["layers"], own["decoder"]["headLayers"]) == (2, decoder_heads)
        for kind, weights in (("encoder", record.encoder_attention), ("decoder", record.decoder_attention)):
            assert np.abs(own[kind]["maps"] / 255 - kept_views(weights, -1, keep)).max() <= 1 / 510 + 1e-6
        assert own["encoder"]["at"][0] == sum(sentences[2]["at"]) and own["decoder"]["at"][0] == sum(
            own["encoder"]["at"]
        )


def test_reference_word_links_become_the_cells_of_their_pieces(tmp_path):
    """Word links -> (reference piece, source piece) cells through app.data.links.piece_links: every piece
    of a linked word; sure cells, and the possible-only ones apart. Either form of links gives the same."""
    records = known_records()
    path = tmp_path / "explorer.html"
    write_explorer(str(path), records, "test", {})
    links = read_explorer(path)[2][1]["ref"]["links"]
    assert links == {"sure": SURE_CELLS, "possible": POSSIBLE_CELLS}
    src, ref = records[1].src_tokens, records[1].ref_tokens
    assert [tuple(c) for c in links["sure"]] == piece_links(LINKS[0], marked_words(src), marked_words(ref))
    as_dict = ExplorerRecord(**{**vars(records[1]), "links": {"sure": [[0, 0], [1, 1]], "possible": [[1, 0]]}})
    assert link_cells(as_dict) == links  # possible given without the sure links: the same cells
    casas = ExplorerRecord(
        "x",
        ["▁casa", "s", "▁blanca", "</s>"],
        ["▁houses", "</s>"],
        np.ones((2, 4)) / 4,
        ref_tokens=["▁white", "▁house", "s", "</s>"],
        ref_attention=np.ones((4, 4)) / 4,
        links=({(0, 1), (1, 0)}, {(0, 1), (1, 0)}),
        src_words=[0, 0, 1, -1],
        ref_words=[0, 1, 1, -1],
    )
    assert link_cells(casas) == {"sure": [[0, 2], [1, 0], [1, 1], [2, 0], [2, 1]], "possible": []}


def test_entropy_is_the_hypothesis_attentions_mean_row_entropy_over_every_head(tmp_path):
    """The list's entropy (a sort key): app.evaluation.views.attention_entropy of the hypothesis attention, the
    mean over every row of every layer and head; the forced attention does not change it."""
    one_hot = np.eye(4, dtype=np.float32)[[0, 2, 1]]
    uniform = np.full((3, 4), 0.25, dtype=np.float32)
    tokens = ["▁a", "▁b", "▁c", "</s>"]
    both = ExplorerRecord(
        "both",
        tokens,
        tokens[1:],
        np.stack([one_hot, uniform])[None],
        ref_tokens=tokens[:3],
        ref_attention=np.stack([uniform, uniform])[None],
    )
    records = [*known_records(), both]
    path = tmp_path / "explorer.html"
    write_explorer(str(path), records, "test", {})
    sentences = read_explorer(path)[2]
    assert sentences[-1]["entropy"] == pytest.approx(math.log(4) / 2, abs=1e-4)  # heads: 0 and log 4
    for record, sent in zip(records, sentences):
        assert sent["entropy"] == pytest.approx(attention_entropy(torch.as_tensor(record.attention)), abs=1e-4)
        plotted = plotted_view(torch.as_tensor(record.attention))[1]
        assert sent["again"] == pytest.approx(reattention(plotted), abs=1e-3)
    # the mean of the heads (one-hot on pieces 0, 2, 1; uniform) has rows of 0.625 at 0, 2, 1 and 0.125 elsewhere:
    # the second pays 4 × 0.125 again, the third 0.125 + 0.25 + 0.125 + 0.125: (0.5 + 0.625) / 3 rows
    assert sentences[-1]["again"] == pytest.approx(0.375, abs=1e-3)
    assert sentences[0]["entropy"] > 0  # a one-hot head among softmax heads: not 0


def test_monotonicity_is_that_of_the_plotted_layers_mean_of_heads(tmp_path):
    """The list's M (a sort key): app.evaluation.views.monotonicity of the map the heatmaps show, layer
    viz.layer's mean of heads, or an RNN's one map: 1 for a diagonal, -1 for an anti-diagonal."""
    tokens = ["▁a", "▁b", "▁c", "</s>"]
    diagonal, anti = np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32)[::-1].copy()
    # layer 0 anti-diagonal, layer 1 (the plotted one) diagonal in both heads
    layered = np.stack([np.stack([anti, anti]), np.stack([diagonal, diagonal])])
    records = [
        ExplorerRecord("layered", tokens, tokens, layered),
        ExplorerRecord("rnn", tokens, tokens, anti),
    ]
    path = tmp_path / "explorer.html"
    write_explorer(str(path), records, "test", {}, layer=-1)
    assert [sent["mono"] for sent in read_explorer(path)[2]] == [1.0, -1.0]
    write_explorer(str(path), records, "test", {}, layer=0)
    assert read_explorer(path)[2][0]["mono"] == -1.0


def test_text7_round_trips_every_byte_and_avoids_what_html_changes():
    data = bytes(range(256)) + np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    text = text7(data)
    assert untext7(text) == data
    assert len(text) == math.ceil(len(data) * 8 / 7)
    assert not {"\0", "\r", "<"} & set(text)
    assert {"\u0100", "\u010d", "\u013c"} <= set(text)  # NUL, CR and '<' written escaped


def test_data_that_looks_like_markup_or_placeholders_stays_data(tmp_path):
    record = known_records()[3]
    record.hypothesis, record.reference, record.id = "</script><script>alert(1)</script>", "__MAPS__ & __TITLE__", "<b>"
    path = tmp_path / "explorer.html"
    write_explorer(str(path), [record], "A <title> & more", {"note": "</script>"})
    page, meta, (sent,) = read_explorer(path)
    assert (sent["hypothesis"], sent["reference"], sent["id"]) == (record.hypothesis, record.reference, "<b>")
    assert meta == {"note": "</script>"}
    assert "<title>A &lt;title&gt; &amp; more</title>" in page
    assert page.count("</script>") == 4


def test_bad_records_are_refused(tmp_path):
    path = str(tmp_path / "explorer.html")
    good, linked, own = vars(known_records()[0]), vars(known_records()[1]), vars(known_records()[2])
    refused = {
        "expected": [
            {**good, "attention": good["attention"][..., :3]},
            {**good, "attention": good["attention"][0]},  # (heads, tgt, src)
            {**linked, "ref_attention": linked["ref_attention"][..., :3, :]},
        ],  # rows != ref_tokens
        "need ref_attention": [{**linked, "ref_attention": None}, {**good, "ref_tokens": ["▁x", "</s>"]}],
        "needs ref_tokens": [{**linked, "ref_tokens": None, "links": None}],
        "same model": [
            {**linked, "ref_attention": linked["ref_attention"][:1]},  # 1 layer of 2
            {**linked, "ref_attention": linked["ref_attention"][1, 2]},
        ],  # an RNN's map
        "outside": [
            {**linked, "links": ({(2, 0)}, {(2, 0)})},  # source word 2 is </s>: not a word
            {**linked, "links": ({(0, 2)}, {(0, 2)})},
        ],  # "And said" has 2 words, not 3 (pieces)
        "come together": [
            {**own, "decoder_attention": None},
            {**own, "attention": own["attention"][1, 2], "encoder_attention": None},  # an RNN has none
        ],
        "encoder_attention of shape": [{**own, "encoder_attention": own["encoder_attention"][..., :23]}],
        "decoder_attention of shape": [{**own, "decoder_attention": own["encoder_attention"]}],  # 24 x 24, not 22
        "has 2 heads, the attention 3": [{**own, "decoder_attention": own["decoder_attention"][:, :2]}],
    }
    for message, records in refused.items():
        for record in records:
            with pytest.raises(ValueError, match=message.replace("(", r"\(")):
                write_explorer(path, [record], "t", {})
    assert not os.path.exists(path)


# ---- in Chromium ----
@pytest.fixture(scope="module")
def browser():
    from browser import Browser, find_chromium

    if find_chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    with Browser(1280, 800) as b:
        yield b


def snapshot(b):
    """The viewport as an RGB image (device scale 1: one pixel per CSS pixel)."""
    from PIL import Image

    with Image.open(io.BytesIO(b.screenshot())) as image:
        return image.convert("RGB")


def pixel(image, x: float, y: float) -> tuple:
    return image.getpixel((int(x), int(y)))


def close(rgb, expected, tolerance=2) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(rgb, expected))


def cell_center(b, t: int, s: int) -> tuple[float, float]:
    x, y, cell = b.evaluate(
        "(() => { const r = document.getElementById('heat').getBoundingClientRect();"
        " return [r.x, r.y, heatmap.cell]; })()"
    )
    return x + (s + 0.5) * cell, y + (t + 0.5) * cell


def cell_colours(b, cells: list[tuple[int, int]]) -> dict[tuple[int, int], tuple]:
    """The colour drawn in the middle of each (row, column) cell, the view scrolled to the rows below the window."""
    colours, height = {}, b.evaluate("innerHeight")
    while missing := [c for c in cells if c not in colours]:
        y = cell_center(b, *missing[0])[1]
        if not 0 <= y < height:
            b.evaluate(f"document.getElementById('view').scrollTop += {y - 100}")
        png = snapshot(b)
        for cell in missing:
            x, y = cell_center(b, *cell)
            if 0 <= y < height:
                colours[cell] = pixel(png, x, y)
    return colours


def label_alphas(b, axis: str) -> list[float]:
    """The highlight opacity of every x (source) or y (target) label."""
    colours = b.evaluate(
        f"[...document.querySelectorAll('#{axis}labels .tok')].map(e => getComputedStyle(e).backgroundColor)"
    )
    alphas = []
    for colour in colours:
        numbers = [float(v) for v in re.findall(r"[\d.]+", colour)]
        alphas.append(numbers[3] if len(numbers) == 4 else 1.0)
    return alphas


def texts(b, selector: str) -> list[str]:
    return b.evaluate(f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.textContent)")


def shown(b, expected: str) -> None:
    b.wait_for(f"document.getElementById('view').dataset.shown === {json.dumps(expected)}", timeout=10)


@pytest.mark.slow
def test_explorer_in_chromium(browser, tmp_path):
    b, records = browser, known_records()
    path = tmp_path / "explorer.html"
    write_explorer(str(path), records, "known maps", {"model": "test"})
    page, _, sentences = read_explorer(path)
    assert {"\u0100", "\u010d", "\u013c"} <= set(page)  # NUL, CR and '<' of the maps, escaped: decoded below

    # the hash selects sentence, layer and head on load; this sentence has no forced reference: no rows toggle
    b.open(path, "s=0&l=1&h=2")
    shown(b, "0,1,2,hypothesis")
    assert b.evaluate("document.getElementById('rows').hidden")
    assert b.evaluate("[...inflated.keys()]") == ["0"]  # only the maps shown are inflated
    assert texts(b, "#title")[0].startswith("Gen.1.1#0 · BLEU 30")
    assert b.evaluate("[...document.querySelectorAll('#layers .active, #heads .active')].map(e => e.textContent)") == [
        "1",
        "2",
    ]
    assert texts(b, "#xlabels .tok") == records[0].src_tokens
    assert texts(b, "#ylabels .tok") == records[0].tgt_tokens
    assert b.evaluate("document.querySelector('.item.selected').dataset.i") == "0"

    # the browser inflates every map set to the bytes Python wrote (escaped characters included)
    own = "...(s.own ? [loadMaps(i, 'encoder'), loadMaps(i, 'decoder')] : [])"
    sets = f"[loadMaps(i), ...(s.ref ? [loadMaps(i, 'reference')] : []), {own}]"
    assert b.evaluate(f"Promise.all(SENTENCES.flatMap((s, i) => {sets}).map(p => p.then(m => Array.from(m))))") == [
        maps["maps"].ravel().tolist()
        for s in sentences
        for maps in filter(None, (s, s["ref"], *(s["own"] or {}).values()))
    ]
    b.evaluate("inflated.clear()")

    # pixels: a weight of 1 in the top colour of the scale, 0 in the bottom one
    png = snapshot(b)
    for t in range(4):
        for s in range(5):
            expected = VIRIDIS[255] if PERM[t] == s else VIRIDIS[0]
            assert close(pixel(png, *cell_center(b, t, s)), expected), (t, s)

    # hovering a target token lights the source tokens by its weights; a source token, the targets on it
    b.hover(*b.center("#ylabels .tok:nth-child(3)"))
    assert label_alphas(b, "x") == [1.0 if s == PERM[2] else 0.0 for s in range(5)]
    assert label_alphas(b, "y") == [0.0] * 4
    assert b.evaluate("document.querySelector('#ylabels .tok:nth-child(3)').classList.contains('focus')")
    assert texts(b, "#readout") == ["‘▁beginning’ attends most to ‘▁creó’ (1.000)"]
    b.hover(*b.center("#xlabels .tok:nth-child(1)"))
    assert label_alphas(b, "y") == [0.0, 1.0, 0.0, 0.0]  # only "▁the" attends to "▁En"
    assert label_alphas(b, "x") == [0.0] * 5
    b.hover(*cell_center(b, 0, 1))  # a cell counts as its target token
    assert label_alphas(b, "x") == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert texts(b, "#readout") == ["‘▁In’ → ‘▁el’: 1.000"]

    # the mean of the layer's heads: button, hash and colour of the mean weight
    b.click(*b.center("#heads button[data-value='mean']"))
    shown(b, "0,1,mean,hypothesis")
    assert b.evaluate("location.hash") == "#s=0&l=1&h=mean"
    mean = sentences[0]["maps"][3 + 1, 0, PERM[0]] / 255  # after layer 1's 3 heads: layer 0's mean, layer 1's
    assert 1 / 3 < mean < 1 and abs(mean - records[0].attention[1, :, 0, PERM[0]].mean()) <= 1 / 510 + 1e-6
    assert close(pixel(snapshot(b), *cell_center(b, 0, PERM[0])), VIRIDIS[round(mean * 255)], 1)

    # layer 0 keeps only its mean (make eval keeps the heads of viz.layer): no head buttons, a note says so;
    # a head asked for in the address falls back to the mean
    b.click(*b.center("#layers button[data-value='0']"))
    shown(b, "0,0,mean,hypothesis")
    assert texts(b, "#heads button") == ["mean"]
    assert "heads kept for layer 1" in texts(b, "#heads .note")[0]
    b.evaluate("location.hash = 's=0&l=0&h=2'")
    shown(b, "0,0,mean,hypothesis")
    assert b.evaluate("location.hash") == "#s=0&l=0&h=mean"

    # another sentence from the list keeps the layer and head and shows its hypothesis rows, without links
    b.click(*b.center(".item[data-i='1']"))
    shown(b, "1,0,mean,hypothesis")
    assert b.evaluate("location.hash") == "#s=1&l=0&h=mean"
    assert not b.evaluate("document.getElementById('rows').hidden")
    assert texts(b, "#rows button") == ["cross: hypothesis", "cross: reference (forced)"]
    assert texts(b, "#rows .active") == ["cross: hypothesis"]
    assert texts(b, "#ylabels .tok") == records[1].tgt_tokens
    assert "reference (forced) rows" in texts(b, "#legend")[0]
    assert not b.evaluate("inflated.has('1r')")  # the forced maps wait until they are shown
    half = b.evaluate("heatmap.cell") // 2

    def red_pixels(png, t, s):  # pixels of the links' outline colour in a cell (less a pixel each side)
        x, y = cell_center(b, t, s)
        return sum(
            close(pixel(png, x + dx, y + dy), (255, 45, 85), 40)
            for dx in range(1 - half, half - 1)
            for dy in range(1 - half, half - 1)
        )

    def all_red(rows: int) -> dict:
        png = snapshot(b)
        return {(t, s): red_pixels(png, t, s) for t in range(rows) for s in range(3)}

    assert sum(all_red(3).values()) == 0

    # the reference rows: forced attention, the links outlined (sure solid, possible dashed), m=ref in the hash
    b.click(*b.center("#rows button[data-value='reference']"))
    shown(b, "1,0,mean,reference")
    assert b.evaluate("location.hash") == "#s=1&l=0&h=mean&m=ref"
    assert b.evaluate("inflated.has('1r')")
    assert texts(b, "#rows .active") == ["cross: reference (forced)"]
    assert texts(b, "#ylabels .tok") == records[1].ref_tokens
    assert texts(b, "#title small")[0].endswith("3 source × 4 reference (forced) pieces")
    assert texts(b, "#corner")[0].startswith("reference (forced) ↓")
    assert texts(b, "#readout") == ["rows: the reference, forced through the decoder · hover a token or a cell"]
    assert "sure" in texts(b, "#legend")[0]
    red = all_red(4)
    sure = [red.pop(tuple(cell)) for cell in SURE_CELLS]
    possible = [red.pop(tuple(cell)) for cell in POSSIBLE_CELLS]
    assert min(sure) > 20 and 5 < max(possible) < min(sure), (sure, possible)  # solid; dashed: fewer pixels
    assert set(red.values()) == {0}, red  # no other cell is outlined

    # the forced maps themselves, per layer and head (layer 1 head 2: one-hot); hover names the links
    b.click(*b.center("#layers button[data-value='1']"))
    b.click(*b.center("#heads button[data-value='2']"))
    shown(b, "1,1,2,reference")
    png = snapshot(b)
    for t in range(4):
        for s in range(3):
            expected = VIRIDIS[255] if REF_PERM[t] == s else VIRIDIS[0]
            assert close(pixel(png, *cell_center(b, t, s)), expected), (t, s)
    b.hover(*cell_center(b, 2, 1))
    assert texts(b, "#readout") == ["‘id’ → ‘▁dijo’: 1.000 (sure reference link)"]
    b.hover(*cell_center(b, 0, 1))
    assert texts(b, "#readout") == ["‘▁And’ → ‘▁dijo’: 0.000 (possible reference link)"]
    b.hover(*b.center("#xlabels .tok:nth-child(2)"))  # "▁dijo" is attended by both pieces of "said"
    assert label_alphas(b, "y") == [0.0, 1.0, 1.0, 0.0]

    # a sentence without forced attention shows its hypothesis (no m in the hash); a typed hash with r=1 (as
    # addresses said before m=) opens the reference rows again, and the hypothesis button goes back
    b.click(*b.center(".item[data-i='0']"))
    shown(b, "0,1,2,hypothesis")
    assert b.evaluate("location.hash") == "#s=0&l=1&h=2"
    assert b.evaluate("document.getElementById('rows').hidden")
    b.evaluate("location.hash = 's=1&l=0&h=mean&r=1'")
    shown(b, "1,0,mean,reference")
    b.click(*b.center("#rows button[data-value='hypothesis']"))
    shown(b, "1,0,mean,hypothesis")
    assert b.evaluate("location.hash") == "#s=1&l=0&h=mean"
    assert texts(b, "#ylabels .tok") == records[1].tgt_tokens
    assert sum(all_red(3).values()) == 0

    # sentence 2's self-attention: the encoder's over the source (its own 3 layers), the decoder's over <s> and the
    # hypothesis pieces but the last (causal); layer and head kept where the stack has them
    b.evaluate("location.hash = 's=2&l=2&h=1&m=encoder'")
    shown(b, "2,2,1,encoder")
    assert texts(b, "#rows button") == ["cross: hypothesis", "encoder self", "decoder self"]
    assert texts(b, "#layers button") == ["0", "1", "2"]  # the encoder's 3 layers; the decoder has 2
    assert texts(b, "#xlabels .tok") == texts(b, "#ylabels .tok") == records[2].src_tokens
    assert texts(b, "#corner") == ["source ↓  source →"]
    assert texts(b, "#readout")[0].startswith("encoder self-attention: each source piece over the source")
    cells = [(t, s) for t in range(24) for s in (ENC_NEXT[t], (ENC_NEXT[t] + 5) % 24)]
    for (t, s), rgb in cell_colours(b, cells).items():
        assert close(rgb, VIRIDIS[255] if ENC_NEXT[t] == s else VIRIDIS[0]), (t, s)
    b.evaluate("document.getElementById('view').scrollTop = 0")
    b.click(*b.center("#rows button[data-value='decoder']"))
    shown(b, "2,1,1,decoder")  # layer 2 is not the decoder's: its last layer, whose heads are kept
    assert b.evaluate("location.hash") == "#s=2&l=1&h=1&m=decoder"
    assert texts(b, "#xlabels .tok") == ["<s>", *records[2].tgt_tokens[:-1]]
    assert texts(b, "#ylabels .tok") == records[2].tgt_tokens
    assert texts(b, "#title small")[0].endswith("22 hypothesis (read) × 22 hypothesis (writing) pieces")
    b.click(*b.center("#heads button[data-value='0']"))
    shown(b, "2,1,0,decoder")
    cells = [(t, s) for t in range(22) for s in {0, t, min(t + 1, 21)}]
    for (t, s), rgb in cell_colours(b, cells).items():
        assert close(rgb, VIRIDIS[255] if s == t else VIRIDIS[0]), (t, s)
    b.evaluate("document.getElementById('view').scrollTop = 0")  # back to the buttons
    b.hover(*cell_center(b, 3, 3))
    assert texts(b, "#readout") == ["‘▁t3’ → ‘▁t2’: 1.000"]  # the position writing ▁t3 reads ▁t2 (the input before)
    inflated = b.evaluate("[...inflated.keys()]")
    assert {"2e", "2d"} <= set(inflated) and "2" not in inflated  # only the maps shown are inflated
    b.click(*b.center(".item[data-i='0']"))  # a sentence without self-attention: its hypothesis
    shown(b, "0,1,0,hypothesis")
    b.evaluate("location.hash = 's=1&l=0&h=mean'")
    shown(b, "1,0,mean,hypothesis")

    # search over source / hypothesis / reference
    b.click(*b.center("#search"))
    b.type_text("FIRMAMENT")
    assert texts(b, "#count") == ["1 of 4"]
    assert b.evaluate("[...document.querySelectorAll('#list .item')].map(e => e.dataset.i)") == ["2"]
    b.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input')); })()"
    )

    # sorting: ids in numeric order; BLEU both ways, a missing BLEU last
    def order():
        return [int(i) for i in b.evaluate("[...document.querySelectorAll('#list .item')].map(e => e.dataset.i)")]

    def sort_by(key):
        b.evaluate(
            f"(() => {{ const s = document.getElementById('sort'); s.value = '{key}';"
            " s.dispatchEvent(new Event('change')); })()"
        )

    assert order() == [0, 1, 2, 3]  # the corpus order: Gen.1.1, Gen.1.2, Gen.1.10, Gen.1.9, as given
    b.click(*b.center("#order"))
    assert order() == [3, 2, 1, 0]
    b.click(*b.center("#order"))
    sort_by("bleu")
    assert order() == [1, 0, 2, 3]
    b.click(*b.center("#order"))
    assert order() == [2, 0, 1, 3]
    sort_by("entropy")
    assert order() == sorted(range(4), key=lambda i: -sentences[i]["entropy"])
    sort_by("mono")
    assert order() == sorted(range(4), key=lambda i: (-sentences[i]["mono"], i))
    # what the list's numbers are, and what the measures mean, written beside them
    assert texts(b, "#columns")[0].startswith("BLEU: sentence BLEU · H: attention entropy · M: monotonicity")
    assert "1 = a diagonal" in texts(b, "#measures")[0]
    first = texts(b, "#list .item .line span")[0]
    assert re.fullmatch(r"BLEU [\d.–]+ · H \d\.\d\d · M -?\d\.\d\d · R \d\.\d\d · \d+×\d+( · ref)?", first), first
    sort_by("again")
    assert order() == sorted(range(4), key=lambda i: (-sentences[i]["again"], i))
    sort_by("length")
    b.click(*b.center("#order"))
    assert order() == [3, 1, 0, 2]  # 2, 3, 5, 24 source pieces

    # ↓ moves to the next sentence of the list; a typed hash is followed
    b.page("Input.dispatchKeyEvent", type="keyDown", key="ArrowDown", code="ArrowDown", windowsVirtualKeyCode=40)
    shown(b, "0,0,mean,hypothesis")
    b.evaluate("location.hash = 's=2&l=1&h=0'")
    shown(b, "2,1,0,hypothesis")


@pytest.mark.slow
def test_rnn_map_in_chromium(browser, tmp_path):
    path = tmp_path / "rnn.html"
    weights = torch.eye(3)[[2, 0, 1]]
    record = ExplorerRecord("1", ["▁a", "▁b", "</s>"], ["▁x", "▁y", "</s>"], weights)
    write_explorer(str(path), [record], "rnn", {})
    browser.open(path)
    shown(browser, "0,0,mean,hypothesis")
    assert browser.evaluate("location.hash") == "#s=0"
    assert browser.evaluate("document.getElementById('layers').hidden && document.getElementById('heads').hidden")
    png = snapshot(browser)
    for t in range(3):
        for s in range(3):
            assert close(pixel(png, *cell_center(browser, t, s)), VIRIDIS[255 if weights[t, s] else 0]), (t, s)


def test_a_copying_models_shares_are_listed_sorted_and_read_out_per_row(browser, tmp_path):
    """model.copy_attention's shares (app.evaluation.records.add_copy_shares): per sentence their mean over the
    pieces (EOS left out) in the list, as a sort key, and each hypothesis row's in the readout when hovered."""
    path = tmp_path / "copy.html"
    weights = torch.eye(3)[[2, 0, 1]]
    records = [
        ExplorerRecord("1", ["▁Abram", "▁dijo", "</s>"], ["▁Abram", "▁said", "</s>"], weights, copied=[0.9, 0.1, 0.4]),
        ExplorerRecord("2", ["▁a", "▁b", "</s>"], ["▁x", "▁y", "</s>"], weights, copied=[0.0, 0.2, 0.0]),
        ExplorerRecord("3", ["▁a", "▁b", "</s>"], ["▁x", "▁y", "</s>"], weights),  # a model that does not copy
    ]
    write_explorer(str(path), records, "copy", {})
    _, _, sentences = read_explorer(path)
    assert [(s.get("copy"), s.get("copied")) for s in sentences] == [
        (0.5, [0.9, 0.1, 0.4]),
        (0.1, [0.0, 0.2, 0.0]),
        (None, None),
    ]
    browser.open(path)
    shown(browser, "0,0,mean,hypothesis")
    assert [line.split(" · ")[-1] for line in texts(browser, ".item .line span")] == ["C 0.50", "C 0.10", "3×3"]
    browser.evaluate("document.getElementById('sort').value = 'copy'; renderList()")
    assert browser.evaluate("state.order") == [1, 0, 2]  # ascending; the sentence without shares last
    browser.hover(*browser.center("#ylabels .tok:nth-child(1)"))
    assert texts(browser, "#readout") == ["‘▁Abram’ attends most to ‘</s>’ (1.000) · copied 0.90 of its probability"]
    with pytest.raises(ValueError, match="sentence 1: 2 copy shares for 3 target pieces"):
        write_explorer(
            str(path),
            [ExplorerRecord("1", ["▁a", "</s>"], ["▁x", "▁y", "</s>"], weights[:, :2], copied=[0, 1])],
            "x",
            {},
        )


def test_every_reference_is_shown_numbered_and_searched(browser, tmp_path):
    """make eval's eval.references: a sentence's further references are listed under the first, numbered, and the
    search finds words that only they hold; a sentence with one reference keeps the single "reference" row."""
    path = tmp_path / "references.html"
    weights = torch.eye(3)[[2, 0, 1]]
    pieces = (["▁a", "▁b", "</s>"], ["▁x", "▁y", "</s>"], weights)
    records = [
        ExplorerRecord("1", *pieces, reference="In the beginning", more_references=["At first", "Originally"]),
        ExplorerRecord("2", *pieces, reference="And the earth"),
    ]
    write_explorer(str(path), records, "references", {})
    _, _, sentences = read_explorer(path)
    assert [s.get("more") for s in sentences] == [["At first", "Originally"], None]
    browser.open(path)
    shown(browser, "0,0,mean,hypothesis")
    assert texts(browser, "#texts dt") == ["source", "hypothesis", "reference 1", "reference 2", "reference 3"]
    assert texts(browser, "#texts dd")[2:] == ["In the beginning", "At first", "Originally"]
    browser.click(*browser.center("#search"))
    browser.type_text("originally")
    assert texts(browser, "#count") == ["1 of 2"]
    browser.evaluate("location.hash = 's=1'")
    shown(browser, "1,0,mean,hypothesis")
    assert texts(browser, "#texts dt") == ["source", "hypothesis", "reference"]


def test_the_baseline_hypothesis_is_shown_and_the_list_sorts_by_the_bleu_difference(browser, tmp_path):
    """make eval's eval.baseline: each sentence's baseline hypothesis under the references, its BLEU beside ours,
    Δ (ours minus the baseline's) in the list and as a sort key; the search reads the baseline too."""
    path = tmp_path / "baseline.html"
    weights = torch.eye(3)[[2, 0, 1]]
    pieces = (["▁a", "▁b", "</s>"], ["▁x", "▁y", "</s>"], weights)
    records = [
        ExplorerRecord("1", *pieces, bleu=30.0, baseline="a worse one", baseline_bleu=40.5),
        ExplorerRecord("2", *pieces, bleu=50.0, baseline="a lucky one", baseline_bleu=12.25),
        ExplorerRecord("3", *pieces, bleu=20.0, baseline="the same", baseline_bleu=20.0),
    ]
    write_explorer(str(path), records, "baseline", {"baseline": "other_run"})
    browser.open(path)
    shown(browser, "0,0,mean,hypothesis")
    assert [line.split(" · ")[-1] for line in texts(browser, ".item .line span")] == ["Δ −10.50", "Δ +37.75", "Δ ±0.00"]
    assert texts(browser, "#texts dt")[-1] == "baseline" and texts(browser, "#texts dd")[-1] == "a worse one"
    assert "BLEU 30 (the baseline's 40.5)" in texts(browser, "#title small")[0]
    browser.evaluate("document.getElementById('sort').value = 'delta'; renderList()")
    assert browser.evaluate("state.order") == [0, 2, 1]
    browser.click(*browser.center("#search"))
    browser.type_text("lucky")
    assert texts(browser, "#count") == ["1 of 3"]


@pytest.mark.slow
def test_screenshot_for_the_readme(browser, tmp_path):
    """A README picture of a synthetic explorer, its reference rows with their links; $EXPLORER_SCREENSHOT
    keeps it (tests/browser.py makes one of a real eval's explorer)."""
    from browser import explorer_screenshot
    from PIL import Image

    path = tmp_path / "explorer.html"
    meta = {"model": "transformer", "split": "test", "alignment": "AER 0.412 (layer 4 head 2, chosen on dev)"}
    write_explorer(
        str(path), synthetic_records(40, lengths=(14, 24), forced=True), "synthetic attention (not a model's)", meta
    )
    png = os.environ.get("EXPLORER_SCREENSHOT") or str(tmp_path / "explorer.png")
    size = explorer_screenshot(str(path), png, "s=3&l=5&h=mean&r=1", browser=browser)
    assert size == os.path.getsize(png) < 300_000
    with Image.open(png) as image:
        assert image.size == (1280, 800)
        colours = [c for _, c in image.convert("RGB").getcolors(1280 * 800)]
    assert (255, 255, 255) in colours and tuple(VIRIDIS[0]) in colours  # the page and the heatmap's zero
    assert any(close(c, (255, 45, 85), 10) for c in colours)  # the reference links' outlines
    assert browser.evaluate("document.getElementById('view').dataset.shown") == "3,5,mean,reference"
    assert browser.evaluate("document.querySelectorAll('#ylabels .tok.focus').length") == 1  # hovered
    assert "alignment: AER 0.412 (layer 4 head 2, chosen on dev)" in texts(browser, "#meta")[0]

    smaller = tmp_path / "smaller.png"
    assert (
        explorer_screenshot(str(path), str(smaller), "s=3&l=5&h=mean&r=1", browser=browser, max_bytes=size - 1) < size
    )
    with Image.open(smaller) as image:
        assert image.mode == "P" and image.size == (1280, 800)
    explorer_screenshot(str(path), str(smaller), browser=browser)  # no hash: the first sentence, hypothesis rows
    assert browser.evaluate("document.getElementById('view').dataset.shown") == "0,5,mean,hypothesis"


@pytest.mark.slow
@pytest.mark.parametrize("maps", ["hypothesis", "forced", "self"], ids=["hypothesis", "hypothesis+forced", "+self"])
def test_a_full_test_set_opens_quickly(browser, tmp_path, capsys, maps):
    """1000 sentences, 6 layers x 8 heads, 25-55 source pieces (synthetic peaked attention, not a
    model's), with or without every sentence's forced reference maps or self-attention: the file stays under 8 MB
    a map set and the first heatmap shows within seconds, as opening parses only the list; the other maps are
    inflated when they are first shown."""
    records = synthetic_records(1000, forced=maps == "forced", own=maps == "self")
    sets = ("attention", "ref_attention", "encoder_attention", "decoder_attention")
    floats = sum(getattr(r, name).size for r in records for name in sets if getattr(r, name) is not None)
    path = tmp_path / "explorer.html"
    start = time.perf_counter()
    write_explorer(str(path), records, "1000 sentences", {"model": "transformer"})
    write_seconds = time.perf_counter() - start
    megabytes = path.stat().st_size / 1e6
    browser.open(path, "s=999&l=5&h=3")
    shown(browser, "999,5,3,hypothesis")
    first_render_ms = browser.evaluate("window.explorerReady")
    timed = "(async () => {{ const t = performance.now(); await show({}); return performance.now() - t; }})()"
    switch_ms = browser.evaluate(timed.format("500, 2, 'mean', 'hypothesis'"))
    report = (
        f"\n{len(records)} sentences, {floats / 1e6:.1f} M floats ({maps} maps):"
        f" {megabytes:.1f} MB written in {write_seconds:.1f} s; first heatmap {first_render_ms:.0f} ms after"
        f" navigation; another sentence {switch_ms:.0f} ms"
    )
    others = {"forced": ["reference"], "self": ["encoder", "decoder"]}.get(maps, [])
    for other in others:
        other_ms = browser.evaluate(timed.format(f"500, 2, 'mean', '{other}'"))
        assert browser.evaluate("document.getElementById('view').dataset.shown") == f"500,2,mean,{other}"
        report += f"; its {other} maps {other_ms:.0f} ms"
    with capsys.disabled():
        print(report)
    assert megabytes < 8 * (1 + len(others))  # the heads of one layer and every layer's mean (make eval's default)
    assert first_render_ms < 5000
