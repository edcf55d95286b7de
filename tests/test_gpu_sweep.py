"""A planned sweep trained a run per call on lent machines (``scripts/gpu_check.sh compare``), its records
brought back and assembled here (``collect``): each call takes the next run without a record, whatever
session made the others, and the report covers every record. Runs on the CPU with a tiny model, as the
script does with GPU_CHECK_ARGS."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY

pytestmark = pytest.mark.slow  # each call trains and evaluates a run through the real CLI

PLAN = """# two runs of one plan
common train.max_steps=6 train.max_minutes=0.5 decode.beam_size=2

rope +variant=rope
alibi +variant=alibi
"""


def gpu_check(cwd, part, out, **env):
    settings = [a for a in TINY if not a.startswith("name=")]
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "PY": sys.executable,
        "OUT": str(out),
        "GPU_CHECK_ARGS": " ".join(settings),
        **env,
    }
    return subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), part],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_each_call_trains_the_next_run_without_a_record_and_collect_reports_them_all(tmp_path, corpus_tsv):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.txt").write_text(PLAN)

    # a call too short for the run's budget (30 s) and the 45 s around it starts nothing
    short = gpu_check(tmp_path, "compare", tmp_path / "call0", PLAN=str(plan), CALL_SECONDS="70")
    assert short.returncode == 0 and os.listdir(tmp_path / "call0") == ["compare.log"]
    assert "rope would need about 75 s" in short.stdout and f"left in {plan}: alibi" in short.stdout

    first = gpu_check(tmp_path, "compare", tmp_path / "call1", PLAN=str(plan), CODE_COMMIT="abc1234")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert set(os.listdir(tmp_path / "call1")) == {"compare.log", "rope.tar.gz"}  # one run per call
    assert f"left in {plan}: alibi" in first.stdout

    # the same machine, called again before the record was collected here, packs it again untrained
    again = gpu_check(tmp_path, "compare", tmp_path / "again", PLAN=str(plan), CODE_COMMIT="abc1234", CALL_SECONDS="70")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "rope.tar.gz again: this machine trained it in an earlier call" in again.stdout
    assert "== " not in again.stdout and f"left in {plan}: alibi" in again.stdout  # nothing ran
    assert set(os.listdir(tmp_path / "again")) == {"compare.log", "rope.tar.gz"}

    collected = gpu_check(tmp_path, "collect", tmp_path / "here", PLAN=str(plan), FROM=str(tmp_path / "again"))
    assert collected.returncode == 0, collected.stdout[-3000:]
    record = plan / "runs" / "rope"
    assert json.loads((record / "provenance.json").read_text())["commit"] == "abc1234"
    assert (record / "eval" / "test" / "hyp.txt").exists() and not list(record.rglob("*.pt"))
    assert (record / "validations.jsonl").read_text().count('"dev_bleu"') >= 1  # its learning curve comes too
    assert not list(record.rglob("*.npz")) and not list(record.rglob("*.png"))  # attention files stay there

    # a later call (another session) sees the record in the plan folder and trains the next run
    second = gpu_check(tmp_path, "compare", tmp_path / "call2", PLAN=str(plan), CODE_COMMIT="def5678")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert set(os.listdir(tmp_path / "call2")) == {"compare.log", "alibi.tar.gz"}
    collected = gpu_check(tmp_path, "collect", tmp_path / "here", PLAN=str(plan), FROM=str(tmp_path / "call2"))
    assert collected.returncode == 0, collected.stdout[-3000:]

    third = gpu_check(tmp_path, "compare", tmp_path / "call3", PLAN=str(plan))
    assert third.returncode == 0 and "every run of" in third.stdout
    assert sorted(os.listdir(tmp_path / "call3")) == ["compare.log"]

    report = (plan / "compare.md").read_text()
    rows = [line.split(" | ")[0] for line in report.split("\n## ")[0].splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| rope", "| alibi"]  # the plan's order, each labelled by its name in the plan
    assert "(code abc1234, " in report and "(code def5678, " in report
    assert (plan / "bleu_by_length.png").stat().st_size > 10_000 and (plan / "learning_curves.png").exists()

    # the decoding part on the runs this machine trained (alibi, first by name, with rope in the ensemble); the run
    # folders of a sweep are named by their overrides (= and , in them: Hydra takes them quoted)
    settings = " ".join([a for a in TINY if not a.startswith("name=")] + ["eval.max_sentences=4"])
    decoded = gpu_check(tmp_path, "decoding", tmp_path / "decoding", GPU_CHECK_ARGS=settings)
    assert decoded.returncode == 0, decoded.stdout[-3000:] + decoded.stderr[-3000:]
    how = {
        tag: json.loads((tmp_path / "decoding" / f"decoding_{tag}_metrics.json").read_text())["decoding"]
        for tag in ("greedy", "beam5", "topk10", "topp09", "whole", "ensemble5")
    }
    assert how["greedy"] == "greedy" and how["topk10"] == "sampling top-k 10, seed 0", how
    assert how["topp09"] == "sampling top-p 0.9, seed 0" and how["whole"] == "sampling the whole distribution, seed 0"
    metrics = json.loads((tmp_path / "decoding" / "decoding_ensemble5_metrics.json").read_text())
    assert len(metrics["ensemble"]) == 2 and "gpu_sweeps/rope/" in metrics["ensemble"][1]
    scores = (tmp_path / "decoding" / "decoding_score_test.tsv").read_text().splitlines()
    assert scores and all(len(line.split("\t")) == 3 for line in scores)
