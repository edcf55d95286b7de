"""Transformer encoder-decoder (Vaswani et al. 2017) behind the common model API.

    encode(src, src_mask)             -> Memory
    decode(memory, tgt_in)            -> logits (B, T, V), attention (B, layers, heads, T, S) | None
    start(memory, beam, steps)        -> DecoderState for ``beam`` consecutive rows per sentence
    step(memory, prev_tokens, state)  -> logits (rows, V), attention (rows, layers, heads, 1, S) | None, state

``step`` keeps each decoder layer's self-attention keys/values in a cache allocated once and written in
place, and the encoder memory's cross-attention keys/values, projected once per sentence (all layers in one
matrix multiply) and shared by its beams, whose queries attend together. A decoding step costs one
token's worth of compute per layer (docs/benchmarking.md, "Decoding speed").

Variants from the literature are settings of this one implementation (docs/transformer_variants.md):
model.pos (sinusoidal | learned | rope | alibi, app/models/positions.py), model.norm_type (layernorm |
rmsnorm), model.kv_heads (grouped-query / multi-query attention) and model.window (sliding-window
encoder self-attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.config import TransformerConfig
from app.data.tokenizer import PAD
from app.models.attention import MultiHeadAttention, attention_weights, band_mask
from app.models.decoder_state import DecoderState, Projection, StepWeights, beam_queries, beam_rows, grouped_queries
from app.models.positions import ALiBi, LearnedPositions, Rotary, Rotation, SinusoidalPositions

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


@dataclass
class Memory:
    states: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor  # (B, S) True at real tokens

    def select(self, index: torch.Tensor) -> Memory:
        """Rows ``index`` of the batch (beam search: expand per beam)."""
        return Memory(self.states.index_select(0, index), self.src_mask.index_select(0, index))


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
    ) -> torch.Tensor:
        x, _ = self.attn_block(x, lambda h: self.self_attn(h, mask=mask, rotation=rotation, bias=bias, batch=batch))
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x


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
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The whole target, causal (``step`` decodes one token), over the source's (B·S, D) ``memory`` rows.
        Positions (RoPE rotation, ALiBi bias) enter self-attention only: cross-attention has none."""
        x, _ = self.self_block(x, lambda h: self.self_attn(h, causal=True, rotation=rotation, bias=bias, batch=batch))
        x, weights = self.cross_block(
            x, lambda h: self.cross_attn(h, memory, mask=key_mask, need_weights=need_weights, batch=batch)
        )
        x, _ = self.ff_block(x, lambda h: (self.ff(h), None))
        return x, weights

    def step_weights(self, onednn: bool = False, dtype: Optional[torch.dtype] = None) -> StepWeights:
        """The layer's projections for decoding steps (read from the parameters when a decoding starts; ``dtype``:
        autocast's, if on)."""
        a, c, ff = self.self_attn, self.cross_attn, self.ff

        def projection(*linears: nn.Linear, activation: str = "none") -> Projection:
            weight, bias = torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])
            return Projection(weight, bias, onednn, dtype, activation)

        return StepWeights(
            projection(a.qkv_proj),
            projection(a.out_proj),
            projection(c.q_proj),
            projection(c.out_proj),
            projection(ff[0], activation="gelu" if isinstance(ff[1], nn.GELU) else "relu"),
            projection(ff[3]),
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


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool):
        super().__init__()
        # model.norm, norm_type and pos are choices the schema checked (app/config.py)
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
        # a fused projection is initialized block by block, each as the matrix it stands for (its own fans)
        blocks = {}
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                blocks.update(module.weight_blocks())
        for name, p in self.named_parameters():
            if p.dim() > 1:
                for block in blocks.get(p, (p,)):
                    nn.init.xavier_uniform_(block)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for embed in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(embed.weight, std=self.d_model**-0.5)
            with torch.no_grad():
                embed.weight[PAD].zero_()
        if isinstance(self.positions, LearnedPositions):
            nn.init.normal_(self.positions.table.weight, std=self.d_model**-0.5)

    def embed(self, table: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The (B, T) tokens as (B·T, D) rows, E y · √d_model plus their positions, dropped out. Built as rows, so
        that the first layer's input is no view (a compiled layer would compile again for a view)."""
        x = table(tokens.flatten()) * math.sqrt(self.d_model)
        if self.positions is not None:
            x = x + self.positions(offset, tokens.size(1)).repeat(tokens.size(0), 1)
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
        x = self.embed(self.src_embed, src)  # the layers work on (B·S, D) rows: no linear layer reshapes
        for layer in self.encoder:
            x = layer(x, src.size(0), mask, rotation, bias)
        return Memory(self.enc_norm(x).view(src.shape + (-1,)), src_mask)

    def decode(self, memory: Memory, tgt_in: torch.Tensor, need_attention: bool = False, layer: Optional[int] = None):
        """Teacher-forced logits and, with ``need_attention``, every layer's cross-attention; with
        ``layer`` instead, that layer's alone (batch, heads, tgt, src): the others keep the fast kernels."""
        batch = tgt_in.size(0)
        x = self.embed(self.tgt_embed, tgt_in)  # (B·T, D) rows, as the encoder's
        source = memory.states.flatten(0, 1)
        key_mask = memory.src_mask[:, None, None, :]
        rotation, bias = self.relative_positions(0, tgt_in.size(1))
        only = None if layer is None else layer % len(self.decoder)
        attention = []
        for i, block in enumerate(self.decoder):
            weigh = need_attention or i == only
            x, weights = block(x, batch, source, key_mask, need_weights=weigh, rotation=rotation, bias=bias)
            attention.append(weights)
        logits = self.out_proj(self.dec_norm(x)).view(tgt_in.shape + (-1,))
        if need_attention:
            return logits, torch.stack(attention, dim=1)
        return logits, None if only is None else attention[only]

    @torch.no_grad()
    def start(self, memory: Memory, beam: int = 1, steps: Optional[int] = None, onednn: bool = False) -> DecoderState:
        """The decoding state of ``beam`` consecutive rows per sentence of ``memory`` for at most ``steps`` steps
        (unknown: the cache grows as it fills). Computes every layer's cross-attention keys and values at once.
        ``onednn``: the steps' matrix multiplies on a CPU through oneDNN (``Projection``)."""
        sentences, src_len, _ = memory.states.shape
        device = memory.states.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        layers, attention = len(self.decoder), self.decoder[0].cross_attn
        kv_heads, d_head = attention.kv_heads, attention.d_head
        projections = [layer.cross_attn.kv_proj for layer in self.decoder]
        weight, bias = torch.cat([p.weight for p in projections]), torch.cat([p.bias for p in projections])
        cross = Projection(weight, bias, onednn)(memory.states.flatten(0, 1))
        # (sentences · S, layers · 2 · kv_heads · d_head) -> (layers, 2, sentences, kv_heads, S, d_head)
        cross = cross.view(sentences, src_len, layers, 2, kv_heads, d_head).permute(2, 3, 0, 4, 1, 5).contiguous()
        state = DecoderState(
            layers=layers,
            rows=sentences * beam,
            capacity=steps if steps is not None else 16,
            cross=cross,
            key_mask=memory.src_mask[:, None, None, :],
            beam=beam,
            weights=[layer.step_weights(onednn, dtype) for layer in self.decoder],
            output=Projection(self.out_proj.weight, None, onednn, dtype),
            embedding=self.tgt_embed.weight * math.sqrt(self.d_model),
            exact=beam > 1 and steps is not None,
        )
        state.cross_views()
        return state

    @torch.no_grad()
    def step(
        self, memory: Memory, prev_tokens: torch.Tensor, state: Optional[DecoderState], need_attention: bool = False
    ):
        """One token for every row: ``prev_tokens`` (rows,) -> next-token logits (rows, V). ``memory`` starts the
        state when there is none (one row per sentence, or ``rows / sentences`` beams each); the state holds what
        later steps need. Inference only: no dropout."""
        if state is None:
            state = self.start(memory, prev_tokens.size(0) // memory.states.size(0))
        if state.length == state.capacity:
            state.make_room()
        span = state.length + 1
        x = F.embedding(prev_tokens, state.embedding)  # E y · √d_model
        if self.positions is not None:
            x = x + self.positions.at(state.position)
        rotation = self.rotary.at(state.position) if self.rotary is not None else None
        self_mask = None
        if self.alibi is not None:  # heads grouped as the queries are (grouped_queries)
            self_mask = self.alibi.at(state.position, span).view(self.decoder[0].self_attn.kv_heads, -1, span)
        attention = []
        for layer, cache, cross, weights in zip(self.decoder, state.layers, state.cross_layers, state.weights):
            x, layer_attention = layer.step(
                x, cache, cross, state, weights, span, self_mask, rotation, need_weights=need_attention
            )
            attention.append(layer_attention)
        state.position += 1
        state.length += 1
        logits = state.output(self.dec_norm(x))
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
