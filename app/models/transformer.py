"""Transformer encoder-decoder (Vaswani et al. 2017) behind the common model API.

    encode(src, src_mask)             -> Memory
    decode(memory, tgt_in)            -> logits (B, T, V), attention (B, layers, heads, T, S) | None
    step(memory, prev_tokens, state)  -> logits (B, V),    attention (B, layers, heads, 1, S) | None, state

``step`` caches each decoder layer's self-attention keys/values and the projected encoder memory, so
a decoding step costs one token's worth of compute per layer.

Variants from the literature are settings of this one implementation (docs/transformer_variants.md):
model.pos (sinusoidal | learned | rope | alibi, app/models/positions.py), model.norm_type (layernorm |
rmsnorm), model.kv_heads (grouped-query / multi-query attention) and model.window (sliding-window
encoder self-attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from app.config import TransformerConfig
from app.data.tokenizer import PAD
from app.models.attention import MultiHeadAttention, band_mask
from app.models.positions import POSITIONS, ALiBi, LearnedPositions, Rotary, Rotation, SinusoidalPositions

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


@dataclass
class Memory:
    states: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor  # (B, S) True at real tokens

    def select(self, index: torch.Tensor) -> Memory:
        """Rows ``index`` of the batch (beam search: expand per beam)."""
        return Memory(self.states.index_select(0, index), self.src_mask.index_select(0, index))


@dataclass
class DecoderState:
    position: int = 0
    self_kv: list = field(default_factory=list)  # per layer (k, v): (B, kv_heads, t, d_head); RoPE keys rotated
    cross_kv: list = field(default_factory=list)  # per layer (k, v): (B, kv_heads, S, d_head), computed once

    def select(self, index: torch.Tensor) -> DecoderState:
        """Rows ``index`` of the batch (beam search: follow the surviving beams)."""
        pick = lambda kv: [t.index_select(0, index) for t in kv]  # noqa: E731
        return DecoderState(self.position, [pick(kv) for kv in self.self_kv], [pick(kv) for kv in self.cross_kv])

    def cache_bytes(self) -> int:
        """Bytes held by the cached keys and values (tensor metadata: no device sync)."""
        return sum(t.nbytes for kv in (*self.self_kv, *self.cross_kv) for t in kv)


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


def attention(cfg: TransformerConfig) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cfg.kv_heads)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = attention(cfg)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.dropout, cfg.activation)
        self.attn_block = Sublayer(cfg)
        self.ff_block = Sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        rotation: Optional[Rotation] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x, _ = self.attn_block(x, lambda h: self.self_attn(h, h, mask=mask, rotation=rotation, bias=bias))
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = attention(cfg)
        self.cross_attn = attention(cfg)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.dropout, cfg.activation)
        self.self_block = Sublayer(cfg)
        self.cross_block = Sublayer(cfg)
        self.ff_block = Sublayer(cfg)

    def forward(
        self,
        x,
        memory: torch.Tensor,
        key_mask,
        need_weights=False,
        self_kv=None,
        cross_kv=None,
        rotation: Optional[Rotation] = None,
        bias: Optional[torch.Tensor] = None,
    ):
        """Whole target (self_kv None, causal) or one cached step (self_kv = keys/values so far, with x).
        Positions (RoPE rotation, ALiBi bias) enter self-attention only: cross-attention has none."""
        x, _ = self.self_block(
            x,
            lambda h: self.self_attn(
                h,
                mask=None,
                causal=self_kv is None,
                rotation=rotation,
                bias=bias,
                kv=_extend(self_kv, self.self_attn, h, rotation),
            ),
        )
        x, weights = self.cross_block(
            x, lambda h: self.cross_attn(h, memory, mask=key_mask, need_weights=need_weights, kv=cross_kv)
        )
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x, weights


def _extend(cache: Optional[list], attn: MultiHeadAttention, h: torch.Tensor, rotation: Optional[Rotation]):
    """Keys/values for self-attention: of ``h`` alone, or appended to the cache (a list, updated in place)."""
    k, v = attn.project_kv(h, rotation)
    if cache is None:
        return k, v
    if cache:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    cache[:] = [k, v]
    return k, v


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool):
        super().__init__()
        if cfg.norm not in ("pre", "post"):
            raise ValueError(f"model.norm={cfg.norm!r}: choose pre or post")
        if cfg.norm_type not in NORMS:
            raise ValueError(f"model.norm_type={cfg.norm_type!r}: choose {' or '.join(NORMS)}")
        if cfg.pos not in POSITIONS:
            raise ValueError(f"model.pos={cfg.pos!r}: choose {', '.join(POSITIONS)}")
        if cfg.window < 0:
            raise ValueError(f"model.window={cfg.window}: a distance >= 1, or 0 to attend to the whole sentence")
        self.cfg, self.d_model = cfg, cfg.d_model
        # decoding keeps inputs and outputs within max_len: the table of absolute schemes, a bound for relative ones
        self.max_positions = cfg.max_len
        self.tgt_embed = nn.Embedding(tgt_vocab, cfg.d_model, padding_idx=PAD)
        share_src = cfg.tie_embeddings and joint_vocab
        self.src_embed = self.tgt_embed if share_src else nn.Embedding(src_vocab, cfg.d_model, padding_idx=PAD)
        absolute = {"sinusoidal": SinusoidalPositions, "learned": LearnedPositions}.get(cfg.pos)
        self.positions = absolute(cfg.max_len, cfg.d_model) if absolute else None
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        self.rotary = Rotary(cfg.d_model // cfg.heads) if cfg.pos == "rope" else None
        self.alibi = ALiBi(cfg.heads) if cfg.pos == "alibi" else None
        # pre-norm stacks end with a norm; post-norm layers already end normalized
        self.enc_norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()
        self.out_proj = nn.Linear(cfg.d_model, tgt_vocab, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.out_proj.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for embed in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(embed.weight, std=self.d_model**-0.5)
            with torch.no_grad():
                embed.weight[PAD].zero_()
        if isinstance(self.positions, LearnedPositions):
            nn.init.normal_(self.positions.table.weight, std=self.d_model**-0.5)

    def embed(self, table: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        x = table(tokens) * math.sqrt(self.d_model)
        if self.positions is not None:
            x = x + self.positions(offset, tokens.size(1))
        return self.embed_dropout(x)

    def relative_positions(self, offset: int, length: int) -> tuple[Optional[Rotation], Optional[torch.Tensor]]:
        """Self-attention's RoPE rotation and ALiBi bias for ``length`` tokens at positions offset..,
        against keys at 0 .. offset + length - 1 (None, None for absolute schemes)."""
        rotation = self.rotary(offset, length) if self.rotary is not None else None
        bias = self.alibi(offset, length, offset + length) if self.alibi is not None else None
        return rotation, bias

    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> Memory:
        src_mask = src != PAD if src_mask is None else src_mask
        mask = src_mask[:, None, None, :]
        if self.cfg.window:
            # a padding position with only padding within its window would have no key left (a NaN row
            # that spreads through the next layer's values): padding positions keep the whole sentence
            padding = ~src_mask[:, None, :, None]
            mask = mask & (band_mask(src.size(1), self.cfg.window, src.device) | padding)
        rotation, bias = self.relative_positions(0, src.size(1))
        x = self.embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, mask, rotation, bias)
        return Memory(self.enc_norm(x), src_mask)

    def decode(self, memory: Memory, tgt_in: torch.Tensor, need_attention: bool = False, layer: Optional[int] = None):
        """Teacher-forced logits and, with ``need_attention``, every layer's cross-attention; with
        ``layer`` instead, that layer's alone (batch, heads, tgt, src): the others keep the fast kernels."""
        x = self.embed(self.tgt_embed, tgt_in)
        key_mask = memory.src_mask[:, None, None, :]
        rotation, bias = self.relative_positions(0, tgt_in.size(1))
        only = None if layer is None else layer % len(self.decoder)
        attention = []
        for i, block in enumerate(self.decoder):
            weigh = need_attention or i == only
            x, weights = block(x, memory.states, key_mask, need_weights=weigh, rotation=rotation, bias=bias)
            attention.append(weights)
        logits = self.out_proj(self.dec_norm(x))
        if need_attention:
            return logits, torch.stack(attention, dim=1)
        return logits, None if only is None else attention[only]

    def step(
        self, memory: Memory, prev_tokens: torch.Tensor, state: Optional[DecoderState], need_attention: bool = False
    ):
        if state is None:
            state = DecoderState(
                0,
                [[] for _ in self.decoder],
                [layer.cross_attn.project_kv(memory.states) for layer in self.decoder],
            )
        x = self.embed(self.tgt_embed, prev_tokens[:, None], offset=state.position)
        key_mask = memory.src_mask[:, None, None, :]
        rotation, bias = self.relative_positions(state.position, 1)
        attention = []
        for layer, self_kv, cross_kv in zip(self.decoder, state.self_kv, state.cross_kv):
            x, weights = layer(
                x,
                None,
                key_mask,
                need_weights=need_attention,
                self_kv=self_kv,
                cross_kv=cross_kv,
                rotation=rotation,
                bias=bias,
            )
            attention.append(weights)
        state.position += 1
        logits = self.out_proj(self.dec_norm(x))[:, 0]
        return logits, torch.stack(attention, dim=1) if need_attention else None, state

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        alignment: bool = False,
    ):
        """Teacher-forced logits (the training path: no attention weights materialized); with
        ``alignment``, also the (batch, tgt, src) weights of the head guided alignment trains: head 0 of
        layer ``model.align_layer``. ``src_lengths`` is part of the common API (RNN encoders pack by it);
        padding masks serve here."""
        logits, weights = self.decode(self.encode(src), tgt_in, layer=self.cfg.align_layer if alignment else None)
        return (logits, weights[:, 0]) if alignment else logits
