"""The one FLOP count of a training step, shared by ``make bench`` and the training log (MFU).

Model FLOPs utilisation (MFU) counts the useful (non-padding) work of a training step as
    6 × (P_enc · source tokens + P_dec · target tokens) + attention
where P_enc, P_dec are the matrix-multiply parameters applied once per source / target token (the output
projection included, embedding lookups not) and the factor 6 is 2 FLOPs per multiply-add times forward
plus a backward twice as costly (Kaplan et al. 2020). Attention adds 12 · width FLOPs per (query, key)
pair and layer: QKᵀ and the weighted sum of values, forward and backward. MFU is that count per second
over the device's peak dense bf16 rate. Weights that train.freeze froze are counted for what their backward
still computes (``FlopCounter.backward_shares``). For RNN attention the key projection (Bahdanau U, Luong general
W_a) runs once per source token but is counted per target token: a small overcount when targets are
longer than sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from torch import nn

from app.config.schema import TransformerConfig
from app.models import Family

# dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched on the device name
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "RTX 4090": 165e12}


def matmul_parameters(module: nn.Module, trained: Optional[bool] = None) -> int:
    """Weights used in a matrix multiply (Linear layers, RNN input/recurrent matrices), each once; ``trained``: only
    those that train (True) or only those train.freeze froze (False)."""
    seen, total = set(), 0
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.RNNBase)):
            for p in m.parameters(recurse=False):
                if p.dim() == 2 and id(p) not in seen and trained in (None, p.requires_grad):
                    seen.add(id(p))
                    total += p.numel()
    return total


class FlopCounter:
    """Useful FLOPs of training steps of one model, from the lengths of their sentences (EOS/BOS
    included): ``counter(src_lens, tgt_lens)``."""

    def __init__(self, model: Family):
        cfg = model.cfg
        self.p_enc = matmul_parameters(model.encoder)
        self.p_dec = matmul_parameters(model) - self.p_enc
        self.enc_weights, self.dec_weights, self.enc_pairs, self.dec_pairs = self.backward_shares(model)
        self.transformer = isinstance(cfg, TransformerConfig)
        self.window, self.enc_layers, self.dec_layers, self.rnn_attention = 0, 0, 0, False
        if isinstance(cfg, TransformerConfig):
            self.window, self.width = cfg.window, cfg.d_model
            self.enc_layers, self.dec_layers = cfg.enc_layers, cfg.dec_layers
        else:
            self.width, self.rnn_attention = cfg.hidden, cfg.attention != "none"

    def backward_shares(self, model: Family) -> tuple[float, float, float, float]:
        """FLOPs per token of the encoder's and the decoder's weights (6 × P when all train), and per (query, key)
        pair and width of their attention (12 when it is back-propagated). A weight train.freeze froze costs its
        forward (2) and, where something below it trains, the gradient of its input (2 more), not its own; a part
        with nothing trainable in or below it runs forward only (Transformer attention: 4)."""
        enc_frozen = matmul_parameters(model.encoder, trained=False)
        dec_frozen = matmul_parameters(model, trained=False) - enc_frozen
        embeddings = any(p.requires_grad for m in model.parts()["embeddings"] for p in m.parameters())
        enc_trains, dec_trains = self.p_enc > enc_frozen, self.p_dec > dec_frozen
        # whether a part's backward runs: something in it or below it trains (a frozen weight inside a part that
        # trains, such as an output projection tied to frozen embeddings, is counted as having trained ones below)
        enc_back = enc_trains or embeddings
        dec_back = dec_trains or embeddings or enc_trains
        enc = 6.0 * (self.p_enc - enc_frozen) + (4.0 if enc_back else 2.0) * enc_frozen
        dec = 6.0 * (self.p_dec - dec_frozen) + (4.0 if dec_back else 2.0) * dec_frozen
        return enc, dec, 12.0 if enc_back else 4.0, 12.0 if dec_back else 4.0

    def __call__(self, src_lens, tgt_lens) -> float:
        """FLOPs of sentences of these lengths (sequences or arrays of ints, EOS/BOS included)."""
        src, tgt = np.asarray(src_lens, dtype=np.float64), np.asarray(tgt_lens, dtype=np.float64)
        flops = self.enc_weights * src.sum() + self.dec_weights * tgt.sum()
        pairs_tgt_src = float(src @ tgt)
        if self.transformer:
            if self.window:  # sliding window: keys within `window` on either side
                pairs_src_src = float(windowed_pairs(src, self.window).sum())
            else:
                pairs_src_src = float(src @ src)
            pairs_tgt_tgt = float((tgt * (tgt + 1) / 2).sum())  # causal: each query sees itself and earlier keys
            flops += self.width * (
                self.enc_pairs * self.enc_layers * pairs_src_src
                + self.dec_pairs * self.dec_layers * (pairs_tgt_tgt + pairs_tgt_src)
            )
        elif self.rnn_attention:
            flops += self.dec_pairs * self.width * pairs_tgt_src
        return float(flops)

    def of_batches(self, batches: list[list[int]], src_lens: np.ndarray, tgt_lens: np.ndarray) -> float:
        """FLOPs of training on these batches of sentence indices (``src_lens``, ``tgt_lens``: arrays of every
        sentence's lengths without EOS/BOS)."""
        indices = np.concatenate([np.asarray(batch, dtype=np.int64) for batch in batches])
        return self(src_lens[indices] + 1, tgt_lens[indices] + 1)


def training_flops(model: Family, src_lens: Sequence[int] | np.ndarray, tgt_lens: Sequence[int] | np.ndarray) -> float:
    """Useful FLOPs of one training step over sentences of these lengths (EOS/BOS included)."""
    return FlopCounter(model)(src_lens, tgt_lens)


def windowed_pairs(length, window: int):
    """Query-key pairs (i, j) with |i - j| <= window in sentences of ``length`` tokens (an int or an array)."""
    w = np.minimum(window, np.asarray(length) - 1)
    return length * (2 * w + 1) - w * (w + 1)


def peak_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak, None for a CPU or a GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)
