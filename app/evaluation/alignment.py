"""Hard word alignments read from attention (app/evaluation/extraction.py: every view, as it is and shift-att; both
directions symmetrized or agreeing), scored against reference links with AER, precision and recall (Och & Ney
2003), every method at once, the best chosen; a hypothesis' word links."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from tqdm import tqdm

from app.data.links import word_links
from app.data.symmetrization import AGREEMENT, agreement, symmetrize
from app.decode.passes import forced_attention
from app.evaluation.extraction import (
    Method,
    agreement_asked,
    allowed,
    candidates,
    has_reading,
    read_links,
    read_probabilities,
    read_words,
)
from app.evaluation.views import plotted_view
from app.run.errors import UserError


def links_view(attention, layer: int = -1, view: Optional[str] = None) -> str:
    """The reading (a view, or a view shift-att) of a hypothesis' attention its word links are read from: ``view``
    (the one AER chose, where the corpus has reference links), else, or where its view is not among the
    attention's (an export returns one map), the view plots show (an RNN's map, a Transformer's layer ``layer``
    mean of heads)."""
    return view if view and has_reading(attention, view) else plotted_view(attention, layer)[0]


def hypothesis_links(attention, src_words: Sequence[int], hyp_words: Sequence[int], view: str) -> set[tuple[int, int]]:
    """The (source word, hypothesis word) links read from the reading ``view`` (``links_view``) of the attention
    that wrote a hypothesis (the word of each source piece and of each hypothesis piece, EOS's -1)."""
    return read_links(attention, src_words, hyp_words, view)


def align_scope(setting: Optional[str], gold_file: bool) -> str:
    """eval.align_scope, or where unset: "all" for a gold file (it annotates every word), "linked" for the
    corpus's own reference links (Strong's numbers leave function words untagged)."""
    return setting or ("all" if gold_file else "linked")


def alignment_view(a: dict) -> str:
    """Which method (attention, shift-att, both directions) an AER of metrics.json's ``alignment`` read, and over
    which words."""
    return f"{a.get('method', a['view'])}, chosen on {a['chosen_on']}; {a['scope']} target words"


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

    def best(self, among: Optional[list[str]] = None) -> str:
        """The view with the lowest AER (the first of equals), of all or of those ``among``."""
        return min(self.views if among is None else among, key=lambda view: self.result(view)["aer"])


def alignment_error_rate(predicted: list[set], gold: list[tuple[set, set]], scope: str = "all") -> dict:
    """AER, precision and recall of one set of predicted links per sentence."""
    if len(predicted) != len(gold):
        raise UserError(f"{len(predicted)} sentences to align but the gold file has {len(gold)} lines")
    score = AlignmentScore(["links"], scope)
    for links, (sure, possible) in zip(predicted, gold):
        score.add([links], sure, possible)
    return score.result("links")


@dataclass
class DirectionLinks:
    """What every reading (app/evaluation/extraction.py) of one model's attention links, per pair (by index in the
    pairs read): the most attended source word of each target word, (readings, target words); and of the readings
    ``soft`` names, each target word's distribution over the source words (``probabilities``: what agreement
    reads). A pair not read (too long for the model) links nothing."""

    names: list[str]
    best: dict[int, np.ndarray] = field(default_factory=dict)
    soft: tuple[str, ...] = ()
    probabilities: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # (pair, reading) -> (tgt, src)

    def links(self, i: int, reading: str, turned: bool = False) -> set[tuple[int, int]]:
        """Pair ``i``'s links of ``reading``; ``turned``: (target word, source word) of this model become (source
        word, target word) of the other direction."""
        row = self.best.get(i)
        if row is None:
            return set()
        links = word_links(row[self.names.index(reading)])
        return {(t, s) for s, t in links} if turned else links

    def score(self, gold: list[tuple[set, set]], scope: str, turned: bool = False) -> AlignmentScore:
        """Every reading's AER against ``gold`` (the forward direction's links; ``turned``: this model reads the
        pairs the other way round, so the gold is turned round too)."""
        score = AlignmentScore(self.names, scope)
        for i, (sure, possible) in enumerate(gold):
            if turned:
                sure, possible = {(t, s) for s, t in sure}, {(t, s) for s, t in possible}
            score.add([self.links(i, name) for name in self.names], sure, possible)
        return score


def read_direction(
    model,
    tokenizer,
    src: list[list[int]],
    tgt: list[list[int]],
    texts: tuple[list[str], list[str]],
    device,
    dtype,
    batch_tokens: int,
    readings: Optional[Sequence[str]] = None,
    keep: int = 0,
    progress: str = "",
    soft: Sequence[str] = (),
) -> tuple[Optional[DirectionLinks], dict]:
    """The links of every reading (or of ``readings``) of the teacher-forced attention of the pairs (``src``,
    ``tgt``: the model's subword ids of ``texts``, whose whitespace words the links number) that fit the model, the
    word probabilities of the readings ``soft``, and the attention of the first ``keep`` pairs (float16: for plots
    and the explorer). None, {} for a model without attention. ``progress``: a progress bar's title."""
    fits = fitting(model, src, tgt)
    read: Optional[DirectionLinks] = None
    kept = {}
    src_words = tokenizer.src_words([texts[0][i] for i in fits])
    tgt_words = tokenizer.tgt_words([texts[1][i] for i in fits])
    pairs = forced_attention(model, [src[i] for i in fits], [tgt[i] for i in fits], device, batch_tokens, dtype)
    for n, attention in tqdm(pairs, progress, len(fits), leave=False, unit="sentence", disable=not progress):
        i = fits[n]
        columns, rows = src_words[n] + [-1], tgt_words[n] + [-1]  # EOS: of no word
        names, best = read_words(attention, columns, rows, readings)
        read = read or DirectionLinks(names, soft=tuple(soft))
        read.best[i] = best
        if soft:
            for reading, words in zip(soft, read_probabilities(attention, columns, rows, soft)):
                read.probabilities[i, reading] = words.astype(np.float32)
        if i < keep:
            kept[i] = attention.half()
    return read, kept


def link_candidates(
    model,
    tokenizer,
    pairs: tuple[list[list[int]], list[list[int]]],
    texts: tuple[list[str], list[str]],
    device,
    dtype,
    batch_tokens: int,
    reverse=None,
    readings: tuple[Optional[Sequence[str]], Optional[Sequence[str]]] = (None, None),
    keep: int = 0,
    progress: str = "",
    soft: tuple[Sequence[str], Sequence[str]] = ((), ()),
) -> tuple[Optional[LinkCandidates], dict]:
    """The links of the ``pairs`` (this model's subword ids) by every reading of its attention (or ``readings[0]``)
    and, given a run of the other direction (``reverse``: a TrainedModel), by every reading (or ``readings[1]``) of
    its attention over the pairs' ``texts`` turned round; the word probabilities of the readings ``soft`` of each
    direction; the forced attention of the first ``keep`` pairs. None, {} for a model without attention.
    ``progress``: the progress bars' title."""
    src, tgt = pairs
    forward, kept = read_direction(
        model, tokenizer, src, tgt, texts, device, dtype, batch_tokens, readings[0], keep, progress, soft[0]
    )
    if forward is None or reverse is None:
        return (None if forward is None else LinkCandidates(forward)), kept
    r = reverse
    src, tgt = r.tokenizer.encode_src(texts[1]), r.tokenizer.encode_tgt(texts[0])  # the pairs turned round
    title = progress and f"{progress}, reverse run"
    backward, _ = read_direction(
        r.model,
        r.tokenizer,
        src,
        tgt,
        (texts[1], texts[0]),
        r.device,
        r.dtype,
        batch_tokens,
        readings[1],
        0,
        title,
        soft[1],
    )
    return LinkCandidates(forward, backward), kept


def fitting(model, src: list[list[int]], tgt: list[list[int]]) -> list[int]:
    """The pairs whose source and target (each with its ``</s>``) fit the model's positions, and neither empty."""
    limit = getattr(model, "max_positions", None) or float("inf")
    return [i for i, (s, t) in enumerate(zip(src, tgt)) if s and t and len(s) < limit and len(t) < limit]


@dataclass
class LinkCandidates:
    """The links of a split's pairs by every reading of this run's attention (``forward``) and, given a run of the
    other direction, of its attention (``reverse``, read from the pairs turned round): what the methods
    (app.evaluation.extraction.Method) are chosen among and read from."""

    forward: DirectionLinks
    reverse: Optional[DirectionLinks] = None

    def links(self, i: int, method: Method) -> set[tuple[int, int]]:
        if method.symmetrization == AGREEMENT and self.reverse is not None and method.threshold is not None:
            p_fwd = self.forward.probabilities.get((i, method.forward))
            p_rev = self.reverse.probabilities.get((i, str(method.reverse)))
            return set() if p_fwd is None or p_rev is None else agreement(p_fwd, p_rev, method.threshold)
        forward = self.forward.links(i, method.forward)
        if method.symmetrization is None or self.reverse is None:
            return forward
        return symmetrize(method.symmetrization, forward, self.reverse.links(i, str(method.reverse), turned=True))

    def directions(self, gold: list[tuple[set, set]], scope: str) -> tuple[str, Optional[str]]:
        """The reading of each direction that the symmetrizations and agreement join: this run's best against
        ``gold``, and the reverse run's reading whose intersection with it is the best. The reverse run serves only
        to be joined, so its reading is chosen by what it adds, not by its own AER (its own best reading is not
        always the one that agrees best: a guided head, docs/attention.md)."""
        forward = self.forward.score(gold, scope).best()
        if self.reverse is None:
            return forward, None
        score = AlignmentScore(self.reverse.names, scope)
        for i, (sure, possible) in enumerate(gold):
            mine = self.forward.links(i, forward)
            score.add([mine & self.reverse.links(i, name, turned=True) for name in self.reverse.names], sure, possible)
        return forward, score.best()

    def add_probabilities(self, other: Optional[LinkCandidates]) -> None:
        """Take the word probabilities ``other`` (a pass over the same pairs) read."""
        if other is None:
            return
        for mine, theirs in ((self.forward, other.forward), (self.reverse, other.reverse)):
            if mine is not None and theirs is not None:
                mine.soft += theirs.soft
                mine.probabilities.update(theirs.probabilities)

    def agreeing(self, directions: tuple[str, Optional[str]]) -> bool:
        """Whether the probabilities of both directions' readings were read (agreement can be scored)."""
        return self.reverse is not None and directions[0] in self.forward.soft and directions[1] in self.reverse.soft

    def score(self, gold: list[tuple[set, set]], scope: str, methods: list[Method]) -> AlignmentScore:
        score = AlignmentScore([m.name for m in methods], scope)
        for i, (sure, possible) in enumerate(gold):
            score.add([self.links(i, m) for m in methods], sure, possible)
        return score

    def methods(self, directions: tuple[str, Optional[str]], setting: str = "auto") -> list[Method]:
        """The methods ``align.method`` allows: this run's readings, and the symmetrizations and agreement (where
        their probabilities were read) of each direction's reading ``directions`` (``directions``' choice)."""
        return allowed(candidates(self.forward.names, *directions, agreeing=self.agreeing(directions)), setting)

    def choose(
        self,
        gold: list[tuple[set, set]],
        scope: str,
        setting: str = "auto",
        read_two: Optional[Callable[[tuple[str, str]], Optional[LinkCandidates]]] = None,
    ) -> tuple[Method, tuple[str, Optional[str]], AlignmentScore]:
        """The method of the lowest AER against ``gold`` that ``setting`` (align.method) allows, the reading of
        each direction (what the symmetrizations join), and the scores of every method (each kind's best:
        ``best(among=...)``), scored once. Agreement is among them where ``read_two`` reads the probabilities of
        the two readings over the same pairs (a pass more of each model) or they were read already."""
        directions = self.directions(gold, scope)
        if read_two is not None and directions[1] is not None and agreement_asked(directions, setting):
            self.add_probabilities(read_two((directions[0], directions[1])))
        methods = self.methods(directions)
        names = [m.name for m in allowed(methods, setting)]
        if not names:
            raise UserError(f"align.method={setting}: it needs a run of the other direction, align.reverse=<run>")
        score = self.score(gold, scope, methods)
        best = score.best(names)
        return next(m for m in methods if m.name == best), directions, score
