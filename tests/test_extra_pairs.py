"""data.extra_train / data.extra_tag: extra pairs (back-translations, a teacher's translations) join the train
split only, cleaned and de-duplicated with it, never holding a dev or test sentence, tagged as one piece."""

import json
import os
import shutil
from dataclasses import asdict

import pytest
from conftest import TINY, run_cli
from test_prepare import corpus_rows, data_cfg

from app.config.schema import DataConfig, FilterConfig, TokenizerConfig
from app.data.prepare import PREPARE_VERSION, _fingerprint, cache_key, prepare, read_tsv
from app.data.sources import SPLITS
from app.data.tokenizer import build_tokenizer
from app.run.errors import UserError
from app.run.files import stable_hash


def splits_of(cfg):
    return {s: read_tsv(os.path.join(cfg.dir, f"{s}.tsv")) for s in SPLITS}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def corpus(tmp_path, write_tsv):
    """The corpus prepared without extra pairs: its splits, and the path of its file."""
    path = write_tsv("corpus.tsv", corpus_rows(300))
    plain = data_cfg(tmp_path, train=path, dir=str(tmp_path / "plain"))
    prepare(plain)
    return splits_of(plain), path


def test_extra_pairs_join_train_cleaned_deduplicated_tagged_and_never_a_held_out_sentence(tmp_path, corpus):
    splits, path = corpus
    dev, test, train = splits["dev"][0], splits["test"][0], splits["train"][0]
    new = [(f"frase sintetica {i}", f"monolingual line {i} of english") for i in range(7)]
    pairs = [
        *new[:4],
        (train.src, train.tgt),  # a copy of a corpus pair: a duplicate
        ("otra frase cualquiera", test.tgt),  # a test reference as a target
        (dev.src, "some other english line"),  # a dev source as a source
        ("x", "a pair far too long for its short source " * 3),  # max_ratio
        new[4],
        new[4],  # twice: one is a duplicate
        *new[5:],
    ]
    extra = ",".join(
        write_lines(tmp_path / name, [pair[k] for pair in pairs]) for k, name in enumerate(("bt.es", "mono.en"))
    )
    cfg = data_cfg(tmp_path, train=path, extra_train=extra, extra_tag="<BT>")
    report = prepare(cfg)
    got = splits_of(cfg)
    for split in ("dev", "test"):  # held-out splits as without extra pairs
        assert [(p.id, p.src, p.tgt) for p in got[split]] == [(p.id, p.src, p.tgt) for p in splits[split]]
    own, added = got["train"][: len(splits["train"])], got["train"][len(splits["train"]) :]
    assert own == splits["train"]
    assert [(p.src, p.tgt) for p in added] == [(f"<BT> {s}", t) for s, t in new]
    assert [p.id for p in added] == [f"extra:bt.es:{n}" for n in (1, 2, 3, 4, 9, 11, 12)]
    assert report["extra"] == {"pairs": 7, "dropped": {"duplicate": 2, "held-out sentence": 2, "max_ratio": 1}}
    assert report["pairs"]["train"] == len(splits["train"]) + 7
    with open(os.path.join(cfg.dir, "prepare.json"), encoding="utf-8") as f:
        assert json.load(f) == report
    assert prepare(cfg) == report  # cached: the second call reads the report
    (tmp_path / "mono.en").write_text("changed line\n" * len(pairs), encoding="utf-8")
    prepare(cfg)  # an edited extra file: prepared again
    assert {p.tgt for p in splits_of(cfg)["train"] if p.id.startswith("extra:")} == {"changed line"}


def test_an_extra_pair_with_a_held_out_id_is_dropped_and_reverse_turns_them_round(tmp_path, corpus, write_tsv):
    """Pairs with ids of their own go through the split rule: the verse of a test pair never trains, even in
    other words (another translation of it); data.reverse turns extra pairs round with the corpus's."""
    splits, path = corpus
    rows = [(pid, f"otra version {pid}", f"another version of {pid}") for pid in (f"s{i}" for i in range(300))]
    cfg = data_cfg(tmp_path, train=path, extra_train=write_tsv("other.tsv", rows))
    report = prepare(cfg)
    added = splits_of(cfg)["train"][len(splits["train"]) :]
    train_ids = {p.id for p in splits["train"]}
    assert [p.id for p in added] == [f"extra:{pid}" for pid, _, _ in rows if pid in train_ids]
    assert report["extra"]["dropped"] == {"held-out id": len(rows) - len(train_ids)}
    back = data_cfg(tmp_path, train=path, extra_train=cfg.extra_train, dir=str(tmp_path / "r"), reverse=True)
    prepare(back)
    assert [(p.id, p.src, p.tgt) for p in splits_of(back)["train"]] == [
        (p.id, p.tgt, p.src) for p in splits_of(cfg)["train"]
    ]


def test_the_folder_the_cache_key_and_old_corpora(tmp_path):
    plain = DataConfig(source="files", name="gen")
    assert plain.dir == os.path.join("data", "gen")
    tagged = DataConfig(source="files", name="gen", extra_train="bt.es,mono.en", extra_tag="<BT>")
    untagged = DataConfig(source="files", name="gen", extra_train="bt.es,mono.en")
    assert tagged.dir.startswith(os.path.join("data", "gen_plus_bt_")) and untagged.dir.startswith(tagged.dir[:-6])
    assert tagged.dir != untagged.dir  # the tag changes what the corpus holds
    assert len({cache_key(plain), cache_key(tagged), cache_key(untagged)}) == 3
    before = {k: v for k, v in asdict(plain).items() if k not in ("num_proc", "aligner", "reverse")}
    before = {k: v for k, v in before.items() if k not in ("extra_train", "extra_tag")}
    key = {"version": PREPARE_VERSION, "settings": before, "inputs": _fingerprint(plain), "split_key": "text"}
    assert cache_key(plain) == stable_hash(key)  # as before data.extra_train: no corpus is prepared again


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(extra_tag="<BT>"), "data.extra_tag='<BT>' tags the pairs of data.extra_train, which is not set"),
        (dict(extra_train="a.tsv", extra_tag="<B T>"), "data.extra_tag='<B T>' must be one word"),
        (dict(extra_train="a.tsv", extra_tag=""), "data.extra_tag='' must be one word"),
    ],
)
def test_a_tag_is_refused_in_one_line(settings, message):
    with pytest.raises(UserError) as err:
        DataConfig(source="files", name="x", **settings)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_what_extra_pairs_cannot_join_is_refused(tmp_path, corpus):
    _, path = corpus
    links = write_lines(tmp_path / "links.txt", ["0-0"] * 300)
    extra = write_lines(tmp_path / "x.es", ["frase nueva"]) + "," + write_lines(tmp_path / "x.en", ["new line"])
    with pytest.raises(UserError, match=r"its pairs have no reference links, and data.train_align=.* links every"):
        prepare(data_cfg(tmp_path, train=path, train_align=links, extra_train=extra))
    with pytest.raises(UserError, match=r"^data.extra_train: .*missing.tsv: file not found$"):
        prepare(data_cfg(tmp_path, train=path, extra_train=str(tmp_path / "missing.tsv")))
    train = read_tsv(os.path.join(str(tmp_path / "plain"), "train.tsv"))[0]
    copies = ",".join(write_lines(tmp_path / f"c.{k}", [v]) for k, v in (("es", train.src), ("en", train.tgt)))
    with pytest.raises(UserError, match=r"every pair was dropped \(\{'duplicate': 1\}\)"):
        prepare(data_cfg(tmp_path, train=path, extra_train=copies, dir=str(tmp_path / "c")))
    with pytest.raises(UserError, match=r"has 1 lines but .* has 2"):
        uneven = write_lines(tmp_path / "u.es", ["a"]) + "," + write_lines(tmp_path / "u.en", ["b", "c"])
        prepare(data_cfg(tmp_path, train=path, extra_train=uneven, dir=str(tmp_path / "u")))


def test_the_tag_is_one_piece_of_the_tokenizer_and_another_corpus_tokenizer_must_hold_it(tmp_path, corpus):
    _, path = corpus
    rows = [f"frase sintetica numero {i}" for i in range(40)]
    extra = write_lines(tmp_path / "bt.es", rows) + "," + write_lines(tmp_path / "m.en", [f"line {i}" for i in rows])
    cfg = data_cfg(tmp_path, train=path, extra_train=extra, extra_tag="<BT>", filters=FilterConfig(max_ratio=0))
    prepare(cfg)
    tokenizer = build_tokenizer(cfg.dir, TokenizerConfig(vocab_size=120), symbols=("<BT>",))
    pieces = tokenizer.src_pieces(tokenizer.encode_src(["<BT> frase numero 3"])[0])
    assert "<BT>" in pieces and not any("<" in p and p != "<BT>" for p in pieces)
    untagged = build_tokenizer(str(tmp_path / "plain"), TokenizerConfig(vocab_size=120))
    assert "<BT>" not in untagged.src_pieces(untagged.encode_src(["<BT> frase numero 3"])[0])  # split without
    other = TokenizerConfig(vocab_size=120, dir=str(tmp_path / "plain"))
    with pytest.raises(UserError, match=r"data.extra_tag=<BT>: not a piece of tokenizer.dir=.*'s model"):
        build_tokenizer(cfg.dir, other, symbols=("<BT>",))
    assert build_tokenizer(cfg.dir, TokenizerConfig(vocab_size=120, dir=cfg.dir), symbols=("<BT>",))


@pytest.mark.slow
def test_back_translation_through_the_cli(tmp_path, corpus_tsv):
    """The workflow of docs/configuration.md on the tiny corpus: a reverse run samples synthetic sources for
    monolingual target lines; a forward run trains on the corpus and them, tagged; the data step names them."""
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    tiny = [arg for arg in TINY if not arg.startswith("data.name=")]
    reverse = run_cli(
        tmp_path, "command=train", *tiny, "data.name=tiny", "data.reverse=true", "train.max_steps=20", "name=en_es"
    )
    assert reverse.returncode == 0, reverse.stderr[-3000:]
    english = [line.split("\t")[2] for line in (tmp_path / "corpus.tsv").read_text(encoding="utf-8").splitlines()]
    mono = write_lines(tmp_path / "mono.en", [f"And {line[0].lower()}{line[1:]}" for line in english[:60]])
    sampled = run_cli(
        tmp_path,
        "command=translate",
        "name=en_es",
        "decode.sampling=true",
        "decode.beam_size=1",
        f"translate.input={mono}",
        "translate.output=bt.es",
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert len((tmp_path / "bt.es").read_text(encoding="utf-8").splitlines()) == 60
    forward = run_cli(
        tmp_path,
        "command=train",
        *tiny,
        "data.name=tiny",
        "data.extra_train='bt.es,mono.en'",
        "data.extra_tag='<BT>'",
        "train.max_steps=20",
        "name=es_en_bt",
    )
    assert forward.returncode == 0, forward.stderr[-3000:]
    folders = [name for name in os.listdir(tmp_path / "data") if name.startswith("tiny_plus_bt_")]
    assert len(folders) == 1, os.listdir(tmp_path / "data")
    log = (tmp_path / "checkpoints" / "es_en_bt" / "train.log").read_text(encoding="utf-8")
    report = json.loads((tmp_path / "data" / folders[0] / "prepare.json").read_text(encoding="utf-8"))
    kept = report["extra"]["pairs"]
    assert f"data: train: {kept} extra pairs from bt.es,mono.en kept, tagged <BT>, dropped" in log
    assert 40 <= kept <= 60
    lines = (tmp_path / "data" / folders[0] / "train.tsv").read_text(encoding="utf-8").splitlines()
    assert sum(line.split("\t")[1].startswith("<BT> ") for line in lines) == kept
