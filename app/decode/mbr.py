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
from collections.abc import Callable
from typing import Optional

from tqdm import tqdm

from app.config.commands import MBR_UTILITIES, DecodeConfig
from app.decode.mbr_utility import PairwiseUtility, rank_sentences, ranked
from app.decode.search import Hypotheses
from app.run.host_worker import host_worker, submit

# (sources, decoding, prefixes, constraints) -> hypotheses: a trained model's corpus decoding
Search = Callable[[list[list[int]], DecodeConfig, Optional[list[list[int]]], Optional[list]], Hypotheses]
# from this many sentences on, the host worker process ranks the second half of them while this one ranks the
# first (fewer rank in less time than a worker takes to start)
WORKER_FROM = 32


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


def minimum_bayes_risk(
    search: Search,
    src: list[list[int]],
    decode: DecodeConfig,
    detokenize: Callable[[list[list[int]]], list[str]],
    prefix: Optional[list[list[int]]] = None,
    constraints: Optional[list] = None,
    progress: bool = False,
    worker_from: int = WORKER_FROM,
) -> Hypotheses:
    """Each sentence's candidate of highest expected utility (the module's docstring), as Hypotheses without
    attention; with ``decode.n_best`` > 1, its distinct candidates ranked, scored by expected utility. From
    ``worker_from`` sentences on, the host worker ranks half of them. What it did and where its seconds went is in
    the result's ``mbr``."""
    start = time.perf_counter()
    candidates = draw_candidates(search, src, decode, prefix, constraints)
    drawn = time.perf_counter()
    texts = [detokenize(tokens) for tokens in candidates]
    worker = host_worker(preload=("app.decode.mbr_utility",)) if len(src) >= worker_from else None
    cut = len(texts) // 2 if worker is not None else len(texts)
    beside = submit(worker, rank_sentences, texts[cut:], decode.mbr_utility) if worker is not None else None
    u, orders = PairwiseUtility(decode.mbr_utility), []
    desc = f"MBR ({decode.mbr_utility}{', half in a worker process' * (worker is not None)})"
    for sentence in tqdm(texts[:cut], desc=desc, unit="sentence", disable=not progress):
        orders.append(ranked(sentence, u))
    orders += beside.result() if beside is not None else []
    best = [tokens[order[0][0]] for tokens, order in zip(candidates, orders)]
    nbest = [[(tokens[i], value) for i, value in order[: decode.n_best]] for tokens, order in zip(candidates, orders)]
    distinct = sum(len(order) for order in orders)
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
            "utility_processes": 1 + (worker is not None),
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
