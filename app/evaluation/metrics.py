"""Scores with sacrebleu: corpus BLEU, chrF and TER, each with its signature; BLEU by source length and of
the longest sources; sentence BLEU. A split's BLEU statistics are counted once and every BLEU above is
summed from them (``BleuStatistics``); TER, slow pure Python, can be counted in parts (``ter_statistics``):
a share in the host worker process while the caller does the rest. BLEU counts the words of one of sacrebleu's
tokenizers (``bleu_tokenizer``: eval.bleu_tokenize, or sacrebleu's choice for the target language), named in its
signature; chrF counts characters and TER whitespace words, as sacrebleu's defaults do, but for a target BLEU counts
in Chinese, Japanese or Korean words (``ter_metric``). Every score takes more than one reference translation of each
sentence where given (``more``: further streams of references, a line per sentence each; eval.references): BLEU
counts an n-gram matched in any of them, its length the closest reference's; chrF takes each sentence's best
reference, TER its fewest edits over the references' mean length (tercom's rule). The signatures say how many
(``nrefs``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Optional

from sacrebleu.metrics import BLEU, CHRF, TER

from app.run.errors import UserError


def _streams(hypotheses: list[str], references: list[str], more: Sequence[list[str]] = ()) -> list[list[str]]:
    """sacrebleu's reference streams: ``references`` and each of ``more``, each with a line per hypothesis."""
    streams = [references, *more]
    for stream in streams:
        if len(hypotheses) != len(stream):
            raise UserError(f"cannot score {len(hypotheses)} hypotheses against {len(stream)} references")
    return streams


def bleu_tokenizer(setting: Optional[str], tgt_lang: str) -> str:
    """The tokenizer whose words BLEU counts: ``setting`` (eval.bleu_tokenize), or, unset, the one sacrebleu's own
    command line picks for the target language (``tgt_lang``: data.tgt_lang, or data.src_lang for data.reverse;
    zh_CN is zh): zh for Chinese, ja-mecab for Japanese, ko-mecab for Korean, 13a otherwise. 13a splits at spaces
    and punctuation only, so a sentence of unsegmented Chinese would be a single word, and BLEU 0 unless the
    hypothesis is the reference exactly. A tokenizer whose extras are not installed is one line naming the setting."""
    language = tgt_lang.replace("-", "_").split("_")[0].lower()
    name = setting or getattr(BLEU, "_TOKENIZER_MAP", {}).get(language, BLEU.TOKENIZER_DEFAULT)
    try:
        BLEU(tokenize=name)
    except RuntimeError:  # sacrebleu's message: its extras are missing
        extra = name.split("-")[0]
        why = "" if setting else f" (sacrebleu's choice for the target language {tgt_lang})"
        raise UserError(
            f"eval.bleu_tokenize={name}{why} needs sacrebleu's {extra} extras: .venv/bin/pip install "
            f"'sacrebleu[{extra}]', or set eval.bleu_tokenize=char"
        ) from None
    return name


# BLEU's tokenizers of languages written without spaces between words
ASIAN_TOKENIZERS = ("zh", "ja-mecab", "ko-mecab")


def ter_metric(tokenize: str) -> TER:
    """sacrebleu's TER for a target whose BLEU counts ``tokenize``'s words: with a Chinese, Japanese or Korean
    tokenizer, TER splits those scripts' characters too (``asian_support``, which sacrebleu allows with
    ``normalized`` only: punctuation split off, as its tercom normalization does); otherwise its default, whitespace
    words, under which a sentence of unsegmented Chinese is one word and any error costs all of it."""
    asian = tokenize in ASIAN_TOKENIZERS
    return TER(normalized=asian, asian_support=asian)


def score(
    hypotheses: list[str], references: list[str], tokenize: str, ter: bool = True, more: Sequence[list[str]] = ()
) -> dict:
    """Corpus BLEU (of ``tokenize``'s words), chrF and (``ter``) TER, each with its signature."""
    streams = _streams(hypotheses, references, more)
    metrics: dict[str, Any] = {"sentences": len(hypotheses)}
    metrics_of = [("bleu", BLEU(tokenize=tokenize)), ("chrf", CHRF())] + (
        [("ter", ter_metric(tokenize))] if ter else []
    )
    for name, metric in metrics_of:
        result = metric.corpus_score(hypotheses, streams)
        metrics[name] = round(result.score, 2)
        metrics[f"{name}_signature"] = str(metric.get_signature())
    return metrics


class BleuStatistics:
    """Each sentence's BLEU statistics (n-gram matches and lengths of ``tokenize``'s words), counted
    once: corpus BLEU of any subset of the sentences and each sentence's BLEU are sums of them, the same
    numbers as sacrebleu's ``corpus_score`` and ``sentence_score`` of those sentences."""

    def __init__(self, hypotheses: list[str], references: list[str], tokenize: str, more: Sequence[list[str]] = ()):
        streams = _streams(hypotheses, references, more)
        self.metric, self.tokenize = BLEU(tokenize=tokenize), tokenize
        # sacrebleu's own per-sentence counting (what corpus_score sums)
        self.stats = self.metric._extract_corpus_statistics(hypotheses, streams)

    def corpus(self, members: Optional[list[int]] = None) -> float:
        stats = self.stats if members is None else [self.stats[i] for i in members]
        return self.metric._aggregate_and_compute(stats).score

    def sentences(self) -> list[float]:
        """Each sentence's BLEU with effective n-gram order (short sentences score too)."""
        sentence = BLEU(tokenize=self.tokenize, effective_order=True)
        return [sentence._compute_score_from_stats(stats).score for stats in self.stats]


def bleu_by_length(stats: BleuStatistics, sources: list[str], edges: list[int]) -> list[dict]:
    """Corpus BLEU (of the sentences' ``stats``) of the sentences in each source-length bucket (whitespace words),
    as in Bahdanau et al. 2014, Fig. 2. ``edges`` [10, 20] gives buckets 0-10, 10-20 and 20+ (lower bound
    inclusive)."""
    lengths = [len(src.split()) for src in sources]
    buckets = []
    for low, high in zip([0, *edges], [*edges, None]):
        members = [i for i, n in enumerate(lengths) if n >= low and (high is None or n < high)]
        bucket: dict[str, Any] = {
            "bucket": f"{low}-{high}" if high is not None else f"{low}+",
            "sentences": len(members),
        }
        if members:
            bucket["bleu"] = round(stats.corpus(members), 2)
        buckets.append(bucket)
    return buckets


def bleu_of_longest(stats: BleuStatistics, sources: list[str], fraction: float = 0.1) -> tuple[Optional[float], int]:
    """Corpus BLEU (of the sentences' ``stats``) of the ⌈fraction · N⌉ sentences with the longest sources
    (whitespace words; of equal lengths, the earlier sentences), and their number: where position schemes that
    extrapolate differ."""
    n = math.ceil(fraction * len(sources))
    longest = sorted(range(len(sources)), key=lambda i: -len(sources[i].split()))[:n]
    if not longest:
        return None, 0
    return round(stats.corpus(longest), 2), n


def sentence_bleu(
    hypotheses: list[str], references: list[str], tokenize: str, more: Sequence[list[str]] = ()
) -> list[float]:
    """Each hypothesis's BLEU against its reference(s) (effective n-gram order: short sentences score too)."""
    return BleuStatistics(hypotheses, references, tokenize, more).sentences()


def split_scores(
    hypotheses: list[str],
    references: list[str],
    sources: list[str],
    length_buckets: list[int],
    tokenize: str,
    ter: bool = True,
    more: Sequence[list[str]] = (),
) -> tuple[dict, list[float]]:
    """What ``make eval`` reports of a split's translations: BLEU (of ``tokenize``'s words), chrF and (``ter``) TER
    with their signatures, BLEU per source-length bucket (``length_buckets``: the edges) and BLEU of the longest
    10 %; and each sentence's BLEU. The BLEU statistics are counted once for all of them."""
    stats = BleuStatistics(hypotheses, references, tokenize, more)
    metrics: dict[str, Any] = {"sentences": len(hypotheses), "bleu": round(stats.corpus(), 2)}
    metrics["bleu_signature"], metrics["bleu_tokenize"] = str(stats.metric.get_signature()), tokenize
    chrf = CHRF()
    metrics["chrf"] = round(chrf.corpus_score(hypotheses, [references, *more]).score, 2)
    metrics["chrf_signature"] = str(chrf.get_signature())
    if ter:
        metrics.update(ter_score(hypotheses, references, tokenize, more))
    metrics["bleu_by_source_length"] = bleu_by_length(stats, sources, length_buckets)
    metrics["bleu_longest_10pct"], metrics["longest_10pct_sentences"] = bleu_of_longest(stats, sources)
    return metrics, stats.sentences()


def ter_score(hypotheses: list[str], references: list[str], tokenize: str, more: Sequence[list[str]] = ()) -> dict:
    """Corpus TER (``ter_metric(tokenize)``) and its signature: {"ter", "ter_signature"}."""
    metric = ter_metric(tokenize)
    result = metric.corpus_score(hypotheses, _streams(hypotheses, references, more))
    return {"ter": round(result.score, 2), "ter_signature": str(metric.get_signature())}


def ter_statistics(
    hypotheses: list[str], references: list[str], tokenize: str, more: Sequence[list[str]] = ()
) -> tuple[list, Optional[str], float]:
    """Each sentence's TER statistics (``ter_metric(tokenize)``: edits, reference words: what sacrebleu's
    ``corpus_score`` sums), the metric's signature (None for no sentences) and the seconds they took. sacrebleu's
    TER is pure Python, seconds for a thousand sentences on one core: ``make eval`` counts a share of the sentences
    in the host worker (app/run/host_worker.py) and the rest itself."""
    streams = _streams(hypotheses, references, more)
    if not hypotheses:
        return [], None, 0.0
    start, metric = time.perf_counter(), ter_metric(tokenize)
    stats = metric._extract_corpus_statistics(hypotheses, streams)
    return stats, str(metric.get_signature()), time.perf_counter() - start


def ter_of_statistics(stats: list, signature: Optional[str]) -> dict:
    """Corpus TER from the sentences' ``ter_statistics``, in the split's order, with its signature: the
    number ``ter_score`` of the same sentences gives."""
    return {"ter": round(TER()._aggregate_and_compute(stats).score, 2), "ter_signature": signature}
