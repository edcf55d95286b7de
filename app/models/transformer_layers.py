"""The Transformer's layers (Vaswani et al. 2017): the residual blocks, the encoder layer (self-attention,
feed-forward) and the decoder layer (causal self-attention, attention to the source, feed-forward) with its
cached decoding step. app/models/transformer.py stacks them behind the model API."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.config.schema import TransformerConfig
from app.models.attention import MultiHeadAttention, attention_weights
from app.models.decoder_state import DecoderState, Projection, StepWeights, beam_queries, beam_rows, grouped_queries
from app.models.positions import Rotation

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


class FeedForward(nn.Sequential):
    def __init__(self, d_model: int, ff_dim: int, dropout: float, activation: str):
        act = {"relu": nn.ReLU(), "gelu": nn.GELU()}[activation]
        super().__init__(nn.Linear(d_model, ff_dim), act, nn.Dropout(dropout), nn.Linear(ff_dim, d_model))


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019): x / RMS(x) · g, no centring, no bias."""
    return NORMS[cfg.norm_type](cfg.d_model, eps=1e-5)


class Sublayer(nn.Module):
    """Residual wrapper: pre-norm x + f(N(x)) or post-norm N(x + f(x)), N = LayerNorm or RMSNorm."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm, self.dropout, self.pre_norm = make_norm(cfg), nn.Dropout(cfg.dropout), cfg.norm == "pre"

    def forward(self, x: torch.Tensor, fn) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, extra = fn(self.norm(x) if self.pre_norm else x)
        x = x + self.dropout(out)
        return (x if self.pre_norm else self.norm(x)), extra

    def residual(self, x: torch.Tensor, fn, with_extra: bool = False):
        """``forward`` in inference (no dropout), for a decoding step: ``fn(h, x)`` returns x + f(h), its last
        projection adding the residual x."""
        out = fn(self.norm(x) if self.pre_norm else x, x)
        out, extra = out if with_extra else (out, None)
        out = out if self.pre_norm else self.norm(out)
        return (out, extra) if with_extra else out


def attention(cfg: TransformerConfig, self_attention: bool) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cfg.kv_heads, self_attention)


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward over the source's (B·S, D) rows."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = attention(cfg, self_attention=True)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.activation_dropout, cfg.activation)
        self.attn_block = Sublayer(cfg)
        self.ff_block = Sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        batch: int,
        mask: torch.Tensor,
        rotation: Optional[Rotation] = None,
        bias: Optional[torch.Tensor] = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The layer's output and, with ``need_weights``, its self-attention weights (B, heads, S, S)."""
        x, weights = self.attn_block(
            x,
            lambda h: self.self_attn(
                h, mask=mask, need_weights=need_weights, rotation=rotation, bias=bias, batch=batch
            ),
        )
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x, weights


class DecoderLayer(nn.Module):
    """Causal self-attention, attention to the source, feed-forward: over the target's (B·T, D) rows."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = attention(cfg, self_attention=True)
        self.cross_attn = attention(cfg, self_attention=False)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.activation_dropout, cfg.activation)
        self.self_block = Sublayer(cfg)
        self.cross_block = Sublayer(cfg)
        self.ff_block = Sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        batch: int,
        memory: torch.Tensor,
        key_mask: torch.Tensor,
        need_weights: bool = False,
        rotation: Optional[Rotation] = None,
        bias: Optional[torch.Tensor] = None,
        need_self_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The whole target, causal (``step`` decodes one token), over the source's (B·S, D) ``memory`` rows:
        the output, with ``need_weights`` the cross-attention weights (B, heads, T, S), with ``need_self_weights``
        the self-attention's (B, heads, T, T). Positions (RoPE rotation, ALiBi bias) enter self-attention
        only: cross-attention has none."""
        x, self_weights = self.self_block(
            x,
            lambda h: self.self_attn(
                h, causal=True, need_weights=need_self_weights, rotation=rotation, bias=bias, batch=batch
            ),
        )
        x, weights = self.cross_block(
            x, lambda h: self.cross_attn(h, memory, mask=key_mask, need_weights=need_weights, batch=batch)
        )
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x, weights, self_weights

    def step_weights(self, onednn: bool = False, dtype: Optional[torch.dtype] = None) -> StepWeights:
        """The layer's projections for decoding steps (read from the parameters when a decoding starts; ``dtype``:
        autocast's, if on)."""
        a, c, ff = self.self_attn, self.cross_attn, self.ff
        inner, outer = ff[0], ff[3]
        assert isinstance(inner, nn.Linear) and isinstance(outer, nn.Linear)  # FeedForward's

        def projection(*linears: nn.Linear, activation: str = "none") -> Projection:
            weight, bias = torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])
            return Projection(weight, bias, onednn, dtype, activation)

        return StepWeights(
            projection(a.qkv_proj),
            projection(a.out_proj),
            projection(c.q_proj),
            projection(c.out_proj),
            projection(inner, activation="gelu" if isinstance(ff[1], nn.GELU) else "relu"),
            projection(outer),
        )

    def step(
        self,
        x: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        cross: tuple[torch.Tensor, torch.Tensor],
        state: DecoderState,
        weights: StepWeights,
        span: int,
        self_mask: Optional[torch.Tensor],
        rotation: Optional[Rotation],
        need_weights: bool,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token per row, x (rows, D), in inference: the keys and values of x go into the ``cache``'s
        (keys, values), (rows, kv_heads, capacity, d_head) each, at ``state.position``; its query attends over
        the first ``span`` positions (``self_mask``: ALiBi's float bias, or None), then over the source's
        ``cross`` keys and values (sentences, kv_heads, S, d_head)."""
        heads, kv_heads, d_head = self.self_attn.heads, self.self_attn.kv_heads, self.self_attn.d_head
        rows = x.size(0)

        def attend_self(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            qkv = weights.qkv(h).view(rows, heads + 2 * kv_heads, 1, d_head)
            if rotation is None:
                q, new_k, new_v = qkv.split([heads, kv_heads, kv_heads], 1)
            else:  # RoPE: queries and keys turn by the angle of their position, values do not
                qk, new_v = qkv.split([heads + kv_heads, kv_heads], 1)
                q, new_k = rotation(qk).split([heads, kv_heads], 1)
            keys, values = cache
            keys.index_copy_(2, state.position, new_k)
            values.index_copy_(2, state.position, new_v)
            k, v = (keys, values) if span == keys.size(2) else (keys.narrow(2, 0, span), values.narrow(2, 0, span))
            context = F.scaled_dot_product_attention(grouped_queries(q, kv_heads), k, v, attn_mask=self_mask)
            return weights.self_out(context.reshape(rows, -1), residual)

        def attend_source(h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            q = beam_queries(weights.cross_q(h), state.beam, kv_heads, d_head)
            k, v = cross
            if need_weights:
                attention = attention_weights(q @ k.transpose(-2, -1) / math.sqrt(d_head), state.key_mask)
                context = attention @ v
                attention = beam_rows(attention, state.beam, kv_heads).view(rows, heads, 1, -1)
            else:
                context, attention = F.scaled_dot_product_attention(q, k, v, attn_mask=state.key_mask), None
            return weights.cross_out(beam_rows(context, state.beam, kv_heads), residual), attention

        x = self.self_block.residual(x, attend_self)
        x, attention = self.cross_block.residual(x, attend_source, with_extra=True)
        x = self.ff_block.residual(x, lambda h, residual: weights.ff_out(weights.ff_in(h), residual))
        return x, attention
