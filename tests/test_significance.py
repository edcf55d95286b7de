"""Paired significance (app/evaluation/significance.py) against sacrebleu's own command line on the same files;
what the report says in words; make eval's eval.baseline and make compare's section through the CLI."""

import json
import operator
import random
import re
import subprocess
import sys

import pytest
import sacrebleu
from conftest import TINY, run_cli, trained_tiny_run
from test_explorer import read_explorer

from app.evaluation.significance import in_words, paired_significance, sentence_wins
from app.run.errors import UserError


def systems(genesis_pairs):
    """References and three systems: a baseline that drops a word a verse, a far worse one, and the baseline again."""
    refs = [en for _, _, en in genesis_pairs]
    rng = random.Random(0)

    def drop(text: str, n: int) -> str:
        words = text.split()
        for _ in range(min(n, len(words) - 1)):
            words.pop(rng.randrange(len(words)))
        return " ".join(words)

    baseline = [drop(r, 1) for r in refs]
    worse = [drop(r, 6) for r in refs]
    return refs, baseline, worse


def sacrebleu_cli(tmp_path, refs, hyps: dict, test: str) -> str:
    files = []
    for name, lines in {"refs": refs, **hyps}.items():
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        files.append(str(tmp_path / name))
    cli = [sys.executable, "-m", "sacrebleu", files[0], "-i", *files[1:], "-m", "bleu", "chrf", f"--paired-{test}"]
    result = subprocess.run(cli + ["--format", "text"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_p_values_and_intervals_are_sacrebleus_own(tmp_path, genesis_pairs):
    refs, baseline, worse = systems(genesis_pairs)
    ours = paired_significance([("baseline", baseline), ("worse", worse)], refs, "13a")
    boot = sacrebleu_cli(tmp_path, refs, {"baseline": baseline, "worse": worse}, "bs")
    # the CLI's table: "score (mean ± ci)" per system and metric, then "(p = ...)" under the compared system
    cells = re.findall(r"(\d+\.\d) \((\d+\.\d) ± (\d+\.\d)\)", boot)
    assert len(cells) == 4
    for (score, mean, ci), (system, metric) in zip(cells, [(0, "BLEU"), (0, "chrF2"), (1, "BLEU"), (1, "chrF2")]):
        s = ours[system].scores[metric]
        assert (float(score), float(mean), float(ci)) == pytest.approx((s["score"], s["mean"], s["ci95"]), abs=0.051)
    p_boot = [float(p) for p in re.findall(r"p = (\d\.\d+)", boot)]
    assert p_boot == pytest.approx([ours[1].scores[m]["p_bootstrap"] for m in ("BLEU", "chrF2")], abs=1e-4)
    rand = sacrebleu_cli(tmp_path, refs, {"baseline": baseline, "worse": worse}, "ar")
    p_rand = [float(p) for p in re.findall(r"p = (\d\.\d+)", rand)]
    assert p_rand == pytest.approx([ours[1].scores[m]["p_randomization"] for m in ("BLEU", "chrF2")], abs=1e-4)


def test_sentence_wins_count_higher_lower_and_equal_sentence_bleu_to_the_hundredth():
    assert sentence_wins([10.0, 5.0, 7.004, 0.0], [9.0, 6.5, 7.0, 0.0]) == {"better": 1, "worse": 1, "same": 2}
    # as the explorer shows them: 1.43 against 1.42 is higher, though they are 0.0036 apart (it was "the same")
    assert sentence_wins([1.4267, 0.0006], [1.4231, 0.0]) == {"better": 1, "worse": 0, "same": 1}
    with pytest.raises(ValueError):  # a sentence without its baseline is a caller's bug, never a silent zip
        sentence_wins([1.0, 2.0], [1.0])


def test_the_words_say_which_differences_are_significant(genesis_pairs):
    refs, baseline, worse = systems(genesis_pairs)
    again = paired_significance([("base", baseline), ("worse", worse), ("same", list(baseline))], refs, "13a")
    lines = in_words(again)
    assert lines[0].startswith("worse: BLEU -") and "worse than base, significantly" in lines[0]
    assert lines[1].startswith("same: BLEU +0.00 (the same score as base: p = ")  # not called significant
    near = [b if i % 2 else w for i, (b, w) in enumerate(zip(baseline, worse))][:4] + baseline[4:]
    lines = in_words(paired_significance([("base", baseline), ("near", near)], refs, "13a"))
    assert "not significantly different from base" in lines[0]
    with pytest.raises(UserError, match="worse: 3 hypotheses for 80 references"):
        paired_significance([("base", baseline), ("worse", worse[:3])], refs, "13a")


@pytest.mark.slow
def test_make_eval_tests_the_run_against_a_baseline_file_and_refuses_one_of_another_length(
    tmp_path_factory, corpus_tsv
):
    root = trained_tiny_run(tmp_path_factory, corpus_tsv, "significance")
    evaluated = run_cli(root, "command=eval", *TINY)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    hyp = (root / "checkpoints" / "tiny" / "eval" / "test" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    (root / "shorter.txt").write_text("".join(h.rsplit(" ", 1)[0] + "\n" for h in hyp), encoding="utf-8")
    result = run_cli(root, "command=eval", *TINY, "eval.baseline=shorter.txt")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "against eval.baseline (shorter.txt), paired bootstrap and approximate randomization:" in result.stdout
    assert re.search(r"tiny: BLEU [-+]\d+\.\d\d \(", result.stdout)
    metrics = json.loads((root / "checkpoints" / "tiny" / "eval" / "test" / "metrics.json").read_text())
    names = [s["name"] for s in metrics["significance"]["systems"]]
    assert names == ["shorter.txt", "tiny"] and metrics["significance"]["systems"][1]["BLEU"]["p_bootstrap"] is not None
    wins = metrics["significance"]["sentences"]  # each sentence's BLEU against the baseline's
    assert sum(wins.values()) == len(hyp), wins
    said = f"higher on {wins['better']} sentences, lower on {wins['worse']}, the same on {wins['same']}"
    assert said in result.stdout
    assert "[sacrebleu]" not in result.stdout + result.stderr  # its INFO lines narrate the tests: not for users
    _, meta, explored = read_explorer(root / "checkpoints" / "tiny" / "eval" / "test" / "alignments.html")
    shorter = (root / "shorter.txt").read_text(encoding="utf-8").splitlines()
    assert meta["baseline"] == "shorter.txt" and [s["base"] for s in explored] == shorter
    expected = [round(sacrebleu.sentence_bleu(b, [s["reference"]]).score, 2) for b, s in zip(shorter, explored)]
    assert [s["baseBleu"] for s in explored] == expected
    ours = [s["bleu"] for s in explored]
    counted = [sum(op(a, b) for a, b in zip(ours, expected)) for op in (operator.gt, operator.lt, operator.eq)]
    assert counted == [wins["better"], wins["worse"], wins["same"]]
    (root / "cut.txt").write_text("".join(h + "\n" for h in hyp[:-1]), encoding="utf-8")
    refused = run_cli(root, "command=eval", *TINY, "eval.baseline=cut.txt")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (
        f"error: eval.baseline=cut.txt: cut.txt has {len(hyp) - 1} lines for the {len(hyp)} sentences of test: a line "
        "per sentence, in its order"
    )
    (root / "latin1.txt").write_bytes("ok\naño\n".encode("latin-1"))  # read before its length is checked
    refused = run_cli(root, "command=eval", *TINY, "eval.baseline=latin1.txt")
    assert refused.returncode == 2 and refused.stderr.strip() == "error: latin1.txt:2: not valid UTF-8", refused.stderr


def test_make_eval_scores_against_more_references_and_refuses_a_file_of_another_length(tmp_path_factory, corpus_tsv):
    """eval.references: the run's own hypotheses as a second reference make every hypothesis a match (BLEU and
    chrF 100, TER 0), in the scores, the signatures, the console line and the test against a baseline; a
    reference file of another length than the sentences evaluated, or none, is one line naming it."""
    root = trained_tiny_run(tmp_path_factory, corpus_tsv, "significance")
    out = root / "checkpoints" / "tiny" / "eval" / "test"
    first = run_cli(root, "command=eval", *TINY)
    assert first.returncode == 0, first.stderr[-2000:]
    hyp = (out / "hyp.txt").read_text(encoding="utf-8").splitlines()
    single = json.loads((out / "metrics.json").read_text())
    assert single["bleu"] < 100 and "references" not in single
    (root / "own.txt").write_text("".join(h + "\n" for h in hyp), encoding="utf-8")
    (root / "worse.txt").write_text("".join(h.rsplit(" ", 1)[0] + "\n" for h in hyp), encoding="utf-8")
    result = run_cli(root, "command=eval", *TINY, "eval.references=[own.txt]", "eval.baseline=worse.txt")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"({len(hyp)} sentences, 2 references each;" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["bleu"], metrics["chrf"], metrics["ter"], metrics["references"]) == (100.0, 100.0, 0.0, 2)
    assert all("nrefs:2" in metrics[f"{name}_signature"] for name in ("bleu", "chrf", "ter"))
    tested = metrics["significance"]["systems"]
    assert [s["name"] for s in tested] == ["worse.txt", "tiny"] and tested[1]["BLEU"]["score"] == 100.0
    _, _, explored = read_explorer(out / "alignments.html")  # each sentence's second reference, under the first
    assert [s["more"] for s in explored] == [[h] for h in hyp]
    subset = run_cli(root, "command=eval", *TINY, "eval.references=[own.txt]", "eval.max_sentences=3")
    assert subset.returncode == 0, subset.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["sentences"], metrics["bleu"]) == (3, 100.0) and metrics["subset"], metrics
    (root / "cut.txt").write_text("".join(h + "\n" for h in hyp[:-1]), encoding="utf-8")
    for given, line in (
        ("cut.txt", f"cut.txt has {len(hyp) - 1} lines for the {len(hyp)} sentences of test: a line per sentence"),
        ("nowhere.txt", "nowhere.txt does not exist"),
    ):
        refused = run_cli(root, "command=eval", *TINY, f"eval.references=[own.txt,{given}]")
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert refused.stderr.strip().startswith(f"error: eval.references: {line}"), refused.stderr
