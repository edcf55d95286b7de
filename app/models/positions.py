"""Where a token is: the Transformer's position schemes (``model.pos``).

Absolute schemes add a vector per position to the token embeddings, once, at the input:

    sinusoidal  Vaswani et al. 2017, §3.5: a fixed table of sines and cosines
    learned     a trained table of ``model.max_len`` vectors (Gehring et al. 2017; BERT; GPT)

Relative schemes act inside self-attention instead, so that a query-key score sees only the
distance between the two tokens:

    rope        Su et al. 2021, "RoFormer": queries and keys rotated by an angle proportional to position
    alibi       Press et al. 2021, "Train Short, Test Long": a per-head penalty linear in the distance
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq)
    return pe


def table_rows(table: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """Rows offset .. offset + length - 1 of a position table; a table has no row past its end."""
    if offset + length > table.size(0):
        raise ValueError(f"sequence of {offset + length} tokens exceeds model.max_len={table.size(0)}")
    return table[offset : offset + length]


class SinusoidalPositions(nn.Module):
    table: torch.Tensor  # a buffer

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        if d_model % 2:
            raise ValueError(
                f"model.pos=sinusoidal pairs a sine and a cosine of each frequency: model.d_model={d_model} must be "
                "even (or give model.pos=learned, rope or alibi)"
            )
        # not in the state dict: a function of the config (and older checkpoints do not have it)
        self.register_buffer("table", sinusoidal_positions(max_len, d_model), persistent=False)

    def forward(self, offset: int, length: int) -> torch.Tensor:  # (length, d_model)
        return table_rows(self.table, offset, length)

    def at(self, positions: torch.Tensor) -> torch.Tensor:  # (len(positions), d_model)
        """The rows of ``positions``, a device tensor (a decoding step's position, which the host does not read)."""
        return self.table.index_select(0, positions)


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, offset: int, length: int) -> torch.Tensor:  # (length, d_model)
        return table_rows(self.table.weight, offset, length)

    def at(self, positions: torch.Tensor) -> torch.Tensor:  # (len(positions), d_model)
        return self.table.weight.index_select(0, positions)


@dataclass
class Rotation:
    """RoPE angles m·θ_i for the positions m of some consecutive tokens, (T, d_head) each, laid out as the
    features they turn: ``cos`` = (cos m·θ_0, cos m·θ_0, cos m·θ_1, ...), ``sin`` = (-sin m·θ_0, sin m·θ_0, ...)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate each pair (x_2i, x_2i+1) of x (B, H, T, d_head) by its angle (Su et al. 2021, eq. 34):

            (x_2i cos − x_2i+1 sin,  x_2i+1 cos + x_2i sin) = x ⊙ cos + swap(x) ⊙ sin,

        with swap exchanging the two features of each pair: three kernels (and bf16's casts), where splitting the
        pairs and stacking four products took seven; a Transformer step is host-bound (docs/benchmarking.md)."""
        x_ = x.to(torch.promote_types(x.dtype, torch.float32))
        swapped = x_.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return torch.addcmul(x_ * self.cos, swapped, self.sin).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021): θ_i = 10000^(-2i/d_head), i = 0 .. d_head/2 - 1.

    The query at position m and the key at position n are rotated by m·θ and n·θ, so
    ⟨R_m q, R_n k⟩ = ⟨q, R_{n-m} k⟩: the score depends on the offset n - m alone. No table: the
    angles of any position are computed when asked for, so RoPE runs at any length.
    """

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, d_head: int, base: float = 10000.0):
        super().__init__()
        if d_head % 2:
            raise ValueError(
                f"model.pos=rope rotates pairs of features: the head size model.d_model / model.heads "
                f"= {d_head} must be even"
            )
        self.register_buffer(
            "inv_freq", base ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head), persistent=False
        )

    def forward(self, offset: int, length: int) -> Rotation:
        return self.at(torch.arange(offset, offset + length, device=self.inv_freq.device))

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of ``positions`` (a device tensor: a decoding step's position)."""
        angles = positions.float()[:, None] * self.inv_freq
        sin = angles.sin()
        return Rotation(angles.cos().repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2))


def alibi_slopes(heads: int) -> torch.Tensor:
    """m_h = 2^(-8h/H) for heads h = 1 .. H: the geometric sequence of Press et al. 2021, §3
    (H = 8: 1/2, 1/4, …, 1/256). The paper derives slopes for other head counts from the nearest
    power of two; this formula gives every H its own geometric sequence from 2^(-8/H) to 1/256."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)


class ALiBi(nn.Module):
    """Attention with linear biases (Press et al. 2021): score(i, j) += -m_h · |i - j|, per head h.

    The paper's decoder-only model sees only j <= i, where |i - j| = i - j; here the encoder uses the
    same symmetric distance in both directions, and the decoder's causal mask removes j > i.
    """

    slopes: torch.Tensor  # a buffer

    def __init__(self, heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def forward(self, offset: int, queries: int, keys: int) -> torch.Tensor:
        """Bias (H, queries, keys) for queries at positions offset.. against keys at 0 .. keys - 1."""
        return self.at(torch.arange(offset, offset + queries, device=self.slopes.device), keys)

    def at(self, positions: torch.Tensor, keys: int) -> torch.Tensor:
        """Bias (H, len(positions), keys) for queries at ``positions`` (a device tensor: a decoding step's)."""
        j = torch.arange(keys, device=positions.device)
        return -self.slopes[:, None, None] * (positions[:, None] - j[None, :]).abs()
