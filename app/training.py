"""The training loop: bf16 autocast on CUDA, inverse-sqrt warmup, clipping, validation with dev BLEU,
best/last checkpoints, early stopping, resume, TensorBoard scalars and a progress bar with ETA."""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from app.checkpoint import load_checkpoint, save_checkpoint
from app.config import Config
from app.data.batching import Batcher, make_batches, sorted_batches
from app.data.corpus import ParallelData, load_split, prepare_data
from app.data.tokenizer import EOS, PAD, Tokenizer
from app.decoding import decode_corpus
from app.errors import UserError
from app.evaluation import score
from app.models import build_model, count_parameters
from app.utils import atomic_write_text, autocast, file_hash, resolve_device, seed_everything

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already trained on
    best_bleu: float = -1.0
    best_step: int = 0
    bad_evals: int = 0  # validations since the last improvement (early stopping)
    elapsed_seconds: float = 0.0  # wall clock of the training loop, validations included
    eval_seconds: float = 0.0
    tgt_tokens: int = 0


def amp_dtype(setting: str, device: torch.device) -> Optional[torch.dtype]:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if setting in ("bf16", "fp32"):
        return torch.bfloat16 if setting == "bf16" else None
    raise UserError(f"train.amp={setting!r}: choose auto, bf16 or fp32")


def inverse_sqrt(warmup: int):
    """Linear warmup to the peak rate, then decay ∝ 1/√step (Vaswani et al. 2017, eq. 3, rescaled)."""
    warmup = max(warmup, 1)
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


def vocab_fingerprint(tokenizer: Tokenizer) -> dict:
    """Identifies the vocabulary a model was trained with: the SentencePiece model files' hashes."""
    return {"src": file_hash(tokenizer.src_path), "tgt": file_hash(tokenizer.tgt_path), "joint": tokenizer.joint}


def sequence_loss(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed (label-smoothed) cross-entropy over non-padding target tokens."""
    return F.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=PAD, label_smoothing=label_smoothing, reduction="sum"
    )


def train_step(model, batch, n_tokens: int, optimizer, scheduler, cfg: Config, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One update; returns the summed loss and the gradient norm as device tensors (no host sync)."""
    with autocast(batch.src.device, dtype):
        loss_sum = sequence_loss(model(batch.src, batch.tgt_in), batch.tgt_out, cfg.train.label_smoothing)
    (loss_sum / n_tokens).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss_sum.detach(), grad_norm


@torch.no_grad()
def validate(model, dev: ParallelData, tokenizer: Tokenizer, cfg: Config, device, dtype) -> dict:
    """Dev perplexity (teacher forcing, no smoothing) and dev BLEU/chrF of greedy translations."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in sorted_batches(dev.src, dev.tgt, cfg.decode.batch_tokens):
        batch = batch.to(device)
        with autocast(device, dtype):
            logits = model(batch.src, batch.tgt_in)
        loss_sum += sequence_loss(logits.float(), batch.tgt_out).item()
        tokens += int((batch.tgt_out != PAD).sum())
    hyps = decode_corpus(
        model, dev.src, device, cfg.decode.batch_tokens, cfg.decode.max_len_ratio, cfg.decode.max_len_extra, amp_dtype=dtype
    )
    metrics = score(tokenizer.decode_tgt(hyps.tokens), dev.tgt_texts, ter=False)
    model.train()
    return {"loss": loss_sum / tokens, "ppl": math.exp(min(loss_sum / tokens, 50)), **metrics}


@torch.no_grad()
def log_alignments(writer: SummaryWriter, model, dev: ParallelData, tokenizer: Tokenizer, cfg: Config, device,
                   dtype, step: int) -> None:
    """Heatmaps of the first ``viz.sentences`` dev sentences (greedy decoding), and two scalars over
    them: mean attention entropy and monotonicity (the step slider shows alignment emerging)."""
    from app.plots import attention_entropy, figures, layer_views, monotonicity

    n = min(cfg.viz.sentences, len(dev))
    if n == 0:
        return
    hyps = decode_corpus(model, dev.src[:n], device, cfg.decode.batch_tokens, cfg.decode.max_len_ratio,
                         cfg.decode.max_len_extra, need_attention=True, amp_dtype=dtype)
    if hyps.attention is None:  # a model without attention
        return
    entropy, monotone = [], []
    for i, attention in enumerate(hyps.attention):
        src_tokens = tokenizer.src_pieces(dev.src[i] + [EOS])
        hyp_tokens = tokenizer.tgt_pieces(hyps.tokens[i] + [EOS])
        for name, fig in figures(attention, src_tokens, hyp_tokens, cfg.viz.layer).items():
            writer.add_figure(f"alignment/{i}/{name}", fig, step)  # closes the figure
        weights = layer_views(attention, cfg.viz.layer)["weights"]
        entropy.append(attention_entropy(weights))
        monotone.append(monotonicity(weights))
    writer.add_scalar("dev/attention_entropy", sum(entropy) / n, step)
    writer.add_scalar("dev/attention_monotonicity", sum(monotone) / n, step)


def train(cfg: Config) -> dict:
    run_dir = cfg.run_dir
    device = resolve_device(cfg.device)
    dtype = amp_dtype(cfg.train.amp, device)
    seed_everything(cfg.train.seed)
    tokenizer = prepare_data(cfg)
    train_data = load_split(cfg.data.dir, "train", tokenizer)
    dev_data = load_split(cfg.data.dir, "dev", tokenizer).head(cfg.train.max_dev_sentences)
    vocab = vocab_fingerprint(tokenizer)

    model = build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas),
        weight_decay=cfg.train.weight_decay, fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.train.warmup_steps))
    progress = Progress()
    last_path, best_path = os.path.join(run_dir, "last.pt"), os.path.join(run_dir, "best.pt")
    config_dict = OmegaConf.to_container(cfg, resolve=True)

    if cfg.train.resume:
        if not os.path.exists(last_path):
            raise UserError(f"train.resume=true but {last_path} does not exist")
        state = load_checkpoint(last_path, device)
        if state["vocab"] != vocab:
            raise UserError(f"{last_path}: its vocabulary differs from this run's tokenizer; cannot resume")
        if state["config"]["model"] != config_dict["model"]:
            raise UserError(f"{last_path}: model settings differ from this run's (model=...); cannot resume")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        progress = Progress(**state["progress"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
        log.info("resumed from %s at step %d (epoch %d, batch %d)", last_path, progress.step, progress.epoch, progress.batch_in_epoch)

    os.makedirs(run_dir, exist_ok=True)
    atomic_write_text(os.path.join(run_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))
    n_params = count_parameters(model)
    log.info("model: %s, %.1f M parameters; device %s, %s; %d train / %d dev pairs", cfg.model.arch, n_params / 1e6,
             device, dtype or "fp32", len(train_data), len(dev_data))

    def checkpoint(path: str) -> None:
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        save_checkpoint(path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "progress": asdict(progress), "config": config_dict, "vocab": vocab, "rng": rng,
        })

    writer = SummaryWriter(os.path.join(run_dir, "tb"))
    batcher = Batcher(train_data.src, train_data.tgt)
    src_lens, tgt_lens = [len(s) for s in train_data.src], [len(t) for t in train_data.tgt]
    budget = cfg.train.max_minutes * 60 if cfg.train.max_minutes else float("inf")
    bar = tqdm(total=cfg.train.max_steps, initial=progress.step, desc="training", unit="step", dynamic_ncols=True)
    window_start, window_tokens, window_loss, window_loss_tokens = time.time(), 0, torch.zeros((), device=device), 0
    last_eval_step, stop_reason = -1, "max_steps"
    model.train()

    def run_validation() -> bool:
        """Validate, log, keep the best checkpoint; returns True when early stopping says stop."""
        nonlocal last_eval_step
        last_eval_step = progress.step
        t0 = time.time()
        metrics = validate(model, dev_data, tokenizer, cfg, device, dtype)
        log_alignments(writer, model, dev_data, tokenizer, cfg, device, dtype, progress.step)
        for key in ("loss", "ppl", "bleu", "chrf"):
            writer.add_scalar(f"dev/{key}", metrics[key], progress.step)
        improved = metrics["bleu"] > progress.best_bleu
        if improved:
            progress.best_bleu, progress.best_step, progress.bad_evals = metrics["bleu"], progress.step, 0
        else:
            progress.bad_evals += 1
        progress.eval_seconds += time.time() - t0
        tqdm.write(
            f"step {progress.step}: dev loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} BLEU {metrics['bleu']:.2f} "
            f"chrF {metrics['chrf']:.2f} ({time.time() - t0:.0f}s){' *best*' if improved else ''}"
        )
        if improved:
            checkpoint(best_path)
        return bool(cfg.train.patience) and progress.bad_evals >= cfg.train.patience

    done = progress.step >= cfg.train.max_steps
    loop_start = time.time() - progress.elapsed_seconds
    while not done:
        batches = make_batches(src_lens, tgt_lens, cfg.train.batch_tokens, shuffle=True, seed=cfg.train.seed, epoch=progress.epoch)
        for indices in batches[progress.batch_in_epoch:]:
            batch = batcher(indices)
            n_tokens = int((batch.tgt_out != PAD).sum())
            loss_sum, grad_norm = train_step(model, batch.to(device), n_tokens, optimizer, scheduler, cfg, dtype)
            progress.step += 1
            progress.batch_in_epoch += 1
            progress.tgt_tokens += n_tokens
            window_tokens += n_tokens
            window_loss += loss_sum
            window_loss_tokens += n_tokens
            bar.update(1)

            if progress.step % cfg.train.log_every == 0:
                loss = window_loss.item() / window_loss_tokens  # the only host sync between validations
                elapsed = time.time() - window_start
                writer.add_scalar("train/loss", loss, progress.step)
                writer.add_scalar("train/ppl", math.exp(min(loss, 50)), progress.step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], progress.step)
                writer.add_scalar("train/grad_norm", float(grad_norm), progress.step)
                writer.add_scalar("train/tgt_tokens_per_s", window_tokens / elapsed, progress.step)
                postfix = dict(loss=f"{loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", tok_s=f"{window_tokens / elapsed:,.0f}")
                if budget < float("inf"):  # the step-count ETA means little when time is the limit
                    postfix["time_left"] = tqdm.format_interval(max(budget - (time.time() - loop_start), 0))
                bar.set_postfix(postfix)
                window_start, window_tokens, window_loss_tokens = time.time(), 0, 0
                window_loss.zero_()

            if progress.step % cfg.train.eval_every == 0 and run_validation():
                done, stop_reason = True, f"early stopping (no dev BLEU gain in {cfg.train.patience} validations)"
            if progress.step % cfg.train.save_every == 0:
                checkpoint(last_path)
            if progress.step >= cfg.train.max_steps:
                done = True
            elif time.time() - loop_start >= budget:
                done, stop_reason = True, f"time budget of {cfg.train.max_minutes} min"
            progress.elapsed_seconds = time.time() - loop_start
            if done:
                break
        else:
            progress.epoch += 1
            progress.batch_in_epoch = 0
    bar.close()

    if last_eval_step != progress.step:
        run_validation()
    checkpoint(last_path)
    if not os.path.exists(best_path):
        checkpoint(best_path)
    summary = {
        "stopped": stop_reason, "steps": progress.step, "epochs": progress.epoch + progress.batch_in_epoch / max(len(batches), 1),
        "train_minutes": round(progress.elapsed_seconds / 60, 2),
        "validation_minutes": round(progress.eval_seconds / 60, 2),
        "tgt_tokens_per_s": round(progress.tgt_tokens / max(progress.elapsed_seconds - progress.eval_seconds, 1e-9)),
        "best_dev_bleu": progress.best_bleu, "best_step": progress.best_step, "parameters": n_params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "amp": str(dtype or "fp32"),
    }
    if device.type == "cuda":
        summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    atomic_write_text(os.path.join(run_dir, "train_summary.json"), json.dumps(summary, indent=2))
    writer.close()
    log.info("training stopped: %s. %s", stop_reason, json.dumps(summary))
    return summary
