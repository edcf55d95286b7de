"""The files and hf sources: every accepted format, and one-line UserErrors for bad input."""

import json
import os
import re

import datasets
import pytest

from app.config.schema import DataConfig
from app.data import sources
from app.data.links import read_pharaoh
from app.data.sources import Pair
from app.run.errors import UserError

datasets.disable_progress_bars()


# Sources read lazily; these read everything at once, as prepare() does.
def read_parallel_file(*args) -> list[Pair]:
    return list(sources.read_parallel_file(*args))


def materialized(splits: dict) -> dict:
    return {split: None if pairs is None else list(pairs) for split, pairs in splits.items()}


def read_files(cfg):
    return materialized(sources.read_files(cfg))


def read_hf(cfg):
    return materialized(sources.read_hf(cfg))


def read_source(cfg):
    return materialized(sources.read_source(cfg))


def files_cfg(**kw) -> DataConfig:
    return DataConfig(source="files", name="t", dir="unused", **kw)


def hf_cfg(hf_path, **kw) -> DataConfig:
    base = dict(
        source="hf",
        name="x",
        dir="unused",
        hf_path=str(hf_path),
        train="train",
        src_field="translation.es",
        tgt_field="translation.en",
    )
    return DataConfig(**{**base, **kw})


# --- files: accepted formats -----------------------------------------------------------------------


def test_tsv_two_columns_ids_name_file_and_line(write_tsv):
    path = write_tsv("a.tsv", [("hola", "hello"), ("adiós", "goodbye")])
    assert read_parallel_file(path) == [Pair("a.tsv:1", "hola", "hello"), Pair("a.tsv:2", "adiós", "goodbye")]


def test_tsv_blank_lines_skipped_but_line_numbers_kept(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("hola\thello\n\n   \nadiós\tbye\n", encoding="utf-8")
    assert read_parallel_file(str(path)) == [Pair("a.tsv:1", "hola", "hello"), Pair("a.tsv:4", "adiós", "bye")]


def test_tsv_crlf_line_endings(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_bytes(b"hola\thello\r\nadios\tbye\r\n")
    assert read_parallel_file(str(path)) == [Pair("a.tsv:1", "hola", "hello"), Pair("a.tsv:2", "adios", "bye")]


def test_a_lone_cr_stays_in_its_line_and_line_numbers_are_the_files(tmp_path):
    path = tmp_path / "a.tsv"  # universal newlines would split line 2 in two pairs, and number line 3 as 4
    path.write_bytes(b"a\tuno\tone\nb\tdos\rtres\ttwo three\nmal\n")
    with pytest.raises(UserError, match=re.escape(f"{path}:3: expected 2")):
        read_parallel_file(str(path))
    path.write_bytes(b"a\tuno\tone\nb\tdos\rtres\ttwo three\n")
    assert read_parallel_file(str(path)) == [Pair("a", "uno", "one"), Pair("b", "dos\rtres", "two three")]


def test_a_lone_cr_in_an_id_is_refused(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_bytes(b"a\tuno\tone\nb\rc\tdos\ttwo\n")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: the id 'b\\rc' holds a tab or a line break")):
        read_parallel_file(str(path))


def test_a_file_of_lone_crs_says_so(tmp_path):
    path = tmp_path / "mac.tsv"
    path.write_bytes(b"uno\tone\rdos\ttwo\rtres\tthree\r")
    with pytest.raises(UserError, match=re.escape(f"{path}:1: expected 2") + ".*got 4 .*lone"):
        read_parallel_file(str(path))


@pytest.mark.parametrize(
    "name, content, first",
    [
        ("three.tsv", "Gen.1.1\tuno\tone\nGen.1.2\tdos\ttwo\n", Pair("Gen.1.1", "uno", "one")),
        ("two.tsv", "uno\tone\ndos\ttwo\n", Pair("two.tsv:1", "uno", "one")),
        ("a.jsonl", '{"src": "uno", "tgt": "one"}\n', Pair("a.jsonl:1", "uno", "one")),
    ],
)
def test_a_byte_order_mark_is_dropped(tmp_path, name, content, first):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8-sig")
    assert read_parallel_file(str(path))[0] == first


def test_a_byte_order_mark_is_dropped_from_both_plain_files(tmp_path):
    (tmp_path / "a.es").write_text("uno\ndos\n", encoding="utf-8-sig")
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8-sig")
    assert read_parallel_file(f"{tmp_path / 'a.es'},{tmp_path / 'a.en'}")[0] == Pair("a.es:1", "uno", "one")


def test_a_json_array_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"src": "uno", "tgt": "one"},\n {"src": "dos", "tgt": "two", "id": "k2"}]\n', encoding="utf-8")
    assert read_parallel_file(str(path)) == [Pair("a.json:1", "uno", "one"), Pair("k2", "dos", "two")]


def test_tsv_three_columns_keeps_id(write_tsv):
    path = write_tsv(
        "b.tsv", [("Gen.1.1", "En el principio", "In the beginning"), ("Gen.1.2", "y la tierra", "and the earth")]
    )
    assert read_parallel_file(path) == [
        Pair("Gen.1.1", "En el principio", "In the beginning"),
        Pair("Gen.1.2", "y la tierra", "and the earth"),
    ]


def test_jsonl_src_tgt(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"src": "hola", "tgt": "hello"}, {"src": "sí", "tgt": "yes", "id": "k2"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert read_parallel_file(str(path), "es", "en") == [Pair("a.jsonl:1", "hola", "hello"), Pair("k2", "sí", "yes")]


def test_jsonl_translation_dict_uses_languages(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"translation": {"es": "hola", "en": "hello", "fr": "salut"}},
        {"translation": {"es": "gato", "en": "cat", "fr": "chat"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert read_parallel_file(str(path), "es", "en") == [
        Pair("t.jsonl:1", "hola", "hello"),
        Pair("t.jsonl:2", "gato", "cat"),
    ]
    assert [(p.src, p.tgt) for p in read_parallel_file(str(path), "fr", "es")] == [("salut", "hola"), ("chat", "gato")]


def test_plain_text_pair(tmp_path):
    (tmp_path / "a.es").write_text("uno\ndos\ntres\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n", encoding="utf-8")
    spec = f"{tmp_path / 'a.es'},{tmp_path / 'a.en'}"
    assert read_parallel_file(spec) == [
        Pair("a.es:1", "uno", "one"),
        Pair("a.es:2", "dos", "two"),
        Pair("a.es:3", "tres", "three"),
    ]


def test_read_files_per_split(write_tsv):
    train = write_tsv("train.tsv", [("a", "b"), ("c", "d")])
    test = write_tsv("test.tsv", [("e", "f")])
    splits = read_source(files_cfg(train=train, test=test))
    assert splits["dev"] is None
    assert [p.src for p in splits["train"]] == ["a", "c"]
    assert splits["test"] == [Pair("test.tsv:1", "e", "f")]


def test_read_files_without_train_is_user_error():
    with pytest.raises(UserError, match="data.train"):
        read_files(files_cfg())


def test_unknown_source_is_user_error():
    with pytest.raises(UserError, match="nope"):
        read_source(DataConfig(source="nope", name="t", dir="unused"))


# --- files: bad input --------------------------------------------------------------------------------


def test_tsv_wrong_column_count_names_file_and_line(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("a\tb\nc\td\ne\tf\tg\th\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        read_parallel_file(str(path))
    assert f"{path}:3" in str(err.value)
    assert "got 4" in str(err.value)


@pytest.mark.parametrize(
    "text,got,first",
    [
        ("a\tb\nla casa es grande\tthe house is big\t\n", 3, "2 (src, tgt)"),  # a trailing tab: not an id
        ("a\tb\tc\nel perro\tthe dog\n", 2, "3 (id, src, tgt)"),
    ],
    ids=["a stray tab", "an id missing"],
)
def test_a_tsv_keeps_the_layout_of_its_first_line(tmp_path, text, got, first):
    """One row with a tab more (a spreadsheet's trailing tab, a tab in a sentence) was read as id, src, tgt: its
    source an id, its target the source, the pair lost as empty or trained on half a sentence."""
    path = tmp_path / "c.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError) as err:
        read_parallel_file(str(path))
    assert str(err.value) == (
        f"{path}:2: {got} tab-separated columns, but line 1 has {first}: one layout per file "
        "(a tab inside a sentence, or at the end of a line?)"
    )


def test_tsv_single_column_is_user_error(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("a\tb\njust one column\n", encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:2")):
        read_parallel_file(str(path))


def test_text_pair_different_lengths(tmp_path):
    (tmp_path / "a.es").write_text("uno\ndos\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("one\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        read_parallel_file(f"{tmp_path / 'a.es'},{tmp_path / 'a.en'}")
    message = str(err.value)
    assert str(tmp_path / "a.es") in message and str(tmp_path / "a.en") in message
    assert "2" in message and "1" in message


def test_missing_file(tmp_path):
    path = tmp_path / "missing.tsv"
    with pytest.raises(UserError, match=re.escape(f"{path}: file not found")):
        read_parallel_file(str(path))


def test_missing_second_file_of_pair(tmp_path):
    (tmp_path / "a.es").write_text("uno\n", encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'a.en'}: file not found")):
        read_parallel_file(f"{tmp_path / 'a.es'},{tmp_path / 'a.en'}")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.tsv"
    path.write_bytes(b"")
    with pytest.raises(UserError, match=re.escape(f"{path}: file is empty")):
        read_parallel_file(str(path))


def test_three_comma_separated_files(tmp_path):
    for name in "abc":
        (tmp_path / name).write_text("x\n", encoding="utf-8")
    with pytest.raises(UserError, match="two plain-text files"):
        read_parallel_file(",".join(str(tmp_path / n) for n in "abc"))


def test_tsv_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"hola\thello\nadios\tbye\nmal\xff\tbad\nbien\tgood\n")
    with pytest.raises(UserError) as err:
        read_parallel_file(str(path))
    message = str(err.value)
    assert f"{path}:3" in message
    assert "utf-8" in message.lower()
    assert "\n" not in message


def test_text_pair_invalid_utf8_names_the_bad_file(tmp_path):
    (tmp_path / "a.es").write_bytes(b"uno\n")
    (tmp_path / "a.en").write_bytes(b"one\ntw\xc3o\n")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'a.en'}:2")):
        read_parallel_file(f"{tmp_path / 'a.es'},{tmp_path / 'a.en'}")


def test_jsonl_invalid_utf8(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"src": "a", "tgt": "b"}\n{"src": "m\xffal", "tgt": "bad"}\n')
    with pytest.raises(UserError, match=re.escape(str(path))):
        read_parallel_file(str(path))


def test_jsonl_row_without_fields(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"src": "hola", "tgt": "hello"}\n{"src": "solo"}\n', encoding="utf-8")
    with pytest.raises(UserError) as err:
        read_parallel_file(str(path), "es", "en")
    assert f"{path}:2" in str(err.value)
    assert "src" in str(err.value) and "tgt" in str(err.value)


def test_jsonl_translation_missing_language(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"translation": {"es": "hola", "fr": "salut"}}\n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:1")):
        read_parallel_file(str(path), "es", "en")


def test_jsonl_syntax_error_names_the_files_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"src": "a", "tgt": "b"}\n\n{"src": "c", }\n{"src": "d", "tgt": "e"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:3: not valid JSON: Expecting property name")):
        read_parallel_file(str(path))


@pytest.mark.parametrize(
    "row, message",
    [
        ({"src": 5, "tgt": ["a"]}, '"src" holds a number (5), not a string'),
        ({"src": "siete", "tgt": 7}, '"tgt" holds a number (7), not a string'),
        ({"src": "nada", "tgt": None}, '"tgt" holds null (null), not a string'),
        ({"translation": {"es": ["a", "b"], "en": "x"}}, '"translation.es" holds an array (["a", "b"]), not a string'),
    ],
)
def test_jsonl_field_that_is_not_a_string(tmp_path, row, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"src": "uno", "tgt": "one"}) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: {message}")):
        read_parallel_file(str(path), "es", "en")


def test_jsonl_row_that_is_not_an_object(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"src": "uno", "tgt": "one"}\n"dos"\n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: expected") + ".*got a string"):
        read_parallel_file(str(path))


# --- link files: data.train_align, eval.gold_align, align.gold ------------------------------------------


def test_train_align_invalid_utf8_names_file_and_line(write_tsv, tmp_path):
    train = write_tsv("t.tsv", [("uno dos", "one two"), ("tres", "three")])
    (tmp_path / "t.align").write_bytes(b"0-0 1-1\n0-0 \xe9\n")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 't.align'}:2: not valid UTF-8")):
        read_source(files_cfg(train=train, train_align=str(tmp_path / "t.align")))


def test_train_align_folder(write_tsv, tmp_path):
    train = write_tsv("t.tsv", [("uno", "one")])
    with pytest.raises(UserError, match=re.escape(f"data.train_align={str(tmp_path)!r}: a folder, not a file")):
        read_source(files_cfg(train=train, train_align=str(tmp_path)))


def test_train_align_lone_cr_and_bom(write_tsv, tmp_path):
    train = write_tsv("t.tsv", [("uno dos", "one two"), ("tres", "three")])
    (tmp_path / "t.align").write_bytes(b"\xef\xbb\xbf0-0\r1-1\n0-0\n")
    pairs = read_source(files_cfg(train=train, train_align=str(tmp_path / "t.align")))["train"]
    assert [p.links for p in pairs] == ["0-0 1-1", "0-0"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.align", "{path}: file not found"),
        ("", "{path}: a folder, not a file"),
        ("pipe.align", "{path}: a pipe or a device, not a file: write it into a file and give that"),
        ("latin1.align", "{path}:2: not valid UTF-8"),
    ],
)
def test_read_pharaoh_bad_files_are_one_line_errors(tmp_path, name, message):
    (tmp_path / "latin1.align").write_bytes(b"0-0\n0-1 caf\xe9\n")
    os.mkfifo(tmp_path / "pipe.align")  # as a shell's <(...): it is there, and no writer will come
    path = tmp_path / name  # "": the folder itself
    with pytest.raises(UserError, match=re.escape(message.format(path=path))):
        read_pharaoh(str(path))


@pytest.mark.parametrize("link", ["1_0-0", "\u00b2-0", "0-\u0663", "-1-0", "0-1-2", "0:1"])
def test_a_link_not_in_ascii_digits_is_refused_naming_its_line(tmp_path, link):
    """int() read ``1_0`` as word 10 and Arabic-Indic ``٣`` as 3: a gold file's typo scored AER, status 0."""
    path = tmp_path / "gold.align"
    path.write_text(f"0-0\n{link} 1-1\n", encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: {link!r} is not an i-j or i?j alignment link")):
        read_pharaoh(str(path))


def test_read_pharaoh_counts_the_files_lines(tmp_path):
    path = tmp_path / "gold.align"
    path.write_bytes(b"\xef\xbb\xbf0-0 1?1\r\n0-0\r1-1\n\n")
    assert read_pharaoh(str(path)) == [
        ({(0, 0)}, {(0, 0), (1, 1)}),
        ({(0, 0), (1, 1)}, {(0, 0), (1, 1)}),
        (set(), set()),
    ]


# --- hf -------------------------------------------------------------------------------------------


def translation_dataset(pairs, ids=None):
    columns = {"translation": [{"es": es, "en": en} for es, en in pairs]}
    if ids is not None:
        columns["id"] = ids
    return datasets.Dataset.from_dict(columns)


TRAIN = [("hola", "hello"), ("adiós", "goodbye"), ("gato", "cat")]
VALIDATION = [("perro", "dog")]


@pytest.fixture
def saved_dict(tmp_path):
    path = tmp_path / "saved"
    datasets.DatasetDict(
        train=translation_dataset(TRAIN, ids=["t1", "t2", "t3"]),
        validation=translation_dataset(VALIDATION, ids=["v1"]),
    ).save_to_disk(str(path))
    return path


def test_hf_saved_dataset_dict(saved_dict):
    splits = read_hf(hf_cfg(saved_dict, dev="validation"))
    assert splits["train"] == [Pair(f"train:{i}", es, en) for i, (es, en) in enumerate(TRAIN)]
    assert splits["dev"] == [Pair("validation:0", "perro", "dog")]
    assert splits["test"] is None


def test_hf_id_field_and_reversed_direction(saved_dict):
    splits = read_hf(hf_cfg(saved_dict, id_field="id", src_field="translation.en", tgt_field="translation.es"))
    assert splits["train"] == [Pair(f"t{i + 1}", en, es) for i, (es, en) in enumerate(TRAIN)]


def test_hf_flat_fields(tmp_path):
    path = tmp_path / "flat"
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"es": ["uno"], "en": ["one"]})).save_to_disk(str(path))
    assert read_hf(hf_cfg(path, src_field="es", tgt_field="en"))["train"] == [Pair("train:0", "uno", "one")]


def test_hf_jsonl_folder_through_load_dataset(tmp_path):
    folder = tmp_path / "jsonfolder"
    folder.mkdir()
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for es, en in TRAIN:
            f.write(json.dumps({"translation": {"es": es, "en": en}}, ensure_ascii=False) + "\n")
    splits = read_source(hf_cfg(folder))
    assert splits["train"] == [Pair(f"train:{i}", es, en) for i, (es, en) in enumerate(TRAIN)]
    assert splits["dev"] is None and splits["test"] is None


def test_hf_null_text_is_empty_and_a_null_id_numbers_its_row(tmp_path):
    """A hub row's null was the sentence "None", trained on; now it is empty text (the filters drop it, counted:
    tests/test_prepare.py), and a null id leaves its row numbered, as a JSON Lines row without an id."""
    path = tmp_path / "nulls"
    columns = {"id": ["a", None, "c"], "es": ["hola", "adiós", None], "en": ["hello", None, "thanks"]}
    datasets.DatasetDict(train=datasets.Dataset.from_dict(columns)).save_to_disk(str(path))
    rows = read_hf(hf_cfg(path, src_field="es", tgt_field="en", id_field="id"))["train"]
    assert rows == [Pair("a", "hola", "hello"), Pair("train:1", "adiós", ""), Pair("c", "", "thanks")]
    assert [row.numbered for row in rows] == [False, True, False]


def test_hf_text_that_is_not_a_string_is_refused_in_one_line(tmp_path):
    path = tmp_path / "lists"
    columns = {"es": [["uno", "un"]], "en": ["one"]}
    datasets.DatasetDict(train=datasets.Dataset.from_dict(columns)).save_to_disk(str(path))
    with pytest.raises(UserError) as err:
        read_hf(hf_cfg(path, src_field="es", tgt_field="en"))
    assert str(err.value) == f'{path}[train] row 0: \'es\' holds an array (["uno", "un"]), not a string'


def test_hf_missing_field_names_field(saved_dict):
    with pytest.raises(UserError) as err:
        read_hf(hf_cfg(saved_dict, tgt_field="translation.fr"))
    assert "'translation.fr'" in str(err.value)
    assert "[train] row 0" in str(err.value)


def test_hf_missing_split_lists_splits(saved_dict):
    with pytest.raises(UserError) as err:
        read_hf(hf_cfg(saved_dict, dev="dev"))
    assert "data.dev='dev'" in str(err.value)
    assert "['train', 'validation']" in str(err.value)


def test_hf_unloadable_path(tmp_path):
    with pytest.raises(UserError, match="cannot load dataset"):
        read_hf(hf_cfg(tmp_path / "does-not-exist"))


def test_hf_path_not_set():
    with pytest.raises(UserError, match="data.hf_path"):
        read_hf(DataConfig(source="hf", name="x", dir="unused", train="train"))


def test_hf_missing_id_field_is_user_error(saved_dict):
    with pytest.raises(UserError, match="nope"):
        read_hf(hf_cfg(saved_dict, id_field="nope"))


def test_hf_saved_single_dataset(tmp_path):
    path = tmp_path / "single"
    translation_dataset(TRAIN).save_to_disk(str(path))
    splits = read_hf(hf_cfg(path))  # a single saved split is read as the train split
    assert [(p.src, p.tgt) for p in splits["train"]] == TRAIN
