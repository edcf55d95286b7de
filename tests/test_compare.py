"""How a comparison is assembled: run folders named by their settings, runs in the order they were
started whatever call trained them, the report's columns and length table, and the rules that let a
cut sweep continue (a spent budget takes no step, a finished run is recognised)."""

import json
import os
import re
import time

import pytest
import torch
import yaml

from app.cli import job_dir
from app.config.schema import TrainConfig
from app.report.compare import compare_report, load_runs
from app.run.errors import UserError
from app.train.state import finished
from app.train.stop_rules import StopRules

BUCKETS = [("0-10", 3, 20.0), ("10-20", 5, 10.0), ("20+", 1, None)]  # the last has too few words for BLEU


def write_run(sweep, folder, overrides, started, bleu, buckets=BUCKETS, attention=None, heads=None):
    run = sweep / folder
    (run / ".hydra" / "train").mkdir(parents=True)
    (run / "eval" / "test").mkdir(parents=True)
    (run / ".hydra" / "train" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    summary = {"started": started, "steps": 1234, "train_minutes": 4.0, "tgt_tokens_per_s": 50000}
    summary.update(best_dev_bleu=bleu - 1, parameters=2_500_000)
    (run / "train_summary.json").write_text(json.dumps(summary))
    by_length = [{"bucket": b, "sentences": n, **({} if v is None else {"bleu": v + bleu})} for b, n, v in buckets]
    metrics = {
        "sentences": sum(n for _, n, _ in buckets),
        "bleu": bleu,
        "chrf": 40.0,
        "bleu_by_source_length": by_length,
    }
    metrics.update(decoding="beam 5, length penalty 1.0", decode_seconds=1.2, sentences_per_s=800.0, device="cpu")
    if attention:
        metrics["attention"] = attention
    if heads:
        metrics["self_attention_heads"] = heads
    (run / "eval" / "test" / "metrics.json").write_text(json.dumps(metrics))
    return run


def test_run_folders_are_named_by_their_settings():
    assert job_dir("model=rnn_plain,train.max_minutes=4") == "model=rnn_plain,train.max_minutes=4"
    assert job_dir("") == "defaults"
    with_path = job_dir("data.train=/corpora/a.tsv,model=rnn_plain")
    assert "/" not in with_path and with_path.startswith("data.train=_corpora_a.tsv,model=rnn_plain-")
    assert with_path != job_dir("data.train=_corpora_a.tsv,model=rnn_plain")  # the hash tells them apart
    long_a, long_b = ",".join(f"k{i}=value{i}" for i in range(30)), ",".join(f"k{i}=value{i}" for i in range(31))
    assert len(job_dir(long_a)) <= 120 and job_dir(long_a) != job_dir(long_b)
    assert job_dir(long_a) == job_dir(long_a)  # the same settings find the same folder in every call


def test_runs_come_in_the_order_they_were_started_labelled_by_what_differs(tmp_path):
    common = ["command=train", "experiment=compare", "train.max_minutes=4", "train.auto_resume=true"]
    # folder names sort the other way round: the order must come from when each run started
    write_run(tmp_path, "b_later", [*common, "model=rnn_bahdanau"], "2026-11-24T10:05:00", 30.0)
    write_run(tmp_path, "a_first", [*common, "model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    (tmp_path / "not_evaluated").mkdir()  # a run still training: left out
    runs = load_runs(str(tmp_path))
    assert [r["dir"] for r in runs] == ["a_first", "b_later"]
    assert [r["label"] for r in runs] == ["model=rnn_plain", "model=rnn_bahdanau"]


def test_a_run_without_a_differing_setting_is_labelled_by_its_model(tmp_path):
    base = ["command=train", "model=rnn_luong", "train.max_minutes=4"]
    write_run(tmp_path, "general", base, "2026-11-24T10:00:00", 20.0)
    write_run(tmp_path, "dot", [*base, "model.score=dot"], "2026-11-24T10:05:00", 25.0)
    assert [r["label"] for r in load_runs(str(tmp_path))] == ["model=rnn_luong", "model.score=dot"]


def test_report_has_the_columns_the_length_table_and_the_commands(tmp_path):
    shape = {"view": "attention", "entropy": 1.23456, "monotonicity": 0.875, "reattention": 0.4321}
    write_run(tmp_path, "plain", ["command=train", "model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    write_run(tmp_path, "att", ["command=train", "model=rnn_bahdanau"], "2026-11-24T10:01:00", 30.0, attention=shape)
    text = compare_report(str(tmp_path))
    report = (tmp_path / "compare.md").read_text()
    assert text in report
    header = next(line for line in report.splitlines() if line.startswith("| run | params")).split(" | ")
    plain, att = (line.split(" | ") for line in text.splitlines() if line.startswith("| model=rnn_"))
    assert att[header.index("updates")] == "1,234"
    assert att[header.index("attention entropy")] == "1.235" and att[header.index("monotonicity")] == "0.875"
    assert att[header.index("re-attention")] == "0.432" and plain[header.index("re-attention")] == "-"
    assert plain[header.index("attention entropy")] == "-"  # no attention: no figure, not a zero
    assert plain[header.index("positional heads enc, dec")] == "-"  # no self-attention
    assert "| run | 0-10 (3) | 10-20 (5) | 20+ (1) |" in report
    assert (
        "| model=rnn_plain | 40.00 | 30.00 | - |" in report and "| model=rnn_bahdanau | 50.00 | 40.00 | - |" in report
    )
    assert "- `plain`: `python -m app command=train model=rnn_plain`" in report
    assert (tmp_path / "bleu_by_length.png").stat().st_size > 10_000


def test_a_transformers_positional_self_attention_heads_are_counted(tmp_path):
    def head(positional):
        return {"confidence": 0.5, "offsets": {"-1": 0.95, "0": 0.0, "+1": 0.0}, "positional": positional}

    heads = {"encoder": [[head(-1), head(None)], [head(1), head(None)]], "decoder": [[head(None), head(None)]]}
    write_run(tmp_path, "t", ["command=train", "model=transformer"], "2026-11-24T10:00:00", 30.0, heads=heads)
    compare_report(str(tmp_path))
    report = (tmp_path / "compare.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| run | params")).split(" | ")
    row = next(line for line in report.splitlines() if line.startswith("| model=transformer")).split(" | ")
    assert row[header.index("positional heads enc, dec")] == "2/4, 0/2"


def test_runs_trained_on_other_devices_are_named_above_the_table_and_the_report_goes_to_out(tmp_path):
    sweep, out = tmp_path / "runs", tmp_path / "report"
    h100 = write_run(sweep, "plain", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    h200 = write_run(sweep, "bahdanau", ["model=rnn_bahdanau"], "2026-11-26T10:00:00", 30.0)
    for run, device in ((h100, "NVIDIA H100 80GB HBM3"), (h200, "NVIDIA H200")):
        summary = json.loads((run / "train_summary.json").read_text())
        (run / "train_summary.json").write_text(json.dumps({**summary, "device": device}))
    summary = json.loads((h100 / "train_summary.json").read_text())
    (h100 / "train_summary.json").write_text(json.dumps({**summary, "stopped": "early stopping (no gain)"}))
    provenance = {"name": "bahdanau_h200", "commit": "abc1234", "finished": "2026-11-26 10:05 UTC"}
    (h200 / "provenance.json").write_text(json.dumps(provenance))  # a plan's run: labelled by its name there
    compare_report(str(sweep), out=str(out))
    report = (out / "compare.md").read_text()
    assert not (sweep / "compare.md").exists() and (out / "bleu_by_length.png").exists()
    assert (
        "**Trained on different devices** (NVIDIA H100 80GB HBM3: model=rnn_plain; NVIDIA H200: bahdanau_h200)"
        in report.split("| run |")[0]
    )
    assert "`python -m app command=train model=rnn_bahdanau` (code abc1234, 2026-11-26 10:05 UTC)" in report
    assert "`python -m app command=train model=rnn_plain`; stopped: early stopping (no gain)\n" in report

    same = tmp_path / "same"
    write_run(same, "plain", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    write_run(same, "bahdanau", ["model=rnn_bahdanau"], "2026-11-24T10:05:00", 30.0)
    compare_report(str(same))
    assert "different devices" not in (same / "compare.md").read_text()


def test_runs_decoded_on_other_sentences_are_refused(tmp_path):
    write_run(tmp_path, "one", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    write_run(tmp_path, "two", ["model=rnn_bahdanau"], "2026-11-24T10:01:00", 30.0, buckets=BUCKETS[:2])
    with pytest.raises(UserError, match="two and one were evaluated on different test sentences"):
        load_runs(str(tmp_path))


def test_runs_whose_bleu_counted_other_words_are_refused(tmp_path):
    """BLEU of zh's words and of 13a's are different numbers: not one table (a run from before bleu_tokenize was
    recorded counted 13a's)."""
    write_run(tmp_path, "one", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    two = write_run(tmp_path, "two", ["model=rnn_bahdanau"], "2026-11-24T10:01:00", 30.0)
    metrics = two / "eval" / "test" / "metrics.json"
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "bleu_tokenize": "13a"}))
    assert [r["dir"] for r in load_runs(str(tmp_path))] == ["one", "two"]
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "bleu_tokenize": "zh"}))
    with pytest.raises(UserError) as refused:
        load_runs(str(tmp_path))
    assert str(refused.value) == (
        "two and one counted BLEU's words apart (eval.bleu_tokenize zh vs 13a): evaluate them with one "
        "eval.bleu_tokenize"
    )


def test_runs_scored_against_other_references_are_refused_and_more_references_are_not_retested(tmp_path):
    """A run scored against eval.references' more references has other numbers than one scored against the corpus's
    alone: not one table; runs scored alike are compared, but their significance is left to make eval, which reads
    the reference files (a run keeps only its hypotheses)."""
    for name, started in (("one", "2026-11-24T10:00:00"), ("two", "2026-11-24T10:01:00")):
        run = write_run(tmp_path, name, [f"model=rnn_{name}"], started, 20.0)
        metrics = run / "eval" / "test" / "metrics.json"
        metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "references": 2}))
        (run / "eval" / "test" / "hyp.txt").write_text("a\n" * 9, encoding="utf-8")
        (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(tmp_path / "data")}}))
    compare_report(str(tmp_path))
    report = (tmp_path / "compare.md").read_text(encoding="utf-8")
    assert "Not tested: the runs were scored against 2 references a sentence (eval.references)" in report
    metrics.write_text(json.dumps({k: v for k, v in json.loads(metrics.read_text()).items() if k != "references"}))
    with pytest.raises(UserError) as refused:
        load_runs(str(tmp_path))
    assert str(refused.value) == (
        "two and one were scored against 1 and 2 references a sentence (eval.references): evaluate them against the "
        "same references"
    )


def test_a_resumed_run_whose_budget_is_spent_takes_no_step():
    rules = StopRules(TrainConfig(max_steps=100, max_minutes=1.0), world=1, device=torch.device("cpu"))
    assert rules.reached(5, 0, rules.out_of_time(59.0)) is None
    assert rules.reached(5, 0, rules.out_of_time(60.0)) == "time budget of 1.0 min"
    assert rules.reached(100, 0, False) == "max_steps"
    assert rules.reached(5, 7, False) is None  # no epoch limit
    epochs = StopRules(TrainConfig(max_steps=100, max_epochs=2), world=1, device=torch.device("cpu"))
    assert epochs.reached(5, 1, False) is None and epochs.reached(5, 2, False) == "max_epochs (2)"
    unlimited = StopRules(TrainConfig(max_steps=100), world=1, device=torch.device("cpu"))
    assert not unlimited.out_of_time(1e9)


def test_a_run_is_finished_once_its_summary_is_newer_than_its_last_checkpoint(tmp_path):
    last, summary = tmp_path / "last.pt", tmp_path / "train_summary.json"
    assert not finished(str(tmp_path))
    last.write_bytes(b"x")
    assert not finished(str(tmp_path))  # cut before the end
    summary.write_text("{}")
    os.utime(summary, (time.time() + 1, time.time() + 1))
    assert finished(str(tmp_path))
    os.utime(last, (time.time() + 2, time.time() + 2))  # resumed and saved again after that summary
    assert not finished(str(tmp_path))


def test_learning_curves_are_drawn_from_the_runs_that_have_a_validation_history(tmp_path):
    def history(run, bleus, entropies=None):
        lines = []
        for i, bleu in enumerate(bleus):
            entry = {"step": 100 * (i + 1), "minutes": 0.5 * (i + 1), "dev_bleu": bleu}
            if entropies:
                entry["attention_entropy"] = entropies[i]
            lines.append(json.dumps(entry) + "\n")
        (run / "validations.jsonl").write_text("".join(lines))

    old = write_run(tmp_path, "old", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    history(write_run(tmp_path, "att", ["model=rnn_bahdanau"], "2026-11-24T10:01:00", 30.0), [5, 12, 30], [3.0, 2, 1])
    compare_report(str(tmp_path))
    report = (tmp_path / "compare.md").read_text()
    assert "## Learning curves" in report
    assert "No validations.jsonl (trained before it was written): model=rnn_plain." in report
    assert (tmp_path / "learning_curves.png").stat().st_size > 20_000
    assert [e["dev_bleu"] for e in load_runs(str(tmp_path))[1]["history"]] == [5, 12, 30]

    alone = tmp_path / "alone"  # no run with a history: no section, no figure
    write_run(alone, "old", ["model=rnn_plain"], "2026-11-24T10:00:00", 20.0)
    compare_report(str(alone))
    assert "Learning curves" not in (alone / "compare.md").read_text() and not (alone / "learning_curves.png").exists()
    assert old.exists()


def test_each_run_is_tested_against_the_baseline_and_the_report_says_which_differ(tmp_path, genesis_pairs):
    """compare.md's significance section: every run's BLEU and chrF with their 95 % intervals and the p-values of
    both paired tests against compare.baseline (else the first run), then in words."""
    refs = [en for _, _, en in genesis_pairs]
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.tsv").write_text("".join(f"{i}\tsrc\t{r}\n" for i, r in enumerate(refs)), encoding="utf-8")
    systems = {"good": refs, "poor": [" ".join(r.split()[::2]) for r in refs], "same": refs}
    buckets = [("0-10", 40, 1.0), ("10+", 40, 2.0)]
    for n, (name, hyps) in enumerate(systems.items()):
        run = write_run(tmp_path, name, ["command=train", f"train.seed={n}"], f"2026-11-24T10:0{n}:00", 30.0, buckets)
        (run / "eval" / "test" / "hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(data)}}))
    compare_report(str(tmp_path), baseline="poor")
    report = (tmp_path / "compare.md").read_text(encoding="utf-8")
    assert "## Significance against train.seed=1" in report
    section = report.split("## Significance", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| train.seed=")]
    assert rows[0].startswith("| train.seed=1 | ") and rows[0].count("baseline") == 3
    assert re.match(r"\| train\.seed=0 \| 100\.00 ± 0\.00 \| 0\.0010, 0\.0001 \| 100\.00 ± 0\.00 \|", rows[1])
    # sentence by sentence: the references themselves beat every shortened verse; a copy of them ties them
    assert rows[0].endswith("| baseline |") and rows[1].endswith(f"| {len(refs)} / 0 / 0 |")
    assert rows[2].endswith(f"| {len(refs)} / 0 / 0 |")
    assert "- train.seed=0: BLEU +" in report and "better than train.seed=1, significantly" in report
    with pytest.raises(UserError, match="compare.baseline=nope: no such run"):
        compare_report(str(tmp_path), baseline="nope")
