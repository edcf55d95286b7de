"""Checkpoints: written atomically, read with ``weights_only=True`` (no arbitrary unpickling)."""
from __future__ import annotations

import os

import torch

from app.errors import UserError
from app.utils import atomic_write


def save_checkpoint(path: str, payload: dict) -> None:
    atomic_write(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: str, device: torch.device | str = "cpu") -> dict:
    if not os.path.exists(path):
        raise UserError(f"{path}: checkpoint not found (train first, or check name=)")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:
        raise UserError(f"{path}: not a loadable checkpoint: {str(err).splitlines()[0]}") from None
