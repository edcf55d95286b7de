"""The one FLOP count of a training step, shared by ``make bench`` and the training log (MFU).

Model FLOPs utilisation (MFU) counts the useful (non-padding) work of a training step as
    6 × (P_enc · source tokens + P_mem · source tokens + P_dec · target tokens + P_sent · sentences) + attention
where the P are the matrix-multiply parameters (the output projection included, embedding lookups not) by how often
they are applied: the encoder's once per source token; the decoder's that read the encoder's states, once per source
token too (P_mem: cross-attention's [K V] projections, Bahdanau's U, Luong general's W_a: the modules' SOURCE_SIDE);
an RNN's bridge once per sentence (ONCE_PER_SENTENCE); the rest of the decoder once per target token. The factor 6
is 2 FLOPs per multiply-add times forward plus a backward twice as costly (Kaplan et al. 2020). Attention adds
12 · width FLOPs per (query, key) pair and layer: QKᵀ and the weighted sum of values, forward and backward. MFU is
that count per second over the device's peak dense bf16 rate. Weights that train.freeze froze are counted for what
their backward still computes (``FlopCounter.backward_shares``). Not counted so: a trained weight whose input has
nothing trainable below it (the first layer of a post-norm Transformer or of an RNN over frozen embeddings) still
counts its input's gradient, a few per cent over for those freeze settings.
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
# (the first name a device's contains: "H100 PCIe" and "H100 NVL" before the SXM part's "H100")
PEAK_BF16 = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def matmul_parameters(module: nn.Module | list[nn.Module], trained: Optional[bool] = None) -> int:
    """Weights used in a matrix multiply (Linear layers, RNN input/recurrent matrices) of ``module`` (or of each of a
    list), each once; ``trained``: only those that train (True) or only those train.freeze froze (False)."""
    seen, total = set(), 0
    for m in (x for part in (module if isinstance(module, list) else [module]) for x in part.modules()):
        if isinstance(m, (nn.Linear, nn.RNNBase)):
            for p in m.parameters(recurse=False):
                if p.dim() == 2 and id(p) not in seen and trained in (None, p.requires_grad):
                    seen.add(id(p))
                    total += p.numel()
    return total


def named_layers(model: nn.Module, attribute: str) -> list[nn.Module]:
    """The layers that modules of ``model`` name in their class's ``attribute`` (SOURCE_SIDE, ONCE_PER_SENTENCE)."""
    layers = (getattr(m, name, None) for m in model.modules() for name in getattr(type(m), attribute, ()))
    return [layer for layer in layers if isinstance(layer, nn.Module)]


class FlopCounter:
    """Useful FLOPs of training steps of one model, from the lengths of their sentences (EOS/BOS
    included): ``counter(src_lens, tgt_lens)``."""

    def __init__(self, model: Family):
        cfg = model.cfg
        self.memory_side, self.sentence_side = (
            named_layers(model, "SOURCE_SIDE"),
            named_layers(model, "ONCE_PER_SENTENCE"),
        )
        self.p_enc = matmul_parameters(model.encoder)
        self.p_mem, self.p_sent = matmul_parameters(self.memory_side), matmul_parameters(self.sentence_side)
        self.p_dec = matmul_parameters(model) - self.p_enc - self.p_mem - self.p_sent
        self.enc_weights, self.mem_weights, self.sent_weights, self.dec_weights, self.enc_pairs, self.dec_pairs = (
            self.backward_shares(model)
        )
        self.transformer = isinstance(cfg, TransformerConfig)
        self.window, self.enc_layers, self.dec_layers, self.rnn_attention = 0, 0, 0, False
        if isinstance(cfg, TransformerConfig):
            self.window, self.width = cfg.window, cfg.d_model
            self.enc_layers, self.dec_layers = cfg.enc_layers, cfg.dec_layers
        else:
            self.width, self.rnn_attention = cfg.hidden, cfg.attention != "none"

    def backward_shares(self, model: Family) -> tuple[float, float, float, float, float, float]:
        """FLOPs per application of the encoder's, the decoder's source-side, its once-a-sentence and its other
        weights (6 × P when all train), and per (query, key) pair and width of the encoder's and the decoder's
        attention (12 when it is back-propagated). A weight costs its forward (2), its own gradient where it trains
        (2), and its input's gradient where something below it trains (2): a frozen weight inside a part that
        trains, such as an output projection tied to frozen embeddings, is counted as having trained ones below; a
        part with nothing trainable in or below it runs forward only (Transformer attention: 4). The decoder's
        weights that read the encoder's states get their input's gradient only where the encoder or the embeddings
        train."""
        enc_frozen = matmul_parameters(model.encoder, trained=False)
        mem_frozen = matmul_parameters(self.memory_side, trained=False)
        sent_frozen = matmul_parameters(self.sentence_side, trained=False)
        dec_frozen = matmul_parameters(model, trained=False) - enc_frozen - mem_frozen - sent_frozen
        embeddings = any(p.requires_grad for m in model.parts()["embeddings"] for p in m.parameters())
        enc_trains = self.p_enc > enc_frozen
        dec_trains = self.p_dec + self.p_mem + self.p_sent > dec_frozen + mem_frozen + sent_frozen
        # whether a part's backward runs: something in it or below it trains
        enc_back = enc_trains or embeddings
        dec_back = dec_trains or enc_back

        def cost(total: int, frozen: int, input_gradient: bool) -> float:
            return (4.0 + 2.0 * input_gradient) * (total - frozen) + (2.0 + 2.0 * input_gradient) * frozen

        return (
            cost(self.p_enc, enc_frozen, enc_back),
            cost(self.p_mem, mem_frozen, enc_back),
            cost(self.p_sent, sent_frozen, enc_back),
            cost(self.p_dec, dec_frozen, dec_back),
            12.0 if enc_back else 4.0,
            12.0 if dec_back else 4.0,
        )

    def __call__(self, src_lens, tgt_lens) -> float:
        """FLOPs of sentences of these lengths (sequences or arrays of ints, EOS/BOS included)."""
        src, tgt = np.asarray(src_lens, dtype=np.float64), np.asarray(tgt_lens, dtype=np.float64)
        flops = (self.enc_weights + self.mem_weights) * src.sum() + self.dec_weights * tgt.sum()
        flops += self.sent_weights * len(src)
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
