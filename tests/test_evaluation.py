"""Corpus scores agree with sacrebleu's own functions."""

import pytest
import sacrebleu

from app.evaluation.metrics import score
from app.run.errors import UserError

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
    result = score(HYPS, REFS, "13a")
    assert result["sentences"] == 4
    assert result["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(HYPS, [REFS]).score, 2)
    assert result["ter"] == round(sacrebleu.corpus_ter(HYPS, [REFS]).score, 2)
    assert 0 < result["bleu"] < 100 and 0 < result["chrf"] < 100 and result["ter"] > 0


def test_perfect_and_disjoint_hypotheses():
    assert score(REFS, REFS, "13a")["bleu"] == 100.0
    assert score(REFS, REFS, "13a")["chrf"] == 100.0
    assert score(REFS, REFS, "13a")["ter"] == 0.0
    assert score(["xyz qqq"] * 4, REFS, "13a")["bleu"] == 0.0


def test_scores_are_rounded_to_two_decimals():
    result = score(HYPS, REFS, "13a")
    for name in ("bleu", "chrf", "ter"):
        assert result[name] == round(result[name], 2)


def test_signatures():
    result = score(HYPS, REFS, "13a")
    version = f"version:{sacrebleu.__version__}"
    for name in ("bleu", "chrf", "ter"):
        assert version in result[f"{name}_signature"]
    assert "nrefs:1" in result["bleu_signature"] and "tok:13a" in result["bleu_signature"]
    assert "nc:6" in result["chrf_signature"]


def test_without_ter():
    result = score(HYPS, REFS, "13a", ter=False)
    assert "ter" not in result and "ter_signature" not in result
    assert result["bleu"] == score(HYPS, REFS, "13a")["bleu"]


def test_count_mismatch_is_user_error():
    with pytest.raises(UserError, match="3 hypotheses against 4 references"):
        score(HYPS[:3], REFS, "13a")


def test_bleu_by_source_length_buckets():
    from app.evaluation.metrics import BleuStatistics, bleu_by_length

    sources = ["a b", "a b c d e", "one two three four five six seven eight nine ten eleven twelve"]
    hyps = ["the cat sat", "a dog ran off fast", "something else entirely here"]
    refs = ["the cat sat", "a dog ran away quickly", "nothing alike at all"]
    buckets = bleu_by_length(BleuStatistics(hyps, refs, "13a"), sources, [3, 10])
    assert [b["bucket"] for b in buckets] == ["0-3", "3-10", "10+"]
    assert [b["sentences"] for b in buckets] == [1, 1, 1]
    assert buckets[0]["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps[:1], [refs[:1]]).score, 2))
    assert buckets[1]["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps[1:2], [refs[1:2]]).score, 2))
    empty = bleu_by_length(BleuStatistics(hyps, refs, "13a"), sources, [100])
    assert empty[1] == {"bucket": "100+", "sentences": 0}


def test_bleu_of_the_longest_tenth():
    from app.evaluation.metrics import BleuStatistics, bleu_of_longest

    # 11 sentences: ⌈1.1⌉ = 2 longest sources, the 8-word one and the earlier of the two 5-word ones
    sources = ["w " * n for n in (1, 5, 2, 8, 3, 5, 1, 2, 3, 1, 2)]
    refs = [f"the reference sentence number {i} is here" for i in range(11)]
    hyps = ["nothing in common"] * 11
    hyps[1], hyps[3] = refs[1], refs[3]
    assert bleu_of_longest(BleuStatistics(hyps, refs, "13a"), sources, 0.1) == (100.0, 2)
    hyps = ["nothing in common"] * 11
    hyps[5] = refs[5]  # the later 5-word sentence is not among them
    assert bleu_of_longest(BleuStatistics(hyps, refs, "13a"), sources, 0.1) == (0.0, 2)
    assert bleu_of_longest(BleuStatistics([], [], "13a"), [], 0.1) == (None, 0)


def test_bleu_counted_once_gives_sacrebleus_numbers():
    """split_scores counts BLEU statistics once: corpus BLEU, each bucket's, the longest tenth's and every
    sentence's BLEU are sums of them, equal to sacrebleu's own scores of those sentences."""
    from sacrebleu.metrics import BLEU

    from app.evaluation.metrics import BleuStatistics, split_scores

    hyps, refs = HYPS * 3, REFS[1:] + REFS[:1] + REFS * 2  # some sentences far from their reference
    sources = ["a " * n for n in (3, 12, 25, 7, 40, 2, 18, 9, 31, 5, 14, 22)]
    metrics, sentence = split_scores(hyps, refs, sources, [10, 20], "13a", ter=False)
    assert "ter" not in metrics and metrics["sentences"] == 12
    assert metrics["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    reference = score(hyps, refs, "13a", ter=False)
    assert (metrics["bleu_signature"], metrics["chrf_signature"]) == (
        reference["bleu_signature"],
        reference["chrf_signature"],
    )
    assert metrics["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    assert sentence == [BLEU(effective_order=True).sentence_score(h, [r]).score for h, r in zip(hyps, refs)]
    assert len(set(sentence)) > 3
    for bucket, members in zip(metrics["bleu_by_source_length"], ([0, 3, 5, 7, 9], [1, 6, 10], [2, 4, 8, 11])):
        assert bucket["sentences"] == len(members)
        picked = [hyps[i] for i in members], [[refs[i] for i in members]]
        assert bucket["bleu"] == round(sacrebleu.corpus_bleu(*picked).score, 2)
    assert metrics["longest_10pct_sentences"] == 2  # sources of 40 and 31 words
    assert metrics["bleu_longest_10pct"] == round(
        sacrebleu.corpus_bleu([hyps[4], hyps[8]], [[refs[4], refs[8]]]).score, 2
    )
    stats = BleuStatistics(hyps, refs, "13a")
    assert stats.corpus([1, 2]) == sacrebleu.corpus_bleu(hyps[1:3], [refs[1:3]]).score


@pytest.mark.parametrize("tokenize", ["zh", "13a"])
def test_ter_of_a_chinese_target_counts_characters_where_bleu_counts_chinese_words(tokenize):
    """A sentence of unsegmented Chinese is one whitespace word: one character wrong costs all of it. Where BLEU
    counts Chinese words, TER splits the characters (sacrebleu's asian_support, with its normalization)."""
    from app.evaluation.metrics import split_scores, ter_of_statistics, ter_statistics

    hyps, refs = ["我爱你。", "他们在学校。"], ["我喜欢你。", "他们在学校。"]
    metrics, _ = split_scores(hyps, refs, ["a", "b"], [10], tokenize)
    stats, signature, _ = ter_statistics(hyps, refs, tokenize)
    assert ter_of_statistics(stats, signature) == {"ter": metrics["ter"], "ter_signature": metrics["ter_signature"]}
    assert score(hyps, refs, tokenize)["ter"] == metrics["ter"]
    if tokenize == "zh":  # 我 爱 你 。 against 我 喜 欢 你 。: 2 edits; 他 们 在 学 校 。: none; of 11 reference words
        assert metrics["ter"] == round(100 * 2 / 11, 2) and "asian:yes" in metrics["ter_signature"]
    else:  # 1 edit of 1 word, and none of 1
        assert metrics["ter"] == 50.0 and "asian:no" in metrics["ter_signature"]


def test_ter_counted_in_parts_in_the_host_worker_is_sacrebleus_ter():
    """make eval's TER, a share of the sentences counted in the host worker process and the rest here, is
    sacrebleu's corpus TER, wherever the split is cut, with the seconds the worker's share took."""
    from app.evaluation.metrics import split_scores, ter_of_statistics, ter_statistics
    from app.run.host_worker import host_worker, submit

    hyps, refs = HYPS + [REFS[1], "", "a b c"], REFS + [HYPS[1], "the end", ""]  # an empty hypothesis, reference
    reference = score(hyps, refs, "13a")
    expected = {"ter": reference["ter"], "ter_signature": reference["ter_signature"]}
    worker = host_worker(preload=("app.evaluation.metrics",))
    assert worker is not None
    for cut in range(len(hyps) + 1):
        shared, shared_signature, seconds = submit(worker, ter_statistics, hyps[:cut], refs[:cut], "13a").result()
        rest, signature, _ = ter_statistics(hyps[cut:], refs[cut:], "13a")
        assert ter_of_statistics(shared + rest, shared_signature or signature) == expected
        assert (seconds > 0) == (cut > 0) and (shared_signature is None) == (cut == 0)
    assert not worker.broken  # the worker counted its shares
    assert ter_of_statistics(shared[:-1], expected["ter_signature"]) != expected  # a sentence fewer is not it
    inline, _ = split_scores(hyps, refs, ["a b"] * len(hyps), [10], "13a")
    assert (inline["ter"], inline["ter_signature"]) == (expected["ter"], expected["ter_signature"])


def test_a_look_at_the_first_sentences_is_not_the_splits_evaluation(tmp_path):
    """train's closing evaluation is skipped for a run evaluated since its checkpoint, but not when that was
    an eval.max_sentences look at the first sentences."""
    import json
    import time

    from app.config.schema import Config
    from app.evaluation.eval_run import evaluated

    cfg = Config(name="run", run_dir=str(tmp_path))
    (tmp_path / "best.pt").write_bytes(b"")
    assert not evaluated(cfg)
    time.sleep(0.01)
    metrics = tmp_path / "eval" / "test" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"bleu": 1.0, "subset": "first 5 of 998 sentences"}))
    assert not evaluated(cfg)
    metrics.write_text(json.dumps({"bleu": 1.0, "subset": None}))
    assert evaluated(cfg)


def test_bleu_counts_the_words_of_the_target_languages_tokenizer():
    """Unsegmented Chinese is one 13a word a sentence: a hypothesis a character off its reference scored BLEU 0.
    Unset, eval.bleu_tokenize is sacrebleu's choice for data.tgt_lang (zh for Chinese, zh_CN too), and every BLEU
    (corpus, buckets, sentences, the paired tests) counts its words."""
    from app.evaluation.metrics import BleuStatistics, bleu_tokenizer, sentence_bleu, split_scores
    from app.evaluation.significance import paired_significance

    refs = ["我们今天去公园散步", "他昨天买了一本新书", "这个城市的冬天很冷"]
    hyps = ["我们今天去公园走路", "他昨天买了一本新书", "这个城市的冬天非常冷"]
    assert [bleu_tokenizer(None, lang) for lang in ("en", "es", "zh", "zh_CN", "zh-Hans")] == [
        "13a",
        "13a",
        "zh",
        "zh",
        "zh",
    ]
    assert bleu_tokenizer("char", "zh") == "char" and bleu_tokenizer("intl", "en") == "intl"
    assert score(hyps, refs, "13a")["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert BleuStatistics(hyps[::2], refs[::2], "13a").corpus() == 0.0  # neither exact: no 13a word matches
    zh = score(hyps, refs, "zh")
    assert zh["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score, 2) and zh["bleu"] > 50
    assert "tok:zh" in zh["bleu_signature"]
    metrics, sentence = split_scores(hyps, refs, ["a b"] * 3, [10], "zh", ter=False)
    assert (metrics["bleu"], metrics["bleu_tokenize"]) == (zh["bleu"], "zh") and "tok:zh" in metrics["bleu_signature"]
    assert sentence == sentence_bleu(hyps, refs, "zh") and 0 < sentence[0] < 99 and sentence[1] == pytest.approx(100)
    compared = paired_significance([("a", hyps), ("b", refs)], refs, "zh")
    assert compared[0].scores["BLEU"]["score"] == zh["bleu"]


def test_a_tokenizer_whose_extras_are_missing_is_one_line():
    from app.evaluation.metrics import bleu_tokenizer

    try:
        import MeCab  # noqa: F401  (sacrebleu[ja]: then there is nothing to refuse)

        pytest.skip("sacrebleu's Japanese extras are installed")
    except ImportError:
        pass
    with pytest.raises(UserError) as chosen:
        bleu_tokenizer(None, "ja")
    assert str(chosen.value) == (
        "eval.bleu_tokenize=ja-mecab (sacrebleu's choice for the target language ja) needs sacrebleu's ja extras: "
        ".venv/bin/pip install 'sacrebleu[ja]', or set eval.bleu_tokenize=char"
    )
    with pytest.raises(UserError, match=r"^eval.bleu_tokenize=ko-mecab needs sacrebleu's ko extras: "):
        bleu_tokenizer("ko-mecab", "en")


# a second translation of the same four verses (the King James Version's wording)
KJV = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good.",
]


def test_more_references_score_as_sacrebleus_multi_reference_scores():
    """eval.references: every score counts each reference stream, as sacrebleu's own corpus scores of several
    references do; the signatures say how many; a hypothesis that is one of the references scores as a match."""
    result = score(HYPS, REFS, "13a", more=[KJV])
    assert result["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS, KJV]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(HYPS, [REFS, KJV]).score, 2)
    assert result["ter"] == round(sacrebleu.corpus_ter(HYPS, [REFS, KJV]).score, 2)
    assert result["bleu"] > score(HYPS, REFS, "13a")["bleu"]  # a second wording matches more n-grams
    assert all("nrefs:2" in result[f"{name}_signature"] for name in ("bleu", "chrf", "ter"))
    matched = score(KJV, REFS, "13a", more=[KJV])
    assert (matched["bleu"], matched["chrf"], matched["ter"]) == (100.0, 100.0, 0.0)
    with pytest.raises(UserError, match="4 hypotheses against 3 references"):
        score(HYPS, REFS, "13a", more=[KJV[:3]])


def test_split_scores_and_ter_in_parts_count_more_references():
    """make eval's split scores (sentence BLEU, buckets) and its TER counted in parts in the host worker take
    the further references too."""
    from sacrebleu.metrics import BLEU

    from app.evaluation.metrics import split_scores, ter_of_statistics, ter_statistics
    from app.run.host_worker import host_worker, submit

    metrics, sentence = split_scores(HYPS, REFS, ["a b"] * 4, [10], "13a", more=[KJV])
    assert metrics["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS, KJV]).score, 2)
    assert metrics["ter"] == round(sacrebleu.corpus_ter(HYPS, [REFS, KJV]).score, 2)
    assert sentence == [BLEU(effective_order=True).sentence_score(h, [r, k]).score for h, r, k in zip(HYPS, REFS, KJV)]
    worker = host_worker(preload=("app.evaluation.metrics",))
    assert worker is not None
    shared, signature, _ = submit(worker, ter_statistics, HYPS[:3], REFS[:3], "13a", [KJV[:3]]).result()
    rest, _, _ = ter_statistics(HYPS[3:], REFS[3:], "13a", [KJV[3:]])
    assert ter_of_statistics(shared + rest, signature) == {
        "ter": metrics["ter"],
        "ter_signature": metrics["ter_signature"],
    }
    assert "nrefs:2" in signature and not worker.broken
