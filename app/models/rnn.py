"""RNN encoder-decoders behind the common model API (encode / decode / step): the encoder and one of the
decoders of app/models/rnn_layers.py (none, Bahdanau, Luong), and with ``model.copy_attention`` the
pointer-generator over the decoder's attention (app/models/copy.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from app.config.schema import RNNConfig
from app.data.tokenizer import PAD
from app.models.api import Seq2Seq
from app.models.copy import PointerGenerator
from app.models.rnn_layers import DECODERS, RNNEncoder, RNNMemory, RNNState


class RNNSeq2Seq(nn.Module):
    def __init__(self, cfg: RNNConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool):
        super().__init__()
        # model.cell and model.attention are choices the schema checked (app/config/schema.py)
        self.cfg = cfg
        tgt_embed = nn.Embedding(tgt_vocab, cfg.emb_dim, padding_idx=PAD)
        share_src = cfg.tie_embeddings and joint_vocab
        src_embed = tgt_embed if share_src else nn.Embedding(src_vocab, cfg.emb_dim, padding_idx=PAD)
        self.encoder = RNNEncoder(cfg, src_embed)
        self.decoder = DECODERS[cfg.attention](cfg, tgt_embed, tgt_vocab)
        if cfg.copy_attention and not joint_vocab:
            raise ValueError(
                "model.copy_attention=true copies source pieces as target pieces: set tokenizer.joint=true"
            )
        # the pointer-generator: p_gen from what the output layer reads and E y_{t-1}
        out_dim = self.decoder.out_proj.in_features
        self.pointer = PointerGenerator(out_dim, cfg.emb_dim) if cfg.copy_attention else None
        for name, p in self.named_parameters():
            if "embed" in name:
                nn.init.normal_(p, std=cfg.emb_dim**-0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            else:  # biases, and the coverage's w_c: at 0 the model computes what it does without the mechanism
                nn.init.zeros_(p)
        with torch.no_grad():
            src_embed.weight[PAD].zero_()
            tgt_embed.weight[PAD].zero_()

    def parts(self) -> dict[str, list[nn.Module]]:
        """What ``train.freeze`` names (app/train/freeze.py): the token tables (and the output projection tied to
        them); the encoder's RNN; the decoder's RNN, attention, bridge and output layers, and pointer."""
        return {
            "embeddings": [self.encoder.embed, self.decoder.embed],
            "encoder": [self.encoder],
            "decoder": [self.decoder, *([self.pointer] if self.pointer is not None else [])],
        }

    def encode(
        self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None, src_lengths: Optional[torch.Tensor] = None
    ) -> RNNMemory:
        src_mask = src != PAD if src_mask is None else src_mask
        states, summary = self.encoder(src, src_mask, src_lengths)
        attention = getattr(self.decoder, "attention", None)
        keys = attention.prepare(states) if attention is not None else None
        return RNNMemory(states, src_mask, summary, keys, src)

    def decode(
        self, memory: RNNMemory, tgt_in: torch.Tensor, need_attention: bool = False, need_logits: bool = True
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Teacher-forced logits and, with ``need_attention``, the attention (batch, tgt, src); ``need_logits=False``:
        the attention alone, without the output layer (logits None). With ``model.copy_attention`` the logits are
        log P of the pointer-generator (app/models/copy.py)."""
        copying = self.pointer is not None and need_logits
        initial = self.decoder.initial_state(memory)
        out, attention, _ = self.decoder(memory, tgt_in, initial, need_attention or copying)
        if not need_logits:
            return None, attention
        return self.output(out, tgt_in, attention, memory.src), attention if need_attention else None

    def output(
        self, out: torch.Tensor, tokens: torch.Tensor, attention: Optional[torch.Tensor], src: torch.Tensor
    ) -> torch.Tensor:
        """The logits of the decoder's outputs ``out`` (B, T, D) fed ``tokens`` (B, T): with the pointer-generator,
        log P mixing them with the ``attention`` (B, T, S) over the pieces ``src`` (B, S)."""
        logits = self.decoder.out_proj(out)
        if self.pointer is None:
            return logits
        assert attention is not None  # asked for when copying
        return self.pointer(logits, out, self.decoder.embed(tokens), attention, src)

    @torch.no_grad()
    def copy_shares(self, memory: RNNMemory, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, T): the share of each ``tgt_out`` piece's probability that came through copying, teacher-forced on
        ``tgt_in`` (app/models/copy.py); None for a model that does not copy."""
        if self.pointer is None:
            return None
        out, attention, _ = self.decoder(memory, tgt_in, self.decoder.initial_state(memory), True)
        logits, embedded = self.decoder.out_proj(out), self.decoder.embed(tgt_in)
        return self.pointer.copied_share(logits, out, embedded, attention, memory.src, tgt_out)

    def start(self, memory: RNNMemory, beam: int = 1, steps: Optional[int] = None, onednn: bool = False) -> RNNState:
        """The decoding state of ``beam`` consecutive rows per sentence of ``memory`` (``steps`` and ``onednn``: the
        API's, unused: an RNN's state does not grow, and its steps are many small operations)."""
        if beam > 1:
            memory = memory.select(
                torch.arange(memory.states.size(0), device=memory.states.device).repeat_interleave(beam)
            )
        state = self.decoder.initial_state(memory)
        state.memory = memory
        return state

    def step(
        self, memory: RNNMemory, prev_tokens: torch.Tensor, state: Optional[RNNState], need_attention: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], RNNState]:
        """One token for every row; ``memory`` starts the state when there is none (the state then holds it)."""
        state = self.start(memory, prev_tokens.size(0) // memory.states.size(0)) if state is None else state
        rows = state.memory
        assert rows is not None  # start keeps it
        out, attention, new = self.decoder(
            rows, prev_tokens[:, None], state, need_attention or self.pointer is not None
        )
        new.memory = rows
        logits = self.output(out, prev_tokens[:, None], attention, rows.src)[:, 0]
        return logits, attention if need_attention else None, new

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        alignment: bool = False,
    ):
        """Teacher-forced logits; with ``alignment``, also the attention (batch, tgt, src)."""
        logits, attention = self.decode(self.encode(src, src_lengths=src_lengths), tgt_in, need_attention=alignment)
        return (logits, attention) if alignment else logits


_API: type[Seq2Seq[RNNMemory, RNNState]] = RNNSeq2Seq  # mypy checks the family against the model API
