"""An exponential moving average of the weights (``train.ema_decay``): Polyak averaging as Marian's
``--exponential-smoothing`` does it, a second copy of the model whose weights trail the trained ones,

    θ̄ ← θ̄ + w_t (θ − θ̄),   w_t = max(1 − decay, 9 / (10 + t))   after update t,

so the first updates are not frozen into the average (TensorFlow's ``ExponentialMovingAverage`` with
``num_updates``; Marian's early formula). One fused ``torch._foreach_lerp_`` over every parameter per update,
on the device, with a weight computed on the host from the step count: no host sync.

The averaged copy is what a run with it on validates, keeps as best.pt and hands to eval, translate and
export (app/train/state.py): the trained weights go on in the optimizer's hands, and a checkpoint holds both.
Parameters alone are averaged: the models have no buffers that training changes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ExponentialAverage:
    """The moving average of ``model``'s parameters, kept in ``self.model`` (float32, eval mode, no gradients)."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).float().eval().requires_grad_(False)
        # the same order: deepcopy keeps the module tree and its ties; a frozen weight (train.freeze) is its own average
        pairs = [(a, t) for a, t in zip(self.model.parameters(), model.parameters()) if t.requires_grad]
        self.averaged: list[torch.Tensor] = [a for a, _ in pairs]
        self.trained: list[torch.Tensor] = [t for _, t in pairs]
        self.same_dtype = all(a.dtype == t.dtype for a, t in zip(self.averaged, self.trained))

    def weight(self, updates: int) -> float:
        """How far the average moves towards the trained weights after update number ``updates`` (from 1)."""
        return max(1.0 - self.decay, 9.0 / (10.0 + updates))

    @torch.no_grad()
    def update(self, updates: int) -> None:
        """After the optimizer's update number ``updates``."""
        trained = self.trained if self.same_dtype else [t.float() for t in self.trained]  # low-precision weights
        torch._foreach_lerp_(self.averaged, trained, self.weight(updates))
