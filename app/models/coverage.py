"""See et al.'s coverage loss (2017, "Get To The Point: Summarization with Pointer-Generator Networks", eq. 12),
the training half of the coverage mechanism (``model.coverage``, app/models/attention.py), and what the attention
views read as re-attention (app/evaluation/views.py):

    covloss_t = Σ_j min(α_tj, c_tj),   c_tj = Σ_{t'<t} α_t'j,

the attention target step t pays again to source pieces that earlier steps attended. It is bounded by 1 (a row of
α sums to 1) and is 0 when every piece is attended once in all. Training minimizes the cross-entropy plus
``train.coverage_weight`` · Σ_t covloss_t, each target piece's term weighed as its cross-entropy is (both summed
over the pieces, divided by the update's target pieces); See et al. used λ = 1. Without the mechanism the model
could lower it only by spreading its attention, so the setting needs ``model.coverage=true``.
"""

from __future__ import annotations

from typing import Optional

import torch

from app.data.tokenizer import PAD


def coverage_loss(attention: torch.Tensor, tgt_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_t covloss_t over one batch's real target pieces: ``attention`` α (batch, target pieces, source pieces) of
    the targets ``tgt_out`` (batch, target pieces), padding PAD; without them, over every row. No host sync."""
    attention = attention.to(torch.promote_types(attention.dtype, torch.float32))  # bf16 under autocast
    coverage = attention.cumsum(-2) - attention  # c_t: the attention before step t
    per_piece = torch.minimum(attention, coverage).sum(-1)
    return per_piece.sum() if tgt_out is None else (per_piece * (tgt_out != PAD)).sum()
