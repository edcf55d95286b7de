"""The attention family.

Every module returns the context vectors and, when asked, the attention weights: a distribution over
key positions for every query (rows sum to 1, masked keys get exactly 0).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# cuDNN's SDPA backend builds an execution plan for every new shape (~4 ms of CPU per call, ~0.4 s per
# training step when batch shapes vary, as length-bucketed batches do). Flash / memory-efficient
# kernels need no plans, so leave those to the dispatcher.
torch.backends.cuda.enable_cudnn_sdp(False)


def attention_weights(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last axis with masked positions (mask == False) at exactly zero weight."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # softmax in at least fp32: under bf16 autocast the weights are what gets plotted and summed
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(scores.dtype)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product multi-head attention (Vaswani et al. 2017, "Attention Is All You Need", eq. 1):

        Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V,   head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V),
        MultiHead(Q, K, V) = Concat(head_1 … head_h) W^O.

    The fast path calls ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU)
    and never materializes the weights; ``need_weights=True`` computes them explicitly instead, for
    plots and alignments. Both paths compute the same function.
    """

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.heads={heads}")
        self.heads, self.d_head, self.dropout = heads, d_model // heads, dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, d_head)
        return x.unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(
        self,
        query: torch.Tensor,  # (B, Tq, D)
        key_value: Optional[torch.Tensor] = None,  # (B, Tk, D); None when k/v are given
        mask: Optional[torch.Tensor] = None,  # bool, broadcastable to (B, H, Tq, Tk); True = may attend
        causal: bool = False,
        need_weights: bool = False,
        kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # precomputed (B, H, Tk, d_head) keys/values
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        q = self.split_heads(self.q_proj(query))
        k, v = kv if kv is not None else self.project_kv(key_value)
        dropout = self.dropout if self.training else 0.0
        if not need_weights:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
            weights = None
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
            if causal:
                causal_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
                mask = causal_mask if mask is None else mask & causal_mask
            weights = attention_weights(scores, mask)
            context = F.dropout(weights, dropout) @ v
        return self.out_proj(context.transpose(1, 2).flatten(-2)), weights
