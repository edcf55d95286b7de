"""torch.distributed under torchrun: process group set-up, rank queries and the few collectives the
training loop needs. A process not started by torchrun is a world of one and every call is local."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def launched() -> bool:
    """Started by torchrun (which sets WORLD_SIZE and RANK for every worker)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def setup(device: torch.device) -> torch.device:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs); each worker gets the GPU of its
    LOCAL_RANK. Returns the device this worker trains on."""
    if not launched() or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    # validation runs on rank 0 while the others wait in a collective: allow it an hour
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(minutes=60),
        device_id=device if device.type == "cuda" else None,
    )
    return device


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Under torchrun, the model in DistributedDataParallel (which all-reduces its gradients); else itself."""
    if not launched():
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def teardown() -> None:
    """Leave the process group once every rank got here (a finished or stopped run): gloo aborts a
    process whose peer left while it still had work in flight. A rank that fails does not come here;
    torchrun then stops the others."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag True on every rank when it is True on any rank (stop requests, time budgets)."""
    if not dist.is_initialized():
        return flags
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def from_main(flag: bool, device: torch.device) -> bool:
    """Rank 0's value of ``flag`` on every rank (decisions only rank 0 can make: early stopping)."""
    return bool(int_from_main(int(flag), device))


def int_from_main(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank (what only rank 0 decides or estimates: early stopping, where the time budget
    ends)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def sum_all(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor over ranks (logged training loss)."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def gather_objects(obj) -> list:
    """Every rank's ``obj`` in rank order (RNG states for the checkpoint)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class NoWriter:
    """What ranks other than 0 log to: nothing (rank 0 alone writes events, plots and checkpoints)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def writer(log_dir: str):
    """A TensorBoard SummaryWriter on rank 0, a writer that drops everything on the other ranks."""
    if not is_main():
        return NoWriter()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir)
