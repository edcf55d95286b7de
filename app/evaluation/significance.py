"""Is system B really better than system A? Paired significance of BLEU and chrF differences on the same
references, through sacrebleu's own implementation (``sacrebleu.significance.PairedTest``, as its CLI's
``--paired-bs`` and ``--paired-ar`` run it): paired bootstrap resampling (Koehn 2004; 1,000 resamples, with each
system's 95 % confidence interval) and approximate randomization (Riezler & Maxwell 2005; sacrebleu's 10,000
trials), each with a fixed seed (sacrebleu's ``SACREBLEU_SEED``, 12345 unless set), so that the same files give the
same p-values."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from app.run.errors import UserError, required

BOOTSTRAP_SAMPLES = 1000
RANDOMIZATION_TRIALS = 10000
ALPHA = 0.05  # a difference is significant where both tests give p below it
METRICS = ("BLEU", "chrF2")  # sacrebleu's names of the scores compared


@dataclass
class Compared:
    """One system's scores against the baseline (the first system): per metric, the score, the bootstrap's mean
    and 95 % confidence interval (± ``ci``), and the p-values of the two paired tests (None for the baseline)."""

    name: str
    scores: dict[str, dict]

    def significant(self, metric: str) -> bool:
        s = self.scores[metric]
        return s["p_bootstrap"] is not None and max(s["p_bootstrap"], s["p_randomization"]) < ALPHA


def paired_significance(
    systems: Sequence[tuple[str, Sequence[str]]],
    references: Sequence[str],
    tokenize: str,
    more: Sequence[Sequence[str]] = (),
) -> list[Compared]:
    """Every system of ``systems`` ((name, hypotheses); the first is the baseline) against the baseline, on
    ``references`` (and the further reference streams ``more``), BLEU counting ``tokenize``'s words: each
    hypothesis list must have one line per reference."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest, Result

    for name, hyps in systems:
        if len(hyps) != len(references):
            raise UserError(f"{name}: {len(hyps)} hypotheses for {len(references)} references: a line per reference")
    if len(systems) < 2:
        return [Compared(name, {}) for name, _ in systems]
    results = {}
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)  # its INFO lines narrate each test's steps
    for test, samples in (("bs", BOOTSTRAP_SAMPLES), ("ar", RANDOMIZATION_TRIALS)):
        paired = PairedTest(
            [(name, list(hyps)) for name, hyps in systems],
            {"bleu": BLEU(tokenize=tokenize), "chrf": CHRF()},
            [list(references), *map(list, more)],
            test_type=test,
            n_samples=samples,
        )
        results[test] = paired()[1]
    compared = []
    for i, (name, _) in enumerate(systems):
        scores = {}
        for metric in METRICS:
            boot, rand = results["bs"][metric][i], results["ar"][metric][i]
            assert isinstance(boot, Result) and isinstance(rand, Result)  # a metric's column ("System": the names)
            scores[metric] = {
                "score": round(float(boot.score), 2),
                "mean": round(float(required(boot.mean, "the bootstrap's mean")), 2),
                "ci95": round(float(required(boot.ci, "the bootstrap's interval")), 2),
                "p_bootstrap": None if boot.p_value is None else round(float(boot.p_value), 4),
                "p_randomization": None if rand.p_value is None else round(float(rand.p_value), 4),
            }
        compared.append(Compared(name, scores))
    return compared


def in_words(compared: list[Compared]) -> list[str]:
    """Which differences from the baseline are significant at p < 0.05 (both tests agreeing), a line each."""
    if len(compared) < 2:
        return []
    base, lines = compared[0], []
    for c in compared[1:]:
        parts = []
        for metric in METRICS:
            s, b = c.scores[metric], base.scores[metric]
            delta = s["score"] - b["score"]
            if delta == 0:  # sacrebleu's tests call even identical systems different (multeval's convention)
                verdict = f"the same score as {base.name}"
            elif c.significant(metric):
                verdict = f"{'better' if delta > 0 else 'worse'} than {base.name}, significantly"
            else:
                verdict = f"not significantly different from {base.name}"
            p = f"p = {s['p_bootstrap']:.4f} bootstrap, {s['p_randomization']:.4f} randomization"
            parts.append(f"{metric} {delta:+.2f} ({verdict}: {p})")
        lines.append(f"{c.name}: " + "; ".join(parts))
    return lines


def sentence_wins(ours: Sequence[float], baseline: Sequence[float]) -> dict[str, int]:
    """On how many sentences our sentence BLEU is above, below or equal to the baseline's as the explorer shows them
    (to 0.01: 1.4267 against 1.4231 is 1.43 against 1.42, higher): where a corpus difference comes from, a few
    sentences or many (compare-mt's question)."""
    differences = [round(a, 2) - round(b, 2) for a, b in zip(ours, baseline, strict=True)]
    return {
        "better": sum(d > 0 for d in differences),
        "worse": sum(d < 0 for d in differences),
        "same": sum(d == 0 for d in differences),
    }


def interval(scores: dict) -> str:
    """``23.41 ± 0.85``: a score and the half width of its bootstrap 95 % interval."""
    return f"{scores['score']:.2f} ± {scores['ci95']:.2f}"
