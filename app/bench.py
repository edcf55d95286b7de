"""Throughput benchmark: training steps and greedy decoding on the prepared corpus, with the run's
settings (model=, train.batch_tokens=, train.amp=, device=).

    make bench ARGS="bench.steps=50 train.batch_tokens=64000"

Prints target tokens/s, source+target tokens/s and peak GPU memory for training, then decoding speed
on the dev split.
"""
from __future__ import annotations

import json
import time

import torch

from app.config import Config
from app.data.batching import Batcher, make_batches
from app.data.corpus import load_split, prepare_data
from app.data.tokenizer import PAD
from app.decoding import decode_corpus
from app.models import build_model, count_parameters
from app.training import amp_dtype, make_optimizer, train_step
from app.utils import resolve_device, seed_everything


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(cfg: Config, steps: int = 50, warmup: int = 10) -> dict:
    device = resolve_device(cfg.device)
    dtype = amp_dtype(cfg.train.amp, device)
    seed_everything(cfg.train.seed)
    tokenizer = prepare_data(cfg)
    data = load_split(cfg.data.dir, "train", tokenizer)
    dev = load_split(cfg.data.dir, "dev", tokenizer)
    model = build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).to(device)
    optimizer, scheduler = make_optimizer(model, cfg)
    batcher = Batcher(data.src, data.tgt)
    batches = make_batches([len(s) for s in data.src], [len(t) for t in data.tgt], cfg.train.batch_tokens, True, cfg.train.seed)
    batches = (batches * (1 + (steps + warmup) // len(batches)))[: steps + warmup]
    tgt_tokens = all_tokens = 0
    for i, indices in enumerate(batches):
        if i == warmup:
            sync(device)
            start = time.time()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        batch = batcher(indices)
        n_tokens = int((batch.tgt_out != PAD).sum())
        if i >= warmup:
            tgt_tokens += n_tokens
            all_tokens += n_tokens + int((batch.src != PAD).sum())
        train_step(model, batch.to(device), n_tokens, optimizer, scheduler, cfg, dtype)
    sync(device)
    seconds = time.time() - start
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg.model.arch, "parameters_m": round(count_parameters(model) / 1e6, 1),
        "amp": str(dtype or "fp32"),
        "batch_tokens": cfg.train.batch_tokens, "timed_steps": steps,
        "train_tgt_tokens_per_s": round(tgt_tokens / seconds), "train_src_tgt_tokens_per_s": round(all_tokens / seconds),
        "steps_per_s": round(steps / seconds, 2),
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    sync(device)
    start = time.time()
    hyps = decode_corpus(model, dev.src, device, cfg.decode.batch_tokens, cfg.decode.max_len_ratio,
                         cfg.decode.max_len_extra, amp_dtype=dtype)
    sync(device)
    seconds = time.time() - start
    result.update(greedy_dev_sentences=len(dev), greedy_sentences_per_s=round(len(dev) / seconds, 1),
                  greedy_tokens_per_s=round(sum(len(h) + 1 for h in hyps.tokens) / seconds))
    print(json.dumps(result))
    return result
