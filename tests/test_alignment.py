"""Hard alignments from attention and AER, by hand and on a learned toy task."""

import pytest
import torch
from conftest import Vocab, model_config
from toy_tasks import reversal_data, train_on_reversal

from app.data.batching import Batcher
from app.data.links import hard_alignment, pharaoh_line, read_pharaoh, word_index
from app.evaluation.alignment import alignment_error_rate, hypothesis_links, links_view
from app.evaluation.views import plotted_view
from app.models import build_model
from app.run.errors import UserError


def test_pieces_merge_into_words():
    assert word_index(["▁In", "▁the", "▁begin", "ning", ",", "</s>"]) == [0, 1, 2, 2, 2, -1]
    # a lone "▁" starts a word only where a piece of it follows; before another word or the end it is a space
    assert word_index(["▁", "Ab", "▁the", "▁", "▁the", "▁", "</s>"]) == [0, 0, 1, -1, 2, -1, -1]
    # <unk> and byte pieces (tokenizer.byte_fallback) are characters of a word, not control pieces: "光 y" was one
    # word short (its ▁ taken for a space, its bytes for special tokens), so every later link was a word off
    assert word_index(["▁", "<0xE5>", "<0x85>", "<0x89>", "▁y", "</s>"]) == [0, 0, 0, 0, 1, -1]
    assert word_index(["▁", "<unk>", "▁y", "<unk>", "<pad>"]) == [0, 0, 1, 1, -1]


def test_hard_alignment_sums_pieces_then_takes_the_argmax():
    src = ["▁En", "▁el", "▁princip", "io", "</s>"]
    tgt = ["▁In", "▁the", "▁begin", "ning", "</s>"]
    weights = [
        [0.9, 0.1, 0.0, 0.0, 0.0],
        [0.0, 0.8, 0.1, 0.1, 0.0],
        [0.1, 0.0, 0.4, 0.4, 0.1],  # "princip"+"io" = 0.8 beats "En" 0.1
        [0.0, 0.5, 0.2, 0.3, 0.0],  # joins row above: word 2 -> source word 2 (1.3) over "el" (0.5)
        [0.0, 0.0, 0.0, 0.0, 1.0],  # </s> row: ignored
    ]
    assert hard_alignment(weights, src, tgt) == {(0, 0), (1, 1), (2, 2)}


def test_a_hypothesis_links_read_the_view_aer_chose_else_the_plotted_one():
    src = ["▁En", "▁el", "▁princip", "io", "</s>"]
    hyp = ["▁In", "▁the", "▁begin", "ning", "</s>"]
    diagonal = torch.tensor([[1.0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]])
    first = torch.zeros(5, 5).index_fill_(1, torch.tensor([0]), 1.0)  # every row on "En"
    attention = torch.stack([torch.stack([first, first]), torch.stack([diagonal, first])])  # (2 layers, 2 heads, ...)
    assert (
        links_view(attention, layer=-1) == "layer 1 mean" and links_view(attention, 0, "no such view") == "layer 0 mean"
    )
    assert links_view(attention, -1, "layer 1 head 0") == "layer 1 head 0"
    assert links_view(diagonal) == "attention"  # an RNN's map, or an export's
    assert hypothesis_links(attention, src, hyp, "layer 1 head 0") == {(0, 0), (1, 1), (2, 2)}
    assert hypothesis_links(attention, src, hyp, "layer 0 mean") == {(0, 0), (0, 1), (0, 2)}
    assert pharaoh_line({(2, 2), (0, 1), (1, 0), (3, 0)}) == "1-0 3-0 0-1 2-2"  # in the order of the target words


def test_aer_hand_computed(tmp_path):
    path = tmp_path / "gold.txt"
    path.write_text("0-0 1-1 2?1\n0-1\n")
    gold = read_pharaoh(str(path))
    assert gold[0] == ({(0, 0), (1, 1)}, {(0, 0), (1, 1), (2, 1)})
    predicted = [{(0, 0), (2, 1), (2, 2)}, {(0, 1)}]
    # A=4, S=3, A∩S={(0,0),(0,1)}=2, A∩P={(0,0),(2,1),(0,1)}=3 -> AER = 1 - 5/7
    scores = alignment_error_rate(predicted, gold)
    assert scores["aer"] == pytest.approx(round(1 - 5 / 7, 4))
    assert scores["precision"] == pytest.approx(0.75) and scores["recall"] == pytest.approx(round(2 / 3, 4))
    # a partial reference scores only the target words it links: target word 2 has no gold link
    linked = alignment_error_rate(predicted, gold, scope="linked")  # A loses (2,2): 3, A∩S 2, A∩P 3
    assert linked["aer"] == pytest.approx(round(1 - 5 / 6, 4)) and linked["precision"] == 1.0
    assert linked["links"] == 3 and scores["links"] == 4
    path.write_text("0-0 1~1\n")
    with pytest.raises(UserError, match="gold.txt:1"):
        read_pharaoh(str(path))


@pytest.mark.slow
def test_attention_rnn_on_reversal_has_low_aer():
    torch.manual_seed(0)
    cfg = model_config(
        arch="rnn",
        emb_dim=32,
        hidden=64,
        enc_layers=1,
        dec_layers=1,
        dropout=0.0,
        tie_embeddings=False,
        attention="bahdanau",
    )
    model = build_model(cfg, Vocab(16, 16))
    train_on_reversal(model, steps=400)
    src, tgt = reversal_data(100, seed=7)
    batch = Batcher(src, tgt)(list(range(100)))
    with torch.no_grad():
        _, attention = model.decode(model.encode(batch.src), batch.tgt_in, need_attention=True)  # teacher forced
    predicted, gold = [], []
    for i, s in enumerate(src):
        n = len(s)
        pieces = [f"▁{x}" for x in s] + ["</s>"]
        weights = plotted_view(attention[i, : n + 1, : n + 1])[1]
        predicted.append(hard_alignment(weights, pieces, [f"▁{x}" for x in tgt[i]] + ["</s>"]))
        links = {(n - 1 - j, j) for j in range(n)}
        gold.append((links, links))
    assert alignment_error_rate(predicted, gold)["aer"] <= 0.1
