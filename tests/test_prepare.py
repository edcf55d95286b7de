"""Corpus preparation: deterministic hash split, filter rules, cached prepare()."""

import dataclasses
import json
import os
import unicodedata
from collections import Counter

import pytest

from app.config.schema import DataConfig, FilterConfig
from app.data.prepare import filter_pairs, normalize, prepare, read_tsv, split_of
from app.data.sources import SPLITS, Pair
from app.run.errors import UserError

# --- split_of -----------------------------------------------------------------------------------------

IDS = [f"Book.{i // 1000}.{i % 1000}" for i in range(20000)]


def test_split_of_is_deterministic():
    first = [split_of(i, 0.1, 0.2) for i in IDS[:2000]]
    assert first == [split_of(i, 0.1, 0.2) for i in IDS[:2000]]
    assert split_of("Gen.1.1", 0.032, 0.032) == split_of("Gen.1.1", 0.032, 0.032)


@pytest.mark.parametrize("dev,test", [(0.032, 0.032), (0.1, 0.2), (0.0, 0.05), (0.3, 0.0)])
def test_split_of_matches_fractions(dev, test):
    counts = Counter(split_of(i, dev, test) for i in IDS)
    assert set(counts) <= set(SPLITS)
    assert abs(counts["dev"] / len(IDS) - dev) <= 0.005
    assert abs(counts["test"] / len(IDS) - test) <= 0.005
    assert counts["train"] + counts["dev"] + counts["test"] == len(IDS)


def test_split_of_zero_fractions_is_all_train():
    assert {split_of(i, 0.0, 0.0) for i in IDS[:1000]} == {"train"}


def test_split_of_growing_dev_only_moves_train_pairs():
    # dev grows out of the low end of the hash range: pairs already in dev stay in dev
    small = {i for i in IDS if split_of(i, 0.02, 0.0) == "dev"}
    large = {i for i in IDS if split_of(i, 0.05, 0.0) == "dev"}
    assert small < large


# --- filter_pairs -----------------------------------------------------------------------------------


def test_normalize():
    assert normalize("  a\u00a0b\t c\n") == "a b c"


def test_filter_pairs_counts_each_rule():
    rules = FilterConfig(min_chars=3, max_chars=20, max_ratio=2.0, dedup=True)
    pairs = [
        Pair("ok1", "hola mundo", "hello world"),
        Pair("empty_src", "", "hello"),
        Pair("empty_tgt", "hola", "   "),
        Pair("short", "ab", "ab"),
        Pair("long", "x" * 21, "y" * 20),
        Pair("ratio", "abc", "abcdefg"),  # 7 / 3 > 2
        Pair("dup", "hola  mundo", " hello world"),  # duplicate of ok1 after whitespace normalization
        Pair("ok2", "gato", "cat cat"),  # 7 / 4 <= 2
        Pair("ok_edge", "x" * 20, "y" * 10),  # exactly max_chars and exactly max_ratio: kept
    ]
    kept, dropped = filter_pairs(pairs, rules, dedup=True)
    assert [p.id for p in kept] == ["ok1", "ok2", "ok_edge"]
    assert kept[0] == Pair("ok1", "hola mundo", "hello world")
    assert dropped == Counter({"empty": 2, "min_chars": 1, "max_chars": 1, "max_ratio": 1, "duplicate": 1})


def test_filter_pairs_dedup_off_and_ratio_off():
    pairs = [Pair("a", "x", "y" * 50), Pair("b", "x", "y" * 50)]
    kept, dropped = filter_pairs(pairs, FilterConfig(max_ratio=0), dedup=False)
    assert [p.id for p in kept] == ["a", "b"]
    assert not dropped


def test_filter_pairs_dedup_is_on_the_pair_not_one_side():
    pairs = [Pair("a", "sí", "yes"), Pair("b", "sí", "yeah"), Pair("c", "sí", "yes")]
    kept, dropped = filter_pairs(pairs, FilterConfig(), dedup=True)
    assert [p.id for p in kept] == ["a", "b"]
    assert dropped == {"duplicate": 1}


# --- prepare --------------------------------------------------------------------------------------------


def corpus_rows(n=400):
    return [(f"s{i}", f"frase numero {i} en espanol", f"sentence number {i} in english") for i in range(n)]


def data_cfg(tmp_path, **kw) -> DataConfig:
    base = dict(source="files", name="t", dir=str(tmp_path / "d"), dev_fraction=0.1, test_fraction=0.1)
    return DataConfig(**{**base, **kw})


def stats(folder):
    names = [f"{s}.tsv" for s in SPLITS] + ["prepare.json"]
    return {n: (os.stat(os.path.join(folder, n)).st_ino, os.stat(os.path.join(folder, n)).st_mtime_ns) for n in names}


def test_prepare_writes_splits_and_carves_dev_test(tmp_path, write_tsv):
    rows = corpus_rows()
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", rows))
    report = prepare(cfg)
    for name in ("train.tsv", "dev.tsv", "test.tsv", "prepare.json"):
        assert os.path.isfile(os.path.join(cfg.dir, name))
    splits = {s: read_tsv(os.path.join(cfg.dir, f"{s}.tsv")) for s in SPLITS}
    ids = {s: [p.id for p in splits[s]] for s in SPLITS}
    # every pair lands in exactly one split, the one its id hashes to
    assert sorted(ids["train"] + ids["dev"] + ids["test"]) == sorted(r[0] for r in rows)
    for s in SPLITS:
        assert all(split_of(i, 0.1, 0.1) == s for i in ids[s])
        assert 0 < len(ids[s])
    assert 20 <= len(ids["dev"]) <= 60 and 20 <= len(ids["test"]) <= 60
    # content round-trips
    by_id = {r[0]: r for r in rows}
    assert all((p.id, p.src, p.tgt) == by_id[p.id] for s in SPLITS for p in splits[s])
    # the report matches the files
    with open(os.path.join(cfg.dir, "prepare.json"), encoding="utf-8") as f:
        assert json.load(f) == report
    assert report["source"] == "files"
    assert report["pairs"] == {s: len(ids[s]) for s in SPLITS}


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "no ids: split by text"])
def test_the_reverse_direction_has_the_same_splits_turned_round_with_its_links(tmp_path, write_tsv, with_ids):
    """data.reverse: every pair in the split it has forward (by its id, or by its text where it has none), source
    and target swapped, its links i-j (i?j) as j-i (j?i); in data/<name>_reverse unless data.dir is given; the
    corpora prepared before the setting keep their cache key."""
    from app.data.prepare import cache_key
    from app.data.sources import reversed_pair

    assert reversed_pair(Pair("v1", "a b c", "x y", "0-1 2?0 1-1")) == Pair("v1", "x y", "a b c", "1-0 0?2 1-1")
    rows = corpus_rows() if with_ids else [(s, t) for _, s, t in corpus_rows()]
    links = [f"0-0 1-1 2?3 {i % 4}-4" for i in range(len(rows))]
    (tmp_path / "links.txt").write_text("".join(line + "\n" for line in links), encoding="utf-8")
    given = dict(train=write_tsv("corpus.tsv", rows), train_align=str(tmp_path / "links.txt"))
    forward = data_cfg(tmp_path, **given)
    backward = data_cfg(tmp_path, **given, dir=str(tmp_path / "r"), reverse=True)
    prepare(forward), prepare(backward)
    for split in SPLITS:
        there = read_tsv(os.path.join(forward.dir, f"{split}.tsv"))
        back = read_tsv(os.path.join(backward.dir, f"{split}.tsv"))
        assert [(p.id, p.tgt, p.src) for p in there] == [(p.id, p.src, p.tgt) for p in back] and back
        if split == "train":
            there_links = open(os.path.join(forward.dir, "train.align"), encoding="utf-8").read().splitlines()
            back_links = open(os.path.join(backward.dir, "train.align"), encoding="utf-8").read().splitlines()
            assert [reversed_pair(Pair("", "", "", line)).links for line in there_links] == back_links
    assert DataConfig(source="files", name="gen", reverse=True).dir == os.path.join("data", "gen_reverse")
    assert DataConfig(source="files", name="gen", reverse=True, aligner="eflomal").dir == os.path.join(
        "data", "gen_reverse_eflomal"
    )
    from app.config.schema import target_language

    assert target_language(DataConfig(src_lang="zh", tgt_lang="en", reverse=True)) == "zh"
    assert target_language(DataConfig(src_lang="zh", tgt_lang="en")) == "en"
    assert cache_key(forward) != cache_key(backward)
    from dataclasses import asdict

    from app.data.prepare import PREPARE_VERSION, _fingerprint
    from app.run.files import stable_hash

    before = {
        k: v
        for k, v in asdict(forward).items()
        if k not in ("num_proc", "aligner", "reverse", "extra_train", "extra_tag")
    }
    key = {"version": PREPARE_VERSION, "settings": before, "inputs": _fingerprint(forward), "split_key": "text"}
    assert cache_key(forward) == stable_hash(key)  # as before data.reverse: no corpus is prepared again


def test_copies_of_a_pair_without_an_id_share_a_split(tmp_path, write_tsv):
    """A 2-column file's ids are its line numbers: drawn from them, a pair written twice landed in train and in
    test (scored on a sentence trained on). Drawn from the text, the copies share a split; train keeps one."""
    rows = [(src, tgt) for _, src, tgt in corpus_rows()]
    cfg = data_cfg(tmp_path, train=write_tsv("twice.tsv", rows + rows))
    prepare(cfg)
    splits = {s: {(p.src, p.tgt) for p in read_tsv(os.path.join(cfg.dir, f"{s}.tsv"))} for s in SPLITS}
    assert splits["dev"] and splits["test"] and not (splits["train"] & (splits["dev"] | splits["test"]))
    assert len(read_tsv(os.path.join(cfg.dir, "train.tsv"))) == len(splits["train"])  # one copy each


def test_copies_that_differ_in_unicode_composition_share_a_split_and_are_written_composed(tmp_path, write_tsv):
    """A "café" typed with a combining accent (e + U+0301) is "café" to SentencePiece and to a reader: hashed as other
    text, such a copy landed in train beside its twin in test."""
    rows = [(f"el café número {i}", f"the café number {i}") for i in range(200)]
    decomposed = [(unicodedata.normalize("NFD", src), unicodedata.normalize("NFD", tgt)) for src, tgt in rows]
    cfg = data_cfg(tmp_path, train=write_tsv("mixed.tsv", [pair for both in zip(rows, decomposed) for pair in both]))
    report = prepare(cfg)
    splits = {s: [(p.src, p.tgt) for p in read_tsv(os.path.join(cfg.dir, f"{s}.tsv"))] for s in SPLITS}
    held_out = splits["dev"] + splits["test"]
    assert held_out and not set(splits["train"]) & set(held_out)  # each pair's two copies in one split
    assert Counter(Counter(held_out).values()) == {2: len(held_out) // 2}  # dev and test keep both copies, train one
    assert len(set(splits["train"])) == len(splits["train"]) == report["dropped"]["train"]["duplicate"]
    assert len(set(splits["train"] + held_out)) == 200
    assert all(unicodedata.is_normalized("NFC", src + tgt) for pairs in splits.values() for src, tgt in pairs)


def test_a_given_test_set_is_scored_whole_but_for_pairs_with_an_empty_side(tmp_path, write_tsv):
    """The length rules clean training pairs: a test set the user gives keeps its short answer to a long question
    and its long line, as sacrebleu would score it; the splits carved out of train are filtered as train is."""
    test_rows = [("t1", "Sí.", "Yes, that is right."), ("t2", "x " * 600, "y " * 600), ("t3", "", "nothing")]
    rows = corpus_rows(200) + [("ratio", "a", "a very long sentence for one letter")]
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", rows), test=write_tsv("test.tsv", test_rows))
    report = prepare(cfg)
    assert [p.id for p in read_tsv(os.path.join(cfg.dir, "test.tsv"))] == ["t1", "t2"]
    assert report["dropped"]["test"] == {"empty": 1}
    assert "ratio" not in {p.id for s in ("train", "dev") for p in read_tsv(os.path.join(cfg.dir, f"{s}.tsv"))}
    assert sum(report["dropped"][s].get("max_ratio", 0) for s in ("train", "dev")) == 1


def test_prepare_given_dev_is_kept_and_test_carved(tmp_path, write_tsv):
    dev_rows = [("d1", "uno", "one"), ("d1b", "uno", "one"), ("d2", "dos", "two")]
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows()), dev=write_tsv("dev.tsv", dev_rows))
    report = prepare(cfg)
    dev = read_tsv(os.path.join(cfg.dir, "dev.tsv"))
    assert [(p.id, p.src, p.tgt) for p in dev] == dev_rows  # dev keeps duplicates
    train_ids = {p.id for p in read_tsv(os.path.join(cfg.dir, "train.tsv"))}
    test_ids = {p.id for p in read_tsv(os.path.join(cfg.dir, "test.tsv"))}
    assert test_ids and not (train_ids & test_ids)
    assert len(train_ids) + len(test_ids) == 400  # nothing carved into dev
    assert report["pairs"]["dev"] == 3


def test_prepare_drops_in_train_and_reports(tmp_path, write_tsv):
    rows = corpus_rows(200) + [
        ("dup", "frase numero 0 en espanol", "sentence number 0 in english"),
        ("empty", "x", " "),
    ]
    cfg = data_cfg(
        tmp_path,
        train=write_tsv("corpus.tsv", rows),
        dev_fraction=0.0,
        test_fraction=0.0,
        dev=write_tsv("dev.tsv", [("d", "a", "b")]),
        test=write_tsv("test.tsv", [("t", "c", "d")]),
    )
    report = prepare(cfg)
    assert report["dropped"]["train"] == {"duplicate": 1, "empty": 1}
    assert report["pairs"] == {"train": 200, "dev": 1, "test": 1}


def test_prepare_max_train_pairs(tmp_path, write_tsv):
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows()), max_train_pairs=25)
    assert prepare(cfg)["pairs"]["train"] == 25
    assert len(read_tsv(os.path.join(cfg.dir, "train.tsv"))) == 25


def test_prepare_second_call_does_not_rewrite(tmp_path, write_tsv):
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows()))
    first = prepare(cfg)
    before = stats(cfg.dir)
    assert prepare(data_cfg(tmp_path, train=cfg.train)) == first
    assert stats(cfg.dir) == before


def test_prepare_changed_filter_reprepares(tmp_path, write_tsv):
    rows = corpus_rows(300) + [("long", "a" * 40, "b" * 40)]
    cfg = data_cfg(
        tmp_path,
        train=write_tsv("corpus.tsv", rows),
        dev_fraction=0.0,
        test_fraction=0.0,
        dev=write_tsv("dev.tsv", [("d", "a", "b")]),
        test=write_tsv("test.tsv", [("t", "c", "d")]),
    )
    first = prepare(cfg)
    before = stats(cfg.dir)
    assert first["pairs"]["train"] == 301

    cfg.filters.max_chars = 35
    second = prepare(cfg)
    assert second["key"] != first["key"]
    assert second["pairs"]["train"] == 300 and second["dropped"]["train"] == {"max_chars": 1}
    assert "long" not in {p.id for p in read_tsv(os.path.join(cfg.dir, "train.tsv"))}
    assert stats(cfg.dir)["train.tsv"] != before["train.tsv"]
    with open(os.path.join(cfg.dir, "prepare.json"), encoding="utf-8") as f:
        assert json.load(f)["key"] == second["key"]


def test_prepare_changed_input_reprepares(tmp_path, write_tsv):
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows(300)))
    first = prepare(cfg)
    write_tsv("corpus.tsv", corpus_rows(400))  # a different size
    second = prepare(cfg)
    assert second["key"] != first["key"]
    assert sum(second["pairs"].values()) == 400


def test_prepare_missing_split_of_files_is_regenerated(tmp_path, write_tsv):
    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows()))
    prepare(cfg)
    os.remove(os.path.join(cfg.dir, "dev.tsv"))
    prepare(cfg)
    assert os.path.isfile(os.path.join(cfg.dir, "dev.tsv"))


def test_prepare_empty_split_is_user_error(tmp_path, write_tsv):
    cfg = data_cfg(
        tmp_path, train=write_tsv("corpus.tsv", corpus_rows(50)), test=write_tsv("test.tsv", [("t", "", "nothing")])
    )
    with pytest.raises(UserError, match="test split"):
        prepare(cfg)


def write_jsonl_folder(folder, n):
    folder.mkdir(exist_ok=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:  # rewritten in place
        for i in range(n):
            f.write(json.dumps({"translation": {"es": f"hola numero {i}", "en": f"hello number {i}"}}) + "\n")


def hf_folder_cfg(tmp_path) -> DataConfig:
    return DataConfig(
        source="hf",
        name="x",
        dir=str(tmp_path / "d"),
        hf_path=str(tmp_path / "folder"),
        train="train",
        src_field="translation.es",
        tgt_field="translation.en",
        dev_fraction=0.2,
        test_fraction=0.2,
    )


def test_prepare_hf_local_folder(tmp_path):
    write_jsonl_folder(tmp_path / "folder", 50)
    report = prepare(hf_folder_cfg(tmp_path))
    assert sum(report["pairs"].values()) == 50


def test_prepare_hf_local_folder_edit_reprepares(tmp_path):
    write_jsonl_folder(tmp_path / "folder", 50)
    prepare(hf_folder_cfg(tmp_path))
    write_jsonl_folder(tmp_path / "folder", 80)
    assert sum(prepare(hf_folder_cfg(tmp_path))["pairs"].values()) == 80


def test_prepare_hf_with_a_link_file_reprepares_when_the_links_change(tmp_path):
    """The link file joins the cache key of every source, not of local files only: mended, its links are read."""
    write_jsonl_folder(tmp_path / "folder", 50)
    links = tmp_path / "train.align"
    links.write_text("0-0 1-1 2-2\n" * 50)
    cfg = dataclasses.replace(hf_folder_cfg(tmp_path), train_align=str(links))
    prepare(cfg)
    assert set(open(os.path.join(cfg.dir, "train.align")).read().splitlines()) == {"0-0 1-1 2-2"}
    links.write_text("0-1 1-0 2-2\n" * 50)
    prepare(cfg)
    assert set(open(os.path.join(cfg.dir, "train.align")).read().splitlines()) == {"0-1 1-0 2-2"}


def test_prepare_hf_null_text_is_dropped_as_empty_and_counted(tmp_path):
    folder = tmp_path / "folder"
    write_jsonl_folder(folder, 50)
    with open(folder / "train.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"translation": {"es": "adiós", "en": None}}) + "\n")
    report = prepare(hf_folder_cfg(tmp_path))
    assert sum(report["pairs"].values()) == 50 and sum(d.get("empty", 0) for d in report["dropped"].values()) == 1
    assert not any("None" in open(os.path.join(tmp_path / "d", f"{s}.tsv")).read() for s in SPLITS)


def test_prepare_hf_streaming_takes_a_shuffled_sample(tmp_path):
    write_jsonl_folder(tmp_path / "folder", 200)
    cfg = hf_folder_cfg(tmp_path)
    cfg.streaming, cfg.shuffle_buffer, cfg.max_train_pairs = True, 50, 30
    report = prepare(cfg)
    assert report["pairs"]["train"] == 30
    train = read_tsv(os.path.join(cfg.dir, "train.tsv"))
    numbers = [int(p.src.split()[-1]) for p in train]
    assert numbers != sorted(numbers)  # drawn through the shuffle buffer, not the first 30 in order


# --- the tokenized Arrow cache ------------------------------------------------------------------


def test_tokenized_cache_is_built_once_and_reused(tmp_path, write_tsv, caplog):
    import logging

    from app.config.schema import TokenizerConfig
    from app.data.corpus import load_split, load_tokenized, tokenized
    from app.data.tokenizer import build_tokenizer

    cfg = data_cfg(tmp_path, train=write_tsv("corpus.tsv", corpus_rows()))
    prepare(cfg)
    tokenizer = build_tokenizer(cfg.dir, TokenizerConfig(vocab_size=200))
    with caplog.at_level(logging.INFO, logger="app.data.corpus"):
        tokenized(cfg.dir, "train", tokenizer)
        stamp = os.path.join(cfg.dir, "tokenized", "spm_unigram200", "train", "key.json")
        built = os.stat(stamp).st_mtime_ns
        assert caplog.text.count("tokenizing") == 1
        train = load_tokenized(cfg.dir, "train", tokenizer)
        assert caplog.text.count("tokenizing") == 1  # the second read maps the cache
    assert os.stat(stamp).st_mtime_ns == built
    pairs = read_tsv(os.path.join(cfg.dir, "train.tsv"))
    assert train.src.to_pylist() == tokenizer.encode_src([p.src for p in pairs])
    assert train.tgt_lens == [len(ids) for ids in tokenizer.encode_tgt([p.tgt for p in pairs])]
    split = load_split(cfg.dir, "train", tokenizer)
    assert split.ids == [p.id for p in pairs] and split.src == tokenizer.encode_src([p.src for p in pairs])
    # lists, read once: a datasets Column reads Arrow again at every item (decoding and scoring read many)
    assert all(type(c) is list for c in (split.ids, split.src_texts, split.tgt_texts, split.src, split.tgt))
    first = load_split(cfg.dir, "train", tokenizer, first=5)  # the first pairs only (make heads' heads.max_sentences)
    assert first == split.head(5) and all(type(c) is list for c in (first.ids, first.src))
    assert load_split(cfg.dir, "train", tokenizer, first=10**6) == split

    other = build_tokenizer(cfg.dir, TokenizerConfig(vocab_size=150))  # another tokenizer: its own cache
    assert load_tokenized(cfg.dir, "train", other).src.to_pylist() == other.encode_src([p.src for p in pairs])
    write_tsv("corpus.tsv", corpus_rows()[:150])  # new data: prepare rewrites train.tsv, the cache follows
    prepare(cfg)
    assert len(load_tokenized(cfg.dir, "train", tokenizer)) == len(read_tsv(os.path.join(cfg.dir, "train.tsv")))
