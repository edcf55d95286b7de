"""Hard alignments from attention and AER, by hand and on a learned toy task."""

import numpy as np
import pytest
import torch
from conftest import NFKC_PAIRS, Vocab, model_config, surface_words
from toy_tasks import reversal_data, train_on_reversal

from app.data.batching import Batcher
from app.data.links import hard_alignment, pharaoh_line, read_pharaoh
from app.data.tokenizer import span_words
from app.evaluation.alignment import alignment_error_rate, hypothesis_links, links_view
from app.evaluation.views import plotted_view
from app.models import build_model
from app.run.errors import UserError


def test_a_piece_is_of_the_whitespace_word_its_span_spells():
    # "▁In" spells "In", "▁the" " the", "▁begin" " begin", "ning", ","
    assert span_words("In the beginning,", [(0, 2), (2, 6), (6, 12), (12, 16), (16, 17)]) == [0, 1, 2, 2, 2]
    # a ▁ the normalization put where the text has nothing (an empty span) or a space is of the word that follows
    assert span_words("ab cd", [(0, 0), (0, 2), (2, 3), (3, 5), (5, 5)]) == [0, 0, 1, 1, -1]
    # a ZWNJ (3 bytes) inside a word: SentencePiece makes it a ▁ of its own, but it is of the word it is in
    zwnj = [(0, 0), (0, 1), (1, 2), (2, 5), (5, 9), (9, 10), (10, 15)]
    assert span_words("mi\u200cxahm ketab", zwnj) == [0, 0, 0, 0, 0, 1, 1]
    # a space before a piece that begins with one (a model's output can hold it) is of no word; " ⁇ " is a word
    assert span_words("x  y", [(0, 1), (1, 2), (2, 4)]) == [0, -1, 1]
    assert span_words("a \u2047 b", [(0, 1), (1, 5), (5, 7)]) == [0, 1, 2]


def test_exactly_right_attention_over_words_the_normalization_splits_scores_aer_0(nfkc_tokenizer):
    """SentencePiece makes a ZWNJ inside a word, and "´", a ▁ of its own: numbered by the ▁ marks, every later
    source word was one too high, and attention on exactly the right pieces scored AER 1.0 (the audit's figure).
    The words are the text's (str.split()), as the gold links number them."""
    tok = nfkc_tokenizer
    predicted, gold = [], []
    for src, tgt, links in NFKC_PAIRS:
        ids, tgt_ids = tok.encode_src([src])[0], tok.encode_tgt([tgt])[0]
        surfaces = [[p.surface for p in tok.src.encode(text, return_type="proto").pieces] for text in (src, tgt)]
        on_source, on_target = surface_words(surfaces[0], src), surface_words(surfaces[1], tgt)
        assert len(on_source) == len(ids) and max(on_source) + 1 == len(src.split())
        assert sum(p.startswith("▁") for p in tok.src_pieces(ids)) > len(src.split())  # a ▁ more than words
        linked = {t: s for s, t in links}  # one link per target word here
        weights = np.zeros((len(tgt_ids) + 1, len(ids) + 1))  # with </s>
        for row, word in enumerate(on_target + [-1]):
            columns = [c for c, w in enumerate(on_source) if word >= 0 and w == linked[word]] or [len(ids)]
            weights[row, columns] = 1 / len(columns)
        words = tok.src_words([src])[0] + [-1], tok.tgt_words([tgt])[0] + [-1]
        predicted.append(hard_alignment(weights, *words))
        gold.append((links, links))
    assert predicted == [links for links, _ in gold]
    assert alignment_error_rate(predicted, gold)["aer"] == 0.0


def test_hard_alignment_sums_pieces_then_takes_the_argmax():
    src = [0, 1, 2, 2, -1]  # the words of ▁En ▁el ▁princip io </s>
    tgt = [0, 1, 2, 2, -1]  # of ▁In ▁the ▁begin ning </s>
    weights = [
        [0.9, 0.1, 0.0, 0.0, 0.0],
        [0.0, 0.8, 0.1, 0.1, 0.0],
        [0.1, 0.0, 0.4, 0.4, 0.1],  # "princip"+"io" = 0.8 beats "En" 0.1
        [0.0, 0.5, 0.2, 0.3, 0.0],  # joins row above: word 2 -> source word 2 (1.3) over "el" (0.5)
        [0.0, 0.0, 0.0, 0.0, 1.0],  # </s> row: ignored
    ]
    assert hard_alignment(weights, src, tgt) == {(0, 0), (1, 1), (2, 2)}


def test_a_hypothesis_links_read_the_view_aer_chose_else_the_plotted_one():
    src = hyp = [0, 1, 2, 2, -1]  # ▁En ▁el ▁princip io </s>, ▁In ▁the ▁begin ning </s>
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
        words = list(range(n)) + [-1]  # a word per symbol, then </s>
        weights = plotted_view(attention[i, : n + 1, : n + 1])[1]
        predicted.append(hard_alignment(weights, words, list(range(len(tgt[i]))) + [-1]))
        links = {(n - 1 - j, j) for j in range(n)}
        gold.append((links, links))
    assert alignment_error_rate(predicted, gold)["aer"] <= 0.1
