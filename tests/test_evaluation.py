"""Corpus scores agree with sacrebleu's own functions."""

import pytest
import sacrebleu

from app.errors import UserError
from app.scoring import score

HYPS = [
    "In the beginning God made the heavens and the earth.",
    "The earth was empty and without form.",
    "God said, let there be light, and there was light.",
    "And God saw the light was good.",
]
REFS = [
    "In the beginning, God created the heavens and the earth.",
    "The earth was formless and empty.",
    "God said, “Let there be light,” and there was light.",
    "God saw the light, and saw that it was good.",
]


def test_scores_match_sacrebleu():
    result = score(HYPS, REFS)
    assert result["sentences"] == 4
    assert result["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(HYPS, [REFS]).score, 2)
    assert result["ter"] == round(sacrebleu.corpus_ter(HYPS, [REFS]).score, 2)
    assert 0 < result["bleu"] < 100 and 0 < result["chrf"] < 100 and result["ter"] > 0


def test_perfect_and_disjoint_hypotheses():
    assert score(REFS, REFS)["bleu"] == 100.0
    assert score(REFS, REFS)["chrf"] == 100.0
    assert score(REFS, REFS)["ter"] == 0.0
    assert score(["xyz qqq"] * 4, REFS)["bleu"] == 0.0


def test_scores_are_rounded_to_two_decimals():
    result = score(HYPS, REFS)
    for name in ("bleu", "chrf", "ter"):
        assert result[name] == round(result[name], 2)


def test_signatures():
    result = score(HYPS, REFS)
    version = f"version:{sacrebleu.__version__}"
    for name in ("bleu", "chrf", "ter"):
        assert version in result[f"{name}_signature"]
    assert "nrefs:1" in result["bleu_signature"] and "tok:13a" in result["bleu_signature"]
    assert "nc:6" in result["chrf_signature"]


def test_without_ter():
    result = score(HYPS, REFS, ter=False)
    assert "ter" not in result and "ter_signature" not in result
    assert result["bleu"] == score(HYPS, REFS)["bleu"]


def test_count_mismatch_is_user_error():
    with pytest.raises(UserError, match="3 hypotheses against 4 references"):
        score(HYPS[:3], REFS)


def test_bleu_by_source_length_buckets():
    from app.scoring import bleu_by_length

    sources = ["a b", "a b c d e", "one two three four five six seven eight nine ten eleven twelve"]
    hyps = ["the cat sat", "a dog ran off fast", "something else entirely here"]
    refs = ["the cat sat", "a dog ran away quickly", "nothing alike at all"]
    buckets = bleu_by_length(hyps, refs, sources, [3, 10])
    assert [b["bucket"] for b in buckets] == ["0-3", "3-10", "10+"]
    assert [b["sentences"] for b in buckets] == [1, 1, 1]
    assert buckets[0]["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps[:1], [refs[:1]]).score, 2))
    assert buckets[1]["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps[1:2], [refs[1:2]]).score, 2))
    empty = bleu_by_length(hyps, refs, sources, [100])
    assert empty[1] == {"bucket": "100+", "sentences": 0}


def test_bleu_of_the_longest_tenth():
    from app.scoring import bleu_of_longest

    # 11 sentences: ⌈1.1⌉ = 2 longest sources, the 8-word one and the earlier of the two 5-word ones
    sources = ["w " * n for n in (1, 5, 2, 8, 3, 5, 1, 2, 3, 1, 2)]
    refs = [f"the reference sentence number {i} is here" for i in range(11)]
    hyps = ["nothing in common"] * 11
    hyps[1], hyps[3] = refs[1], refs[3]
    assert bleu_of_longest(hyps, refs, sources, 0.1) == (100.0, 2)
    hyps = ["nothing in common"] * 11
    hyps[5] = refs[5]  # the later 5-word sentence is not among them
    assert bleu_of_longest(hyps, refs, sources, 0.1) == (0.0, 2)
    assert bleu_of_longest([], [], [], 0.1) == (None, 0)
