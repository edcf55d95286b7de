"""The training loop: bf16 autocast on CUDA, inverse-sqrt warmup, clipping, validation with dev BLEU,
checkpoints (last, best, rotated snapshots), early stopping, exact resume, graceful stop on SIGINT/SIGTERM,
skipped non-finite updates, out-of-memory handling, TensorBoard scalars and a progress bar with ETA."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from app import distributed
from app.checkpoint import (check_compatible, load_checkpoint, rotate_snapshots, save_checkpoint, snapshot_name)
from app.config import Config, TrainConfig
from app.data.batching import Batcher, make_batches, sorted_batches
from app.data.corpus import ParallelData, load_split, load_tokenized, load_tokenizer, prepare_data
from app.data.tokenizer import EOS, PAD, Tokenizer
from app.decoding import decode_corpus
from app.errors import UserError
from app.evaluation import score
from app.interrupt import StopRequest, TrainingInterrupted
from app.models import build_model, count_parameters
from app.utils import (atomic_write_text, autocast, file_hash, resolve_device, rng_state, seed_everything,
                       set_rng_state)

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
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient
    batch_tokens: int = 0  # token budget in force (halved on out-of-memory with train.oom_retry)
    epoch_batch_tokens: int = 0  # the budget the current epoch's batches were cut with
    validations: list = field(default_factory=list)  # [step, dev BLEU] of every validation


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


def make_optimizer(model: torch.nn.Module, cfg: Config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # fused: one kernel for all parameters, and it can skip an update on the device (found_inf below)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas),
                                  weight_decay=cfg.train.weight_decay, fused=cfg.train.fused_optimizer)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.train.warmup_steps))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiled_for_training(module: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """``module`` itself, or with ``train.compile=true`` its torch.compile'd wrapper (parameters shared,
    so checkpoints and decoding use the plain model). Batch shapes vary with every length bucket:
    ``dynamic=True`` traces sequence length and batch size as symbols, one graph for all of them, where
    static shapes would recompile per bucket and give up after torch._dynamo's recompile limit.

    An RNN decoder loops over target positions in Python (a compiled loop would specialize on every
    target length), so for RNNs only the decoder's loop step is compiled, in place: its attention,
    cell and output ops become a few fused kernels, run once per target position. The encoder and the
    decoders that do not loop are single cuDNN calls already. The step compiles with automatic dynamic
    shapes: static first, then once more with the sizes that changed (batch, source length) as
    symbols; model widths stay constants (with every size symbolic, Inductor 2.13 fails on Luong's
    general score: "Exponent must be non-negative")."""
    if not cfg.train.compile:
        return module
    mode = cfg.train.compile_mode
    if mode not in COMPILE_MODES:
        raise UserError(f"train.compile_mode={mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    # Without this, sizes that happen to be equal in the first batch (source length = target length)
    # get one symbol, and the first batch where they differ compiles again.
    torch.fx.experimental._config.use_duck_shape = False
    if cfg.model.arch == "transformer":
        return torch.compile(module, dynamic=True, mode=mode)
    decoder = getattr(module, "module", module).decoder  # under DDP: the wrapped model
    if decoder.loops:
        decoder.loop_step = torch.compile(decoder.loop_step, mode=mode)
    else:
        log.warning("train.compile=true: this RNN decoder runs in one cuDNN call and has no loop to compile; "
                    "training eagerly")
    return module


def train_step(model, batches: list, n_tokens: int, optimizer, scheduler, cfg: Config, dtype, ranks: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One update over ``batches`` (gradient accumulation), the loss normalized by ``n_tokens``, the
    target tokens of the whole update over all ``ranks``. Returns the summed loss, the gradient norm and
    whether both were finite, as device tensors (no host sync). A non-finite update is skipped inside
    the fused optimizer kernel (with ``train.fused_optimizer=false``, by a host-side check)."""
    loss_sum = torch.zeros((), device=batches[0].src.device)
    for i, batch in enumerate(batches):
        # DDP all-reduces gradients on the last micro-batch only; it averages them over the ranks,
        # so each rank's loss is scaled up by their number to keep the sum over the whole update
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast(batch.src.device, dtype):
                logits = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths)
                loss = sequence_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
            (loss / (n_tokens / ranks)).backward()
        loss_sum += loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
    finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()  # what GradScaler hands fused Adam: skip params and step count
        optimizer.step()
    elif finite:  # the unfused optimizer cannot skip on the device: this asks the host (a sync)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss_sum, grad_norm, finite


@torch.no_grad()
def validate(model, dev: ParallelData, tokenizer: Tokenizer, cfg: Config, device, dtype) -> dict:
    """Dev perplexity (teacher forcing, no smoothing) and dev BLEU/chrF of greedy translations."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in sorted_batches(dev.src, dev.tgt, cfg.decode.batch_tokens):
        batch = batch.to(device)
        with autocast(device, dtype):
            logits = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths)
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


def split_batch(indices: list[int], src_lens: list[int], tgt_lens: list[int], budget: int) -> list[list[int]]:
    """Cut a batch into pieces within ``budget`` tokens; always at least two pieces when it has two
    sentences (a batch that ran out of memory must shrink). Deterministic, so resume replays it."""
    pieces = [[indices[i] for i in piece] for piece in
              make_batches([src_lens[i] for i in indices], [tgt_lens[i] for i in indices], budget)]
    if len(pieces) == 1 and len(indices) > 1:
        half = len(indices) // 2
        pieces = [indices[:half], indices[half:]]
    return pieces


def resume_hint() -> str:
    """The command that continues this run: the same Hydra overrides plus train.resume=true."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("train.resume=")]
    except ValueError:  # not started through Hydra (tests)
        overrides = []
    nproc = f"NPROC={distributed.world_size()} " if distributed.launched() else ""
    return f'make train {nproc}ARGS="{" ".join([*overrides, "train.resume=true"])}"'


class Trainer:
    """One training run: set-up (or resume), the update loop, validation and checkpoints."""

    def __init__(self, cfg: Config):
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.last_path, self.best_path = os.path.join(self.run_dir, "last.pt"), os.path.join(self.run_dir, "best.pt")
        if cfg.train.resume and not os.path.exists(self.last_path):  # both checked before any data work
            raise UserError(f"train.resume=true but {self.last_path} does not exist")
        if not cfg.train.resume and os.path.exists(self.last_path):
            raise UserError(f"{self.last_path} exists: continue that run with train.resume=true, "
                            "or train under another name= (or delete the folder)")
        self.device = distributed.setup(resolve_device(cfg.device))
        self.rank, self.world, self.main = distributed.rank(), distributed.world_size(), distributed.is_main()
        self.accum = accumulation_steps(cfg.train, self.world)
        if self.world > 1 and cfg.train.oom_retry:
            raise UserError("train.oom_retry=true works in a single process only: with several ranks every "
                            "rank must cut the same batches; lower train.batch_tokens instead")
        self.dtype = amp_dtype(cfg.train.amp, self.device)
        seed_everything(cfg.train.seed)
        if self.main:  # rank 0 prepares data, tokenizer and Arrow caches; the others then read them
            prepare_data(cfg)
        distributed.barrier()
        self.tokenizer = load_tokenizer(cfg.data.dir, cfg.tokenizer)
        self.train_data = load_tokenized(cfg.data.dir, "train", self.tokenizer)
        self.dev_data = load_split(cfg.data.dir, "dev", self.tokenizer).head(cfg.train.max_dev_sentences)
        self.vocab = vocab_fingerprint(self.tokenizer)
        self.model = build_model(cfg.model, self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size,
                                 self.tokenizer.joint).to(self.device)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)
        self.config_dict = OmegaConf.to_container(cfg, resolve=True)
        self.progress = Progress(batch_tokens=cfg.train.batch_tokens, epoch_batch_tokens=cfg.train.batch_tokens)
        if cfg.train.resume:
            self.resume()
        elif self.world > 1:  # same initial weights (DDP broadcasts rank 0's), different dropout per rank
            torch.manual_seed(cfg.train.seed + self.rank)
        # the module that trains: DDP all-reduces its gradients; self.model stays the plain model
        self.trained = self.model
        if distributed.launched():
            self.trained = DistributedDataParallel(self.model, device_ids=[self.device] if self.device.type == "cuda" else None)
        self.trained = compiled_for_training(self.trained, cfg)
        self.batcher = Batcher(self.train_data.src, self.train_data.tgt)
        self.src_lens, self.tgt_lens = self.train_data.src_lens, self.train_data.tgt_lens

    # --- checkpoints ------------------------------------------------------------------------------

    def resume(self) -> None:
        state = load_checkpoint(self.last_path, self.device)
        check_compatible(state, self.last_path, self.vocab, self.config_dict["model"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = p = Progress(**state["progress"])
        rng = state.get("rng_ranks") or [state["rng"]]
        if len(rng) == self.world:
            set_rng_state(rng[self.rank], self.device)
        else:  # resumed with another number of ranks: same weights and data order, fresh dropout streams
            set_rng_state(state["rng"], self.device)
            torch.manual_seed(self.cfg.train.seed + self.rank + 7919 * p.step)
        saved_budget = state["config"]["train"]["batch_tokens"]
        p.epoch_batch_tokens = p.epoch_batch_tokens or saved_budget  # checkpoints older than these fields
        p.batch_tokens = p.batch_tokens or saved_budget
        if saved_budget != self.cfg.train.batch_tokens:  # the user changed it: from the next batches on
            p.batch_tokens = self.cfg.train.batch_tokens
        log.info("resumed from %s at step %d (epoch %d, batch %d)", self.last_path, p.step, p.epoch, p.batch_in_epoch)

    def full_state(self, rng_ranks: Optional[list] = None) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "progress": asdict(self.progress),
                 "config": self.config_dict, "vocab": self.vocab, "rng": rng_state(self.device)}
        if rng_ranks and len(rng_ranks) > 1:
            state["rng_ranks"] = rng_ranks  # each rank's dropout stream, for an exact resume under DDP
        return state

    def snapshot(self) -> None:
        """A model-only ``step_NNNNNNN.pt`` for averaging, then rotation (train.keep_last / keep_best)."""
        t = self.cfg.train
        path = os.path.join(self.run_dir, f"{snapshot_name(self.progress.step)}.pt")
        if not os.path.exists(path):
            save_checkpoint(path, {"model": self.model.state_dict(), "config": self.config_dict, "vocab": self.vocab,
                                   "progress": asdict(self.progress)})
        rotate_snapshots(self.run_dir, t.keep_last, t.keep_best, self.progress.validations)

    def save(self) -> None:
        """Called on every rank (it gathers their RNG states); rank 0 alone writes."""
        rng_ranks = distributed.gather_objects(rng_state(self.device)) if self.world > 1 else None
        if not self.main:
            return
        save_checkpoint(self.last_path, self.full_state(rng_ranks))
        if self.cfg.train.keep_last > 0:
            self.snapshot()

    # --- validation -------------------------------------------------------------------------------

    def validate(self) -> bool:
        """Validation (once, on rank 0); returns on every rank whether early stopping says stop."""
        return distributed.from_main(self.main and self.validate_on_main(), self.device)

    def validate_on_main(self) -> bool:
        """Validate, log, keep the best checkpoint; returns True when early stopping says stop."""
        cfg, p = self.cfg, self.progress
        t0 = time.time()
        metrics = validate(self.model, self.dev_data, self.tokenizer, cfg, self.device, self.dtype)
        log_alignments(self.writer, self.model, self.dev_data, self.tokenizer, cfg, self.device, self.dtype, p.step)
        for key in ("loss", "ppl", "bleu", "chrf"):
            self.writer.add_scalar(f"dev/{key}", metrics[key], p.step)
        p.validations.append([p.step, metrics["bleu"]])
        improved = metrics["bleu"] > p.best_bleu
        if improved:
            p.best_bleu, p.best_step, p.bad_evals = metrics["bleu"], p.step, 0
        else:
            p.bad_evals += 1
        p.eval_seconds += time.time() - t0
        tqdm.write(f"step {p.step}: dev loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} BLEU {metrics['bleu']:.2f} "
                   f"chrF {metrics['chrf']:.2f} ({time.time() - t0:.0f}s){' *best*' if improved else ''}")
        if improved:
            save_checkpoint(self.best_path, self.full_state())
        if cfg.train.keep_best > 0:
            self.snapshot()
        return bool(cfg.train.patience) and p.bad_evals >= cfg.train.patience

    # --- updates ----------------------------------------------------------------------------------

    def update(self, parts: list[list[int]], n_tokens: int) -> Optional[str]:
        """One optimizer update on this rank's micro-batches ``parts`` (``n_tokens`` target tokens in the
        update over all ranks). When it runs out of memory, nothing changes and the batch's shape comes back."""
        batches = [self.batcher(indices) for indices in parts]
        try:
            loss_sum, grad_norm, finite = train_step(self.trained, [b.to(self.device) for b in batches], n_tokens,
                                                     self.optimizer, self.scheduler, self.cfg, self.dtype, self.world)
        except torch.OutOfMemoryError:
            big = max(batches, key=lambda b: b.src.numel() + b.tgt_in.numel())
            return f"{big.src.size(0)} sentences, source {tuple(big.src.shape)}, target {tuple(big.tgt_in.shape)}"
        p = self.progress
        p.step += 1
        p.tgt_tokens += n_tokens
        self.window_tokens += n_tokens
        self.window_steps += 1
        local_tokens = sum(int((b.tgt_out != PAD).sum()) for b in batches)
        self.window_loss += torch.where(finite, loss_sum, 0.0)
        self.window_loss_tokens += finite * local_tokens
        self.bad_run = (self.bad_run + 1) * ~finite  # consecutive skipped updates, counted on the device
        self.worst_bad_run = torch.maximum(self.worst_bad_run, self.bad_run)
        self.window_skipped += ~finite
        self.grad_norm = grad_norm
        self.bar.update(1)
        t = self.cfg.train
        if p.step % t.log_every == 0 or (t.max_bad_steps and p.step % t.max_bad_steps == 0):
            self.read_window(write_scalars=p.step % t.log_every == 0)
        return None

    def train_update(self, group: list[list[int]]) -> None:
        """One update on a group of world × accum batches of the epoch: this rank's share, accumulated.
        Out of memory (single process, train.oom_retry): halve the budget and cut the same sentences
        into more micro-batches of the same update."""
        p = self.progress
        n_tokens = sum(self.tgt_lens[i] + 1 for indices in group for i in indices)  # +1: EOS; known on every rank
        parts = group[self.rank * self.accum:(self.rank + 1) * self.accum]
        if p.batch_tokens < p.epoch_batch_tokens:  # the budget was halved during this epoch
            parts = [piece for part in parts for piece in split_batch(part, self.src_lens, self.tgt_lens, p.batch_tokens)]
        while True:
            oom_shape = self.update(parts, n_tokens)
            if oom_shape is None:
                return
            # out of memory: the failed step's tensors are gone once its exception frame is
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self.cfg.train.oom_retry or all(len(part) == 1 for part in parts):
                raise UserError(f"out of {self.device.type} memory at step {p.step + 1} on a batch of {oom_shape}: "
                                f"lower train.batch_tokens (now {p.batch_tokens})"
                                + ("" if self.cfg.train.oom_retry else " or set train.oom_retry=true"))
            p.batch_tokens = max(p.batch_tokens // 2, 1)
            log.warning("out of memory on a batch of %s: train.batch_tokens halved to %d", oom_shape, p.batch_tokens)
            parts = [piece for part in parts for piece in split_batch(part, self.src_lens, self.tgt_lens, p.batch_tokens)]

    def read_window(self, write_scalars: bool) -> None:
        """The one host sync between validations: loss of the window, skipped updates, abort check."""
        p, t = self.progress, self.cfg.train
        skipped, worst = int(self.window_skipped), int(self.worst_bad_run)
        if skipped:
            p.skipped_steps += skipped
            self.window_skipped.zero_()
            self.writer.add_scalar("train/skipped_steps", p.skipped_steps, p.step)
            tqdm.write(f"step {p.step}: skipped {skipped} update(s) with a non-finite loss or gradient "
                       f"({p.skipped_steps} in all)")
        if t.max_bad_steps and worst >= t.max_bad_steps:
            raise UserError(f"training aborted at step {p.step}: {worst} updates in a row had a non-finite loss or "
                            f"gradient (train.max_bad_steps={t.max_bad_steps}); lower train.lr or raise "
                            "train.warmup_steps, and check the data")
        if not write_scalars:
            return
        loss_sum, tokens = distributed.sum_all(torch.stack([self.window_loss.double(), self.window_loss_tokens.double()])).tolist()
        loss = loss_sum / tokens if tokens else float("nan")
        elapsed = time.time() - self.window_start
        lr = self.scheduler.get_last_lr()[0]
        self.writer.add_scalar("train/loss", loss, p.step)
        self.writer.add_scalar("train/ppl", math.exp(min(loss, 50)), p.step)
        self.writer.add_scalar("train/lr", lr, p.step)
        self.writer.add_scalar("train/grad_norm", float(self.grad_norm), p.step)
        self.writer.add_scalar("train/tgt_tokens_per_s", self.window_tokens / elapsed, p.step)
        self.writer.add_scalar("train/tgt_tokens_per_update", self.window_tokens / max(self.window_steps, 1), p.step)
        postfix = dict(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{self.window_tokens / elapsed:,.0f}")
        if self.budget < float("inf"):  # the step-count ETA means little when time is the limit
            postfix["time_left"] = tqdm.format_interval(max(self.budget - (time.time() - self.loop_start), 0))
        self.bar.set_postfix(postfix)
        self.reset_window()

    def reset_window(self) -> None:
        zero = lambda dtype: torch.zeros((), dtype=dtype, device=self.device)  # noqa: E731
        self.window_start, self.window_tokens, self.window_steps = time.time(), 0, 0
        self.window_loss, self.window_loss_tokens = zero(torch.float32), zero(torch.long)
        self.window_skipped = zero(torch.long)
        self.worst_bad_run = self.bad_run.clone()  # a run of skips may continue into the next window

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, p = self.cfg, self.progress
        n_params = count_parameters(self.model)
        if self.main:
            os.makedirs(self.run_dir, exist_ok=True)
            atomic_write_text(os.path.join(self.run_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))
            log.info("model: %s, %.1f M parameters; device %s, %s; %d train / %d dev pairs", cfg.model.arch,
                     n_params / 1e6, self.device, self.dtype or "fp32", len(self.train_data), len(self.dev_data))
            log.info("each update: %d rank(s) × %d micro-batch(es) of up to %d tokens = %d padded tokens%s",
                     self.world, self.accum, p.batch_tokens, self.world * self.accum * p.batch_tokens,
                     f" (train.tokens_per_update={cfg.train.tokens_per_update})" if cfg.train.tokens_per_update else "")
        self.writer = SummaryWriter(os.path.join(self.run_dir, "tb")) if self.main else NoWriter()
        self.budget = cfg.train.max_minutes * 60 if cfg.train.max_minutes else float("inf")
        # with a time budget the step-count ETA is meaningless: time_left in the postfix says it instead
        total = None if self.budget < float("inf") else cfg.train.max_steps
        self.bar = tqdm(total=total, initial=p.step, desc="training", unit="step", dynamic_ncols=True,
                        disable=not self.main)
        self.grad_norm = torch.zeros(())
        self.bad_run = torch.zeros((), dtype=torch.long, device=self.device)  # consecutive skipped updates
        self.reset_window()
        last_eval_step, stop_reason = -1, "max_steps"
        self.model.train()
        self.loop_start = time.time() - p.elapsed_seconds
        done, batches = p.step >= cfg.train.max_steps, []
        crossed = lambda every, before: every > 0 and p.step // every > before // every  # noqa: E731
        group = self.world * self.accum  # batches per update: each rank takes accum of them
        with StopRequest() as stop:
            while not done:
                batches = make_batches(self.src_lens, self.tgt_lens, p.epoch_batch_tokens, shuffle=True,
                                       seed=cfg.train.seed, epoch=p.epoch)
                if len(batches) < group:
                    raise UserError(f"the train split makes {len(batches)} batches of train.batch_tokens="
                                    f"{p.epoch_batch_tokens}, fewer than one update takes ({self.world} ranks × "
                                    f"{self.accum} accumulated): lower train.batch_tokens")
                # every rank walks the same global batches; a last group smaller than one update is left out
                for start in range(p.batch_in_epoch, len(batches) - group + 1, group):
                    before = p.step
                    self.train_update(batches[start:start + group])
                    p.batch_in_epoch = start + group
                    if crossed(cfg.train.eval_every, before):
                        last_eval_step = p.step
                        if self.validate():
                            done, stop_reason = True, f"early stopping (no dev BLEU gain in {cfg.train.patience} validations)"
                    if crossed(cfg.train.save_every, before):
                        self.save()
                    p.elapsed_seconds = time.time() - self.loop_start
                    # ranks must agree on stopping: with several, they compare flags every few steps
                    out_of_time, stop_requested = p.elapsed_seconds >= self.budget, stop.requested
                    if self.world > 1:
                        check = p.step % STOP_CHECK_EVERY == 0 or p.step >= cfg.train.max_steps
                        out_of_time, stop_requested = distributed.any_rank([out_of_time, stop_requested], self.device) \
                            if check else (False, False)
                    if p.step >= cfg.train.max_steps:
                        done = True
                    elif out_of_time:
                        done, stop_reason = True, f"time budget of {cfg.train.max_minutes} min"
                    if stop_requested and not done:
                        self.interrupted(stop.signum or signal.SIGTERM)
                    if done:
                        break
                else:
                    p.epoch += 1
                    p.batch_in_epoch = 0
                    p.epoch_batch_tokens = p.batch_tokens
            self.bar.close()
            self.read_window(write_scalars=False)  # skipped updates of the last, partial window
            if last_eval_step != p.step:
                self.validate()
            p.elapsed_seconds = time.time() - self.loop_start
            self.save()
        if self.main and not os.path.exists(self.best_path):
            save_checkpoint(self.best_path, self.full_state())
        return self.finish(stop_reason, n_params, len(batches))

    def interrupted(self, signum: int) -> None:
        self.save()
        self.bar.close()
        self.writer.close()
        name = signal.Signals(signum).name
        raise TrainingInterrupted(f"{name}: stopped after step {self.progress.step} and saved {self.last_path}; "
                                  f"continue with: {resume_hint()}", signum)

    def finish(self, stop_reason: str, n_params: int, epoch_batches: int) -> dict:
        p, device = self.progress, self.device
        summary = {
            "stopped": stop_reason, "steps": p.step, "epochs": round(p.epoch + p.batch_in_epoch / max(epoch_batches, 1), 3),
            "train_minutes": round(p.elapsed_seconds / 60, 2),
            "validation_minutes": round(p.eval_seconds / 60, 2),
            "tgt_tokens_per_s": round(p.tgt_tokens / max(p.elapsed_seconds - p.eval_seconds, 1e-9)),
            "best_dev_bleu": p.best_bleu, "best_step": p.best_step, "parameters": n_params,
            "skipped_steps": p.skipped_steps, "batch_tokens": p.batch_tokens,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "amp": str(self.dtype or "fp32"), "ranks": self.world, "accum_steps": self.accum,
            "tgt_tokens_per_update": round(p.tgt_tokens / max(p.step, 1)),
        }
        if device.type == "cuda":
            summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        self.writer.close()
        if self.main:
            atomic_write_text(os.path.join(self.run_dir, "train_summary.json"), json.dumps(summary, indent=2))
            log.info("training stopped: %s. %s", stop_reason, json.dumps(summary))
        return summary


class NoWriter:
    """What ranks other than 0 log to: nothing (rank 0 alone writes events, plots and checkpoints)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


STOP_CHECK_EVERY = 10  # steps between the ranks' agreement on stopping (a host sync) under DDP


def accumulation_steps(t: TrainConfig, world: int) -> int:
    """Micro-batches per rank and update: train.accum_steps, or what train.tokens_per_update asks for
    with this many ranks (so the tokens per update stay the same when the number of GPUs changes)."""
    if t.tokens_per_update <= 0:
        if t.accum_steps < 1:
            raise UserError(f"train.accum_steps={t.accum_steps} must be at least 1")
        return t.accum_steps
    accum = max(1, round(t.tokens_per_update / (t.batch_tokens * world)))
    if accum * t.batch_tokens * world != t.tokens_per_update:
        log.warning("train.tokens_per_update=%d is not a multiple of %d ranks × train.batch_tokens=%d: using %d "
                    "accumulation steps (%d tokens per update)", t.tokens_per_update, world, t.batch_tokens, accum,
                    accum * world * t.batch_tokens)
    return accum


def train(cfg: Config) -> dict:
    stopped, summary = None, {}
    try:
        summary = Trainer(cfg).run()
    except TrainingInterrupted as err:  # every rank stops at the same step
        stopped = err.with_traceback(None)  # its frames hold the DDP model, which must go before the group
    gc.collect()
    distributed.teardown()
    if stopped:
        raise stopped
    return summary
