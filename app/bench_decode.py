"""``make bench``'s decoding rows: the test split decoded greedily and with ``decode.beam_size`` by our
decoder and, for a Transformer, by its CTranslate2 export (float32 and int8, the same beam), on the same
device, with BLEU beside each. The engines take turns in each of ``bench.decode_rounds`` rounds (a load
change on a shared machine hits all of them alike) and the best time of each is kept."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable

import sacrebleu
import torch

from app.config import Config
from app.ct2_engine import CT2Translator
from app.decoding import decode_corpus
from app.export import convert

CT2_QUANTIZATIONS = {"float32": "none", "int8": "int8"}  # row name -> export.quantization


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decoders(model, cfg: Config, tokenizer, device, dtype) -> dict[str, Callable[[list[list[int]]], list]]:
    """Row name -> a function from source ids to hypothesis ids."""
    runs = {}
    for decode in [cfg.decode.greedy()] + ([cfg.decode] if cfg.decode.beam_size > 1 else []):
        runs[f"decode_beam{decode.beam_size}"] = lambda src, d=decode: (
            decode_corpus(model, src, device, d, amp_dtype=dtype).tokens
        )
    if cfg.model.arch == "transformer" and importlib.util.find_spec("ctranslate2") is None:
        print("no CTranslate2 rows: ctranslate2 is not installed (a lent GPU machine: see make gpu-wheels)")
    elif cfg.model.arch == "transformer":
        threads = cfg.bench.ct2_threads if device.type == "cpu" else 0
        for name, quantization in CT2_QUANTIZATIONS.items():
            out = os.path.join("checkpoints", "bench", f"{cfg.name}_ct2_{name}")
            convert(model, cfg.model, tokenizer.src_path, tokenizer.tgt_path, out, quantization, {"bench": cfg.name})
            engine = CT2Translator(out, device.type, threads=threads, device_index=device.index or 0)
            runs[f"decode_beam{cfg.decode.beam_size}_ct2_{name}"] = lambda src, e=engine: (
                e.translate(src, cfg.decode).tokens
            )
    return runs


def time_decoding(model, cfg: Config, tokenizer, test, device, dtype) -> dict:
    """Each decoder's best time over the rounds, throughput, BLEU, and speed relative to our beam search."""
    runs = decoders(model, cfg, tokenizer, device, dtype)
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(max(cfg.bench.decode_rounds, 1)):
        for name, run in runs.items():
            sync(device)
            start = time.perf_counter()
            outputs[name] = run(test.src)
            sync(device)
            times[name].append(time.perf_counter() - start)
    ours = min(times[f"decode_beam{cfg.decode.beam_size}"])
    rows = {}
    for name, seconds in times.items():
        best = min(seconds)
        hyps = tokenizer.decode_tgt(outputs[name])
        rows[name] = {
            "seconds": round(best, 2),
            "sentences_per_s": round(len(test.src) / best, 1),
            "tokens_per_s": round(sum(len(h) + 1 for h in outputs[name]) / best),
            "bleu": round(sacrebleu.corpus_bleu(hyps, [test.tgt_texts]).score, 2),
        }
        if "_ct2_" in name:
            rows[name]["speedup_vs_ours"] = round(ours / best, 2)
    return rows
