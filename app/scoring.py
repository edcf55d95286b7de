"""Scores with sacrebleu: corpus BLEU, chrF and TER, each with its signature; BLEU by source length and of
the longest sources; sentence BLEU."""

from __future__ import annotations

import math
from typing import Optional

from sacrebleu.metrics import BLEU, CHRF, TER

from app.errors import UserError


def score(hypotheses: list[str], references: list[str], ter: bool = True) -> dict:
    if len(hypotheses) != len(references):
        raise UserError(f"cannot score {len(hypotheses)} hypotheses against {len(references)} references")
    metrics = {"sentences": len(hypotheses)}
    for name, metric in [("bleu", BLEU()), ("chrf", CHRF())] + ([("ter", TER())] if ter else []):
        result = metric.corpus_score(hypotheses, [references])
        metrics[name] = round(result.score, 2)
        metrics[f"{name}_signature"] = str(metric.get_signature())
    return metrics


def bleu_by_length(hypotheses: list[str], references: list[str], sources: list[str], edges: list[int]) -> list[dict]:
    """Corpus BLEU of the sentences in each source-length bucket (whitespace words), as in Bahdanau
    et al. 2014, Fig. 2. ``edges`` [10, 20] gives buckets 0-10, 10-20 and 20+ (lower bound inclusive)."""
    bounds = [0, *edges, None]
    buckets = []
    for low, high in zip(bounds, bounds[1:]):
        members = [
            i for i, src in enumerate(sources) if len(src.split()) >= low and (high is None or len(src.split()) < high)
        ]
        bucket = {"bucket": f"{low}-{high}" if high is not None else f"{low}+", "sentences": len(members)}
        if members:
            bucket["bleu"] = round(
                BLEU().corpus_score([hypotheses[i] for i in members], [[references[i] for i in members]]).score, 2
            )
        buckets.append(bucket)
    return buckets


def bleu_of_longest(
    hypotheses: list[str], references: list[str], sources: list[str], fraction: float = 0.1
) -> tuple[Optional[float], int]:
    """Corpus BLEU of the ⌈fraction · N⌉ sentences with the longest sources (whitespace words; of equal
    lengths, the earlier sentences), and their number: where position schemes that extrapolate differ."""
    n = math.ceil(fraction * len(sources))
    longest = sorted(range(len(sources)), key=lambda i: -len(sources[i].split()))[:n]
    if not longest:
        return None, 0
    result = BLEU().corpus_score([hypotheses[i] for i in longest], [[references[i] for i in longest]])
    return round(result.score, 2), n


def sentence_bleu(hypotheses: list[str], references: list[str]) -> list[float]:
    """Each hypothesis's BLEU against its reference (effective n-gram order: short sentences score too)."""
    metric = BLEU(effective_order=True)
    return [metric.sentence_score(h, [r]).score for h, r in zip(hypotheses, references)]


def split_scores(hypotheses: list[str], references: list[str], sources: list[str], length_buckets: list[int]) -> dict:
    """What ``make eval`` reports of a split's translations: BLEU, chrF and TER with their signatures, BLEU
    per source-length bucket (``length_buckets``: the edges) and BLEU of the longest 10 %."""
    metrics = score(hypotheses, references)
    metrics["bleu_by_source_length"] = bleu_by_length(hypotheses, references, sources, length_buckets)
    metrics["bleu_longest_10pct"], metrics["longest_10pct_sentences"] = bleu_of_longest(
        hypotheses, references, sources, 0.1
    )
    return metrics
