"""Validation with its host work (dev scoring, heatmaps) in the worker process beside training: the same
scores, tables and images as in the training process, at the validation's step; the worker's life."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TINY, compose_config

from app.train.validation import MODEL_PARTS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, corpus_tsv):
    """The tiny corpus prepared in a folder of its own, its dev split and a 1+1-layer Transformer."""
    from app.models import build_model
    from app.train.trainer import load_data

    root = tmp_path_factory.mktemp("validation")
    (root / "corpus.tsv").write_bytes(corpus_tsv.read_bytes())
    cwd = os.getcwd()
    os.chdir(root)  # the corpus settings name their files relative to where training runs
    try:
        cfg = compose_config(*TINY, "viz.sentences=3", "train.max_dev_sentences=6")
        data = load_data(cfg, main=True)
    finally:
        os.chdir(cwd)
    torch.manual_seed(0)
    return root, cfg, data, build_model(cfg.model, data.tokenizer).train()


def events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def run_validation(tiny, name: str, worker: bool, steps=(10,)):
    """Validations at ``steps`` into a TensorBoard folder of their own: their metrics and the events."""
    from torch.utils.tensorboard import SummaryWriter

    from app.train.state import Progress
    from app.train.validation import validate

    root, cfg, data, model = tiny
    cfg.viz.worker = worker
    progress, results = Progress(), []
    with SummaryWriter(str(root / name)) as writer:
        for step in steps:
            progress.step = step
            results.append(validate(model, data.dev, None, data.tokenizer, cfg, writer, progress))
    return results, events(root / name)


def test_the_worker_gives_the_scores_tables_and_images_of_the_training_process(tiny):
    from app.run.host_worker import host_worker

    inline, here = run_validation(tiny, "inline", worker=False)
    worked, there = run_validation(tiny, "worker", worker=True)
    assert host_worker() is not None and not host_worker().broken  # the worker did the host work
    for key in ("loss", "ppl", "bleu", "chrf", "improved"):
        assert worked[0][key] == inline[0][key], key
    images = {tag for tag in here.Tags()["images"]}
    assert images == set(there.Tags()["images"])
    figures = ("alignment", "layers", "heads_layer0", "encoder_self", "decoder_self")
    assert {f"alignment/{n}/{name}" for n in range(3) for name in figures} <= images
    for tag in images:
        [a], [b] = here.Images(tag), there.Images(tag)
        assert a.step == b.step == 10 and a.encoded_image_string == b.encoded_image_string, tag
    text = lambda acc: [e.tensor_proto.string_val[0] for e in acc.Tensors("dev/samples/text_summary")]  # noqa: E731
    assert text(here) == text(there) and len(text(here)) == 1
    for tag in ("dev/bleu", "dev/loss", "dev/attention_entropy", "dev/host_seconds", "dev/validation_seconds"):
        assert [e.step for e in there.Scalars(tag)] == [10], tag
    seconds = worked[0]["seconds"]
    model = sum(seconds.get(part, 0.0) for part in MODEL_PARTS)  # every model part timed, not forward and decode only
    assert {"forward", "decode", "self-attention"} <= seconds.keys()
    # each figure is rounded to 0.01 s on its own: up to 0.005 s each apart
    assert seconds["host"] == pytest.approx(seconds["total"] - model, abs=0.005 * (2 + len(MODEL_PARTS)) + 1e-9)


def test_the_self_attention_figures_are_drawn_only_when_asked(tiny, monkeypatch):
    monkeypatch.setattr(tiny[1].viz, "self_attention", False)
    _, events_ = run_validation(tiny, "no_self_attention", worker=False)
    images = set(events_.Tags()["images"])
    assert "alignment/0/alignment" in images and not any(tag.endswith("_self") for tag in images)


def test_one_worker_serves_every_validation_and_a_dead_one_is_replaced_by_the_training_process(tiny, monkeypatch):
    from app.run import host_worker as hw

    monkeypatch.setattr(hw, "_worker", None)  # a worker of this test's own, whatever earlier tests left
    monkeypatch.setattr(hw, "_unavailable", False)
    results, events_ = run_validation(tiny, "steps", worker=True, steps=(10, 20))
    worker = hw.host_worker()
    assert [e.step for e in events_.Images("alignment/0/heads_layer0")] == [10, 20]
    pid = worker._process.pid
    assert hw.host_worker() is worker and worker._process.is_alive()  # the same process, still there
    os.kill(pid, signal.SIGKILL)
    worker._process.join()
    survived, after = run_validation(tiny, "killed", worker=True, steps=(20,))
    assert worker.broken and hw.host_worker() is None  # its jobs ran in this process
    assert survived[0]["bleu"] == results[1]["bleu"] and survived[0]["loss"] == results[1]["loss"]
    assert [e.step for e in after.Images("alignment/0/heads_layer0")] == [20]


@pytest.mark.parametrize("eval_every, started", [(20, True), (0, False)])
def test_training_starts_the_worker_before_it_loads_its_data(tiny, tmp_path, monkeypatch, eval_every, started):
    """The worker's start-up (a fresh interpreter importing numpy, matplotlib and sacrebleu) runs beside the
    loading of the data, not beside the first validation's decoding; a run without validations starts none."""
    from app.run import host_worker as hw
    from app.train import trainer as training

    monkeypatch.setattr(hw, "_worker", None)  # a worker of this test's own, whatever earlier tests left
    monkeypatch.setattr(hw, "_unavailable", False)
    seen, load_data = [], training.load_data
    monkeypatch.setattr(training, "load_data", lambda *a: seen.append(hw._worker is not None) or load_data(*a))
    root, cfg, _, _ = tiny
    monkeypatch.chdir(root)
    trainer = training.build_trainer(compose_config(*TINY, f"run_dir={tmp_path}", f"train.eval_every={eval_every}"))
    trainer.writer.close()
    assert seen == [started] and (hw._worker is not None) == started
    if hw._worker is not None:
        hw._worker.close()


WORKER_SCRIPT = """
import os, sys, time
from app.run.host_worker import host_worker, submit
worker = host_worker()
assert submit(worker, sorted, [3, 1, 2]).result() == [1, 2, 3]
print(worker._process.pid, flush=True)
if sys.argv[1] == "killed":
    os._exit(0)  # no interpreter exit: the worker must notice by itself
"""


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_the_worker_ends_with_the_training_process(tmp_path, how):
    """However the training process ends, its worker does not outlive it (and Ctrl-C is not the worker's)."""
    script = tmp_path / "worker_life.py"
    script.write_text(WORKER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    pid = int(result.stdout.split()[0])
    deadline = time.time() + 20
    while time.time() < deadline and os.path.exists(f"/proc/{pid}") and "zombie" not in state(pid):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in state(pid), f"worker {pid} outlived its parent"


def test_the_worker_does_not_run_the_callers_script_again(tmp_path):
    """A user's script without ``if __name__ == "__main__"`` (one that trains, say): spawn would run it again
    in the worker before serving. It runs once, and the job runs in the worker."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os\n"
        "print('script', os.getpid(), flush=True)\n"
        "from app.run.host_worker import host_worker, submit\n"
        "print('job', submit(host_worker(), os.getpid).result(), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.split("\n")
    scripts, jobs = (
        [line for line in lines if line.startswith("script")],
        [line for line in lines if line.startswith("job")],
    )
    assert len(scripts) == 1 and len(jobs) == 1, result.stdout
    assert scripts[0].split()[1] != jobs[0].split()[1]  # the job ran in the worker process


def state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).lower()
    except (FileNotFoundError, StopIteration):
        return ""


def test_the_worker_reports_a_failed_job_and_ignores_ctrl_c():
    from app.run.host_worker import HostWorker

    worker = HostWorker()
    try:
        failing, fine = worker.submit(int, "x"), worker.submit(sorted, [2, 1])
        assert fine.result() == [1, 2]  # results in any order; the failure is the failed job's
        with pytest.raises(RuntimeError, match="builtins.int failed in the host worker: ValueError"):
            failing.result()
        os.kill(worker._process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        time.sleep(0.5)
        assert worker.submit(sorted, [3, 1]).result() == [1, 3] and not worker.broken
    finally:
        worker.close()
    assert not worker._process.is_alive() and worker._process.exitcode == 0


def test_the_worker_ends_without_collecting_what_its_imports_made(tmp_path):
    """At its end the worker freezes the collector's objects, as ``python -m app`` does: the training process,
    which waits for it at exit, does not wait while its shutdown collects what numpy and matplotlib made."""
    from app.run.host_worker import HostWorker

    out = tmp_path / "frozen"
    probe = f"import atexit, gc; atexit.register(lambda: open({str(out)!r}, 'w').write(str(gc.get_freeze_count())))"
    worker = HostWorker(preload=("app.report.plots",))
    try:
        assert worker.submit(exec, probe).result() is None
    finally:
        worker.close()
    assert worker._process.exitcode == 0 and int(out.read_text()) > 10000


def test_sending_a_large_job_does_not_wait_for_the_worker_and_closing_does_not_wait_for_unread_results():
    """Validation sends the dev translations (hundreds of KB) while the worker may still be busy: the
    training process goes on at once. A result nobody collects does not hold up the end."""
    from app.run.host_worker import HostWorker

    worker = HostWorker()
    try:
        assert worker.submit(sorted, [2, 1]).result() == [1, 2]  # up and serving
        busy = worker.submit(time.sleep, 2.0)
        start = time.perf_counter()
        large = worker.submit(len, "x" * 5_000_000)
        assert time.perf_counter() - start < 1.0
        assert busy.result() is None and large.result() == 5_000_000
        worker.submit(bytes, 20_000_000)  # 20 MB that are never read
    finally:
        start = time.perf_counter()
        worker.close()
    assert time.perf_counter() - start < 10 and not worker._process.is_alive()
