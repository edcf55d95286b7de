"""Minimum Bayes risk decoding (``decode.mbr_candidates``): of a sentence's candidate translations, the one that
agrees most with the others, instead of the most probable one (Kumar & Byrne 2004; Eikema & Aziz 2020, "Is MAP
Decoding All You Need?"; Freitag et al. 2022, "High Quality Rather than High Model Probability").

The candidates H are N samples of the model (``decode.sampling``, with its top-k, top-p, temperature) or a beam
search's N best. They are also the pseudo-references: the model's distribution stands in for the unknown
reference, so the risk of choosing h is estimated as its expected utility against them,

    ŷ = argmax_{h ∈ H}  (1 / N) Σ_{y ∈ H} u(h, y)

with u sacrebleu's sentence chrF or BLEU (``decode.mbr_utility``) of h against y, on detokenized text. A
candidate drawn twice counts twice among the references (a Monte Carlo estimate), and is scored once. Ties go to
the earlier candidate: the beam's better one, or the first drawn."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from typing import Optional

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.helpers import extract_all_char_ngrams, extract_all_word_ngrams
from tqdm import tqdm

from app.config.commands import MBR_UTILITIES, DecodeConfig
from app.decode.search import Hypotheses

# (sources, decoding, prefixes, constraints) -> hypotheses: a trained model's corpus decoding
Search = Callable[[list[list[int]], DecodeConfig, Optional[list[list[int]]], Optional[list]], Hypotheses]


class PairwiseUtility:
    """u(h, y) of ``decode.mbr_utility`` for every ordered pair of a sentence's distinct candidates: sacrebleu's
    sentence chrF (its defaults: character 6-grams, β = 2) or sentence BLEU (exponential smoothing, orders above the
    hypothesis' length left out), each computed from sacrebleu's own n-gram counts and statistics.

    The counts are what sacrebleu's ``sentence_score`` would count, made once per candidate instead of twice per
    pair, and the clipped matches once per unordered pair: h's matches against y are y's against h. The same
    scores, 9.6 times faster for chrF and 5.4 for BLEU (docs/configuration.md). It calls two of sacrebleu's
    private methods (``_preprocess_segment``, ``_compute_score_from_stats``): tests/test_mbr.py holds every pair's
    score to the public ``sentence_score``, so that a sacrebleu that changes them fails there."""

    def __init__(self, name: str) -> None:
        self.chrf = name == "chrf"
        self.metric: CHRF | BLEU = CHRF() if self.chrf else BLEU(effective_order=True)

    def counts(self, text: str) -> tuple[list[Counter], list[int], int]:
        """Per n-gram order, the n-grams of ``text`` counted, and their totals; and its length in words."""
        m, line = self.metric, self.metric._preprocess_segment(text)
        if isinstance(m, CHRF):
            grams = extract_all_char_ngrams(line, m.char_order, m.whitespace)
            length = 0  # unused by chrF
        else:
            mixed, length = extract_all_word_ngrams(line, 1, m.max_ngram_order)
            grams = [Counter({g: c for g, c in mixed.items() if len(g) == n}) for n in range(1, m.max_ngram_order + 1)]
        return grams, [sum(g.values()) for g in grams], length

    def score(self, hyp: tuple, ref: tuple, matches: list[int]) -> float:
        """sacrebleu's score of ``hyp`` against ``ref`` (their ``counts``) from their clipped ``matches``."""
        (_, hyp_totals, hyp_len), (_, ref_totals, ref_len) = hyp, ref
        if self.chrf:  # [hyp, ref, match] per order; no hypothesis n-grams where the reference has none
            stats = [x for h, r, m in zip(hyp_totals, ref_totals, matches) for x in (h if r else 0, r, m)]
        else:  # [hyp length, ref length, matches per order, hypothesis n-grams per order]
            stats = [hyp_len, ref_len, *matches, *hyp_totals]
        return self.metric._compute_score_from_stats(stats).score

    def matrix(self, texts: list[str]) -> list[list[float]]:
        """u(texts[i], texts[j]) for every i and j."""
        counted = [self.counts(t) for t in texts]
        u = [[0.0] * len(texts) for _ in texts]
        for i, a in enumerate(counted):
            for j in range(i, len(texts)):
                b = counted[j]
                matches = [clipped(x, y) for x, y in zip(a[0], b[0])]
                u[i][j], u[j][i] = self.score(a, b, matches), self.score(b, a, matches)
        return u


def clipped(a: Counter, b: Counter) -> int:
    """The n-grams two counts share, each counted as often as the one that has fewer of it."""
    if len(b) < len(a):
        a, b = b, a
    return sum(min(count, b[gram]) for gram, count in a.items() if gram in b)


def candidate_decoding(decode: DecodeConfig) -> DecodeConfig:
    """The decoding that draws the candidates: one sample per row (each sentence repeated N times), or a beam
    search returning its N best."""
    n = decode.mbr_candidates
    return dataclasses.replace(decode, mbr_candidates=0, n_best=1 if decode.sampling else n)


def draw_candidates(
    search: Search,
    src: list[list[int]],
    decode: DecodeConfig,
    prefix: Optional[list[list[int]]] = None,
    constraints: Optional[list] = None,
) -> list[list[list[int]]]:
    """Per sentence, its candidates' tokens, in the order drawn (samples) or best first (beam search): one search
    over the whole corpus, each sentence, prefix and constraint repeated N times when sampling."""
    n, plain = decode.mbr_candidates, candidate_decoding(decode)
    if not decode.sampling:
        hyps = search(src, plain, prefix, constraints)
        assert hyps.nbest is not None  # a beam search's (beam_size >= n_best = N)
        return [[tokens for tokens, _ in nbest] for nbest in hyps.nbest]
    repeat = lambda rows: None if rows is None else [row for row in rows for _ in range(n)]  # noqa: E731
    hyps = search([s for s in src for _ in range(n)], plain, repeat(prefix), repeat(constraints))
    return [hyps.tokens[i * n : (i + 1) * n] for i in range(len(src))]


def ranked(texts: list[str], utility: PairwiseUtility) -> list[tuple[int, float]]:
    """(index of a candidate's first occurrence in ``texts``, its expected utility) of each distinct candidate,
    the highest first (ties: the earlier first)."""
    counts = Counter(texts)
    distinct = list(counts)  # in the order first drawn
    u = utility.matrix(distinct)
    first = {text: i for i, text in reversed(list(enumerate(texts)))}
    expected = [sum(counts[y] * u[i][j] for j, y in enumerate(distinct)) / len(texts) for i in range(len(distinct))]
    return sorted(((first[text], value) for text, value in zip(distinct, expected)), key=lambda p: (-p[1], p[0]))


def minimum_bayes_risk(
    search: Search,
    src: list[list[int]],
    decode: DecodeConfig,
    detokenize: Callable[[list[list[int]]], list[str]],
    prefix: Optional[list[list[int]]] = None,
    constraints: Optional[list] = None,
    progress: bool = False,
) -> Hypotheses:
    """Each sentence's candidate of highest expected utility (the module's docstring), as Hypotheses without
    attention; with ``decode.n_best`` > 1, its distinct candidates ranked, scored by expected utility. What it did
    and where its seconds went is in the result's ``mbr``."""
    start = time.perf_counter()
    candidates = draw_candidates(search, src, decode, prefix, constraints)
    drawn = time.perf_counter()
    u, best, nbest, distinct = PairwiseUtility(decode.mbr_utility), [], [], 0
    for tokens in tqdm(candidates, desc=f"MBR ({decode.mbr_utility})", unit="sentence", disable=not progress):
        order = ranked(detokenize(tokens), u)
        distinct += len(order)
        best.append(tokens[order[0][0]])
        nbest.append([(tokens[i], value) for i, value in order[: decode.n_best]])
    return Hypotheses(
        best,
        nbest=nbest if decode.n_best > 1 else None,
        mbr={
            "sentences": len(src),
            "candidates": decode.mbr_candidates,
            "utility": decode.mbr_utility,
            "distinct_per_sentence": round(distinct / max(len(src), 1), 2),
            "candidate_seconds": round(drawn - start, 2),
            "utility_seconds": round(time.perf_counter() - drawn, 2),
        },
    )


def mbr_seconds(figures: dict) -> str:
    """Where minimum Bayes risk decoding's seconds went, from its ``Hypotheses.mbr`` figures: "the candidates
    61.2 s, chrF of 9.4 distinct a sentence 20.3 s, the chosen ones' attention 3.1 s"."""
    utility = MBR_UTILITIES[figures["utility"]]
    seconds = (
        f"the candidates {figures['candidate_seconds']:.1f} s, {utility} of "
        f"{figures['distinct_per_sentence']:g} distinct a sentence {figures['utility_seconds']:.1f} s"
    )
    if "attention_seconds" in figures:
        seconds += f", the chosen ones' attention {figures['attention_seconds']:.1f} s"
    return seconds


def merged(figures: list[dict]) -> dict:
    """The figures of several calls (make translate's windows) as one call's."""
    sentences = sum(f["sentences"] for f in figures)
    return {
        **figures[0],
        "sentences": sentences,
        "distinct_per_sentence": round(
            sum(f["distinct_per_sentence"] * f["sentences"] for f in figures) / sentences, 2
        ),
        "candidate_seconds": round(sum(f["candidate_seconds"] for f in figures), 2),
        "utility_seconds": round(sum(f["utility_seconds"] for f in figures), 2),
        **(
            {"attention_seconds": round(sum(f["attention_seconds"] for f in figures), 2)}
            if "attention_seconds" in figures[0]
            else {}
        ),
    }
