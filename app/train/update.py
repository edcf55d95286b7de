"""One training update and what it is made of: the loss, the optimizer and its schedule, and
torch.compile. The training loop and the bench both run ``train_step``."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Protocol, Union, cast

import torch

from app.config.schema import CUDA_GRAPH_MODES, Config, TrainConfig
from app.models import sequence_loss, unsmoothed_loss
from app.models.coverage import coverage_loss
from app.models.rnn import RNNSeq2Seq
from app.models.transformer import Transformer
from app.models.transformer_layers import DecoderLayer, EncoderLayer
from app.run import distributed
from app.run.device import autocast
from app.train.freeze import freeze
from app.train.guided_alignment import guided_alignment_loss
from app.train.master_weights import MasterWeights

log = logging.getLogger(__name__)


DECAYS = ("cosine", "linear")  # the schedules that decay to an end


class LearningRate:
    """The learning rate of update ``step`` (0-based), as a fraction of train.lr: a linear warm-up to 1 over
    train.warmup_steps, then train.lr_schedule's

    - inverse_sqrt: √(warmup / step) (Vaswani et al. 2017, eq. 3, rescaled to peak at 1; no end);
    - cosine:       f + (1 - f) · ½ (1 + cos(π p)) (Loshchilov & Hutter 2017, without restarts);
    - linear:       f + (1 - f) · (1 - p);
    - constant:     1 (and plateau's, which ``cut_on_plateau`` lowers after validations),

    where f is train.lr_floor and p ∈ [0, 1] is how far the run is from the warm-up's end to ``end``: the first of
    train.max_steps, the step train.max_epochs ends at (``epochs_end``) and the step the time budget ends at
    (``budget_end``, estimated at each validation: app/train/decay_end.py). LambdaLR's state_dict keeps these
    attributes (a callable object's ``__dict__``), so that a resumed run decays to the end it was decaying to."""

    def __init__(self, t: TrainConfig):
        self.schedule, self.warmup, self.floor = t.lr_schedule, max(t.warmup_steps, 1), t.lr_floor
        self.max_steps, self.epochs_end, self.budget_end = t.max_steps, 0, 0  # 0: no such limit
        self.max_epochs = 0  # the train.max_epochs that epochs_end is the end of

    @property
    def end(self) -> int:
        return min(e for e in (self.max_steps, self.epochs_end, self.budget_end) if e > 0)

    def __call__(self, step: int) -> float:
        n, warmup, floor = step + 1, self.warmup, self.floor
        if n < warmup:
            return n / warmup
        p = min(max((n - warmup) / max(self.end - warmup, 1), 0.0), 1.0)
        if self.schedule == "inverse_sqrt":
            return math.sqrt(warmup / n)
        if self.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
        if self.schedule == "linear":
            return floor + (1 - floor) * (1 - p)
        return 1.0  # constant, plateau


def cut_on_plateau(scheduler: Any, t: TrainConfig, bad_evals: int, step: int, device: torch.device, main: bool) -> None:
    """train.lr_schedule=plateau, after a validation, on every rank: where rank 0's validations have gone more than
    train.lr_patience without a better dev score (``bad_evals`` of them, a multiple of lr_patience + 1: the count
    starts again after a cut), the learning rate is multiplied by train.lr_decay, not below train.lr × train.lr_floor
    (torch's ReduceLROnPlateau, which JoeyNMT's "plateau" is, patience for patience), from the next update on: the
    scheduler's base rate, which its state_dict keeps for a resume, and the rate in force (in place: a captured
    update reads it from the device)."""
    if t.lr_schedule != "plateau":
        return
    due = main and bad_evals > 0 and bad_evals % (t.lr_patience + 1) == 0
    before = scheduler.base_lrs[0]
    after = max(before * t.lr_decay, t.lr * t.lr_floor)
    if not distributed.from_main(due, device) or after >= before:
        return
    scheduler.base_lrs = [after for _ in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        rate = group["lr"]
        group["lr"] = rate.mul_(after / before) if isinstance(rate, torch.Tensor) else rate * after / before
    if main:
        log.info(
            "step %d: no better dev score (train.best_metric=%s) in %d validations: learning rate %.3g -> %.3g "
            "(train.lr_decay=%g)",
            step,
            t.best_metric,
            t.lr_patience + 1,
            before,
            after,
            t.lr_decay,
        )


def make_optimizer(
    model: torch.nn.Module, cfg: Config
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused: one kernel for all parameters, which can skip an update on the device) with train.lr_schedule
    (``LearningRate``), over the parameters that train: train.freeze's parts are frozen first (app/train/freeze.py),
    so that neither AdamW nor the bf16 compute copy made after it holds them."""
    freeze(model, cfg.train.freeze)
    beta1, beta2 = cfg.train.adam_betas  # two (TrainConfig checks)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.train.lr,
        betas=(beta1, beta2),
        weight_decay=cfg.train.weight_decay,
        fused=cfg.train.fused_optimizer,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, LearningRate(cfg.train))


def compiled_for_training(module: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """``module`` itself, with ``train.compile=true`` parts of it compiled in place for training (parameters
    shared, so checkpoints and decoding use the plain model); evaluation (a validation's dev loss) runs them
    eagerly, which would otherwise compile graphs of its own.

    A Transformer is compiled by region: one compiled function for its encoder layers and one for its decoder
    layers, each called with the layer as its argument, so every layer of a stack reuses one graph
    (regional compilation: two graphs to build instead of the whole model's one, each a twelfth of its size).
    Embeddings, the output projection and the loss stay eager. Sizes are symbols from the first call
    (``dynamic=True``: batch and sequence lengths vary with every length bucket).

    An RNN decoder loops over target positions in Python (a compiled loop would specialize on every
    target length), so for RNNs only the decoder's loop step is compiled, in place: its attention,
    cell and output ops become a few fused kernels, run once per target position. The encoder and the
    decoders that do not loop are single cuDNN calls already. The step's batch and source-length
    dimensions are marked dynamic on every call (the decoder's ``loop_dims``), so its first compile serves
    every later shape; model widths stay constants (with every size symbolic, Inductor 2.13 fails on
    Luong's general score: "Exponent must be non-negative")."""
    if not cfg.train.compile:
        return module
    mode = cfg.train.compile_mode
    # Without this, sizes that happen to be equal in the first batch (source length = target length)
    # get one symbol, and the first batch where they differ compiles again.
    torch.fx.experimental._config.use_duck_shape = False
    # Python floats (dropout rates, scales) are constants of a model: as symbols, each graph is traced twice
    # (dynamo restarts its analysis to turn them into tensors)
    torch._dynamo.config.specialize_float = True
    core = getattr(module, "module", module)  # under DDP: the wrapped model
    if isinstance(core, Transformer):  # model.arch=transformer
        compiled = {kind: torch.compile(kind.forward, dynamic=True, mode=mode) for kind in (EncoderLayer, DecoderLayer)}
        for layer in (*core.encoder, *core.decoder):
            layer.forward = training_compiled(layer, layer.forward, functools.partial(compiled[type(layer)], layer))
        return module
    assert isinstance(core, RNNSeq2Seq)
    decoder = core.decoder
    if decoder.loops:
        step = decoder.loop_step
        decoder.loop_step = training_compiled(decoder, step, torch.compile(step, mode=mode), decoder.loop_dims)
    else:
        log.warning(
            "train.compile=true: this RNN decoder runs in one cuDNN call and has no loop to compile; training eagerly"
        )
    return module


class CompiledMethod(Protocol):
    """What ``training_compiled`` puts in a method's place; ``compiled``: what was compiled."""

    compiled: Callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def training_compiled(
    module: torch.nn.Module, eager: Callable, compiled: Callable, mark_dynamic: Sequence = ()
) -> CompiledMethod:
    """What takes the place of ``module``'s method ``eager``: ``compiled`` while the module trains, ``eager`` in
    evaluation. ``mark_dynamic``, per positional argument, names the dimensions of that tensor (or of each
    tensor of a tuple, an LSTM's hidden state) marked dynamic before every call."""

    def method(*args, **kwargs):
        if not module.training:
            return eager(*args, **kwargs)
        for arg, varying in zip(args, mark_dynamic):
            if arg is None:  # a decoder's state it does not keep (a Luong feed without input feeding, no coverage)
                continue
            for tensor in arg if isinstance(arg, tuple) else (arg,):
                for dim in varying:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(*args, **kwargs)

    wrapper = cast(CompiledMethod, method)
    wrapper.compiled = compiled  # what was compiled (tests check that the wrapper took the method's place)
    return wrapper


class StepResult(NamedTuple):
    """An update's numbers, as device tensors (reading them is a host sync)."""

    loss_sum: torch.Tensor  # summed (label-smoothed) cross-entropy over this rank's target tokens: the objective
    grad_norm: torch.Tensor  # before clipping
    finite: torch.Tensor  # loss and gradient finite: the update was applied
    align_loss: torch.Tensor  # guided alignment's L_a, the mean of the micro-batches' (0 without it)
    coverage_loss: Optional[torch.Tensor]  # the coverage loss summed over this rank's target tokens (None without it)
    nll_sum: torch.Tensor  # the cross-entropy without label smoothing (the perplexity's), summed as loss_sum is


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2), bit for bit, for gradients of one device and dtype, the training
    case: it takes the norms with one foreach call, without the no-op ``.to`` that clip_grad_norm_ calls on
    each of them (one trip through the dispatcher per parameter: 264 of the 712 operators of the default
    Transformer's compiled step). Returns the total norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or len({(g.device, g.dtype) for g in grads}) > 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def train_step(
    model,
    batches: list,
    n_tokens: int,
    optimizer,
    scheduler,
    cfg: Config,
    dtype,
    ranks: int = 1,
    master: Optional[MasterWeights] = None,
) -> StepResult:
    """One update over ``batches`` (gradient accumulation), the loss normalized by ``n_tokens``, the
    target tokens of the whole update over all ``ranks``; batches that carry guided alignment targets
    add ``train.align_weight`` times their L_a (app/train/guided_alignment.py), averaged over the update's
    micro-batches; ``train.coverage_weight`` adds the coverage loss (app/models/coverage.py). No host sync.
    A non-finite update is skipped inside the fused optimizer kernel (with ``train.fused_optimizer=false``, by a
    host-side check). ``model`` runs the step; with ``master``, it is
    (a wrapper of) ``master.compute``, whose gradients go to the fp32 master weights the optimizer holds."""
    result = device_update(model, batches, n_tokens, optimizer, cfg, dtype, ranks, master)
    scheduler.step()
    return result


def device_update(
    model,
    batches: list,
    n_tokens: Union[int, torch.Tensor],
    optimizer,
    cfg: Config,
    dtype,
    ranks: int = 1,
    master: Optional[MasterWeights] = None,
) -> StepResult:
    """``train_step`` without the learning rate's schedule: what runs on the device alone, and what a CUDA graph
    records (app/train/capture.py; there ``n_tokens`` is a device tensor, so that a replay reads each update's)."""
    device = batches[0].src.device
    graphs = cfg.train.compile and cfg.train.compile_mode in CUDA_GRAPH_MODES
    loss_sum, align_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    nll_sum = torch.zeros((), device=device) if cfg.train.label_smoothing else loss_sum
    # made only when trained on: each operator of an update is one more for the host to issue on a GPU
    coverage_sum = torch.zeros((), device=device) if cfg.train.coverage_weight > 0 else None
    accumulated = False  # master gradients hold this update's
    for i, batch in enumerate(batches):
        # DDP all-reduces gradients on the last micro-batch only; it averages them over the ranks,
        # so each rank's loss is scaled up by their number to keep the sum over the whole update
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")
        if graphs:  # the last micro-batch's graph outputs are spent: its memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast(batch.src.device, dtype):
                if batch.align is None and coverage_sum is None:
                    logits = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths)
                else:
                    logits, attention = model(batch.src, batch.tgt_in, src_lengths=batch.src_lengths, alignment=True)
                loss = sequence_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
            objective = loss / (n_tokens / ranks)
            if coverage_sum is not None:
                covered = coverage_loss(attention, batch.tgt_out)
                objective = objective + cfg.train.coverage_weight * covered / (n_tokens / ranks)
                coverage_sum += covered.detach()
            if batch.align is not None:
                align = guided_alignment_loss(attention, batch.align) / len(batches)
                objective = objective + cfg.train.align_weight * align
                align_sum += align.detach()
            objective.backward()
        if master is not None and sync:  # under DDP, after the all-reduce of the last micro-batch
            master.accumulate(first=not accumulated)
            accumulated = True
        loss_sum += loss.detach().float()
        if cfg.train.label_smoothing:
            nll_sum += unsmoothed_loss(loss, logits, batch.tgt_out, cfg.train.label_smoothing)  # no gradient
    parameters = [p for group in optimizer.param_groups for p in group["params"]]  # the fp32 masters
    grad_norm = clip_gradients(parameters, cfg.train.clip_norm)
    finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()  # what GradScaler hands fused Adam: skip params and step count
        optimizer.step()
    elif finite:  # the unfused optimizer cannot skip on the device: this asks the host (a sync)
        optimizer.step()
    if master is not None:
        master.refresh()
        master.zero_grad(optimizer)
    else:
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, grad_norm, finite, align_sum, coverage_sum, nll_sum)
