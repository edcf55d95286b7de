"""A tiny real run through the real CLI: prepare -> train -> eval -> translate -> resume.

The corpus is Genesis 1-6 from the installed SWORD modules (real text, a few hundred verses), fed
through the ``files`` source; the model is a 1+1-layer Transformer, so the whole module runs in
about a minute on 2 CPU cores.
"""
import json
import os
import shutil

import pytest
import sacrebleu
from conftest import TINY, compose_config, run_cli


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    root = tmp_path_factory.mktemp("e2e")
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    result = run_cli(root, "train", *TINY, "train.max_steps=40")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_train_writes_run_folder(workdir):
    run = workdir / "checkpoints" / "tiny"
    for name in ("config.yaml", "last.pt", "best.pt", "train_summary.json", ".hydra/train/config.yaml"):
        assert (run / name).exists(), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tb"))
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 40 and summary["device"] == "cpu"
    for split in ("train", "dev", "test"):
        assert (workdir / "data" / "tiny" / f"{split}.tsv").stat().st_size > 0


def test_eval_writes_hypotheses_and_sacrebleu_scores(workdir):
    result = run_cli(workdir, "eval", "name=tiny", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = [line.rstrip("\n").split("\t")[2] for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    assert len(hyps) == len(refs) == metrics["sentences"]
    assert metrics["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2))
    assert metrics["chrf"] == pytest.approx(round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))
    assert metrics["bleu_signature"].startswith("nrefs:1|")
    assert "BLEU" in result.stdout


def test_translate_reads_stdin_and_writes_one_line_per_input(workdir):
    result = run_cli(workdir, "translate", "name=tiny", "device=cpu", stdin="En el principio.\nY dijo Dios.\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.split("\n")) == 3  # two translations and the final newline


def test_resume_continues_from_last_checkpoint(workdir):
    result = run_cli(workdir, "train", *TINY, "train.max_steps=60", "train.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr and "at step 40" in result.stdout + result.stderr
    assert "up to date" in result.stdout + result.stderr  # data and tokenizer were not redone
    summary = json.loads((workdir / "checkpoints" / "tiny" / "train_summary.json").read_text())
    assert summary["steps"] == 60


def test_config_typo_fails_at_start_up_with_a_clear_message(workdir):
    result = run_cli(workdir, "train", *TINY, "train.max_stepz=3")
    assert result.returncode != 0
    assert "max_stepz" in result.stderr and "Traceback" not in result.stderr


def test_missing_run_is_a_one_line_error(workdir):
    result = run_cli(workdir, "eval", "name=never_trained", "device=cpu")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:") and "best.pt" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_prints_usage(workdir):
    result = run_cli(workdir, "fly")
    assert result.returncode == 2 and "usage" in result.stderr


@pytest.mark.parametrize("preset", ["rnn_plain", "rnn_bahdanau", "rnn_luong"])
def test_rnn_presets_train_and_evaluate_through_the_cli(workdir, preset):
    name = f"tiny_{preset}"
    overrides = [a for a in TINY if not a.startswith(("model", "name="))] + [
        f"model={preset}", "model.emb_dim=16", "model.hidden=32", f"name={name}", "train.max_steps=10",
        "train.eval_every=10",
    ]
    result = run_cli(workdir, "train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "eval", f"name={name}", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "checkpoints" / name / "eval" / "test" / "metrics.json").read_text())
    assert metrics["sentences"] > 0 and "bleu" in metrics


def sweep_and_compare(workdir, sweep, *overrides) -> str:
    """``train -m`` with the compare experiment into ``sweep``, then ``compare``; returns compare.md."""
    result = run_cli(workdir, "train", "-m", "experiment=compare", f"hydra.sweep.dir={sweep}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "compare", f"compare.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    return (sweep / "compare.md").read_text()


def test_compare_trains_evaluates_and_reports_a_sweep(workdir):
    sweep = workdir / "checkpoints" / "compare" / "test"
    overrides = [a for a in TINY if not a.startswith(("model=", "name="))] + [
        "model.emb_dim=16", "model.hidden=32", "train.max_steps=6", "train.eval_every=6", "decode.beam_size=2",
    ]
    table = sweep_and_compare(workdir, sweep, "model=rnn_bahdanau,transformer_small", *overrides)
    rows = [line for line in table.splitlines() if line.startswith("| model=")]
    assert [row.split(" | ")[0] for row in rows] == ["| model=rnn_bahdanau", "| model=transformer_small"]
    assert rows[0].split(" | ")[-2] == "-" and float(rows[1].split(" | ")[-2]) > 0  # KV cache: Transformers only
    assert "beam 2" in table
    from PIL import Image

    with Image.open(sweep / "bleu_by_length.png") as image:
        assert image.size[0] > 400 and image.size[1] > 300
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(sweep / "tb"))


def test_transformer_variant_trains_and_evaluates_through_the_cli(workdir):
    overrides = [a for a in TINY if not a.startswith("name=")] + [
        "name=tiny_rope", "model.pos=rope", "model.norm_type=rmsnorm", "model.kv_heads=1", "model.window=4",
        "train.max_steps=30", "train.eval_every=30", "train.evaluate=true", "decode.beam_size=2",
    ]
    result = run_cli(workdir, "train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "checkpoints" / "tiny_rope" / "eval" / "test" / "metrics.json").read_text())
    assert metrics["longest_10pct_sentences"] == -(-metrics["sentences"] // 10)  # ⌈10 %⌉
    assert 0 <= metrics["bleu_longest_10pct"] <= 100
    assert metrics["kv_cache_mib"] > 0


def test_compare_labels_a_sweep_over_model_settings(workdir):
    """A sweep that varies model.pos (with grouped-query attention throughout): one row per value,
    labelled by it, with the longest-sentence BLEU and the KV cache of each run."""
    sweep = workdir / "checkpoints" / "compare" / "positions"
    overrides = [a for a in TINY if not a.startswith("name=")] + [
        "model.heads=4", "model.kv_heads=2", "train.max_steps=10", "train.eval_every=10", "decode.beam_size=1",
    ]
    lines = sweep_and_compare(workdir, sweep, "model.pos=learned,alibi", *overrides).splitlines()
    header = next(line for line in lines if line.startswith("| run |")).split(" | ")
    rows = [line.split(" | ") for line in lines if line.startswith("| model.pos=")]
    assert [row[0] for row in rows] == ["| model.pos=learned", "| model.pos=alibi"]
    for row in rows:
        assert float(row[header.index("BLEU longest 10 %")]) >= 0 and float(row[header.index("KV cache MiB")]) > 0


def test_training_logs_alignment_images_and_scalars_to_tensorboard(workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(workdir / "checkpoints" / "tiny" / "tb")
    events = EventAccumulator(tb, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    images = set(events.Tags()["images"])
    for i in range(2):
        assert {f"alignment/{i}/alignment", f"alignment/{i}/layers", f"alignment/{i}/heads"} <= images
    steps = [e.step for e in events.Images("alignment/0/alignment")]
    assert 20 in steps and 40 in steps  # one per validation: the slider shows alignment emerging
    entropy = events.Scalars("dev/attention_entropy")
    assert entropy and all(e.value >= 0 for e in entropy)
    assert all(0 <= e.value <= 1 for e in events.Scalars("dev/attention_monotonicity"))


def test_eval_writes_alignment_heatmaps_and_jsonl(workdir):
    from PIL import Image

    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    assert run_cli(workdir, "eval", "name=tiny", "device=cpu", "viz.eval_plots=2").returncode == 0
    pngs = sorted(os.listdir(out / "alignments"))
    assert pngs == ["0000.png", "0000_heads.png", "0000_layers.png", "0001.png", "0001_heads.png", "0001_layers.png"]
    with Image.open(out / "alignments" / "0000.png") as image:
        assert image.size[0] >= 300 and image.size[1] >= 200
    rows = [json.loads(line) for line in (out / "alignments.jsonl").read_text(encoding="utf-8").splitlines()]
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(rows) == len(hyps)
    for row in rows:
        assert row["src_tokens"][-1] == "</s>" and row["hyp_tokens"][-1] == "</s>"
        assert len(row["weights"]) == len(row["hyp_tokens"])
        for weights in row["weights"]:
            assert len(weights) == len(row["src_tokens"])  # no padding columns
            assert sum(weights) == pytest.approx(1.0, abs=2e-3)  # rounded to 4 decimals
        assert row["layer"] == 0 and len(row["head_weights"]) == 2  # 1 layer, 2 heads
        assert sum(row["head_weights"][1][0]) == pytest.approx(1.0, abs=2e-3)


def test_eval_reports_alignment_error_rate_against_a_gold_file(workdir):
    # a diagonal "gold" alignment over the test references: enough to exercise the whole path
    refs = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    gold = workdir / "gold.align"
    gold.write_text("".join(
        " ".join(f"{min(j, len(src.split()) - 1)}-{j}" for j in range(len(tgt.split()))) + "\n" for _, src, tgt in refs
    ))
    result = run_cli(workdir, "eval", "name=tiny", "device=cpu", "decode.beam_size=1", "viz.eval_plots=0",
                     f"eval.gold_align={gold}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AER" in result.stdout
    metrics = json.loads((workdir / "checkpoints" / "tiny" / "eval" / "test" / "metrics.json").read_text())
    alignment = metrics["alignment"]
    assert 0.0 <= alignment["aer"] <= 1.0 and 0.0 <= alignment["precision"] <= 1.0
    assert alignment["links"] == sum(len(tgt.split()) for _, _, tgt in refs)  # one link per reference word


def test_bench_prints_and_writes_the_table(workdir):
    result = run_cli(workdir, "bench", *TINY, "bench.steps=3", "bench.warmup=1", "bench.decode_sentences=4",
                     "bench.beam_size=2", "bench.checkpoint=checkpoints/tiny/best.pt", "bench.profile_steps=2",
                     "bench.ablate=true")
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((workdir / "checkpoints" / "bench" / "tiny.json").read_text())
    assert table["device"] == "cpu" and table["timed_steps"] == 3 and table["mfu"] is None  # no peak known for CPUs
    assert table["train_src_tgt_tokens_per_s"] > table["train_tgt_tokens_per_s"] > 0
    assert 0 <= table["padding_ratio"] < 1 and table["model_tflops_per_s"] > 0
    assert table["decode_sentences"] == 4 and table["decode_beam2"]["sentences_per_s"] > 0
    assert "padding_ratio" in result.stdout and "decode_beam1 sentences_per_s" in result.stdout
    shares = table["profile"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and shares["matrix multiply"] > 0.05
    assert "profile shares matrix multiply" in result.stdout and "aten::" in result.stdout
    assert "aten::" in (workdir / "checkpoints" / "bench" / "tiny_profile.txt").read_text()
    trace = json.loads((workdir / "checkpoints" / "bench" / "tiny_trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    settings = [row["setting"] for row in table["ablation"]]  # no bf16 row: the CPU trains in fp32
    assert settings == ["all speed features on (the defaults)", "without fused AdamW (its non-finite check then syncs)",
                        "without fused SDPA kernels (math attention)", "reading the loss every step (host sync)",
                        "without length bucketing (random batches)", "with train.compile=true"]
    assert all(row["train_tgt_tokens_per_s"] > 0 and row["vs_defaults"] > 0 for row in table["ablation"])
    padding = {row["setting"]: row["padding_ratio"] for row in table["ablation"]}
    assert padding["without length bucketing (random batches)"] > padding["all speed features on (the defaults)"]
    markdown = (workdir / "checkpoints" / "bench" / "tiny_ablation.md").read_text()
    assert markdown.count("\n| ") == 8 and "| with train.compile=true |" in result.stdout  # header, rule, 6 rows


@pytest.mark.parametrize("preset", ["transformer", "rnn_bahdanau", "rnn_luong", "rnn_plain"])
def test_cpu_bench_caps_the_configuration_at_a_small_one(preset):
    from app.bench import small_for_cpu
    from app.models import build_model, count_parameters

    cfg = compose_config(f"model={preset}")
    small, changes = small_for_cpu(cfg)
    assert small.train.batch_tokens == 4000 and small.bench.steps == 10 and small.bench.decode_sentences == 100
    assert cfg.train.batch_tokens == 32000 and cfg.bench.steps == 50  # the original is left alone
    if preset == "transformer":
        assert (small.model.d_model, small.model.ff_dim, small.model.heads, small.model.enc_layers) == (256, 1024, 4, 3)
    else:
        assert (small.model.emb_dim, small.model.hidden) == (256, 512) and small.model.tie_embeddings == cfg.model.tie_embeddings
    assert "train.batch_tokens" not in changes and "batch_tokens 32000→4000" in changes
    assert count_parameters(build_model(small.model, 4000, 4000, True)) < 12e6  # it builds, and small

    tiny = compose_config(*TINY, "bench.steps=3", "bench.warmup=1", "bench.decode_sentences=4")
    assert small_for_cpu(tiny) == (tiny, [])  # already small: nothing to change
    trained = compose_config(f"model={preset}", "bench.checkpoint=best.pt")
    assert small_for_cpu(trained)[0].model == trained.model  # a checkpoint's model is timed as it is


def test_ablation_table_keeps_a_failed_row():
    from app.bench import ablation_markdown

    ok = {"setting": "all speed features on (the defaults)", "steps_per_s": 2.0, "train_tgt_tokens_per_s": 12345,
          "padding_ratio": 0.043, "mfu": 0.3123, "peak_memory_gib": 7.5, "vs_defaults": 1.0}
    table = ablation_markdown([ok, {"setting": "without fused AdamW", "error": "OutOfMemoryError: CUDA out of memory"}], "T")
    assert "| all speed features on (the defaults) | 2.0 | 12,345 | 4.3 % | 31.2 % | 7.5 | 1.00× |" in table
    assert "| without fused AdamW | failed: OutOfMemoryError: CUDA out of memory | | | | | |" in table


def test_a_failing_ablation_row_does_not_lose_the_others(monkeypatch):
    import torch

    import app.bench

    def fake_training(model, cfg, data, device, dtype, steps, warmup, naive=frozenset()):
        if not cfg.train.fused_optimizer:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return {"steps_per_s": 1.0, "train_tgt_tokens_per_s": 900, "padding_ratio": 0.05, "mfu": None}, None

    monkeypatch.setattr(app.bench, "time_training", fake_training)
    cfg = compose_config("model=transformer_small")
    baseline = {"steps_per_s": 1.0, "train_tgt_tokens_per_s": 1000, "mfu": None}
    rows = app.bench.ablation(cfg, lambda: None, None, torch.device("cpu"), None, 1, 0, baseline)
    failed = [r for r in rows if "error" in r]
    assert [r["setting"] for r in failed] == ["without fused AdamW (its non-finite check then syncs)"]
    assert failed[0]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert len(rows) == 6 and all(r["vs_defaults"] == 0.9 for r in rows[1:] if "error" not in r)


def test_profile_kinds_of_work():
    from app.profiling import kind_of

    assert kind_of("aten::mm") == kind_of("aten::addmm") == kind_of("aten::_scaled_mm") == "matrix multiply"
    assert kind_of("aten::_flash_attention_backward") == "attention kernels"
    assert kind_of("aten::_thnn_fused_gru_cell") == kind_of("aten::_cudnn_rnn") == "recurrent cells"
    assert kind_of("aten::_fused_adamw_") == "optimizer"
    assert kind_of("aten::_softmax") == "softmax and loss" and kind_of("aten::index_select") == "copies and layout"
    assert kind_of("## Call CompiledFxGraph fjltto ##") == "compiled kernels"
    assert kind_of("aten::tanh") == kind_of("aten::mul") == "elementwise and other"


def test_training_flops_count_by_hand():
    from app.bench import matmul_parameters, training_flops
    from app.models import build_model

    cfg = compose_config("model=transformer_small", "model.d_model=8", "model.heads=2", "model.enc_layers=1",
                         "model.dec_layers=1", "model.ff_dim=16")
    model = build_model(cfg.model, 10, 10, True)
    # encoder layer: q, k, v, out (4 × 8×8) + ff (8×16 + 16×8); decoder adds cross attention and the
    # output projection (10×8, tied to the embedding but still a matrix multiply per target token)
    p_enc, p_dec = 4 * 64 + 2 * 128, 8 * 64 + 2 * 128 + 80
    assert matmul_parameters(model.encoder) == p_enc and matmul_parameters(model) == p_enc + p_dec
    flops = training_flops(model, [3], [2])
    attention = 12 * 8 * (1 * 3 * 3 + 1 * (2 * 3 / 2 + 2 * 3))
    assert flops == 6 * (p_enc * 3 + p_dec * 2) + attention


def test_windowed_attention_counts_only_the_pairs_in_the_window():
    from app.bench import training_flops, windowed_pairs
    from app.models import build_model

    for length in (1, 4, 9):
        for window in (0, 2, 20):
            assert windowed_pairs(length, window) == sum(abs(i - j) <= window for i in range(length) for j in range(length))
    sizes = ["model=transformer_small", "model.d_model=8", "model.heads=2", "model.enc_layers=1", "model.dec_layers=1",
             "model.ff_dim=16"]
    full = training_flops(build_model(compose_config(*sizes).model, 10, 10, True), [9], [2])
    windowed = training_flops(build_model(compose_config(*sizes, "model.window=2").model, 10, 10, True), [9], [2])
    assert full - windowed == 12 * 8 * (9 * 9 - windowed_pairs(9, 2))
