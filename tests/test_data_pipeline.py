"""The data pipeline on small real inputs: Bible cleaning, local files, hub-style datasets, filters,
splits, caching, SentencePiece, batching and scoring."""
import json
import os

import pytest
import sacrebleu

from app.config import DataConfig, FilterConfig, TokenizerConfig
from app.data.batching import Batcher, make_batches
from app.data.prepare import filter_pairs, prepare, split_of
from app.data.sources import Pair, bible_verses, clean_osis, read_hf, read_parallel_file
from app.data.tokenizer import BOS, EOS, PAD, UNK, build_tokenizer
from app.errors import UserError
from app.evaluation import score

SWORD = "/usr/share/sword"


# --- Bible ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, clean", [
    ('<w lemma="x">God</w><note placement="foot">The Hebrew word…</note><w>created</w> <w>it</w>.', "God created it."),
    ('<l level="1" sID="a"/>Many are<l eID="a"/><l level="2" sID="b"/>those who rise.<l eID="b"/>', "Many are those who rise."),
    ('<title type="main">Section heading</title><w>In</w> <w>the</w> beginning', "In the beginning"),
    ('<title canonical="true" type="psalm">A Psalm by David.</title> <w>Yahweh</w>', "A Psalm by David. Yahweh"),
    ('<speaker>Beloved</speaker> Let him kiss me', "Let him kiss me"),
    ('que <transChange type="added">están</transChange> debajo ¶ &amp; arriba', "que están debajo & arriba"),
    ('<w>word</w> <note>note</note>, next', "word, next"),
])
def test_clean_osis(raw, clean):
    assert clean_osis(raw) == clean


def test_real_verses_are_clean():
    en = bible_verses(SWORD, "engWEB2015eb", ["Gen.1.1", "Matt.1.1", "Ps.3.1", "Rev.22.21"])
    es = bible_verses(SWORD, "spaRV1909eb", ["Gen.1.1"])
    assert en["Gen.1.1"] == "In the beginning, God created the heavens and the earth."
    assert es["Gen.1.1"] == "EN el principio crió Dios los cielos y la tierra."
    assert "Jesus Christ, the son of David" in en["Matt.1.1"] and "Messiah" not in en["Matt.1.1"]
    assert en["Ps.3.1"].startswith("A Psalm by David, when he fled from Absalom his son. Yahweh, how my adversaries")
    assert "<" not in "".join(en.values())
    # the WEB module appends its glossary to the last verse: the length filter must catch it
    assert len(en["Rev.22.21"]) > 10_000
    kept, dropped = filter_pairs([Pair("Rev.22.21", "La gracia.", en["Rev.22.21"])], FilterConfig(), dedup=True)
    assert kept == [] and dropped == {"max_chars": 1}


def test_missing_sword_module_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="sword-text"):
        bible_verses(str(tmp_path), "engWEB2015eb", ["Gen.1.1"])
    with pytest.raises(UserError, match="not found"):
        bible_verses(SWORD, "klingonKJV", ["Gen.1.1"])


# --- local files ---------------------------------------------------------------------------------

def write(path, text, encoding="utf-8"):
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return str(path)


def test_tsv_two_and_three_columns(tmp_path):
    two = read_parallel_file(write(tmp_path / "a.tsv", "hola\thello\nadiós\tbye\n"))
    assert [(p.src, p.tgt) for p in two] == [("hola", "hello"), ("adiós", "bye")]
    assert two[0].id == "a.tsv:1"
    three = read_parallel_file(write(tmp_path / "b.tsv", "v1\thola\thello\n"))
    assert three == [Pair("v1", "hola", "hello")]


def test_jsonl_both_layouts(tmp_path):
    flat = write(tmp_path / "a.jsonl", '{"src": "hola", "tgt": "hello"}\n{"src": "sí", "tgt": "yes"}\n')
    nested = write(tmp_path / "b.jsonl", '{"translation": {"es": "hola", "en": "hello"}}\n')
    assert [(p.src, p.tgt) for p in read_parallel_file(flat, "es", "en")] == [("hola", "hello"), ("sí", "yes")]
    assert [(p.src, p.tgt) for p in read_parallel_file(nested, "es", "en")] == [("hola", "hello")]


def test_plain_text_pair(tmp_path):
    es, en = write(tmp_path / "t.es", "uno\ndos\n"), write(tmp_path / "t.en", "one\ntwo\n")
    assert [(p.src, p.tgt) for p in read_parallel_file(f"{es},{en}")] == [("uno", "one"), ("dos", "two")]


@pytest.mark.parametrize("name, content, message", [
    ("cols.tsv", "a\tb\nc\td\te\tf\n", r"cols.tsv:2: expected 2 \(src, tgt\) or 3"),
    ("empty.tsv", "", "file is empty"),
    ("bad.tsv", b"ok\tfine\nhola\t\xff\xfe\n", "bad.tsv:2: not valid UTF-8"),
    ("fields.jsonl", '{"source": "x", "target": "y"}\n', r"fields.jsonl:1: expected"),
])
def test_bad_files_name_the_file_and_line(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(UserError, match=message):
        read_parallel_file(path, "es", "en")


def test_missing_file_and_unparallel_text(tmp_path):
    with pytest.raises(UserError, match="nope.tsv: file not found"):
        read_parallel_file(str(tmp_path / "nope.tsv"))
    es, en = write(tmp_path / "t.es", "uno\ndos\n"), write(tmp_path / "t.en", "one\n")
    with pytest.raises(UserError, match="has 2 lines but .* has 1"):
        read_parallel_file(f"{es},{en}")


# --- Hugging Face datasets -----------------------------------------------------------------------

def hf_config(path, **kw):
    return DataConfig(source="hf", name="hf", dir="unused", hf_path=path, train="train",
                      src_field="translation.es", tgt_field="translation.en", **kw)


def test_hf_saved_to_disk_and_local_folder(tmp_path):
    import datasets

    rows = {"translation": [{"es": "hola", "en": "hello"}, {"es": "gracias", "en": "thanks"}]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "validation": datasets.Dataset.from_dict(rows)}
                         ).save_to_disk(str(tmp_path / "saved"))
    splits = read_hf(hf_config(str(tmp_path / "saved"), dev="validation"))
    assert [(p.src, p.tgt) for p in splits["train"]] == [("hola", "hello"), ("gracias", "thanks")]
    assert len(splits["dev"]) == 2 and splits["test"] is None

    folder = tmp_path / "hubstyle"
    folder.mkdir()
    write(folder / "train.jsonl", '{"translation": {"es": "sí", "en": "yes"}}\n')
    assert [(p.src, p.tgt) for p in read_hf(hf_config(str(folder)))["train"]] == [("sí", "yes")]

    with pytest.raises(UserError, match="field 'translation.fr' not found"):
        read_hf(DataConfig(source="hf", name="hf", dir="x", hf_path=str(folder), train="train",
                           src_field="translation.fr", tgt_field="translation.en"))
    with pytest.raises(UserError, match="has splits"):
        read_hf(hf_config(str(tmp_path / "saved"), test="nosuchsplit"))


# --- filters, splits, caching --------------------------------------------------------------------

def test_split_is_deterministic_and_near_the_fractions():
    ids = [f"id{i}" for i in range(20_000)]
    first = [split_of(i, 0.05, 0.1) for i in ids]
    assert first == [split_of(i, 0.05, 0.1) for i in ids]
    assert abs(first.count("dev") / 20_000 - 0.05) < 0.005
    assert abs(first.count("test") / 20_000 - 0.10) < 0.005


def test_filters_count_what_each_rule_drops():
    pairs = [Pair("1", "hola", "hello"), Pair("2", " ", "x"), Pair("3", "a" * 50, "b" * 2000),
             Pair("4", "corto", "a much much much longer sentence"), Pair("5", "hola", "hello"),
             Pair("6", "hola  amigo", "hello friend")]
    kept, dropped = filter_pairs(pairs, FilterConfig(max_chars=1000, max_ratio=3.0), dedup=True)
    assert [p.id for p in kept] == ["1", "6"] and kept[1].src == "hola amigo"  # whitespace normalized
    assert dropped == {"empty": 1, "max_chars": 1, "max_ratio": 1, "duplicate": 1}


def make_corpus(tmp_path, n=300):
    lines = "".join(f"s{i}\tfrase número {i} de prueba\tsentence number {i} of the test\n" for i in range(n))
    return write(tmp_path / "corpus.tsv", lines)


def test_prepare_carves_splits_writes_report_and_is_cached(tmp_path):
    cfg = DataConfig(source="files", name="t", dir=str(tmp_path / "out"), train=make_corpus(tmp_path),
                     dev_fraction=0.1, test_fraction=0.1)
    report = prepare(cfg)
    assert sum(report["pairs"].values()) == 300 and all(report["pairs"][s] > 0 for s in ("dev", "test"))
    written = {s: (tmp_path / "out" / f"{s}.tsv").read_text().count("\n") for s in ("train", "dev", "test")}
    assert written == report["pairs"]
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["key"] == report["key"]
    mtime = os.path.getmtime(tmp_path / "out" / "train.tsv")
    prepare(cfg)
    assert os.path.getmtime(tmp_path / "out" / "train.tsv") == mtime  # cached: nothing rewritten
    cfg.filters.max_chars = 30  # a different setting re-prepares (drops the 3-digit sentences)
    assert prepare(cfg)["dropped"]["train"]["max_chars"] > 0


# --- tokenizer -----------------------------------------------------------------------------------

def test_tokenizer_ids_round_trip_and_cache(tmp_path):
    cfg = DataConfig(source="files", name="t", dir=str(tmp_path / "out"), train=make_corpus(tmp_path))
    prepare(cfg)
    tok_cfg = TokenizerConfig(vocab_size=100)
    tok = build_tokenizer(cfg.dir, tok_cfg)
    assert [tok.src.id_to_piece(i) for i in (PAD, UNK, BOS, EOS)] == ["<pad>", "<unk>", "<s>", "</s>"]
    text = "frase número 7 de prueba"
    assert tok.decode_tgt([tok.encode_src([text])[0]]) == [text]
    assert tok.joint and tok.src_vocab_size == tok.tgt_vocab_size
    mtime = os.path.getmtime(tok.src_path)
    build_tokenizer(cfg.dir, tok_cfg)
    assert os.path.getmtime(tok.src_path) == mtime
    separate = build_tokenizer(cfg.dir, TokenizerConfig(vocab_size=60, joint=False))
    assert not separate.joint and separate.src_path != separate.tgt_path and os.path.exists(separate.tgt_path)


# --- batching ------------------------------------------------------------------------------------

def test_batches_cover_everything_within_the_token_budget():
    import random

    rng = random.Random(0)
    src_lens = [rng.randint(1, 60) for _ in range(500)]
    tgt_lens = [rng.randint(1, 60) for _ in range(500)]
    batches = make_batches(src_lens, tgt_lens, 800, shuffle=True, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        cost = len(b) * (max(src_lens[i] for i in b) + 1 + max(tgt_lens[i] for i in b) + 1)
        assert cost <= 800 or len(b) == 1
    assert batches == make_batches(src_lens, tgt_lens, 800, shuffle=True, seed=1, epoch=0)
    assert batches != make_batches(src_lens, tgt_lens, 800, shuffle=True, seed=1, epoch=1)


def test_batcher_adds_bos_eos_and_pads():
    batch = Batcher([[5, 6, 7], [8]], [[9], [10, 11]])([0, 1])
    assert batch.src.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert batch.tgt_in.tolist() == [[BOS, 9, PAD], [BOS, 10, 11]]
    assert batch.tgt_out.tolist() == [[9, EOS, PAD], [10, 11, EOS]]


# --- scoring -------------------------------------------------------------------------------------

def test_scores_equal_sacrebleu_and_refuse_mismatched_counts():
    hyps = ["the cat sat on the mat", "in the beginning God made it"]
    refs = ["the cat sat on a mat", "In the beginning, God created the heavens"]
    metrics = score(hyps, refs)
    assert metrics["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert metrics["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    assert metrics["ter"] == round(sacrebleu.corpus_ter(hyps, [refs]).score, 2)
    assert "nrefs:1" in metrics["bleu_signature"]
    with pytest.raises(UserError, match="2 hypotheses against 1 references"):
        score(hyps, refs[:1])
