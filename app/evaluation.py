"""Corpus-level scores with sacrebleu: BLEU, chrF and TER, each with its signature; BLEU by source length."""
from __future__ import annotations

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


def bleu_by_length(hypotheses: list[str], references: list[str], sources: list[str],
                   edges: list[int]) -> list[dict]:
    """Corpus BLEU of the sentences in each source-length bucket (whitespace words), as in Bahdanau
    et al. 2014, Fig. 2. ``edges`` [10, 20] gives buckets 0-10, 10-20 and 20+ (lower bound inclusive)."""
    bounds = [0, *edges, None]
    buckets = []
    for low, high in zip(bounds, bounds[1:]):
        members = [i for i, src in enumerate(sources) if len(src.split()) >= low and (high is None or len(src.split()) < high)]
        bucket = {"bucket": f"{low}-{high}" if high is not None else f"{low}+", "sentences": len(members)}
        if members:
            bucket["bleu"] = round(BLEU().corpus_score([hypotheses[i] for i in members], [[references[i] for i in members]]).score, 2)
        buckets.append(bucket)
    return buckets
