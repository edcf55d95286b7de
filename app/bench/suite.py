"""Throughput benchmark on the prepared corpus, with the run's settings (model=, train.batch_tokens=,
train.amp=, device=):

    make bench ARGS="model=rnn_bahdanau bench.steps=50 train.batch_tokens=64000"

Times ``bench.steps`` training steps after ``bench.warmup`` untimed ones through the Trainer itself, its
update alone and its whole loop (app/bench/training.py: ``loop_vs_step`` is the share of its step's speed the
loop keeps), then greedy and beam search
(``decode.beam_size``) decoding of the test split, ours and, for a Transformer, CTranslate2's (float32
and int8; app/bench/decoding.py), BLEU beside each; prints one table and writes it as JSON
(``checkpoints/bench/<name>.json``).
Decoding uses the weights of ``bench.checkpoint_path`` when given (an untrained model runs every sentence to
the length limit, so its timings are an upper bound). ``bench.profile_steps=N`` profiles N more steps
(app/bench/profiling.py); ``bench.ablate=true`` times training again with each speed feature off in turn, each
row through the Trainer as the first (from the weights train.seed gives): the before/after table of every speed
change (``<name>_ablation.md``).

MFU is computed with the one FLOP count of app/models/flops.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.bench.decoding import time_decoding
from app.bench.profiling import count_ops, profile_steps
from app.bench.rows import attempt
from app.bench.training import time_trainer
from app.config.load import check_compatible
from app.config.schema import Config
from app.data.corpus import load_split, prepare_data
from app.data.shapes import SUGGESTED_SHAPES
from app.models import build_model, count_parameters
from app.run.checkpoint import load_checkpoint
from app.run.device import amp_dtype, resolve_device, seed_everything
from app.run.files import atomic_write_text


def speed_features(
    cfg: Config, baseline: dict, cuda: bool
) -> list[tuple[str, Config, contextlib.AbstractContextManager, frozenset[str]]]:
    """(label, settings, context, naive loop features) for each speed feature of the Trainer switched off in turn,
    then train.compile switched on; features that cannot apply (bf16 on a CPU) are left out. ``baseline``: the
    defaults' measurement (was the update captured?)."""

    def changed(**train) -> Config:
        variant = copy.deepcopy(cfg)
        for key, value in train.items():
            setattr(variant.train, key, value)
        return variant

    plain, loop = contextlib.nullcontext, frozenset
    bf16 = amp_dtype(cfg.train.amp, torch.device("cuda" if cuda else "cpu")) is not None
    shaped = bool(cfg.train.batch_shapes) or baseline.get("captured", False)  # every batch padded to a fixed shape
    rows: list[tuple[str, Config, contextlib.AbstractContextManager, frozenset[str]]] = []
    if baseline.get("captured"):
        rows.append(
            ("without train.capture (an eager update: a launch per operator)", changed(capture=False), plain(), loop())
        )
    if bf16:
        rows.append(("without bf16 autocast (fp32)", changed(amp="fp32"), plain(), loop()))
        rows.append(
            (
                "without bf16 weights from fp32 masters (autocast casts each weight at each use)",
                changed(master_weights=False),
                plain(),
                loop(),
            )
        )
    rows.append(
        ("without fused AdamW (its non-finite check then syncs)", changed(fused_optimizer=False), plain(), loop())
    )
    if cfg.model.arch == "transformer":
        rows.append(("without fused SDPA kernels (math attention)", cfg, sdpa_kernel(SDPBackend.MATH), loop()))
    rows.append(("reading the loss every step (host sync)", cfg, plain(), loop({"sync"})))
    if not shaped:  # fixed shapes are their own bucketing
        rows.append(("without length bucketing (random batches)", cfg, plain(), loop({"unbucketed"})))
    if cuda:
        rows.append(("without pinned memory (pageable copies)", cfg, plain(), loop({"pageable"})))
    shapes = cfg.train.batch_shapes or SUGGESTED_SHAPES
    if cfg.train.batch_shapes:
        rows.append(("without fixed batch shapes (batch_shapes=0)", changed(batch_shapes=0), plain(), loop()))
    elif not shaped:
        rows.append(
            (f"with train.batch_shapes={shapes} (fixed padded shapes)", changed(batch_shapes=shapes), plain(), loop())
        )
    if not cfg.train.compile:
        rows.append(("with train.compile=true", changed(compile=True), plain(), loop()))
        if cuda:
            rows.append(
                (
                    f"with train.compile=true, compile_mode=reduce-overhead (CUDA graphs), batch_shapes={shapes}",
                    changed(compile=True, compile_mode="reduce-overhead", batch_shapes=shapes),
                    plain(),
                    loop(),
                )
            )
    return rows


def ablation(cfg: Config, cuda: bool, steps: int, warmup: int, failed: dict[str, str]) -> list[dict]:
    """Training speed with each speed feature off in turn, every row timed as the defaults are: through the Trainer
    (``time_trainer``: its loop, from the weights train.seed gives). A row that raises (out of memory without a
    fused kernel, a compile) says why in the table and in ``failed``."""
    baseline, _ = time_trainer(cfg, steps, warmup, rounds=1, extras=False)
    rows = [{"setting": "all speed features on (the defaults)", **baseline, "vs_defaults": 1.0}]
    for label, variant, context, naive in speed_features(cfg, baseline, cuda):
        torch._dynamo.reset()

        def timed(variant=variant, context=context, naive=naive) -> dict:
            with context:
                return time_trainer(variant, steps, warmup, rounds=1, naive=naive, extras=False)[0]

        measured = attempt(failed, f"ablation: {label}", timed)
        if measured is None:
            rows.append({"setting": label, "error": failed[f"ablation: {label}"]})
            continue
        ratio = measured["train_tgt_tokens_per_s"] / max(baseline["train_tgt_tokens_per_s"], 1)
        rows.append({"setting": label, **measured, "vs_defaults": round(ratio, 2)})
        print(f"{label}: {measured['train_tgt_tokens_per_s']:,} target tokens/s ({ratio:.2f}x the defaults)")
    return rows


def ablation_markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| setting | steps/s | target tokens/s | padding | batch shapes | MFU | peak memory GiB | vs defaults |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | failed: {r['error']} | | | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
        lines.append(
            f"| {r['setting']} | {r['steps_per_s']} | {r['train_tgt_tokens_per_s']:,} | "
            f"{100 * r['padding_ratio']:.1f} % | {r.get('batch_shapes_seen', '-')} | {mfu} | "
            f"{r.get('peak_memory_gib', '-')} | {r['vs_defaults']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def small_for_cpu(cfg: Config) -> tuple[Config, list[str]]:
    """A copy of ``cfg`` capped at what a 2-core CPU benches in a few minutes, and the changes made.
    Widths shrink by one factor (so tied or matching sizes stay so) to those of transformer_small, or
    an RNN with 512 hidden units; the model stays as given when a checkpoint's weights are to be timed."""
    small, changes = copy.deepcopy(cfg), []

    def cap(section, key: str, value: int) -> None:
        old = getattr(section, key)
        if value != old:
            setattr(section, key, value)
            changes.append(f"{key} {old}→{value}")

    m = small.model
    if not cfg.bench.checkpoint_path:
        if m.arch == "transformer" and m.d_model > 256:
            factor = 256 / m.d_model
            cap(m, "d_model", 256)
            cap(m, "ff_dim", max(1, round(m.ff_dim * factor)))
            cap(m, "heads", min(m.heads, 4))
            if m.kv_heads:  # grouped queries: as many key/value heads as still divide the heads, else one
                kv_heads = min(m.kv_heads, m.heads)
                cap(m, "kv_heads", kv_heads if m.heads % kv_heads == 0 else 1)
        if m.arch == "transformer":
            cap(m, "enc_layers", min(m.enc_layers, 3))
            cap(m, "dec_layers", min(m.dec_layers, 3))
        if m.arch == "rnn" and m.hidden > 512:
            cap(m, "emb_dim", max(2, round(m.emb_dim * 512 / m.hidden)))
            cap(m, "hidden", 512)
    cap(small.train, "batch_tokens", min(cfg.train.batch_tokens, 4000))
    cap(small.bench, "steps", min(cfg.bench.steps, 10))
    cap(small.bench, "warmup", min(cfg.bench.warmup, 2))
    cap(small.bench, "decode_sentences", min(cfg.bench.decode_sentences or 100, 100))
    return small, changes


def bench(cfg: Config) -> dict:
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.bench.cpu_small:
        cfg, changes = small_for_cpu(cfg)
        if changes:
            print(
                f"bench on the CPU, a small configuration ({', '.join(changes)}); "
                "bench.cpu_small=false benches the one given"
            )
    steps, warmup = cfg.bench.steps, cfg.bench.warmup
    dtype = amp_dtype(cfg.train.amp, device)
    seed_everything(cfg.train.seed)
    tokenizer = prepare_data(cfg)
    test = load_split(cfg.data.dir, "test", tokenizer).head(cfg.bench.decode_sentences)
    model = build_model(cfg.model, tokenizer).to(device)
    if cfg.bench.checkpoint_path:  # an untrained model decodes to the length limit: time real translations
        state = load_checkpoint(cfg.bench.checkpoint_path, device)
        check_compatible(state, cfg.bench.checkpoint_path, tokenizer.fingerprint(), cfg.model)
        model.load_state_dict(state["model"])
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg.model.arch if cfg.model.arch == "transformer" else f"rnn/{cfg.model.attention}",
        "parameters_m": round(count_parameters(model) / 1e6, 1),
        "amp": str(dtype or "fp32"),
        "batch_tokens": cfg.train.batch_tokens,
        "compiled": cfg.train.compile,
        "timed_steps": steps,
    }
    if getattr(cfg.model, "copy_attention", False):
        result["copy_attention"] = True
    if device.type == "cpu":
        result["threads"] = {"torch": torch.get_num_threads(), "ctranslate2": cfg.bench.ct2_threads}
    failed: dict[str, str] = {}  # row -> its one-line error: the other rows still run (app/bench/rows.py)
    os.makedirs(os.path.join("checkpoints", "bench"), exist_ok=True)
    trained = attempt(failed, "training", lambda: time_trainer(cfg, steps, warmup))
    one_more_step = None
    if trained is None:
        result["training"] = {"error": failed["training"]}
    else:
        measured, one_more_step = trained
        result.update(measured)
        # the launches a training step costs: what steers its host time without a GPU (docs/benchmarking.md)
        ops = attempt(
            failed, "train_step_operators", lambda: count_ops(one_more_step, 2, device, dispatch=not cfg.train.compile)
        )
        result["train_step_operators"] = ops if ops is not None else {"error": failed["train_step_operators"]}
    if cfg.bench.profile_steps and one_more_step is not None:
        profiled = attempt(
            failed,
            "profile",
            lambda: profile_steps(
                one_more_step,
                cfg.bench.profile_steps,
                device,
                os.path.join("checkpoints", "bench", f"{cfg.name}_trace.json"),
            ),
        )
        if profiled is None:
            result["profile"] = {"error": failed["profile"]}
        else:
            result["profile"], table = profiled
            atomic_write_text(os.path.join("checkpoints", "bench", f"{cfg.name}_profile.txt"), table)
            print(table)
    result["decode_sentences"] = len(test)
    if cfg.bench.checkpoint_path:  # the timed steps updated the weights: decode (and score) the checkpoint's
        model.load_state_dict(state["model"])
    result.update(time_decoding(model, cfg, tokenizer, test, device, dtype, failed))
    print_table(result)
    if cfg.bench.ablate:
        del model, one_more_step, trained  # free the first run's weights and optimizer state before the others
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows = attempt(failed, "ablation", lambda: ablation(cfg, device.type == "cuda", steps, warmup, failed))
        result["ablation"] = rows if rows is not None else {"error": failed["ablation"]}
        if rows is not None:
            header = (
                f"Training speed, each feature off in turn: {result['model']}, {result['parameters_m']} M "
                f"parameters, {cfg.train.batch_tokens}-token batches, {steps} timed steps after {warmup}, "
                f"{result['device']}"
            )
            markdown = ablation_markdown(rows, header)
            atomic_write_text(os.path.join("checkpoints", "bench", f"{cfg.name}_ablation.md"), markdown)
            print(markdown)
    result["failed_rows"] = failed
    path = os.path.join("checkpoints", "bench", f"{cfg.name}.json")
    atomic_write_text(path, json.dumps(result, indent=2))
    print(f"wrote {path}")
    if failed:
        print(f"{len(failed)} row(s) failed: " + "; ".join(f"{row}: {error}" for row, error in failed.items()))
    return result


def print_table(result: dict) -> None:
    rows = list(flatten(result))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {'n/a (no known peak for this device)' if v is None else v}" for k, v in rows))


def flatten(table: dict, prefix: str = ""):
    """(key path, value) rows of nested dicts: ("decode_beam5 seconds", 3.1)."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key} ")
        else:
            yield f"{prefix}{key}", value
