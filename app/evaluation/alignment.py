"""Hard word alignments read from attention (app.data.links.hard_alignments), scored against reference links with
AER, precision and recall (Och & Ney 2003), for every view of the attention at once; a hypothesis' word links."""

from __future__ import annotations

from typing import Optional

import numpy as np
from tqdm import tqdm

from app.data.links import hard_alignment, hard_alignments
from app.data.tokenizer import EOS
from app.decode.passes import forced_attention
from app.evaluation.views import attention_views, named_view, plotted_view
from app.run.errors import UserError


def links_view(attention, layer: int = -1, view: Optional[str] = None) -> str:
    """The view of a hypothesis' attention its word links are read from: ``view`` (the one AER chose, where the
    corpus has reference links), else, or where it is not among the attention's views (an export returns one
    map), the view plots show (an RNN's map, a Transformer's layer ``layer`` mean of heads)."""
    return view if view and view in attention_views(attention)[0] else plotted_view(attention, layer)[0]


def hypothesis_links(attention, src_pieces: list[str], hyp_pieces: list[str], view: str) -> set[tuple[int, int]]:
    """The (source word, hypothesis word) links read from the view ``view`` (``links_view``) of the attention
    that wrote a hypothesis."""
    return hard_alignment(named_view(attention, view), src_pieces, hyp_pieces)


def align_scope(setting: Optional[str], gold_file: bool) -> str:
    """eval.align_scope, or where unset: "all" for a gold file (it annotates every word), "linked" for the
    corpus's own reference links (Strong's numbers leave function words untagged)."""
    return setting or ("all" if gold_file else "linked")


def alignment_view(a: dict) -> str:
    """Which attention an AER of metrics.json's ``alignment`` read, and over which words."""
    return f"{a['view']}, chosen on {a['chosen_on']}; {a['scope']} target words"


class AlignmentScore:
    """AER, precision and recall (Och & Ney 2003) of several views of the attention at once, over a
    corpus: AER = 1 - (|A∩S| + |A∩P|) / (|A| + |S|); precision = |A∩P| / |A|; recall = |A∩S| / |S|.

    ``scope``: "all" counts the predicted link of every target word (a gold file that annotates every
    word, a word without links being unaligned); "linked" only those of target words the gold links
    (a partial reference, such as Strong's numbers, which leave function words untagged: a link from
    "the" is then unknown, not wrong)."""

    def __init__(self, views: list[str], scope: str = "all"):
        self.views, self.scope = views, scope
        self.counts = np.zeros((len(views), 4), dtype=np.int64)  # |A|, |S|, |A∩S|, |A∩P| per view

    def add(self, links: list[set], sure: set, possible: set) -> None:
        """One sentence: each view's predicted links against the gold ones (possible includes sure)."""
        if self.scope == "linked":
            linked = {t for _, t in possible}
            links = [{(s, t) for s, t in predicted if t in linked} for predicted in links]
        for counts, predicted in zip(self.counts, links):
            counts += (len(predicted), len(sure), len(predicted & sure), len(predicted & possible))

    def result(self, view: str) -> dict:
        a, s, a_s, a_p = self.counts[self.views.index(view)].tolist()
        return {
            "aer": round(1 - (a_s + a_p) / max(a + s, 1), 4),
            "precision": round(a_p / max(a, 1), 4),
            "recall": round(a_s / max(s, 1), 4),
            "links": a,
        }

    def best(self) -> str:
        """The view with the lowest AER (the first of equals)."""
        return min(self.views, key=lambda view: self.result(view)["aer"])


def alignment_error_rate(predicted: list[set], gold: list[tuple[set, set]], scope: str = "all") -> dict:
    """AER, precision and recall of one set of predicted links per sentence."""
    if len(predicted) != len(gold):
        raise UserError(f"{len(predicted)} sentences to align but the gold file has {len(gold)} lines")
    score = AlignmentScore(["links"], scope)
    for links, (sure, possible) in zip(predicted, gold):
        score.add([links], sure, possible)
    return score.result("links")


def score_alignments(
    model,
    data,
    gold: list[tuple[set, set]],
    tokenizer,
    device,
    dtype,
    batch_tokens: int,
    keep: int = 0,
    scope: str = "all",
    progress: str = "",
) -> tuple[Optional[AlignmentScore], dict]:
    """Every view of the teacher-forced attention of ``data`` (a ParallelData) scored against ``gold``
    (per pair: sure, possible links; ``scope`` as AlignmentScore's), and the attention of the first
    ``keep`` pairs (float16: for plots and the explorer). None, {} for a model without attention.
    ``progress``: a progress bar's title (none without)."""
    if len(gold) != len(data):
        raise UserError(f"{len(data)} sentences to align but the reference links have {len(gold)} lines")
    score, kept = None, {}
    pairs = forced_attention(model, data.src, data.tgt, device, batch_tokens, dtype)
    for i, attention in tqdm(pairs, progress, len(data), leave=False, unit="sentence", disable=not progress):
        names, maps = attention_views(attention)
        score = score or AlignmentScore(names, scope)
        links = hard_alignments(
            maps, tokenizer.src_pieces(data.src[i] + [EOS]), tokenizer.tgt_pieces(data.tgt[i] + [EOS])
        )
        score.add(links, *gold[i])
        if i < keep:
            kept[i] = attention.half()
    return score, kept
