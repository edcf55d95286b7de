"""The GPU tier: every CUDA path through the commands of the CLI, with pass/fail. ``pytest -m gpu`` on a machine
with a GPU (``make gpu-check PART=paths``: these tests in stages that each fit a time budget); without CUDA
every test here is skipped with the reason, at no cost.

Each test trains a small model (d_model 128, or 64/128-wide RNNs) for a few dozen steps in bf16 (the
default on CUDA) on a small real corpus, and takes seconds on an H100 apart from the torch.compile ones:

- every family trains, and its beam-5 evaluation writes metrics.json, plus the attention maps where the
  model has attention (none for the plain encoder-decoder): the command ``make train ARGS="...
  train.evaluate=true"`` runs, in this test process, so that the six share one start-up (torch, CUDA, the
  host worker, the tokenizer) instead of paying two each;
- a run killed with SIGKILL after its first checkpoint resumes at the saved step, and its per-step losses
  match an uninterrupted run's within ``LOSS_ATOL``;
- train.capture (the default): the update recorded per batch shape and replayed gives the eager losses step by
  step, leaves train.freeze's parts bit for bit, and a shape whose capture fails trains eagerly;
- train.compile=true (and compile_mode=reduce-overhead, CUDA graphs) builds one graph over every batch shape;
- train.oom_retry=true turns a real CUDA out-of-memory into a halved batch budget and training goes on;
- a 1-GPU torchrun (DDP over NCCL) trains.

The corpus: Genesis 1-6 from the SWORD modules where they are installed (the CPU tests' corpus), else the
first lines of the prepared default corpus carried in ``data/`` (a lent GPU machine has no SWORD modules
and no internet); with neither, the tests skip and say so. Figures (loss differences, graph counts, the
halved budget) are recorded as junit properties, which ``scripts/gpu_check.sh`` copies into its JSON.
"""

import glob
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, SWORD, compose_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the gpu tier tests the GPU paths"),
]

CARRIED_LINES = 300  # lines of a carried data/*/train.tsv taken where there are no SWORD modules
BASE = [  # the data and the loop every run here shares; each test adds a model and its steps
    "data=files",
    "data.name=gpu_tiny",
    "data.train=corpus.tsv",
    "data.dev_fraction=0.08",
    "data.test_fraction=0.08",
    "tokenizer.vocab_size=400",
    "train.batch_tokens=3000",  # several batches of different shapes per epoch
    "train.warmup_steps=20",
    "train.log_every=5",
    "train.eval_every=1000",  # one validation, at the end
    "train.save_every=1000",
    "train.max_dev_sentences=16",
    "viz.sentences=2",
    "viz.eval_plots=2",
    "device=cuda",
]
TRANSFORMER = [
    "model=transformer_small",
    "model.d_model=128",
    "model.heads=4",
    "model.enc_layers=2",
    "model.dec_layers=2",
    "model.ff_dim=256",
]
RNN = ["model.emb_dim=64", "model.hidden=128", "model.enc_layers=1"]
FAMILIES = {  # the presets of README's RNN table, and the Transformer
    "transformer": TRANSFORMER,
    "rnn_plain": ["model=rnn_plain", *RNN],
    "rnn_bahdanau": ["model=rnn_bahdanau", *RNN],
    "rnn_luong_general_feeding": ["model=rnn_luong", "model.score=general", "model.input_feeding=true", *RNN],
    "rnn_luong_dot": ["model=rnn_luong", "model.score=dot", "model.input_feeding=false", *RNN],
    "rnn_luong_concat": ["model=rnn_luong", "model.score=concat", *RNN],
    # coverage in bf16: the running sum of attention is kept in fp32, See et al.'s loss added to the update
    "rnn_bahdanau_coverage": ["model=rnn_bahdanau", "model.coverage=true", "train.coverage_weight=0.1", *RNN],
}
CLI_TIMEOUT = 420  # seconds for one CLI call: a hang fails the test instead of holding the machine
# Per-step train/loss of a resumed run against the uninterrupted one, in nats (the loss is ~5-7 here).
# On CUDA two runs of the same steps are not bit-identical: bf16 autocast rounds to 8 significant bits,
# and reductions with atomics (embedding and attention backward) add in a different order each run. Over
# the ~50 steps compared these differences stay in the thousandths; resuming at another data position, or
# without the optimizer or RNG state, changes a step's loss by hundredths to tenths.
LOSS_ATOL = 0.02


def settings(*overrides: str) -> list[str]:
    """Hydra overrides with the later value of a key replacing the earlier one (BASE's, a test's own)."""
    merged = {}
    for override in overrides:
        merged[override.split("=", 1)[0]] = override
    return list(merged.values())


def app_env() -> dict:
    """The environment of a CLI call: this repository first on the path, what the caller had after it
    (a lent machine's extra wheels are on PYTHONPATH), no progress bars."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0", "TQDM_DISABLE": "1"}


def run_app(cwd, *args, launcher=("-m", "app")) -> subprocess.CompletedProcess:
    """``python -m app ARGS`` (or another ``-m`` launcher such as torchrun's) in ``cwd``, as a user runs it;
    of two values of one setting, the later one."""
    return subprocess.run(
        [sys.executable, *launcher, *settings(*args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=app_env(),
        timeout=CLI_TIMEOUT,
    )


def run_here(workdir, monkeypatch, command: str, *args: str) -> None:
    """``command`` with these settings (of two values of one, the later) in this process, in ``workdir``, as the
    CLI dispatches it (app/cli.py's ``COMMANDS``). A stage's timeout (SIGINT), which training turns into a
    saved stop, ends the session as a Ctrl-C does, so that pytest still writes what passed."""
    from app.cli import COMMANDS
    from app.run.errors import TrainingInterrupted

    monkeypatch.chdir(workdir)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    cfg = compose_config(*settings(*args), command=command)
    try:
        COMMANDS[command](cfg)
    except TrainingInterrupted as stopped:
        raise KeyboardInterrupt(str(stopped)) from stopped


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def tail(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}:\n{output(result)[-4000:]}"


def summary(workdir, name) -> dict:
    return json.loads((workdir / "checkpoints" / name / "train_summary.json").read_text())


def assert_trained_on_cuda(workdir, name, steps) -> dict:
    """The run's train_summary.json: all its steps, on the GPU, in bf16."""
    s = summary(workdir, name)
    assert s["steps"] == steps, s
    assert s["device"] != "cpu" and s["amp"] == "torch.bfloat16", s
    return s


def tiny_pairs(request) -> list[tuple[str, str, str]]:
    """(id, spanish, english): Genesis 1-6 from the SWORD modules (conftest's corpus), else the first
    ``CARRIED_LINES`` pairs of a prepared corpus carried in data/, else skip."""
    if os.path.isdir(os.path.join(SWORD, "mods.d")):
        text = request.getfixturevalue("corpus_tsv").read_text(encoding="utf-8")
        return [tuple(line.split("\t")) for line in text.splitlines()]
    default = os.path.join(REPO, "data", "bible_spaRV1909eb_engWEB2015eb", "train.tsv")
    carried = [default] if os.path.exists(default) else sorted(glob.glob(os.path.join(REPO, "data", "*", "train.tsv")))
    if not carried:
        pytest.skip(f"no corpus: no SWORD modules in {SWORD} and no prepared data/*/train.tsv (make data; carry data/)")
    pairs = []
    with open(carried[0], encoding="utf-8") as f:
        for n, line in enumerate(f):
            if len(pairs) == CARRIED_LINES:
                break
            fields = line.rstrip("\n").split("\t")  # id, src, tgt (or src, tgt)
            pairs.append(tuple(fields) if len(fields) == 3 else (f"line{n}", *fields[:2]))
    return pairs


def write_pairs(path, pairs) -> None:
    path.write_text("".join("\t".join(pair) + "\n" for pair in pairs), encoding="utf-8")


@pytest.fixture(scope="module")
def pairs(request):
    return tiny_pairs(request)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, pairs):
    """A folder with corpus.tsv, where the runs prepare data/gpu_tiny (once) and write checkpoints/<name>."""
    root = tmp_path_factory.mktemp("gpu")
    write_pairs(root / "corpus.tsv", pairs)
    return root


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_on_cuda_and_beam_eval_writes_metrics_and_maps(workdir, family, record_property, monkeypatch):
    """Each model family trains in bf16 on the GPU, validates greedily at its end, and its evaluation with
    ``decode.beam_size=5`` (``train.evaluate=true``: in the same command) writes metrics.json; a model with
    attention also gets the attention's summary in metrics.json and its maps (alignments data file, heatmap
    folder), the plain encoder-decoder gets neither."""
    name, steps = f"family_{family}", 30
    args = [*BASE, *FAMILIES[family], f"name={name}", f"train.max_steps={steps}", "train.evaluate=true"]
    run_here(workdir, monkeypatch, "train", *args, "decode.beam_size=5")
    assert_trained_on_cuda(workdir, name, steps)
    out = workdir / "checkpoints" / name / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sentences"] > 0 and metrics["decoding"].startswith("beam 5"), metrics
    assert metrics["device"] != "cpu" and math.isfinite(metrics["bleu"]), metrics
    maps = [p for p in out.glob("alignments*") if p.is_file() and p.suffix != ".html" and p.stat().st_size > 0]
    plots = [p for p in (out / "alignments").glob("*") if p.stat().st_size > 0] if (out / "alignments").is_dir() else []
    if family == "rnn_plain":
        assert "attention" not in metrics and not maps and not plots, "a model without attention has no maps"
    else:
        assert {"entropy", "monotonicity", "reattention"} <= set(metrics.get("attention", {})), metrics.get("attention")
        assert maps, f"no non-empty alignments file in {out}: {sorted(p.name for p in out.iterdir())}"
        assert plots, f"no heatmaps in {out / 'alignments'}"
    if "model.coverage=true" in FAMILIES[family]:  # the coverage loss trained in bf16 stays finite
        covered = scalar_values(workdir / "checkpoints" / name / "tb", "train/coverage_loss")
        assert covered and all(math.isfinite(v) and v >= 0 for v in covered.values()), covered
    record_property("bleu", metrics["bleu"])
    record_property("sentences_per_s", metrics["sentences_per_s"])


def scalar_values(tb_dir, tag: str) -> dict[int, float]:
    """A scalar per step from a run's TensorBoard events; a step logged twice (before a kill and again
    after resuming) keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def step_losses(tb_dir) -> dict[int, float]:
    """train/loss per step from a run's TensorBoard events."""
    return scalar_values(tb_dir, "train/loss")


def test_sigkill_then_resume_continues_at_the_saved_step_with_the_same_losses(workdir, record_property):
    """A run killed with SIGKILL after its first checkpoint resumes with train.resume=true at the step of
    last.pt (its model, optimizer, RNG and data position restored on the GPU), and every per-step loss
    after that matches an uninterrupted run of the same steps within LOSS_ATOL."""
    steps = 60
    run = settings(*BASE, *TRANSFORMER, f"train.max_steps={steps}", "train.log_every=1", "train.save_every=10")
    result = run_app(workdir, "command=train", *run, "name=resume_full")
    assert result.returncode == 0, tail(result)

    killed = workdir / "checkpoints" / "resume_killed"
    with open(workdir / "resume_killed.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "command=train", *run, "name=resume_killed"],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=app_env(),
        )
        try:
            deadline = time.time() + CLI_TIMEOUT
            while not (killed / "last.pt").exists():
                assert process.poll() is None, (
                    "training ended before its first checkpoint: " + (workdir / "resume_killed.log").read_text()[-3000:]
                )
                assert time.time() < deadline, "no last.pt in time"
                time.sleep(0.01)
            assert process.poll() is None, "training finished before it could be killed"
        finally:
            process.kill()  # SIGKILL: nothing saved on the way out
            process.wait(timeout=60)
    saved = torch.load(killed / "last.pt", map_location="cpu", weights_only=True)["progress"]["step"]
    assert 10 <= saved < steps and saved % 10 == 0, saved

    result = run_app(workdir, "command=train", *run, "name=resume_killed", "train.resume=true")
    assert result.returncode == 0, tail(result)
    resumed_at = set(re.findall(r"resumed from .* at step (\d+)", output(result)))
    assert resumed_at == {str(saved)}, f"resumed at {sorted(resumed_at)}, last.pt holds step {saved}: {tail(result)}"
    assert_trained_on_cuda(workdir, "resume_killed", steps)

    full = step_losses(workdir / "checkpoints" / "resume_full" / "tb")
    resumed = step_losses(killed / "tb")
    assert sorted(full) == sorted(resumed) == list(range(1, steps + 1))
    diff = {step: abs(full[step] - resumed[step]) for step in full}
    # steps up to the checkpoint: two runs of the same steps, the noise the tolerance allows for
    record_property("max_abs_loss_diff_before_kill", round(max(diff[step] for step in range(1, saved + 1)), 6))
    diff = {step: diff[step] for step in range(saved + 1, steps + 1)}
    worst = max(diff, key=diff.get)
    record_property("resumed_at", saved)
    record_property("max_abs_loss_diff", round(diff[worst], 6))
    assert diff[worst] <= LOSS_ATOL, (
        f"step {worst}: loss {resumed[worst]:.5f} resumed, {full[worst]:.5f} uninterrupted "
        f"(|diff| {diff[worst]:.5f} > {LOSS_ATOL}); per step: { {s: round(d, 5) for s, d in diff.items()} }"
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_kernels", "compiled_kernels"])
def test_captured_update_matches_the_eager_one_step_by_step(workdir, compiled, record_property):
    """train.capture=true (the default on CUDA) records the update once per batch shape and replays it: on the same
    batches (train.batch_shapes=4 in both runs) every per-step loss matches an eager run's within LOSS_ATOL, dropout
    included (a replay draws the Philox offsets the eager update would); each shape's first update runs eagerly, the
    rest replay, and train_summary.json says so. With train.compile=true the graph records the compiled layers'
    fused kernels, and matches the same compiled layers run without capture."""
    steps = 40
    run = settings(*BASE, *TRANSFORMER, f"train.max_steps={steps}", "train.log_every=1", "train.batch_shapes=4")
    run += ["train.compile=true"] if compiled else []
    losses, summaries = {}, {}
    for capture in ("false", "true"):
        name = f"capture_{capture}_{'compiled' if compiled else 'eager'}"
        result = run_app(workdir, "command=train", *run, f"name={name}", f"train.capture={capture}")
        assert result.returncode == 0, tail(result)
        summaries[capture] = assert_trained_on_cuda(workdir, name, steps)
        losses[capture] = step_losses(workdir / "checkpoints" / name / "tb")
    assert "capture" not in summaries["false"], summaries["false"]
    c = summaries["true"]["capture"]
    record_property("capture", c)
    assert 1 <= c["graphs"] <= 4 and c["eager_shapes"] == 0, c
    assert c["eager_updates"] == c["graphs"] and c["replays"] == steps - c["eager_updates"], c
    assert sorted(losses["true"]) == sorted(losses["false"]) == list(range(1, steps + 1))
    diff = {step: abs(losses["true"][step] - losses["false"][step]) for step in losses["true"]}
    worst = max(diff, key=diff.get)
    record_property("max_abs_loss_diff", round(diff[worst], 6))
    captured, eager = losses["true"][worst], losses["false"][worst]
    assert diff[worst] <= LOSS_ATOL, f"step {worst}: {captured:.5f} captured, {eager:.5f} eager"


def test_captured_bf16_update_leaves_frozen_parts_bit_for_bit(workdir, record_property):
    """train.freeze=[embeddings,encoder] under the captured bf16 update: the fp32 encoder and embeddings of the last
    checkpoint are those of the first snapshot bit for bit (no gradient, no AdamW state, no master pair recorded
    into the graph), the decoder trained, and the update was replayed."""
    steps, name = 30, "frozen_captured"
    run = settings(*BASE, *TRANSFORMER, f"train.max_steps={steps}", "train.save_every=10", "train.batch_shapes=4")
    result = run_app(workdir, "command=train", *run, f"name={name}", "train.freeze=[embeddings,encoder]")
    assert result.returncode == 0, tail(result)
    s = assert_trained_on_cuda(workdir, name, steps)
    assert s["capture"]["replays"] > 0 and s["frozen"]["parts"] == ["embeddings", "encoder"], s
    folder = workdir / "checkpoints" / name
    first = torch.load(folder / "step_0000010.pt", map_location="cpu", weights_only=True)["model"]
    last = torch.load(folder / "last.pt", map_location="cpu", weights_only=True)["trained_model"]
    frozen = [k for k in first if k.startswith(("encoder.", "enc_norm.", "src_embed", "tgt_embed", "out_proj"))]
    assert frozen and all(torch.equal(first[k], last[k]) for k in frozen)
    trained = [k for k in first if k.startswith(("decoder.", "dec_norm."))]
    assert any(not torch.equal(first[k], last[k]) for k in trained)
    record_property("frozen_parameters", s["frozen"]["parameters"])


def test_an_update_that_cannot_be_recorded_runs_eagerly(workdir, monkeypatch, caplog, record_property):
    """A model whose forward pass asks the host for a value (a hook that reads its output back: a sync, which a
    CUDA graph cannot record) still trains under train.capture=true: each shape's capture fails, says so in one
    line, and the shape runs eagerly from then on, with the losses of a run that never tried to capture."""
    from app.models.transformer import Transformer

    def read_back(module, inputs, output):
        if isinstance(module, Transformer) and isinstance(output, torch.Tensor):
            float(output.float().sum())  # a host sync: cannot be recorded in a CUDA graph

    handle = torch.nn.modules.module.register_module_forward_hook(read_back)
    steps, losses = 12, {}
    try:
        for capture in ("false", "true"):
            name = f"uncapturable_{capture}"
            args = [*BASE, *TRANSFORMER, f"name={name}", f"train.max_steps={steps}", "train.log_every=1"]
            with caplog.at_level("WARNING"):
                run_here(workdir, monkeypatch, "train", *args, "train.batch_shapes=2", f"train.capture={capture}")
            losses[capture] = step_losses(workdir / "checkpoints" / name / "tb")
    finally:
        handle.remove()
    said = [r.getMessage() for r in caplog.records if "could not be recorded" in r.getMessage()]
    c = summary(workdir, "uncapturable_true")["capture"]
    record_property("capture", c)
    assert said and len(said) == c["eager_shapes"] >= 1 and c["graphs"] == 0 and c["replays"] == 0, (said, c)
    assert c["eager_updates"] == steps, c
    diff = max(abs(losses["true"][step] - losses["false"][step]) for step in range(1, steps + 1))
    assert diff <= LOSS_ATOL, diff


@pytest.mark.parametrize(
    "mode,shapes",
    [("default", 0), ("reduce-overhead", 0), ("reduce-overhead", 4)],
    ids=["inductor", "cudagraphs", "cudagraphs_4_shapes"],
)
@pytest.mark.parametrize("family", ["transformer", "rnn_bahdanau"])
def test_compile_builds_one_graph_over_every_batch_shape(workdir, family, mode, shapes, record_property):
    """train.compile=true (with compile_mode=reduce-overhead: CUDA graphs too) trains through batches of
    many shapes (length-bucketed batches of a 3000-token budget, or train.batch_shapes=4 fixed ones, what
    CUDA graphs replay) without a graph per shape: one compiled region for an RNN decoder's step, two for a
    Transformer (its encoder layers and its decoder layers), each compiled at most twice (on CUDA a
    decoder layer's SDPA kernels guard on the target length's alignment to 8: a second graph for the other
    case), whatever the number of shapes."""
    name, steps = f"compile_{family}_{mode}_{shapes}", 30
    result = run_app(
        workdir,
        "command=train",
        *BASE,
        *FAMILIES[family],
        f"name={name}",
        f"train.max_steps={steps}",
        "train.compile=true",
        f"train.compile_mode={mode}",
        f"train.batch_shapes={shapes}",
    )
    assert result.returncode == 0, tail(result)
    s = assert_trained_on_cuda(workdir, name, steps)
    record_property("compile_graphs", s.get("compile_graphs"))
    record_property("tgt_tokens_per_s", s["tgt_tokens_per_s"])
    said = [line for line in output(result).splitlines() if "graph(s)" in line]  # the log's compile line
    regions = 2 if family == "transformer" else 1
    record_property("compile_seconds", s.get("compile_seconds"))
    assert 1 <= s.get("compile_graphs", 0) <= 2 * regions, f"compile_graphs in train_summary.json: {said}"


# The out-of-memory run: a Transformer twice the base's width on the small corpus repeated to ~150 k words
# (Genesis 1-6: ~3,500 pairs, one batch of ~0.7 M tokens padded to its longest pair with the 400-piece
# vocabulary, counted on the CPU). Its activations for backward, counted by hand at ~0.4 MB per token in bf16
# (an estimate, not measured), come to ~280 GB: past any one GPU lent (80 or 141 GB), while the tokenizer
# trains in seconds (3 M words took minutes).
OOM_MODEL = ["model=transformer", "model.d_model=1024", "model.ff_dim=4096", "model.heads=16"]
OOM_WORDS = 150_000


def test_oom_retry_halves_the_batch_after_a_real_out_of_memory(tmp_path, pairs, record_property):
    """With train.oom_retry=true, a batch of 2,000,000 tokens (the whole corpus, ~0.7 M padded tokens) on a wide
    Transformer runs the GPU out of memory for real; the run halves train.batch_tokens, says so, and finishes
    its steps with the smaller budget."""
    # the small corpus repeated (distinct ids, duplicates kept)
    words = sum(len(src.split()) + len(tgt.split()) for _, src, tgt in pairs)
    copies = math.ceil(OOM_WORDS / words)
    write_pairs(tmp_path / "oom.tsv", [(f"{i}.{k}", src, tgt) for k in range(copies) for i, src, tgt in pairs])
    steps = 2
    result = run_app(
        tmp_path,
        "command=train",
        "data=files",
        "data.name=gpu_oom",
        "data.train=oom.tsv",
        "data.filters.dedup=false",
        "tokenizer.vocab_size=400",
        *OOM_MODEL,
        "train.batch_tokens=2000000",
        "train.oom_retry=true",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "train.max_dev_sentences=8",
        "viz.sentences=1",
        "device=cuda",
        "name=oom",
    )
    assert result.returncode == 0, tail(result)
    assert "train.batch_tokens halved" in output(result), tail(result)
    s = assert_trained_on_cuda(tmp_path, "oom", steps)
    record_property("batch_tokens", s["batch_tokens"])
    assert s["batch_tokens"] < 2_000_000, s


def test_torchrun_on_one_gpu_trains(workdir, record_property):
    """``python -m torch.distributed.run --standalone --nproc_per_node=1 -m app command=train``: NCCL process
    group and DistributedDataParallel on one GPU train every step, and the checkpoint holds the plain
    model's weights (no DDP ``module.`` prefix), so eval and translate load it."""
    name, steps = "torchrun", 20
    result = run_app(
        workdir,
        "command=train",
        *BASE,
        *TRANSFORMER,
        f"name={name}",
        f"train.max_steps={steps}",
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "app"),
    )
    assert result.returncode == 0, tail(result)
    s = assert_trained_on_cuda(workdir, name, steps)
    assert s["ranks"] == 1, s
    weights = torch.load(workdir / "checkpoints" / name / "last.pt", map_location="cpu", weights_only=True)["model"]
    assert weights and not any(key.startswith("module.") for key in weights), sorted(weights)[:5]
    record_property("tgt_tokens_per_s", s["tgt_tokens_per_s"])
