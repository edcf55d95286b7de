"""How much each attention head of a Transformer matters to its loss (``make heads``), after Michel, Levy & Neubig
2019, "Are Sixteen Heads Really Better than One?".

An attention's output is Concat(head_1 … head_h) W^O (app/models/attention.py): each head enters W^O through one
slice of W^O's columns. A gate ξ_h multiplies those columns, as a parametrization of the attention's
``out_proj.weight`` (torch.nn.utils.parametrize: the model's code is untouched, every path that reads the weight sees
the gated one, the decoding steps' projections too, and the trained weight is back when the gates go). Over a split,
teacher forced, in nats per target token without label smoothing (the dev loss of training):

- **ablation**: the loss with ξ_h = 0 (head h masked, the others as trained) less the loss with every head;
- **gradient**: I_h = Σ_batches |∂L/∂ξ_h| at ξ = 1 over the split's tokens (Michel et al., eq. 2, per batch of
  about 30 sentences rather than per sentence), one backward pass for every head at once;
- **pruning**: the loss, and with ``heads.bleu`` the BLEU of the split's sources decoded as ``decode.*`` says (their
  Figure 2), with the least important heads (by ablation) masked together, a growing share of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm

from app.config.schema import Config, target_language
from app.data.corpus import ParallelData, load_split
from app.data.sources import SPLITS
from app.decode.trained import TrainedModel, load_trained
from app.evaluation.metrics import bleu_tokenizer
from app.evaluation.split import Asked, evaluate_split, mean_loss
from app.models.attention import MultiHeadAttention
from app.models.transformer import Transformer
from app.run.checkpoint import checkpoint_path
from app.run.device import resolve_device
from app.run.errors import UserError

# the attentions of a Transformer: its name in reports -> (the stack, the layer's attribute)
KINDS = {"encoder": ("encoder", "self_attn"), "decoder": ("decoder", "self_attn"), "cross": ("decoder", "cross_attn")}


# the gradient's batches: |∂L/∂ξ| of a batch of about 30 verses, as Michel et al.'s batches of sentences (the absolute
# value of a whole split's gradient would be the first-order estimate of masking, which masking itself measures)
GRADIENT_BATCH_TOKENS = 1024


@dataclass(frozen=True)
class Head:
    kind: str  # encoder (self-attention), decoder (self-attention) or cross (the decoder's attention to the source)
    layer: int
    head: int


def attentions(model: torch.nn.Module) -> dict[str, list[MultiHeadAttention]]:
    """Per kind, each layer's attention module."""
    return {kind: [getattr(layer, name) for layer in getattr(model, stack)] for kind, (stack, name) in KINDS.items()}


class GatedColumns(nn.Module):
    """W^O with each head's columns multiplied by its gate (a parametrization of ``out_proj.weight``)."""

    def __init__(self, gates: dict[str, torch.Tensor], kind: str, layer: int, d_head: int):
        super().__init__()
        self.gates, self.kind, self.layer, self.d_head = gates, kind, layer, d_head

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.gates[self.kind][self.layer].repeat_interleave(self.d_head).to(weight.dtype)


class HeadGates:
    """A gate per head of every attention of ``model`` (``gates[kind]``: (layers, heads), ones), multiplying the head's
    columns of its W^O while ``applied``."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.modules = attentions(model)
        self.gates = {
            kind: torch.ones(len(layers), layers[0].heads, device=device) for kind, layers in self.modules.items()
        }

    def heads(self) -> list[Head]:
        return [
            Head(kind, layer, h)
            for kind, g in self.gates.items()
            for layer in range(g.size(0))
            for h in range(g.size(1))
        ]

    @contextmanager
    def applied(self) -> Iterator[None]:
        gated = []
        try:
            for kind, layers in self.modules.items():
                for layer, module in enumerate(layers):
                    gate = GatedColumns(self.gates, kind, layer, module.d_head)
                    parametrize.register_parametrization(module.out_proj, "weight", gate)
                    gated.append(module.out_proj)
            yield
        finally:
            for out_proj in gated:  # the trained weight back as the parameter it was
                parametrize.remove_parametrizations(out_proj, "weight", leave_parametrized=False)


@dataclass
class HeadImportance:
    base_loss: float
    ablation: dict[Head, float]  # loss with the head masked, less base_loss
    gradient: dict[Head, float]  # Σ |∂L/∂ξ| per target token
    pruning: list[dict]  # {"heads_masked", "share", "loss"[, "bleu"]}, from none to all but one per attention
    tokens: int
    sentences: int

    def ranked(self) -> list[Head]:
        """The heads, most important (largest ablation loss) first."""
        return sorted(self.ablation, key=lambda h: -self.ablation[h])

    def agreement(self) -> float:
        """Spearman's ρ between the two measures: whether the one backward pass orders the heads as masking each
        does."""
        heads = list(self.ablation)
        return rank_correlation([self.ablation[h] for h in heads], [self.gradient[h] for h in heads])


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's ρ: Pearson's r of the ranks (ties ranked in order); 0 where either side is constant."""
    ranks = [torch.tensor(x, dtype=torch.float64).argsort().argsort().double() for x in (a, b)]
    x, y = (r - r.mean() for r in ranks)
    denominator = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator else 0.0


@dataclass
class MeasuredHeads:
    """What make heads found, with the settings it ran with."""

    found: HeadImportance
    cfg: Config
    step: int  # of the checkpoint measured
    seconds: float


def measure_heads(cfg: Config) -> MeasuredHeads:
    """The heads of the run's ``heads.checkpoint`` on the first ``heads.max_sentences`` pairs of ``heads.split``;
    an RNN (one attention, no heads) or another split is a UserError."""
    h = cfg.heads
    if h.split not in SPLITS:
        raise UserError(f"heads.split={h.split!r} is not a split; the splits are {', '.join(SPLITS)}")
    started = time.perf_counter()
    trained = load_trained(cfg.run_dir, h.checkpoint, resolve_device(cfg.device), "heads.checkpoint")
    if not isinstance(trained.model, Transformer):
        raise UserError(
            f"make heads measures a Transformer's attention heads: {cfg.name} is an RNN (model.arch=rnn), whose one "
            "attention has none"
        )
    data = load_split(trained.config.data.dir, h.split, trained.tokenizer, first=h.max_sentences)
    model = trained.config.model
    bleu = split_bleu(trained, data, cfg) if h.bleu and h.prune_steps else None
    print(
        f"heads of {checkpoint_path(cfg.run_dir, h.checkpoint)} (step {trained.step}) on {h.split}, {len(data)} "
        f"pairs: {len(KINDS)} kinds of attention × {model.enc_layers}/{model.dec_layers} layers × {model.heads} "
        "heads, a teacher-forced pass each"
        + (f"; the pruning curve's BLEU decodes the {len(data)} sources at each of its steps" if bleu else "")
    )
    batch_tokens = cfg.decode.batch_tokens
    found = head_importance(trained.model, data, batch_tokens, trained.device, trained.dtype, h.prune_steps, bleu=bleu)
    return MeasuredHeads(found, cfg, trained.step, time.perf_counter() - started)


def split_bleu(trained: TrainedModel, data: ParallelData, cfg: Config) -> Callable[[], float]:
    """The BLEU of ``data``'s sources decoded as ``decode.*`` says, by the heads as gated when it is called: the
    evaluation of a split that validation and make eval run, scores only."""
    trained.check_decoding(cfg.decode)
    asked = Asked(bleu_tokenizer(cfg.eval.bleu_tokenize, target_language(trained.config.data)), records=())
    search = lambda src, _every, _progress: trained.translate(src, cfg.decode)  # noqa: E731
    tokens = cfg.decode.batch_tokens

    def bleu() -> float:
        result = evaluate_split(trained.model, data, trained.tokenizer, search, asked, tokens, trained.dtype)
        return float(result.finish()["bleu"])

    return bleu


def head_importance(
    model: torch.nn.Module,
    data: ParallelData,
    batch_tokens: int,
    device: torch.device,
    dtype: Optional[torch.dtype],
    prune_steps: int,
    progress: bool = True,
    bleu: Optional[Callable[[], float]] = None,
) -> HeadImportance:
    """Every head's ablation and gradient importance over ``data``, and the pruning curve in ``prune_steps``
    steps (0: none), with ``bleu``'s figure at each step where given."""
    was_training = model.training
    model.eval()
    gates = HeadGates(model, device)
    heads = gates.heads()
    loss = lambda: mean_loss(model, data, batch_tokens, device, dtype)  # noqa: E731
    try:
        with gates.applied():
            base = loss()
            tensors = [g.requires_grad_() for g in gates.gates.values()]
            shown = "gradient of every head's gate" if progress else ""
            mean_loss(model, data, min(batch_tokens, GRADIENT_BATCH_TOKENS), device, dtype, tensors, shown)
            tokens = sum(len(t) + 1 for t in data.tgt)
            summed = {kind: torch.zeros_like(g) if g.grad is None else g.grad for kind, g in gates.gates.items()}
            gradient = {h: float(summed[h.kind][h.layer, h.head]) / tokens for h in heads}
            for g in tensors:
                g.requires_grad_(False).grad = None
            ablation = {}
            for h in tqdm(heads, desc="masking each head", unit="head", disable=not progress, leave=False):
                gates.gates[h.kind][h.layer, h.head] = 0.0
                ablation[h] = loss() - base
                gates.gates[h.kind][h.layer, h.head] = 1.0
            least_first = sorted(heads, key=lambda h: ablation[h])
            pruning = pruning_curve(gates, least_first, prune_steps, loss, progress, bleu)
    finally:
        model.train(was_training)
    return HeadImportance(base, ablation, gradient, pruning, tokens, len(data))


def pruning_curve(
    gates: HeadGates,
    least_first: list[Head],
    steps: int,
    loss: Callable[[], float],
    progress: bool,
    bleu: Optional[Callable[[], float]] = None,
) -> list[dict]:
    """The loss (and ``bleu``'s figure, where given) with the first k heads of ``least_first`` masked together, k
    growing in ``steps`` even steps to all but the most important head of each attention (an attention with no head
    left would output only its bias)."""
    if not steps:
        return []
    keep = {(h.kind, h.layer): h for h in least_first}  # each attention's most important head: its last
    prunable = [h for h in least_first if keep[(h.kind, h.layer)] != h]
    counts = sorted({math.ceil(len(prunable) * i / steps) for i in range(steps + 1)})
    curve, masked = [], 0
    for k in tqdm(counts, desc="pruning", unit="step", disable=not progress, leave=False):
        for h in prunable[masked:k]:
            gates.gates[h.kind][h.layer, h.head] = 0.0
        masked = k
        point = {"heads_masked": k, "share": round(k / len(least_first), 4), "loss": loss()}
        curve.append(point if bleu is None else {**point, "bleu": bleu()})
    for g in gates.gates.values():
        g.fill_(1.0)
    return curve
