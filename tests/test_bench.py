"""make bench without its timings: the CPU cap on its configuration, the ablation table, rows that fail, the
profile's kinds of work, and the one FLOP count (app/models/flops.py) checked by hand."""

import pytest
import torch
from conftest import TINY, Vocab, compose_config


@pytest.mark.parametrize("preset", ["transformer", "rnn_bahdanau", "rnn_luong", "rnn_plain"])
def test_cpu_bench_caps_the_configuration_at_a_small_one(preset):
    from app.bench.suite import small_for_cpu
    from app.models import build_model, count_parameters

    cfg = compose_config(f"model={preset}")
    small, changes = small_for_cpu(cfg)
    assert small.train.batch_tokens == 4000 and small.bench.steps == 10 and small.bench.decode_sentences == 100
    assert cfg.train.batch_tokens == 32000 and cfg.bench.steps == 50  # the original is left alone
    if preset == "transformer":
        assert (small.model.d_model, small.model.ff_dim, small.model.heads, small.model.enc_layers) == (256, 1024, 4, 3)
    else:
        assert (small.model.emb_dim, small.model.hidden) == (
            256,
            512,
        ) and small.model.tie_embeddings == cfg.model.tie_embeddings
    assert "train.batch_tokens" not in changes and "batch_tokens 32000→4000" in changes
    assert count_parameters(build_model(small.model, Vocab(4000, 4000))) < 12e6  # it builds, and small

    tiny = compose_config(*TINY, "bench.steps=3", "bench.warmup=1", "bench.decode_sentences=4")
    assert small_for_cpu(tiny) == (tiny, [])  # already small: nothing to change
    trained = compose_config(f"model={preset}", "bench.checkpoint_path=best.pt")
    assert small_for_cpu(trained)[0].model == trained.model  # a checkpoint's model is timed as it is


def test_ablation_table_keeps_a_failed_row():
    from app.bench.suite import ablation_markdown

    ok = {
        "setting": "all speed features on (the defaults)",
        "steps_per_s": 2.0,
        "train_tgt_tokens_per_s": 12345,
        "padding_ratio": 0.043,
        "batch_shapes_seen": 16,
        "mfu": 0.3123,
        "peak_memory_gib": 7.5,
        "vs_defaults": 1.0,
    }
    table = ablation_markdown(
        [ok, {"setting": "without fused AdamW", "error": "OutOfMemoryError: CUDA out of memory"}], "T"
    )
    assert "| all speed features on (the defaults) | 2.0 | 12,345 | 4.3 % | 16 | 31.2 % | 7.5 | 1.00× |" in table
    assert "| without fused AdamW | failed: OutOfMemoryError: CUDA out of memory | | | | | | |" in table


def test_a_failing_ablation_row_does_not_lose_the_others(monkeypatch):
    import torch

    import app.bench.suite

    calls = []

    def fake_training(cfg, steps, warmup, rounds=2, naive=frozenset(), extras=True):
        calls.append(cfg)
        if not cfg.train.fused_optimizer:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        tokens = 1000 if len(calls) == 1 else 900  # the first call times the defaults
        return {"steps_per_s": 1.0, "train_tgt_tokens_per_s": tokens, "padding_ratio": 0.05, "mfu": None}, None

    monkeypatch.setattr(app.bench.suite, "time_trainer", fake_training)
    cfg = compose_config("model=transformer_small")
    errors = {}
    rows = app.bench.suite.ablation(cfg, False, 1, 0, errors)
    failed = [r for r in rows if "error" in r]
    assert [r["setting"] for r in failed] == ["without fused AdamW (its non-finite check then syncs)"]
    assert failed[0]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert errors == {"ablation: without fused AdamW (its non-finite check then syncs)": failed[0]["error"]}
    assert rows[0]["train_tgt_tokens_per_s"] == 1000 and rows[0]["vs_defaults"] == 1.0
    assert len(rows) == 7 and all(r["vs_defaults"] == 0.9 for r in rows[1:] if "error" not in r)


@pytest.mark.parametrize("captured", [True, False])
def test_the_ablation_on_cuda_starts_from_the_update_the_trainer_runs(captured):
    """The defaults on CUDA capture the Transformer's update (train.capture), padded to fixed shapes: the first row
    turns capture off, and the rows that cut batches another way (random order, train.batch_shapes) only apply to
    an update that is not captured."""
    from app.bench.suite import speed_features

    cfg = compose_config("model=transformer_small")
    rows = {label: (variant, naive) for label, variant, _, naive in speed_features(cfg, {"captured": captured}, True)}
    eager = "without train.capture (an eager update: a launch per operator)"
    assert (eager in rows) == captured and ("without length bucketing (random batches)" in rows) != captured
    assert ("with train.batch_shapes=16 (fixed padded shapes)" in rows) != captured
    if captured:
        assert list(rows)[0] == eager and rows[eager][0].train.capture is False and cfg.train.capture is True
    assert rows["without pinned memory (pageable copies)"][1] == {"pageable"}
    assert rows["without bf16 autocast (fp32)"][0].train.amp == "fp32"
    assert not any(label.startswith("without train.capture") for label, *_ in speed_features(cfg, {}, False))


def test_profile_kinds_of_work():
    from app.bench.profiling import kind_of

    assert kind_of("aten::mm") == kind_of("aten::addmm") == kind_of("aten::_scaled_mm") == "matrix multiply"
    assert kind_of("aten::_flash_attention_backward") == "attention kernels"
    assert kind_of("aten::_thnn_fused_gru_cell") == kind_of("aten::_cudnn_rnn") == "recurrent cells"
    assert kind_of("aten::_fused_adamw_") == "optimizer"
    assert kind_of("aten::_softmax") == "softmax and loss" and kind_of("aten::index_select") == "copies and layout"
    assert kind_of("## Call CompiledFxGraph fjltto ##") == "compiled kernels"
    assert kind_of("aten::tanh") == kind_of("aten::mul") == "elementwise and other"


def test_a_replayed_graph_is_profiled_by_its_kernel_names():
    """A replayed CUDA graph's kernels have no op that launched them (on the H200, 2026-11-28, the captured update's
    shares came out as 78 % "optimizer" and device_busy 0.008 from the few ops outside the graph): where ops cover
    under half of the kernel time, the kernels' own names decide; an eager step keeps its ops' attribution."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from app.bench.profiling import time_by_kind

    def event(key, device_type, us):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us)

    kernels = [
        event("nvjet_sm90_tst_128x208_64x5_2x1_v_bz_coopA_NNT", DeviceType.CUDA, 300.0),
        event("fmha_cutlassB_bf16_aligned_64x64_k64_dropout_sm80(PyTorchMemEffAttention::...)", DeviceType.CUDA, 200.0),
        event("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", DeviceType.CUDA, 100.0),
        event(
            "triton_per_fused__to_copy_add_native_dropout_backward_native_layer_norm_backward_6", DeviceType.CUDA, 250.0
        ),
        event("void at::native::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", DeviceType.CUDA, 100.0),
        event("void at::native::reduce_kernel<128, 4, ...>", DeviceType.CUDA, 50.0),
    ]
    replayed = [*kernels, event("aten::_foreach_add_", DeviceType.CPU, 20.0)]  # the few ops outside the graph
    per_kind, total, attributed = time_by_kind(replayed)
    assert attributed == "kernel names" and total == 1000.0
    assert per_kind == {
        "matrix multiply": 300.0,
        "attention kernels": 300.0,
        "compiled kernels": 250.0,
        "optimizer": 100.0,
        "elementwise and other": 50.0,
    }
    eager = [
        *kernels,
        event("aten::mm", DeviceType.CPU, 300.0),
        event("aten::_efficient_attention_backward", DeviceType.CPU, 600.0),
        event("aten::_fused_adamw_", DeviceType.CPU, 100.0),
    ]
    per_kind, total, attributed = time_by_kind(eager)
    assert attributed == "ops" and total == 1000.0
    assert per_kind == {"matrix multiply": 300.0, "attention kernels": 600.0, "optimizer": 100.0}


def test_training_flops_count_by_hand():
    from app.models import build_model
    from app.models.flops import matmul_parameters, training_flops

    cfg = compose_config(
        "model=transformer_small",
        "model.d_model=8",
        "model.heads=2",
        "model.enc_layers=1",
        "model.dec_layers=1",
        "model.ff_dim=16",
    )
    model = build_model(cfg.model, Vocab(10, 10))
    # encoder layer: q, k, v, out (4 × 8×8) + ff (8×16 + 16×8); decoder adds cross attention, whose k and v
    # (2 × 8×8) read the encoder's states, once per source token, and the output projection (10×8, tied to the
    # embedding but still a matrix multiply per target token)
    p_enc, p_mem, p_dec = 4 * 64 + 2 * 128, 2 * 64, 6 * 64 + 2 * 128 + 80
    assert matmul_parameters(model.encoder) == p_enc and matmul_parameters(model) == p_enc + p_mem + p_dec
    flops = training_flops(model, [3], [2])
    attention = 12 * 8 * (1 * 3 * 3 + 1 * (2 * 3 / 2 + 2 * 3))
    assert flops == 6 * ((p_enc + p_mem) * 3 + p_dec * 2) + attention


@pytest.mark.parametrize("lengths", [(60, 5), (5, 60)])
def test_the_flop_count_is_what_torch_counts_of_a_training_step(lengths):
    """Against torch's FlopCounterMode over a forward and backward: a Transformer exactly (attention on the math
    kernel, which computes the causal square whole: added back), RNNs within 1 % (it counts the recurrent matrix
    of the first step, on the zero state, differently; Bahdanau's scores as more than multiplies): source-side
    weights once per source token, the bridge once per sentence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from app.models import build_model, sequence_loss
    from app.models.flops import training_flops

    S, T = lengths

    def measured(model, *args):
        torch.manual_seed(0)
        src, tgt = torch.randint(4, 40, (1, S)), torch.randint(4, 40, (1, T))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counted:
            sequence_loss(model(src, tgt, *args), tgt).backward()
        return counted.get_total_flops()

    sizes = ("model.d_model=32", "model.heads=2", "model.ff_dim=64", "model.dropout=0.0")
    transformer = build_model(compose_config("model=transformer_small", *sizes).model, Vocab(40, 40))
    causal_square = 12 * 32 * transformer.cfg.dec_layers * (T * T - T * (T + 1) / 2)
    assert training_flops(transformer, [S], [T]) + causal_square == measured(transformer)
    for attention in ("none", "bahdanau", "luong"):
        rnn_settings = ("model=rnn_bahdanau", f"model.attention={attention}", "model.hidden=32", "model.emb_dim=32")
        rnn = build_model(compose_config(*rnn_settings, "model.dropout=0.0").model, Vocab(40, 40))
        assert training_flops(rnn, [S], [T]) == pytest.approx(measured(rnn, torch.tensor([S])), rel=0.01), attention


def test_windowed_attention_counts_only_the_pairs_in_the_window():
    from app.models import build_model
    from app.models.flops import training_flops, windowed_pairs

    for length in (1, 4, 9):
        for window in (0, 2, 20):
            assert windowed_pairs(length, window) == sum(
                abs(i - j) <= window for i in range(length) for j in range(length)
            )
    sizes = [
        "model=transformer_small",
        "model.d_model=8",
        "model.heads=2",
        "model.enc_layers=1",
        "model.dec_layers=1",
        "model.ff_dim=16",
    ]
    full = training_flops(build_model(compose_config(*sizes).model, Vocab(10, 10)), [9], [2])
    windowed = training_flops(build_model(compose_config(*sizes, "model.window=2").model, Vocab(10, 10)), [9], [2])
    assert full - windowed == 12 * 8 * (9 * 9 - windowed_pairs(9, 2))


def test_a_row_that_raises_is_recorded_and_the_bench_still_writes_the_others(tmp_path, monkeypatch, corpus_tsv, capsys):
    """The training rows and the beam row raise (as a CUDA crash would): the greedy row and the decoding step
    operators are still measured, the table and the JSON say which rows failed and why, and the command
    exits 1."""
    import json
    import re
    import shutil

    import app.bench.decoding
    import app.bench.suite
    from app.cli import bench_command

    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)

    def crash(*args, **kwargs):
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED\nmore lines")

    real_decode = app.bench.decoding.decode_corpus

    def beam_crashes(model, src, device, decode, **kwargs):
        return real_decode(model, src, device, decode, **kwargs) if decode.beam_size == 1 else crash()

    monkeypatch.setattr(app.bench.suite, "time_trainer", crash)
    monkeypatch.setattr(app.bench.decoding, "decode_corpus", beam_crashes)
    settings = ["bench.decode_sentences=3", "decode.beam_size=2", "bench.profile_steps=2"]
    cfg = compose_config(*TINY, *settings, command="bench")
    with pytest.raises(SystemExit) as exited:
        bench_command(cfg)
    assert exited.value.code == 1
    table = json.loads((tmp_path / "checkpoints" / "bench" / "tiny.json").read_text())
    error = "RuntimeError: it->second->use_count > 0 INTERNAL ASSERT FAILED"
    assert table["failed_rows"] == {"training": error, "decode_beam2": error}
    assert table["training"] == table["decode_beam2"] == {"error": error}
    assert table["decode_beam1"]["seconds"] > 0 and table["decode_step_operators"]["beam1"]["ops"] > 0
    assert "train_step_operators" not in table and "profile" not in table  # they need a training step
    out = capsys.readouterr().out
    assert re.search(rf"^decode_beam2 error +{re.escape(error)}$", out, re.M) and "decode_beam1 sentences_per_s" in out


def test_a_model_ctranslate2_cannot_express_is_benched_without_its_rows(tmp_path, monkeypatch, corpus_tsv, capsys):
    """model.copy_attention has no CTranslate2 export: the bench says so in one line and measures the rest
    (before, the export's refusal stopped the whole bench)."""
    import json
    import shutil

    from app.cli import bench_command

    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    settings = ["model.copy_attention=true", "bench.decode_sentences=3", "bench.steps=2", "bench.warmup=1"]
    bench_command(compose_config(*TINY, *settings, command="bench"))
    table = json.loads((tmp_path / "checkpoints" / "bench" / "tiny.json").read_text())
    assert table["decode_beam5"]["seconds"] > 0 and table["train_tgt_tokens_per_s"] > 0
    assert table["copy_attention"] is True and not [row for row in table if "_ct2_" in row]
    assert not table["failed_rows"]
    assert (
        "no CTranslate2 rows: model.copy_attention=true: CTranslate2's decoder cannot copy" in capsys.readouterr().out
    )


def test_each_h100_part_gets_its_own_peak(monkeypatch):
    """MFU's peak is the device's own (dense bf16, NVIDIA's data sheets): the PCIe and NVL parts of the H100 are
    not the SXM part, whose name ("H100") theirs contain."""
    from app.models.flops import peak_flops

    parts = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "Some Other GPU": None,
    }
    for name, peak in parts.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(torch.device("cuda")) == peak, name
    assert peak_flops(torch.device("cpu")) is None
