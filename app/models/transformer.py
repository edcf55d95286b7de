"""Transformer encoder-decoder (Vaswani et al. 2017) behind the common model API.

    encode(src, src_mask)             -> Memory
    decode(memory, tgt_in)            -> logits (B, T, V), attention (B, layers, heads, T, S) | None
    step(memory, prev_tokens, state)  -> logits (B, V),    attention (B, layers, heads, 1, S) | None, state

``step`` caches each decoder layer's self-attention keys/values and the projected encoder memory, so
a decoding step costs one token's worth of compute per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from app.config import ModelConfig
from app.data.tokenizer import PAD
from app.models.attention import MultiHeadAttention


@dataclass
class Memory:
    states: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor  # (B, S) True at real tokens

    def select(self, index: torch.Tensor) -> "Memory":
        """Rows ``index`` of the batch (beam search: expand per beam)."""
        return Memory(self.states.index_select(0, index), self.src_mask.index_select(0, index))


@dataclass
class DecoderState:
    position: int = 0
    self_kv: list = field(default_factory=list)  # per layer (k, v): (B, H, t, d_head)
    cross_kv: list = field(default_factory=list)  # per layer (k, v): (B, H, S, d_head), computed once

    def select(self, index: torch.Tensor) -> "DecoderState":
        """Rows ``index`` of the batch (beam search: follow the surviving beams)."""
        pick = lambda kv: [t.index_select(0, index) for t in kv]  # noqa: E731
        return DecoderState(self.position, [pick(kv) for kv in self.self_kv], [pick(kv) for kv in self.cross_kv])


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq)
    return pe


class FeedForward(nn.Sequential):
    def __init__(self, d_model: int, ff_dim: int, dropout: float, activation: str):
        act = {"relu": nn.ReLU(), "gelu": nn.GELU()}[activation]
        super().__init__(nn.Linear(d_model, ff_dim), act, nn.Dropout(dropout), nn.Linear(ff_dim, d_model))


class Sublayer(nn.Module):
    """Residual wrapper: pre-norm x + f(LN(x)) or post-norm LN(x + f(x))."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm, self.dropout, self.pre_norm = nn.LayerNorm(d_model), nn.Dropout(dropout), pre_norm

    def forward(self, x: torch.Tensor, fn) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, extra = fn(self.norm(x) if self.pre_norm else x)
        x = x + self.dropout(out)
        return (x if self.pre_norm else self.norm(x)), extra


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.dropout, cfg.activation)
        self.attn_block = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.ff_block = Sublayer(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x, _ = self.attn_block(x, lambda h: self.self_attn(h, h, mask=key_mask))
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.dropout, cfg.activation)
        self.self_block = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.cross_block = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.ff_block = Sublayer(cfg.d_model, cfg.dropout, pre)

    def forward(self, x, memory: torch.Tensor, key_mask, need_weights=False, self_kv=None, cross_kv=None):
        """Whole target (self_kv None, causal) or one cached step (self_kv = keys/values so far, with x)."""
        x, _ = self.self_block(
            x, lambda h: self.self_attn(h, mask=None, causal=self_kv is None, kv=_extend(self_kv, self.self_attn, h))
        )
        x, weights = self.cross_block(
            x, lambda h: self.cross_attn(h, memory, mask=key_mask, need_weights=need_weights, kv=cross_kv)
        )
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x, weights


def _extend(cache: Optional[list], attn: MultiHeadAttention, h: torch.Tensor):
    """Keys/values for self-attention: of ``h`` alone, or appended to the cache (a list, updated in place)."""
    k, v = attn.project_kv(h)
    if cache is None:
        return k, v
    if cache:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    cache[:] = [k, v]
    return k, v


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool):
        super().__init__()
        if cfg.norm not in ("pre", "post"):
            raise ValueError(f"model.norm={cfg.norm!r}: choose pre or post")
        if cfg.pos != "sinusoidal":
            raise ValueError(f"model.pos={cfg.pos!r}: only 'sinusoidal' is implemented")
        self.cfg, self.d_model = cfg, cfg.d_model
        self.max_positions = cfg.max_len  # decoding keeps inputs and outputs within the position table
        self.tgt_embed = nn.Embedding(tgt_vocab, cfg.d_model, padding_idx=PAD)
        share_src = cfg.tie_embeddings and joint_vocab
        self.src_embed = self.tgt_embed if share_src else nn.Embedding(src_vocab, cfg.d_model, padding_idx=PAD)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # pre-norm stacks end with a norm; post-norm layers already end normalized
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
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

    def embed(self, table: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        length = tokens.size(1)
        if offset + length > self.positions.size(0):
            raise ValueError(f"sequence of {offset + length} tokens exceeds model.max_len={self.positions.size(0)}")
        x = table(tokens) * math.sqrt(self.d_model) + self.positions[offset : offset + length]
        return self.embed_dropout(x)

    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> Memory:
        src_mask = src != PAD if src_mask is None else src_mask
        key_mask = src_mask[:, None, None, :]
        x = self.embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, key_mask)
        return Memory(self.enc_norm(x), src_mask)

    def decode(self, memory: Memory, tgt_in: torch.Tensor, need_attention: bool = False):
        x = self.embed(self.tgt_embed, tgt_in)
        key_mask = memory.src_mask[:, None, None, :]
        attention = []
        for layer in self.decoder:
            x, weights = layer(x, memory.states, key_mask, need_weights=need_attention)
            attention.append(weights)
        logits = self.out_proj(self.dec_norm(x))
        return logits, torch.stack(attention, dim=1) if need_attention else None

    def step(self, memory: Memory, prev_tokens: torch.Tensor, state: Optional[DecoderState], need_attention: bool = False):
        if state is None:
            state = DecoderState(
                0,
                [[] for _ in self.decoder],
                [layer.cross_attn.project_kv(memory.states) for layer in self.decoder],
            )
        x = self.embed(self.tgt_embed, prev_tokens[:, None], offset=state.position)
        key_mask = memory.src_mask[:, None, None, :]
        attention = []
        for layer, self_kv, cross_kv in zip(self.decoder, state.self_kv, state.cross_kv):
            x, weights = layer(x, None, key_mask, need_weights=need_attention, self_kv=self_kv, cross_kv=cross_kv)
            attention.append(weights)
        state.position += 1
        logits = self.out_proj(self.dec_norm(x))[:, 0]
        return logits, torch.stack(attention, dim=1) if need_attention else None, state

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (the training path: no attention weights materialized)."""
        return self.decode(self.encode(src), tgt_in)[0]
