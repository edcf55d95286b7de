"""Bad input through the real CLI: each case ends in one line naming the file, line or setting (exit
code 2, no traceback), or in a counted, reported drop."""

import json
import re
import shutil

import pytest
from conftest import TINY, run_cli

pytestmark = pytest.mark.slow  # every test here runs the real CLI in a subprocess, or compiles

GOOD = (
    "Gen.1.1\tEn el principio creó Dios los cielos y la tierra.\t"
    "In the beginning, God created the heavens and the earth.\n"
)


def files(**named):
    """name -> file content (str, or bytes for undecodable input)."""
    return named


# (case, files to write, CLI arguments, fragments the one-line error must hold)
ERRORS = [
    ("missing file", files(), ["data.train=nope.tsv"], ["nope.tsv: file not found"]),
    ("empty file", files(**{"e.tsv": ""}), ["data.train=e.tsv"], ["e.tsv: file is empty"]),
    (
        "too few columns",
        files(**{"c.tsv": GOOD + "just one column\n"}),
        ["data.train=c.tsv"],
        ["c.tsv:2: expected 2 (src, tgt) or 3 (id, src, tgt) tab-separated columns, got 1"],
    ),
    ("too many columns", files(**{"c.tsv": GOOD + "a\tb\tc\td\n"}), ["data.train=c.tsv"], ["c.tsv:2:", "got 4"]),
    (
        "invalid UTF-8",
        files(**{"u.tsv": GOOD.encode() * 2 + b"x\t\xff\xfe\ty\n"}),
        ["data.train=u.tsv"],
        ["u.tsv:3: not valid UTF-8"],
    ),
    (
        "parallel files of different lengths",
        files(**{"a.es": "uno\ndos\ntres\n", "a.en": "one\ntwo\n"}),
        ["data.train='a.es,a.en'"],
        ["a.es has 3 lines but a.en has 2"],
    ),  # quoted: Hydra reads a bare comma as a sweep
    (
        "JSONL row without the fields",
        files(**{"j.jsonl": '{"source": "hola", "target": "hello"}\n'}),
        ["data.train=j.jsonl"],
        ["j.jsonl:1: expected", "got keys ['source', 'target']"],
    ),
    (
        "JSONL field that is not a string",
        files(**{"j.jsonl": '{"src": "hola", "tgt": "hello"}\n{"src": 5, "tgt": ["a"]}\n'}),
        ["data.train=j.jsonl"],
        ['j.jsonl:2: "src" holds a number (5), not a string'],
    ),
    (
        "JSONL syntax error",
        files(**{"j.jsonl": '{"src": "hola", "tgt": "hello"}\n{"src": "hola", }\n'}),
        ["data.train=j.jsonl"],
        ["j.jsonl:2: not valid JSON: Expecting property name enclosed in double quotes (column 17)"],
    ),
    (
        "a bad line after a lone CR",  # the CR ends no line: the bad line is still line 3
        files(**{"c.tsv": GOOD.encode() + b"x\tuno\rdos\tone two\njust one column\n"}),
        ["data.train=c.tsv"],
        ["c.tsv:3: expected 2 (src, tgt) or 3 (id, src, tgt) tab-separated columns, got 1"],
    ),
    (
        "invalid UTF-8 in data.train_align",
        files(**{"t.tsv": GOOD + GOOD.replace("Gen.1.1", "Gen.1.2"), "t.align": b"0-0\n0-1 caf\xe9\n"}),
        ["data.train=t.tsv", "data.train_align=t.align"],
        ["t.align:2: not valid UTF-8"],
    ),
    (
        "a superscript digit in data.train_align",  # str.isdigit passes it, int does not: a ValueError traceback
        files(**{"t.tsv": GOOD + GOOD.replace("Gen.1.1", "Gen.1.2"), "t.align": "0-0\n\u00b2-0\n"}),
        ["data.train=t.tsv", "data.train_align=t.align"],
        ["t.align:2: '\u00b2-0' is not an i-j or i?j alignment link"],
    ),
    (
        "an empty part of data.train",  # it said ": file not found", naming neither the file nor the setting
        files(**{"a.es": "hola\n"}),
        ["data.train='a.es,'"],
        ["data.train='a.es,': an empty file name"],
    ),
    (
        "a folder as data.train_align",
        files(**{"t.tsv": GOOD}),
        ["data.train=t.tsv", "data.train_align=."],
        ["data.train_align='.': a folder, not a file"],
    ),
    ("unknown setting", files(), ["train.max_stepz=3"], ["max_stepz"]),
    ("wrong type", files(), ["train.max_steps=many"], ["max_steps", "many"]),
    (
        "more n-best than beams",
        files(),
        ["decode.beam_size=2", "decode.n_best=3"],
        ["decode.beam_size=2 must be >= 1 and >= decode.n_best=3"],
    ),
    (
        "a negative n-gram ban",
        files(),
        ["decode.no_repeat_ngram_size=-1"],
        ["decode.no_repeat_ngram_size=-1 must be >= 0 (0: off)"],
    ),
    (
        "a negative least length",
        files(),
        ["decode.min_len=-1"],
        ["decode.min_len=-1 must be >= 0: the fewest pieces of a translation"],
    ),
    (
        "a negative coverage penalty",
        files(),
        ["decode.coverage_penalty=-0.2"],
        ["decode.coverage_penalty=-0.2 must be in [0, 10] (GNMT's β; 0: off)"],
    ),
    (
        "sampling with a beam",
        files(),
        ["decode.sampling=true"],
        ["decode.sampling=true draws one hypothesis per sentence, a beam search does not draw: set decode.beam_size=1"],
    ),
    (
        "a nucleus of nothing",
        files(),
        ["decode.sampling_topp=0"],
        ["decode.sampling_topp=0.0 must be in (0, 1] (1: no cut)"],
    ),
    (
        "a zero temperature",
        files(),
        ["decode.sampling_temperature=0"],
        ["decode.sampling_temperature=0.0 must be in [0.001, 1000]"],
    ),
    ("a negative top-k", files(), ["decode.sampling_topk=-2"], ["decode.sampling_topk=-2 must be >= 0"]),
    (
        "an ensemble to prepare",
        files(),
        ["data.train=a.tsv", "ensemble=[other]"],
        ["ensemble= decodes with eval, translate, score, serve"],
    ),
    ("a setting outside its choices", files(), ["train.amp=fp16"], ["train.amp='fp16' is not a choice: choose auto"]),
]


@pytest.mark.parametrize("case,inputs,args,fragments", ERRORS, ids=[case[0] for case in ERRORS])
def test_bad_input_is_one_clear_line(tmp_path, case, inputs, args, fragments):
    for name, content in inputs.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run_cli(tmp_path, "command=prepare", "data=files", "data.name=bad", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (case, result.stderr)
    if args[0].startswith("data."):  # our own errors: exactly one line, exit code 2
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")


def test_hub_dataset_without_the_configured_fields(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"es": ["hola"] * 8, "en": ["hello"] * 8}).save_to_disk(str(tmp_path / "ds"))
    result = run_cli(tmp_path, "command=prepare", "data=hf", "data.name=bad", f"data.hf_path={tmp_path / 'ds'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "field 'translation.es' not found" in result.stderr and "data.src_field" in result.stderr


# t.tsv prepared as train, dev and test alike: every rule's drops counted on each
PREPARE_T_AS_EVERY_SPLIT = (
    "command=prepare",
    "data=files",
    "data.name=d",
    "data.train=t.tsv",
    "data.dev_fraction=0",
    "data.test_fraction=0",
    "data.dev=t.tsv",
    "data.test=t.tsv",
)


def test_empty_overlong_and_duplicate_pairs_are_dropped_counted_and_reported(tmp_path):
    rows = [f"v{i}\tfrase número {i}\tsentence number {i}\n" for i in range(40)]
    rows += [
        "e1\t\tonly a target\n",
        "e2\tsólo origen\t\n",
        f"long\t{'palabra ' * 400}\tword\n",
        rows[0].replace("v0", "dup"),
    ]
    (tmp_path / "t.tsv").write_text("".join(rows), encoding="utf-8")
    result = run_cli(tmp_path, *PREPARE_T_AS_EVERY_SPLIT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "data" / "d" / "prepare.json").read_text())
    assert report["dropped"]["train"] == {"empty": 2, "max_chars": 1, "duplicate": 1}
    assert report["pairs"]["train"] == 40
    assert "dropped {'empty': 2, 'max_chars': 1, 'duplicate': 1}" in result.stdout + result.stderr


def test_a_lone_cr_and_a_byte_order_mark_lose_and_move_no_pair(tmp_path):
    rows = [f"v{i}\tfrase número {i}\tsentence number {i}\n" for i in range(30)]
    rows[5] = "v5\tfrase\rnúmero 5\tsentence number 5\n"  # a lone CR in a field: whitespace, as a tab in JSON
    (tmp_path / "t.tsv").write_bytes("".join(rows).encode("utf-8-sig"))
    result = run_cli(tmp_path, *PREPARE_T_AS_EVERY_SPLIT)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "data" / "d" / "train.tsv", "rb") as f:
        lines = f.read().decode("utf-8").split("\n")
    assert lines[:-1] == [row.replace("\r", " ").rstrip("\n") for row in rows]


@pytest.mark.parametrize(
    "args,error",
    [
        ([], "standard input: nothing to translate (it is empty)"),
        (["translate.input=missing.txt"], "translate.input='missing.txt': file not found"),
        (["translate.input=/dev/null"], "translate.input='/dev/null': nothing to translate (it is empty)"),
        (["translate.input=empty.txt"], "translate.input='empty.txt': nothing to translate (it is empty)"),
        (["translate.input=."], "translate.input='.': a folder, not a file"),
    ],
)
def test_translate_input_that_is_empty_or_missing(tmp_path, args, error):
    (tmp_path / "empty.txt").write_text("")
    result = run_cli(tmp_path, "command=translate", "name=none", *args, stdin="")
    assert result.returncode == 2 and result.stderr == f"error: {error}\n"


def test_a_model_too_short_for_the_corpus_is_refused_before_the_first_update(tmp_path, corpus_tsv):
    """model.max_len below the longest pair: the positions table raised mid-step (a traceback, no checkpoint)."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    result = run_cli(tmp_path, "command=train", *TINY, "model.max_len=16", "train.max_steps=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    message = (
        r"error: model\.max_len=16: the train split has a sentence of \d+ pieces with its EOS; raise model\.max_len"
    )
    assert re.match(message, result.stderr.strip().splitlines()[-1]), result.stderr
    assert not (tmp_path / "checkpoints" / "tiny").exists()


@pytest.mark.parametrize(
    "args,error",
    [
        (["command=translate", "translate.output=data"], "translate.output='data': a folder, not a file"),
        (
            ["command=translate", "translate.output=/proc/nope/x.txt"],
            "translate.output='/proc/nope/x.txt': its folder /proc/nope cannot be made (No such file or directory)",
        ),
        (
            ["command=translate", "translate.output=in.txt/x.txt"],
            "translate.output='in.txt/x.txt': its folder {root}/in.txt cannot be made: {root}/in.txt is a file",
        ),
        (
            ["command=score", "score.source=in.txt", "score.target=in.txt", "score.output=data"],
            "score.output='data': a folder, not a file",
        ),
        (["command=align", "align.output=data"], "align.output='data': a folder, not a file"),
        (
            ["command=align", "align.output=links.json"],
            "align.output='links.json': the summary <output>.json would replace the links: name them .align",
        ),
        (
            ["command=export", "export.dir=/proc/nope/ct2"],
            "export.dir=/proc/nope/ct2 cannot be made (No such file or directory)",
        ),
        (["command=compare", "compare.dir=.", "compare.out=in.txt"], "compare.out='in.txt': a file, not a folder"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, args, error):
    """An output setting naming a folder, or a file whose folder cannot be made, was a traceback once the work was
    done (IsADirectoryError, FileNotFoundError); now one line naming the setting, before any checkpoint is read:
    the run name=none has none."""
    (tmp_path / "data").mkdir()
    (tmp_path / "in.txt").write_text("Hola.\n")
    result = run_cli(tmp_path, *args, "name=none", "translate.input=in.txt", "device=cpu")
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2 and result.stderr == f"error: {error.format(root=tmp_path)}\n"


def test_an_output_folder_to_make_is_made_only_by_the_writer(tmp_path):
    """The folders made to find out that an output's folder can be made are removed: a refused command leaves none."""
    (tmp_path / "in.txt").write_text("Hola.\n")
    result = run_cli(tmp_path, "command=translate", "name=none", "translate.input=in.txt", "translate.output=a/b/x.txt")
    assert result.returncode == 2 and "checkpoint not found" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "a").exists()
