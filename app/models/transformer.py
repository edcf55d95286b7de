"""Transformer encoder-decoder (Vaswani et al. 2017) behind the common model API.

    encode(src, src_mask)             -> Memory
    decode(memory, tgt_in)            -> logits (B, T, V), attention (B, layers, heads, T, S) | None
    self_attention(src, tgt_in)       -> SelfAttention: encoder (B, layers, heads, S, S), decoder (.., T, T)
    start(memory, beam, steps)        -> DecoderState for ``beam`` consecutive rows per sentence
    step(memory, prev_tokens, state)  -> logits (rows, V), attention (rows, layers, heads, 1, S) | None, state

``step`` keeps each decoder layer's self-attention keys/values in a cache allocated once and written in
place, and the encoder memory's cross-attention keys/values, projected once per sentence (all layers in one
matrix multiply) and shared by its beams, whose queries attend together. A decoding step costs one
token's worth of compute per layer (docs/benchmarking.md, "Decoding speed"). The layers:
app/models/transformer_layers.py.

Variants from the literature are settings of this one implementation (docs/transformer_variants.md):
model.pos (sinusoidal | learned | rope | alibi, app/models/positions.py), model.norm_type (layernorm |
rmsnorm), model.kv_heads (grouped-query / multi-query attention) and model.window (sliding-window
encoder self-attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from app.config.schema import TransformerConfig
from app.data.tokenizer import PAD
from app.models.api import SelfAttention, Seq2Seq
from app.models.attention import MultiHeadAttention, band_mask
from app.models.copy import PointerGenerator
from app.models.decoder_state import DecoderState, Projection
from app.models.positions import ALiBi, LearnedPositions, Rotary, Rotation, SinusoidalPositions
from app.models.transformer_layers import DecoderLayer, EncoderLayer, make_norm


@dataclass
class Memory:
    states: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor  # (B, S) True at real tokens
    src: torch.Tensor  # (B, S) the source pieces (what model.copy_attention copies)

    def select(self, index: torch.Tensor) -> Memory:
        """Rows ``index`` of the batch (beam search: expand per beam)."""
        return Memory(*(t.index_select(0, index) for t in (self.states, self.src_mask, self.src)))


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool):
        super().__init__()
        # model.norm, norm_type and pos are choices the schema checked (app/config/schema.py)
        if cfg.window < 0:
            raise ValueError(f"model.window={cfg.window}: a distance >= 1, or 0 to attend to the whole sentence")
        self.cfg, self.d_model = cfg, cfg.d_model
        # decoding keeps inputs and outputs within max_len: the table of absolute schemes, a bound for relative ones
        self.max_positions = cfg.max_len
        self.tgt_embed = nn.Embedding(tgt_vocab, cfg.d_model, padding_idx=PAD)
        share_src = cfg.tie_embeddings and joint_vocab
        self.src_embed = self.tgt_embed if share_src else nn.Embedding(src_vocab, cfg.d_model, padding_idx=PAD)
        absolute: dict[str, type[SinusoidalPositions | LearnedPositions]]
        absolute = {"sinusoidal": SinusoidalPositions, "learned": LearnedPositions}
        self.positions = absolute[cfg.pos](cfg.max_len, cfg.d_model) if cfg.pos in absolute else None
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        self.rotary = Rotary(cfg.d_model // cfg.heads) if cfg.pos == "rope" else None
        self.alibi = ALiBi(cfg.heads) if cfg.pos == "alibi" else None
        # pre-norm stacks end with a norm; post-norm layers already end normalized
        self.enc_norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()
        self.out_proj = nn.Linear(cfg.d_model, tgt_vocab, bias=False)
        if cfg.copy_attention and not joint_vocab:
            raise ValueError(
                "model.copy_attention=true copies source pieces as target pieces: set tokenizer.joint=true"
            )
        # the pointer-generator reads model.align_layer's cross-attention, its heads averaged
        self.pointer = PointerGenerator(cfg.d_model, cfg.d_model) if cfg.copy_attention else None
        self.pointer_layer = cfg.align_layer % cfg.dec_layers
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
        return self.encoder_pass(src, src_mask)[0]

    def encoder_pass(
        self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None, need_weights: bool = False
    ) -> tuple[Memory, Optional[torch.Tensor]]:
        """The memory and, with ``need_weights``, every layer's self-attention (B, layers, heads, S, S)."""
        src_mask = src != PAD if src_mask is None else src_mask
        mask = src_mask[:, None, None, :]
        if self.cfg.window:
            # a padding position with only padding within its window would have no key left (a NaN row
            # that spreads through the next layer's values): padding positions keep the whole sentence
            padding = ~src_mask[:, None, :, None]
            mask = mask & (band_mask(src.size(1), self.cfg.window, src.device) | padding)
        rotation, bias = self.relative_positions(0, src.size(1))
        x = self.embed(self.src_embed, src)  # the layers work on (B·S, D) rows: no linear layer reshapes
        weights = []
        for layer in self.encoder:
            x, layer_weights = layer(x, src.size(0), mask, rotation, bias, need_weights=need_weights)
            weights.append(layer_weights)
        memory = Memory(self.enc_norm(x).view(src.shape + (-1,)), src_mask, src)
        return memory, torch.stack(weights, dim=1) if need_weights else None

    def decode(
        self,
        memory: Memory,
        tgt_in: torch.Tensor,
        need_attention: bool = False,
        layer: Optional[int] = None,
        need_logits: bool = True,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Teacher-forced logits and, with ``need_attention``, every layer's cross-attention; with
        ``layer`` instead, that layer's alone (batch, heads, tgt, src): the others keep the fast kernels.
        ``need_logits=False``: the attention alone, without the output layer (logits None). With
        ``model.copy_attention`` the logits are log P of the pointer-generator (app/models/copy.py)."""
        only = None if layer is None else layer % len(self.decoder)
        copying = self.pointer is not None and need_logits
        x, attention, _ = self.decoder_pass(
            memory, tgt_in, lambda i: need_attention or i == only or (copying and i == self.pointer_layer)
        )
        logits = None
        if need_logits:
            logits, *copying_inputs = self.outputs(x, tgt_in, attention)
            if self.pointer is not None:
                logits = self.pointer(logits, *copying_inputs, memory.src)
        if need_attention:
            return logits, stack_layers(attention)
        return logits, None if only is None else attention[only]

    def outputs(
        self, x: torch.Tensor, tgt_in: torch.Tensor, attention: list[Optional[torch.Tensor]]
    ) -> tuple[torch.Tensor, ...]:
        """The logits (B, T, V) of the decoder's last (B·T, D) rows ``x``, fed ``tgt_in`` (B, T); with the
        pointer-generator also what it reads besides: those rows normalized (B, T, D), the embedded inputs
        E y_{t-1} · √d_model and model.align_layer's cross-attention, its heads averaged (B, T, S)."""
        output = self.dec_norm(x)
        logits = self.out_proj(output).view(tgt_in.shape + (-1,))
        if self.pointer is None:
            return (logits,)
        copied = attention[self.pointer_layer]
        assert copied is not None  # asked for
        embedded = self.tgt_embed(tgt_in) * math.sqrt(self.d_model)
        return logits, output.view(embedded.shape), embedded, copied.mean(1)

    @torch.no_grad()
    def copy_shares(self, memory: Memory, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, T): the share of each ``tgt_out`` piece's probability that came through copying, teacher-forced on
        ``tgt_in`` (app/models/copy.py); None for a model that does not copy."""
        if self.pointer is None:
            return None
        x, attention, _ = self.decoder_pass(memory, tgt_in, lambda i: i == self.pointer_layer)
        logits, output, embedded, copied = self.outputs(x, tgt_in, attention)
        return self.pointer.copied_share(logits, output, embedded, copied, memory.src, tgt_out)

    def decoder_pass(
        self,
        memory: Memory,
        tgt_in: torch.Tensor,
        cross_weights: Callable[[int], bool],
        need_self_weights: bool = False,
    ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
        """The decoder's last (B·T, D) rows, per layer its cross-attention weights (B, heads, T, S) where
        ``cross_weights(layer index)`` asks for them (else None), and with ``need_self_weights`` its
        self-attention weights (B, heads, T, T)."""
        batch = tgt_in.size(0)
        x = self.embed(self.tgt_embed, tgt_in)  # (B·T, D) rows, as the encoder's
        source = memory.states.flatten(0, 1)
        key_mask = memory.src_mask[:, None, None, :]
        rotation, bias = self.relative_positions(0, tgt_in.size(1))
        cross, own = [], []
        for i, block in enumerate(self.decoder):
            x, weights, self_weights = block(
                x, batch, source, key_mask, cross_weights(i), rotation, bias, need_self_weights=need_self_weights
            )
            cross.append(weights)
            own.append(self_weights)
        return x, cross, own

    @torch.no_grad()
    def self_attention(self, src: torch.Tensor, tgt_in: torch.Tensor) -> SelfAttention:
        """The self-attention of the encoder over ``src`` and of the decoder fed ``tgt_in`` (teacher forcing):
        what the attention views show beside the cross-attention. No logits are computed."""
        memory, encoder = self.encoder_pass(src, need_weights=True)
        _, _, decoder = self.decoder_pass(memory, tgt_in, lambda i: False, need_self_weights=True)
        assert encoder is not None  # asked for
        return SelfAttention(encoder, stack_layers(decoder))

    @torch.no_grad()
    def start(self, memory: Memory, beam: int = 1, steps: Optional[int] = None, onednn: bool = False) -> DecoderState:
        """The decoding state of ``beam`` consecutive rows per sentence of ``memory`` for at most ``steps`` steps
        (unknown: the cache grows as it fills). Computes every layer's cross-attention keys and values at once.
        ``onednn``: the steps' matrix multiplies on a CPU through oneDNN (``Projection``)."""
        sentences, src_len, _ = memory.states.shape
        device = memory.states.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        decoder = self.decoder_layers
        layers, attention = len(decoder), decoder[0].cross_attn
        kv_heads, d_head = attention.kv_heads, attention.d_head
        projections = [layer.cross_attn.kv_proj for layer in decoder]
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
            weights=[layer.step_weights(onednn, dtype) for layer in decoder],
            output=Projection(self.out_proj.weight, None, onednn, dtype),
            embedding=self.tgt_embed.weight * math.sqrt(self.d_model),
            exact=beam > 1 and steps is not None,
            source=memory.src if self.pointer is not None else None,
        )
        state.cross_views()
        return state

    @torch.no_grad()
    def step(
        self, memory: Memory, prev_tokens: torch.Tensor, state: Optional[DecoderState], need_attention: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], DecoderState]:
        """One token for every row: ``prev_tokens`` (rows,) -> next-token logits (rows, V). ``memory`` starts the
        state when there is none (one row per sentence, or ``rows / sentences`` beams each); the state holds what
        later steps need. Inference only: no dropout."""
        if state is None:
            state = self.start(memory, prev_tokens.size(0) // memory.states.size(0))
        if state.length == state.capacity:
            state.make_room()
        span = state.length + 1
        x = embedded = F.embedding(prev_tokens, state.embedding)  # E y · √d_model
        if self.positions is not None:
            x = x + self.positions.at(state.position)
        rotation = self.rotary.at(state.position) if self.rotary is not None else None
        self_mask, decoder = None, self.decoder_layers
        if self.alibi is not None:  # heads grouped as the queries are (grouped_queries)
            self_mask = self.alibi.at(state.position, span).view(decoder[0].self_attn.kv_heads, -1, span)
        attention = []
        for i, (layer, cache, cross, weights) in enumerate(
            zip(decoder, state.layers, state.cross_layers, state.weights)
        ):
            weighed = need_attention or (self.pointer is not None and i == self.pointer_layer)
            x, layer_attention = layer.step(x, cache, cross, state, weights, span, self_mask, rotation, weighed)
            attention.append(layer_attention)
        state.position += 1
        state.length += 1
        output = self.dec_norm(x)
        logits = state.output(output)
        if self.pointer is not None:
            copied, source = attention[self.pointer_layer], state.source
            assert copied is not None and source is not None  # asked for; start keeps the source when copying
            # rows are ``beam`` consecutive rows per sentence: (sentences, beam, ...) against each sentence's source
            per_sentence = lambda t: t.view(source.size(0), -1, t.size(-1))  # noqa: E731
            mixed = self.pointer(
                per_sentence(logits),
                per_sentence(output),
                per_sentence(embedded),
                per_sentence(copied[:, :, 0].mean(1)),
                source,
            )
            logits = mixed.view(logits.shape)
        return logits, stack_layers(attention) if need_attention else None, state

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
        if not alignment:
            return logits
        assert weights is not None  # the layer's, asked for
        return logits, weights[:, 0]

    def parts(self) -> dict[str, list[nn.Module]]:
        """What ``train.freeze`` names (app/train/freeze.py): the token tables, the output projection tied to them
        and learned positions; the encoder's layers and norm; the decoder's layers, norm, output projection
        (when untied) and pointer."""
        return {
            "embeddings": [self.src_embed, self.tgt_embed, *([self.positions] if self.positions is not None else [])],
            "encoder": [self.encoder, self.enc_norm],
            "decoder": [
                self.decoder,
                self.dec_norm,
                self.out_proj,
                *([self.pointer] if self.pointer is not None else []),
            ],
        }

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """The decoder's layers, as what they are (an nn.ModuleList holds modules of any type)."""
        return cast("Sequence[DecoderLayer]", self.decoder)


def stack_layers(weights: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """Every layer's attention weights, asked of each, as one (batch, layers, ...) tensor."""
    asked = [w for w in weights if w is not None]
    assert len(asked) == len(weights), "a layer did not return the weights asked for"
    return torch.stack(asked, dim=1)


_API: type[Seq2Seq[Memory, DecoderState]] = Transformer  # mypy checks the family against the model API
