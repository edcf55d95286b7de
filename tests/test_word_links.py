"""Word links worth exporting (issue 66): shift-att and the symmetrizations on hand-made matrices and link sets,
the choice of a method by its AER, eflomal's links for guided alignment, and make align through the CLI."""

import json
import os
import re
import sys

import numpy as np
import pytest
from conftest import TINY, run_cli

from app.config.schema import DataConfig
from app.data.aligner import aligner_words, check_aligner, write_aligner_links
from app.data.links import read_pharaoh, word_probabilities
from app.data.prepare import prepare, read_tsv
from app.data.symmetrization import (
    AGREEMENT_THRESHOLDS,
    agreement,
    grow_diag_final_and,
    intersection,
    symmetrize,
    union,
)
from app.evaluation.alignment import DirectionLinks, LinkCandidates, alignment_error_rate
from app.evaluation.extraction import Method, default_method, read_links, read_words, shift_att
from app.run.errors import UserError

SRC = [0, 1, 2, -1]  # the words of ▁a ▁b ▁c </s>
TGT = [0, 1, 2, -1]  # of ▁x ▁y ▁z </s>
# rows: the positions that write x, y, z, </s> (their inputs: <s>, x, y, z); each looks at one source word
ROWS = np.array(
    [
        [0.0, 0.1, 0.9, 0.0],  # writes x (input <s>): on c
        [0.8, 0.1, 0.1, 0.0],  # writes y (input x): on a
        [0.1, 0.8, 0.1, 0.0],  # writes z (input y): on b
        [0.0, 0.1, 0.9, 0.0],  # writes </s> (input z): on c
    ]
)


def test_shift_att_reads_the_row_where_the_target_word_is_the_decoders_input():
    assert read_links(ROWS, SRC, TGT, "attention") == {(2, 0), (0, 1), (1, 2)}  # x-c, y-a, z-b
    assert read_links(ROWS, SRC, TGT, "attention, shift-att") == {(0, 0), (1, 1), (2, 2)}  # x-a, y-b, z-c
    shifted = shift_att(ROWS[None])[0]
    assert np.array_equal(shifted[:3], ROWS[1:]) and not shifted[3].any()  # </s>'s row links no word
    # a Transformer's (layers, heads, tgt, src): every head and layer mean, as it is and shifted
    attention = np.stack([np.stack([ROWS, np.roll(ROWS, 1, axis=0)])])  # 1 layer, 2 heads
    names, best = read_words(attention, SRC, TGT)
    assert names == [
        "layer 0 head 0",
        "layer 0 head 1",
        "layer 0 mean",
        "layer 0 head 0, shift-att",
        "layer 0 head 1, shift-att",
        "layer 0 mean, shift-att",
    ]
    assert best[names.index("layer 0 head 0, shift-att")].tolist() == [0, 1, 2]
    assert best[names.index("layer 0 head 1, shift-att")].tolist() == [2, 0, 1]  # head 1's rows are one late
    assert read_words(attention, SRC, TGT, ["layer 0 head 1, shift-att"])[1].tolist() == [[2, 0, 1]]


# A worked example of grow-diag-final-and, by hand (6 source words, 6 target words):
# intersection {0-0, 1-1}; the union's other links in order: 2-2, 3-2, 4-0, 5-3, 5-5.
# grow-diag: 2-2 (source 2 unaligned, diagonal to 1-1) in; 3-2 (source 3 unaligned, beside 2-2) in; 4-0, 5-3 and
# 5-5 touch no link: out; a second pass adds nothing. final-and, forward first: 4-0 out (target 0 is aligned),
# 5-5 in (both unaligned); then reverse: 5-3 out (source 5 is aligned by now).
FORWARD = {(0, 0), (1, 1), (2, 2), (5, 5), (4, 0)}
REVERSE = {(0, 0), (1, 1), (3, 2), (5, 3)}


def test_symmetrizations_of_a_worked_example():
    assert intersection(FORWARD, REVERSE) == {(0, 0), (1, 1)}
    assert union(FORWARD, REVERSE) == {(0, 0), (1, 1), (2, 2), (3, 2), (4, 0), (5, 3), (5, 5)}
    assert grow_diag_final_and(FORWARD, REVERSE) == {(0, 0), (1, 1), (2, 2), (3, 2), (5, 5)}
    # the reverse direction's links first: final-and then takes 5-3 before 5-5
    assert grow_diag_final_and(REVERSE, FORWARD) == {(0, 0), (1, 1), (2, 2), (3, 2), (5, 3)}
    assert symmetrize("grow-diag-final-and", FORWARD, REVERSE) == grow_diag_final_and(FORWARD, REVERSE)
    # a diagonal grows from a corner one step at a time, each step beside the last
    diagonal = {(i, i) for i in range(5)}
    assert grow_diag_final_and({(0, 0)} | diagonal, {(0, 0)}) == diagonal


def test_the_method_of_lowest_aer_is_chosen_and_scored_against_a_known_gold():
    # one pair of 3 x 3 words; gold: 0-0 1-1 2-2 sure
    gold = [({(0, 0), (1, 1), (2, 2)}, {(0, 0), (1, 1), (2, 2)})]
    forward = DirectionLinks(["view", "view, shift-att"], {0: np.array([[0, 0, 2], [0, 1, 0]])})
    # reverse: a row per source word (its targets): the target word it links, turned round {0-0, 1-1, 2-1}
    reverse = DirectionLinks(["view"], {0: np.array([[0, 1, 1]])})
    found = LinkCandidates(forward, reverse)
    # "view": {0-0, 0-1, 2-2}: |A∩S| = 2 -> AER 1 - 4/6; shift: {0-0, 1-1, 0-2}: also 2 of 3 right
    assert found.forward.score(gold, "all").result("view")["aer"] == pytest.approx(round(1 - 4 / 6, 4))
    assert found.directions(gold, "all") == ("view", "view")  # the first of equals
    method, directions, _ = found.choose(gold, "all")
    # intersection of {0-0, 0-1, 2-2} and the reverse {0-0, 1-1, 2-1}: {0-0}: AER 1 - 2/4; union: 5 links, 3 right:
    # 1 - 6/8; grow-diag-final-and: 0-1 (target 1 unaligned, beside 0-0), 1-1 (source 1 unaligned), 2-1 (source 2),
    # 2-2 (target 2): the union again, listed after it
    scores = found.score(gold, "all", found.methods(directions))
    assert scores.result("intersection of view and the reverse run's view")["aer"] == 0.5
    assert scores.result("union of view and the reverse run's view")["aer"] == 0.25
    assert method == Method("view", "union", "view")  # AER 0.25, the lowest; the first of equals
    assert alignment_error_rate([found.links(0, method)], gold) == scores.result(method.name)
    assert found.choose(gold, "all", "shift-att")[0] == Method("view, shift-att")
    with pytest.raises(UserError, match="align.reverse"):
        LinkCandidates(forward).choose(gold, "all", "union")


def test_agreement_links_the_words_whose_two_directions_probabilities_multiply_to_the_threshold():
    # forward: each target word's distribution over 3 source words; reverse: each source word's over 3 target words
    forward = np.array([[0.9, 0.1, 0.0], [0.1, 0.5, 0.4], [0.0, 0.0, 0.0]])  # target 2 attends to no word
    reverse = np.array([[0.8, 0.2, 0.0], [0.1, 0.6, 0.3], [0.0, 0.9, 0.1]])
    # products (target, source): 0-0 0.72, 1-1 0.30, 1-2 0.36, 0-1 0.01, 1-0 0.02; none for target 2
    assert agreement(forward, reverse, 0.3) == {(0, 0), (1, 1), (2, 1)}  # target 1 links to two words
    assert agreement(forward, reverse, 0.35) == {(0, 0), (2, 1)}
    assert agreement(forward, reverse, 0.8) == set()  # none is sure enough: no links, not the argmax
    # a tokenizer that drops a word's only character: the common words are read
    assert agreement(forward, reverse[:2, :2], 0.3) == {(0, 0), (1, 1)}
    # pieces summed into words, each target word's row a distribution; a row on </s> alone stays zeros
    maps = np.array([[[0.2, 0.2, 0.5, 0.1], [0.0, 0.0, 0.0, 1.0], [0.5, 0.25, 0.25, 0.0]]])
    words = word_probabilities(maps, [0, 0, 1, -1], [0, 1, 2])  # ▁a b ▁c </s>, ▁x ▁y ▁z
    assert np.allclose(words, [[[0.4 / 0.9, 0.5 / 0.9], [0.0, 0.0], [0.75, 0.25]]])


def test_the_reverse_reading_is_chosen_by_what_it_adds_and_agreement_by_its_aer_on_gold():
    # one pair of 3 x 3 words; gold: the diagonal, sure. The forward reading links every target word to source 0.
    gold = [({(0, 0), (1, 1), (2, 2)}, {(0, 0), (1, 1), (2, 2)})]
    forward = DirectionLinks(["view"], {0: np.array([[0, 0, 0]])})  # 0-0 0-1 0-2: one right
    # the reverse run's rows, a row per source word (its target word): "own" is right twice on its own (1-1 2-2) but
    # joins the forward reading only in its wrong 0-1; "joins" is right once (0-0), the link the forward got right
    rows = np.array([[1, 1, 2], [0, 0, 0]])
    reverse = DirectionLinks(["own", "joins"], {0: rows})
    found = LinkCandidates(forward, reverse)
    assert reverse.score(gold, "all", turned=True).best() == "own"
    assert found.directions(gold, "all") == ("view", "joins")

    # agreement: the probabilities of the two readings, read by a pass more (read_two). The forward model is unsure
    # of target words 1 and 2 (0.5 / 0.5 and 0.55 / 0.45 between source 0 and their own), the reverse one is sure.
    p_fwd = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.55, 0.0, 0.45]])
    p_rev = np.eye(3)
    asked = []

    def read_two(directions):
        asked.append(directions)
        fwd = DirectionLinks(["view"], dict(forward.best), ("view",), {(0, "view"): p_fwd})
        rev = DirectionLinks(["joins"], {0: rows[1:]}, ("joins",), {(0, "joins"): p_rev})
        return LinkCandidates(fwd, rev)

    method, directions, score = found.choose(gold, "all", "auto", read_two)
    assert asked == [("view", "joins")] and directions == ("view", "joins")
    # at 0.45 and below agreement links the diagonal, all three right; the others: intersection 0-0 alone
    assert method.name == f"agreement ≥ {AGREEMENT_THRESHOLDS[0]:g} of view and the reverse run's joins"
    assert score.result(method.name)["aer"] == 0.0
    assert score.result("intersection of view and the reverse run's joins")["aer"] == 0.5
    assert found.links(0, method) == {(0, 0), (1, 1), (2, 2)}
    assert found.choose(gold, "all", "grow-diag-final-and", read_two)[0].kind == "grow-diag-final-and"
    assert found.choose(gold, "all", "agreement")[0].kind == "agreement"  # the probabilities were kept
    with pytest.raises(UserError, match="align.reverse"):
        LinkCandidates(forward).choose(gold, "all", "agreement", read_two)


def test_without_dev_links_the_method_is_the_plotted_view():
    attention = np.zeros((3, 4, 1, 1))
    assert default_method(attention, -1, "auto") == Method("layer 2 mean")
    assert default_method(attention, 1, "shift-att").name == "layer 1 mean, shift-att"
    assert default_method(attention, -1, "auto", attention).name == (
        "grow-diag-final-and of layer 2 mean and the reverse run's layer 2 mean"
    )
    assert default_method(attention, -1, "agreement", attention).name == (
        "agreement ≥ 0.15 of layer 2 mean and the reverse run's layer 2 mean"
    )


def test_a_missing_eflomal_is_a_one_line_error_naming_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "eflomal", None)  # import eflomal raises ImportError
    with pytest.raises(UserError, match=r'^data.aligner=eflomal needs the eflomal package: pip install "nmt-attention'):
        check_aligner("eflomal")
    check_aligner("none")


def test_the_aligner_reads_words_without_their_punctuation_and_keeps_their_count():
    assert aligner_words("En el principio, Dios creó «los cielos». —") == "En el principio Dios creó los cielos —"


def eflomal_or_skip():
    return pytest.importorskip("eflomal", reason='eflomal is not installed: pip install "nmt-attention[align]"')


@pytest.mark.slow
def test_eflomal_links_guide_training_and_leave_the_reference_links_of_dev_and_test(tmp_path, corpus_tsv):
    eflomal_or_skip()
    cfg = DataConfig(source="files", train=str(corpus_tsv), dev_fraction=0.1, test_fraction=0.1, aligner="eflomal")
    assert cfg.dir.endswith("_eflomal")  # beside the corpus prepared without it, never in its place
    cfg.dir = str(tmp_path / "d")
    report = prepare(cfg)
    assert report["aligned"] == ["train"] and not os.path.exists(os.path.join(cfg.dir, "dev.align"))
    pairs = read_tsv(os.path.join(cfg.dir, "train.tsv"))
    links = read_pharaoh(os.path.join(cfg.dir, "train.align"))
    assert len(links) == len(pairs) > 100
    for pair, (sure, possible) in zip(pairs, links):
        assert sure == possible and sure  # every link sure, and every pair linked
        assert all(s < len(pair.src.split()) and t < len(pair.tgt.split()) for s, t in sure)
    # read back through the split: where "Dios" and "God" (Genesis 1-6) both occur once, most pairs link them
    both = [
        (pair.src.split().index("Dios"), pair.tgt.split().index("God"), sure)
        for pair, (sure, _) in zip(pairs, links)
        if pair.src.split().count("Dios") == 1 and pair.tgt.split().count("God") == 1
    ]
    assert len(both) > 20 and sum((s, t) in sure for s, t, sure in both) > 0.5 * len(both)
    for split in ("dev", "test"):  # the aligner's own links of dev and test, to score it, under another name
        assert len(read_pharaoh(os.path.join(cfg.dir, f"{split}.eflomal.align"))) == len(
            read_tsv(os.path.join(cfg.dir, f"{split}.tsv"))
        )
    # a corpus with reference links: dev and test keep theirs, train's are replaced by the aligner's
    gold = {split: os.path.join(cfg.dir, f"{split}.align") for split in ("dev", "test")}
    for split, path in gold.items():
        with open(path, "w", encoding="utf-8") as f:
            f.writelines("0-0\n" for _ in read_tsv(os.path.join(cfg.dir, f"{split}.tsv")))
    write_aligner_links(cfg.dir, "eflomal", ("train", "dev", "test"))
    assert all(set(open(path, encoding="utf-8").read().split()) == {"0-0"} for path in gold.values())


def pharaoh_words(line: str) -> list[tuple[int, int]]:
    assert re.fullmatch(r"(\d+-\d+( \d+-\d+)*)?", line), line
    return [tuple(map(int, link.split("-"))) for link in line.split()]


@pytest.fixture(scope="module")
def linked_runs(tmp_path_factory, corpus_tsv):
    """A tiny run trained on Genesis 1-6 with word links (a diagonal: every dev and test pair has reference links),
    and a run of the other direction (data.reverse: the same pairs and splits turned round, links too)."""
    root = tmp_path_factory.mktemp("word_links")
    rows = [line.split("\t") for line in corpus_tsv.read_text(encoding="utf-8").splitlines()]
    diagonal = [" ".join(f"{i}-{i}" for i in range(min(len(s.split()), len(t.split())))) for _, s, t in rows]
    (root / "corpus.tsv").write_text("".join(f"{r}\t{s}\t{t}\n" for r, s, t in rows), encoding="utf-8")
    (root / "links.txt").write_text("".join(line + "\n" for line in diagonal), encoding="utf-8")
    tiny = [a for a in TINY if not a.startswith(("data.train=", "name="))]
    for name, reverse in (("tiny", "false"), ("tiny_turned", "true")):
        args = [*tiny, "data.train=corpus.tsv", "data.train_align=links.txt", f"data.reverse={reverse}", f"name={name}"]
        result = run_cli(root, "command=train", *args, "train.max_steps=40", "train.eval_every=40")
        assert result.returncode == 0, result.stderr[-3000:]
    turned = read_tsv(str(root / "data" / "tiny_reverse" / "test.tsv"))
    assert [(p.id, p.tgt, p.src) for p in read_tsv(str(root / "data" / "tiny" / "test.tsv"))] == [
        (p.id, p.src, p.tgt) for p in turned
    ]
    return root


@pytest.mark.slow
def test_make_align_writes_a_line_per_pair_and_counts_the_pairs_it_skips(linked_runs):
    root = linked_runs
    src = ["En el principio creó Dios los cielos y la tierra.", "", " ".join(["palabra"] * 1100), "Y dijo Dios."]
    tgt = ["In the beginning God created the heavens and the earth.", "And God said.", "word", "And God said."]
    (root / "a.es").write_text("".join(line + "\n" for line in src), encoding="utf-8")
    (root / "a.en").write_text("".join(line + "\n" for line in tgt), encoding="utf-8")
    (root / "gold.txt").write_text("0-0 1-1 2-2\n\n\n0-0 1-1 2-2\n", encoding="utf-8")
    args = ["align.source=a.es", "align.target=a.en", "align.gold=gold.txt", "align.output=out/a.align"]
    result = run_cli(root, "command=align", "name=tiny", "device=cpu", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (root / "out" / "a.align").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == len(src) + 1  # one line per pair
    for line, s, t in zip(lines, src, tgt):
        for i, j in pharaoh_words(line):
            assert i < len(s.split()) and j < len(t.split())
    assert lines[1] == lines[2] == "" and lines[0] and lines[3]  # the empty and the over-long pair: empty lines
    assert "skipped 2 pairs, an empty line each: 1 empty, 1 too long for the model" in result.stdout
    assert re.search(r"aligned 4 pairs in [\d.]+ s \([\d.]+ lines/s\)", result.stdout)
    summary = json.loads((root / "out" / "a.json").read_text())
    assert summary["skipped"] == {"empty": 1, "too long for the model": 1}
    assert summary["chosen_on"].startswith("chosen on dev: AER") and summary["alignment"]["scope"] == "all"
    assert summary["method"] in result.stdout and 0 <= summary["alignment"]["aer"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "files, message",
    [
        ({"r.gold": "0-0\n0-0 9-1\n"}, "error: r.gold:2: link 9-1 is past the end of the pair's words (3 source, 3 "),
        ({"r.es": "Y dijo Dios.\nY vio Dios.\na\xf1o\n".encode("latin-1")}, "error: r.es:3: not valid UTF-8"),
        ({"r.en": None}, "error: align.target='r.en': file not found"),
    ],
    ids=["link past the end", "not UTF-8", "missing"],
)
def test_make_align_refuses_files_it_cannot_read_right_in_one_line(linked_runs, files, message):
    """A gold link to a word the pair lacks was scored as a miss; a non-UTF-8 or missing file was a traceback."""
    root = linked_runs
    given = {"r.es": "Y dijo Dios.\nY vio Dios.\n", "r.en": "And God said.\nAnd God saw.\n", "r.gold": "0-0\n0-0\n"}
    for name, text in {**given, **files}.items():
        (root / name).unlink(missing_ok=True)
        if text is not None:
            (root / name).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    args = ["align.source=r.es", "align.target=r.en", "align.gold=r.gold", "align.output=out/r.align"]
    result = run_cli(root, "command=align", "name=tiny", "device=cpu", *args)
    assert result.returncode == 2 and result.stderr.startswith(message), result.stderr[-3000:]


@pytest.mark.slow
def test_both_directions_symmetrized_through_make_align_and_make_eval(linked_runs):
    root = linked_runs
    turned = os.path.join("checkpoints", "tiny_turned")
    for method in ("grow-diag-final-and", "intersection", "agreement"):
        args = ["align.split=test", f"align.reverse={turned}", f"align.method={method}"]
        result = run_cli(root, "command=align", "name=tiny", "device=cpu", *args)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((root / "checkpoints" / "tiny" / "align" / "test.json").read_text())
        named = f"{method} ≥ " if method == "agreement" else f"{method} of layer 0 "  # agreement names its threshold
        assert summary["method"].startswith(named) and summary["kind"] == method
        lines = (root / "checkpoints" / "tiny" / "align" / "test.align").read_text(encoding="utf-8").splitlines()
        assert len(lines) == len(read_tsv(str(root / "data" / "tiny" / "test.tsv")))
        assert summary["alignment"]["scope"] == "linked" and summary["alignment"]["gold"].endswith("test.align")
    result = run_cli(root, "command=eval", "name=tiny", "device=cpu", f"align.reverse={turned}", "viz.eval_plots=1")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((root / "checkpoints" / "tiny" / "eval" / "test" / "metrics.json").read_text())
    a = metrics["alignment"]
    assert any(name.startswith("grow-diag-final-and of ") for name in a["aer_by_view"])
    assert any(name.endswith(", shift-att") for name in a["aer_by_view"])
    assert a["method"] in a["aer_by_view"] and metrics["hyp_align_view"] == a["method"]
    assert a["aer"] == a["aer_by_view"][a["method"]] and a["chosen_on"] == "dev"
    # each kind of method at its best reading on dev, scored on test; the one reported is its kind's best
    kinds = ["attention", "shift-att", "intersection", "union", "grow-diag-final-and", "agreement"]
    assert sorted(a["by_method"]) == sorted(kinds)
    for kind, best in a["by_method"].items():
        assert best["aer"] == a["aer_by_view"][best["method"]] and 0 <= best["precision"] <= 1, kind
    assert a["method"] in [best["method"] for best in a["by_method"].values()]
    assert "    AER by method: attention " in result.stdout
