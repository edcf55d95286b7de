"""Copying source pieces through the attention: the pointer-generator (See et al. 2017, §2.2), the form of
OpenNMT's copy attention and of fairseq's ``transformer_pointer_generator`` (``model.copy_attention``).

    p_gen  = σ(w_gᵀ [o_t; E y_{t-1}] + b_g)                                      (See et al. eq. 8)
    P(w)   = p_gen · softmax(W_s o_t)_w + (1 − p_gen) · Σ_{j: x_j = w} α_tj      (eq. 9)

o_t is what the output layer reads (a Transformer's last normalized layer output, an RNN's pre-output or
attentional state), E y_{t-1} the embedded previous target piece, α_t the attention over the source pieces
x_1..x_S. With one vocabulary for both languages (``tokenizer.joint``) every source piece is a target piece,
so copying needs no extended vocabulary: the copy mass of a source piece is added to that piece's probability.

The model returns log P where other models return logits: log_softmax leaves a log-distribution as it is, so
greedy and beam search, sampling (temperature included), ensembles, scoring and the label-smoothed loss read it
as they read any model's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.data.tokenizer import PAD

# the copy term's log floors at this where a piece's attention is 0 (its gradient there is 0, not NaN)
_FLOOR = 1e-30


class PointerGenerator(nn.Module):
    """The gate p_gen and the mixture of generating and copying (module docstring)."""

    def __init__(self, d_output: int, d_embedding: int):
        super().__init__()
        self.gate = nn.Linear(d_output + d_embedding, 1)

    def gate_logit(self, output: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """w_gᵀ [o_t; E y_{t-1}] + b_g (..., 1) in at least float32, for outputs o_t (..., D) and embedded previous
        pieces E y_{t-1} (..., E): p_gen is its sigmoid."""
        return _at_least_fp32(self.gate(torch.cat([output, embedded], -1)))

    def forward(
        self,
        logits: torch.Tensor,
        output: torch.Tensor,
        embedded: torch.Tensor,
        attention: torch.Tensor,
        src: torch.Tensor,
    ) -> torch.Tensor:
        """log P (B, T, V) in at least float32 from the vocabulary's ``logits`` (B, T, V), ``output`` o_t (B, T, D),
        ``embedded`` E y_{t-1} (B, T, E) and the ``attention`` α (B, T, S) over the source pieces ``src`` (B, S)
        (T: target positions, or the beams of a decoding step).

        Copying touches the S source pieces only: log P is log p_gen + log_softmax everywhere, and where a
        source piece w is, that plus softplus(log((1 − p_gen) Σ_{j: x_j = w} α_tj) − (log p_gen + log_softmax_w))
        = the log of the sum of both terms. Dense work over V is one log_softmax and one addition, as a plain
        output layer's loss has; a piece's copy mass sums its every occurrence, and only its first occurrence
        writes (duplicates add 0, so that their gradient is not counted twice)."""
        gate = self.gate_logit(output, embedded)
        vocabulary = F.log_softmax(_at_least_fp32(logits), -1)
        log_p = vocabulary + F.logsigmoid(gate)  # written in place below: nothing saved it for the backward pass
        same = src[:, :, None] == src[:, None, :]  # (B, S, S): x_j = x_k
        earlier = torch.ones_like(same[0]).tril(-1)  # k < j
        first = (src != PAD) & ~(same & earlier).any(-1)  # (B, S): the first occurrence of a real piece
        mass = attention.to(log_p.dtype) @ same.to(log_p.dtype)  # (B, T, S): Σ_{k: x_k = x_j} α_tk
        index = src[:, None, :].expand(attention.shape)
        generated = vocabulary.gather(-1, index) + F.logsigmoid(gate)
        copied = mass.clamp_min(_FLOOR).log() + F.logsigmoid(-gate)  # log(1 − p_gen) = logsigmoid(−gate)
        return log_p.scatter_add_(-1, index, F.softplus(copied - generated) * first[:, None, :])

    def copied_share(
        self,
        logits: torch.Tensor,
        output: torch.Tensor,
        embedded: torch.Tensor,
        attention: torch.Tensor,
        src: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """(B, T): the share of each ``target`` piece's probability that came through copying,
        (1 − p_gen) Σ_{j: x_j = y_t} α_tj / P(y_t), in [0, 1]; 0 for a piece not in the source. The other
        arguments as ``forward``'s."""
        log_p = self(logits, output, embedded, attention, src).gather(-1, target[..., None])[..., 0]
        mass = (attention.to(log_p.dtype) * (src[:, None, :] == target[..., None])).sum(-1)
        copied = mass.clamp_min(_FLOOR).log() + F.logsigmoid(-self.gate_logit(output, embedded))[..., 0]
        return torch.where(mass > 0, (copied - log_p).exp().clamp(max=1.0), 0.0)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 as float32 (the mixture's sums and logs), float64 as it is (gradcheck)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
