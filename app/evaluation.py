"""Corpus-level scores with sacrebleu: BLEU, chrF and TER, each with its signature."""
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
