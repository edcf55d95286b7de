"""Small helpers shared by several stages: hashing, atomic writes, seeding, devices and mixed precision."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from typing import Optional

import torch

from app.errors import DiskFull, UserError, disk_full


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", size: int = 0):
    """A file to write ``path`` through: a temp file in the same folder, fsynced and renamed when the
    block ends, removed if it fails. A crash leaves either the old file or the new one, never a torn one;
    a full disk is a DiskFull naming the file, ``size`` (what it needs, where known) and the space left."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, Exception) and disk_full(err):
            needs = f"it needs about {human_bytes(size)}, " if size else ""
            free = human_bytes(shutil.disk_usage(folder).free)
            raise DiskFull(f"{path}: no space left on its device to write it ({needs}{free} free)") from None
        raise


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def atomic_write(path: str, write, size: int = 0) -> None:
    """Write ``path`` atomically through ``write(file_object)`` (see atomic_open)."""
    with atomic_open(path, size=size) as f:
        write(f)


def atomic_write_text(path: str, text: str) -> None:
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data), size=len(data))


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """Every random generator training may draw from, as tensors and plain values (weights_only-safe)."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
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


class Stopwatch:
    """Seconds per named stage of a command: ``with clock("decode"): ...``; a stage entered again adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def rounded(self, digits: int = 2) -> dict[str, float]:
        return {stage: round(seconds, digits) for stage, seconds in self.seconds.items()}

    def line(self) -> str:
        """``load 1.2 s, decode 7.0 s, ... (total 9.3 s)``"""
        stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.seconds.items())
        return f"{stages} (total {sum(self.seconds.values()):.1f} s)"
