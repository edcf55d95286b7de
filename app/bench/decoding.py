"""``make bench``'s decoding rows: the test split decoded greedily and with ``decode.beam_size`` by our
decoder and, for a Transformer, by its CTranslate2 export (float32 and int8, on CUDA also float16; the same
beam, the same batch budget), on the same device, with BLEU beside each. The engines take turns in each of
``bench.decode_rounds`` rounds (a load change on a shared machine hits all of them alike) and the best time of
each is kept. ``decode_step_operators``: the ATen operators and kernels one greedy and one beam step launch
(app/bench/profiling.py, ``count_ops``). A row that raises is recorded with its error (app/bench/rows.py)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any, Optional

import sacrebleu
import torch

from app.bench.profiling import count_ops
from app.bench.rows import attempt
from app.config.schema import Config
from app.data.batching import Batcher
from app.decode.ct2_engine import CT2Translator
from app.decode.export import check_exportable, convert
from app.decode.passes import decode_corpus, searcher
from app.run.device import autocast
from app.run.errors import UserError

CT2_QUANTIZATIONS = {"float32": "none", "int8": "int8", "float16": "float16"}  # row name -> export.quantization
COUNTED_STEPS = 5  # decoding steps whose operators are counted, after two not counted


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decoders(
    model, cfg: Config, tokenizer, device, dtype, failed: dict[str, str]
) -> dict[str, Callable[[list[list[int]]], list]]:
    """Row name -> a function from source ids to hypothesis ids; an export that fails is a failed row."""
    runs: dict[str, Callable[[list[list[int]]], list]] = {}
    ours = lambda d: lambda src: decode_corpus(model, src, device, d, amp_dtype=dtype).tokens  # noqa: E731
    ct2 = lambda e, d: lambda src: e.translate(src, d).tokens  # noqa: E731
    for greedy_or_beam in [cfg.decode.greedy()] + ([cfg.decode] if cfg.decode.beam_size > 1 else []):
        runs[f"decode_beam{greedy_or_beam.beam_size}"] = ours(greedy_or_beam)
    refused = cfg.model.arch == "transformer" and export_refusal(model, cfg.model)
    if cfg.model.arch == "transformer" and importlib.util.find_spec("ctranslate2") is None:
        print("no CTranslate2 rows: ctranslate2 is not installed (a lent GPU machine: see make gpu-wheels)")
    elif refused:
        print(f"no CTranslate2 rows: {refused}")
    elif cfg.model.arch == "transformer":
        threads = cfg.bench.ct2_threads if device.type == "cpu" else 0
        # CTranslate2 batches by source tokens before the beam (batch_source_tokens): give it our budget on CUDA
        budget = cfg.decode.cuda_batch_tokens if device.type == "cuda" else cfg.decode.batch_tokens
        ct2_decode = dataclasses.replace(cfg.decode, batch_tokens=budget)
        for name, quantization in CT2_QUANTIZATIONS.items():
            if name == "float16" and device.type != "cuda":  # CTranslate2 computes float16 on GPUs only
                continue
            out = os.path.join("checkpoints", "bench", f"{cfg.name}_ct2_{name}")

            def export(out=out, quantization=quantization) -> CT2Translator:
                source = {"bench": cfg.name}
                convert(model, cfg.model, tokenizer.src_path, tokenizer.tgt_path, out, quantization, source)
                return CT2Translator(out, device.type, threads=threads, device_index=device.index or 0)

            row = f"decode_beam{cfg.decode.beam_size}_ct2_{name}"
            engine = attempt(failed, row, export)
            if engine is not None:
                runs[row] = ct2(engine, ct2_decode)
    return runs


def export_refusal(model, model_cfg) -> Optional[str]:
    """Why CTranslate2 cannot express this model (``check_exportable``'s one line), or None."""
    try:
        check_exportable(model, model_cfg)
    except UserError as refusal:
        return str(refusal)
    return None


def step_operators(model, cfg: Config, test, device: torch.device, dtype) -> dict:
    """ATen operators and kernels per decoding step (``count_ops``), greedy (``beam1``) and with
    ``decode.beam_size``, each also with the attention weights kept as ``make eval`` keeps them
    (``_attention``), on a batch of the 16 longest test sentences (still decoding while counted), the steps as
    ``decode_corpus`` runs them on this device."""
    longest = sorted(range(len(test.src)), key=lambda i: -len(test.src[i]))[:16]
    src = Batcher(test.src)(longest).src.to(device)
    measured = {}
    was_training = model.training
    model.eval()
    for decode in [cfg.decode.greedy()] + ([cfg.decode] if cfg.decode.beam_size > 1 else []):
        for attention in (False, True):
            with torch.no_grad(), autocast(device, dtype):
                search = searcher(model, src, dataclasses.replace(decode, n_best=1), need_attention=attention)
                steps = min(COUNTED_STEPS, search.steps - 3)

                def step(search=search) -> None:
                    search.step(check=(search.t + 1) % search.check_every == 0)

                for _ in range(2):
                    step()
                key = f"beam{decode.beam_size}" + ("_attention" if attention else "")
                measured[key] = count_ops(step, steps, device)
    model.train(was_training)
    return measured


def time_decoding(model, cfg: Config, tokenizer, test, device, dtype, failed: dict[str, str]) -> dict:
    """Each decoder's best time over the rounds, throughput, BLEU, and speed relative to our beam search. A
    decoder that raises is a row with its error (and in ``failed``); it is not run again."""
    runs = decoders(model, cfg, tokenizer, device, dtype, failed)
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}

    def timed(name: str, run) -> float:
        sync(device)
        start = time.perf_counter()
        outputs[name] = run(test.src)
        sync(device)
        return time.perf_counter() - start

    for _ in range(max(cfg.bench.decode_rounds, 1)):
        for name, run in runs.items():
            if name not in failed:
                seconds = attempt(failed, name, functools.partial(timed, name, run))
                if seconds is not None:
                    times[name].append(seconds)
    ours_row = f"decode_beam{cfg.decode.beam_size}"
    ours = min(times[ours_row]) if times.get(ours_row) else None
    rows: dict[str, dict[str, Any]] = {}
    for name, timings in times.items():
        if name in failed:
            continue
        best = min(timings)
        hyps = tokenizer.decode_tgt(outputs[name])
        rows[name] = {
            "seconds": round(best, 2),
            "sentences_per_s": round(len(test.src) / best, 1),
            "tokens_per_s": round(sum(len(h) + 1 for h in outputs[name]) / best),
            "bleu": round(sacrebleu.corpus_bleu(hyps, [test.tgt_texts]).score, 2),
        }
        if "_ct2_" in name and ours is not None:
            rows[name]["speedup_vs_ours"] = round(ours / best, 2)
    rows |= {name: {"error": error} for name, error in failed.items() if name.startswith("decode_")}
    ops = attempt(failed, "decode_step_operators", lambda: step_operators(model, cfg, test, device, dtype))
    rows["decode_step_operators"] = ops if ops is not None else {"error": failed["decode_step_operators"]}
    return rows
