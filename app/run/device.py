"""The device a command runs on, its mixed precision, and its random generators (seeded, saved, restored)."""

from __future__ import annotations

import random
from typing import Optional

import torch

from app.run.errors import UserError


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """Every random generator training may draw from, as tensors and plain values (weights_only-safe)."""
    import numpy as np

    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # the global generator's (MT19937) legacy form
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    import numpy as np

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].cpu().numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
        )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name!r} but CUDA is not available on this machine; use device=auto or device=cpu")
    return device


def autocast(device: torch.device, dtype):
    """bf16 (or other) autocast on ``device`` when ``dtype`` is set; a no-op context for fp32."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def amp_dtype(setting: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of ``train.amp``: bf16 on CUDA by default, None (fp32) on a CPU."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if setting in ("bf16", "fp32"):
        return torch.bfloat16 if setting == "bf16" else None
    raise UserError(f"train.amp={setting!r}: choose auto, bf16 or fp32")
