"""Where a training step's time goes: ``make bench ARGS="bench.profile_steps=5"`` runs that many more
steps under torch.profiler after the timed ones.

Each ATen op's *self* time (on a GPU: the kernels it launched itself; on a CPU: its own host time) is
put into one of a few kinds of work, so the shares add up to 100 %. On a GPU, ``device_busy`` is the
kernels' total time over the wall time of the profiled steps: well below 1, the GPU waits for the
host to launch work (many small kernels, as in an RNN decoder loop) rather than for its own compute.

A replayed CUDA graph (``train.capture``) launches its kernels without any op: its steps are attributed by the
kernels' own names instead (``KERNEL_KINDS``; ``attributed`` in the summary says which).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

# first match wins; names are ATen ops (aten::mm), autograd nodes and compiled regions
KINDS = [
    ("matrix multiply", r"\b(mm|addmm|bmm|baddbmm|_scaled_mm|matmul|linear)\b"),
    ("attention kernels", r"flash|efficient_attention|scaled_dot_product|_cudnn_attention"),
    ("recurrent cells", r"rnn|gru|lstm"),
    ("optimizer", r"adam|foreach|clip_grad|_amp_"),
    ("compiled kernels", r"compiled|triton|inductor"),
    ("softmax and loss", r"softmax|cross_entropy|nll_loss"),
    ("copies and layout", r"copy_|contiguous|cat|index|gather|scatter|pad|to_copy|clone|expand|repeat|where|fill"),
]


# the same kinds, read off CUDA kernel names (cuBLAS's nvjet/gemm, the SDPA back-ends, Inductor's triton_*)
KERNEL_KINDS = [
    ("matrix multiply", r"nvjet|gemm|xmma|cutlass.*(mma|matmul)|splitkreduce"),
    ("attention kernels", r"fmha|flash|attention"),
    ("recurrent cells", r"rnn|gru|lstm"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("compiled kernels", r"^triton_"),
    ("softmax and loss", r"softmax|cross_entropy|nll_loss"),
    ("copies and layout", r"copy|cat|index|gather|scatter|fill"),
]


def kind_of(name: str, kinds: list[tuple[str, str]] = KINDS) -> str:
    return next((kind for kind, pattern in kinds if re.search(pattern, name, re.IGNORECASE)), "elementwise and other")


def time_by_kind(events) -> tuple[dict[str, float], float, str]:
    """Device time per kind of work over a profile's averaged events (``key``, ``device_type``,
    ``self_device_time_total`` in microseconds), the kernels' total, and what it was attributed by: the ops that
    launched the kernels, or, where ops account for under half of it (a replayed CUDA graph has none), the kernels'
    names."""
    per_op: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type == DeviceType.CPU:
            per_op[kind_of(event.key)] += event.self_device_time_total
        else:
            per_kernel[kind_of(event.key, KERNEL_KINDS)] += event.self_device_time_total
    kernels = sum(per_kernel.values())
    if sum(per_op.values()) >= 0.5 * kernels:
        return per_op, kernels, "ops"
    return per_kernel, kernels, "kernel names"


def profile_steps(run_step: Callable[[], None], steps: int, device: torch.device, trace_path: str) -> tuple[dict, str]:
    """Runs ``run_step`` ``steps`` times under the profiler; returns the summary (shares of time per
    kind, device busy fraction, milliseconds per step) and a table of the top ops. Writes a Chrome
    trace (chrome://tracing, Perfetto) to ``trace_path``."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
    with profile(activities=activities) as prof:
        if timer is not None:
            timer[0].record()
        for _ in range(steps):
            run_step()
        if timer is not None:
            timer[1].record()
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(trace_path)
    averages = prof.key_averages()
    if cuda:
        # each kernel is listed as an event of its own, and counted again in the self time of the op (or
        # compiled region) that launched it: one of the two
        per_kind, kernels, attributed = time_by_kind(averages)
    else:
        per_kind, attributed = defaultdict(float), "ops"
        for event in averages:
            per_kind[kind_of(event.key)] += event.self_cpu_time_total
    total = sum(per_kind.values()) or 1.0
    summary = {
        "profiled_steps": steps,
        "measured_on": "GPU kernel time" if cuda else "CPU time of each op",
        "attributed": attributed,
        "shares": {k: round(v / total, 3) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
    }
    if timer is not None:
        wall_ms = timer[0].elapsed_time(timer[1])
        summary["ms_per_step"] = round(wall_ms / steps, 2)
        summary["device_busy"] = round(kernels / 1e3 / wall_ms, 3)  # profiler times are microseconds
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return summary, averages.table(sort_by=sort_by, row_limit=30, max_name_column_width=100)


def count_ops(run_step: Callable[[], None], steps: int, device: torch.device, dispatch: bool = True) -> dict:
    """ATen operators per call of ``run_step`` (one decoding or training step), over ``steps`` calls:

    - ``ops``: the operators called from Python (the profiler's top-level ATen events), each one trip through
      the dispatcher: a step's host cost;
    - ``kernels``: the operators that compute, as they reach the kernels (composites such as ``linear``
      counted as what they run, views and allocations left out): what a GPU launches. On CUDA, the kernels
      the profiler saw launched. Without ``dispatch`` (a compiled step, whose generated kernels pass no
      dispatcher) a CPU's are not counted (None).
    """
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counter = KernelCounter() if dispatch and not cuda else None
    with profile(activities=activities) as prof, counter if counter is not None else contextlib.nullcontext():
        for _ in range(steps):
            run_step()
        if cuda:
            torch.cuda.synchronize(device)
    # operators of every namespace (aten::, mkldnn::, ...), not the profiler's own records
    events = [e for e in prof.profiler.function_events if re.match(r"\w+::\w+", e.name)]
    nested = set(id(e) for e in events)

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and id(parent) not in nested:
            parent = parent.cpu_parent
        return parent is None

    ops = sum(top_level(e) for e in events)
    if cuda:
        kernels = sum(e.device_type == DeviceType.CUDA for e in prof.profiler.function_events)
    else:
        kernels = counter.kernels if counter is not None else None
    return {"ops": round(ops / steps, 1), "kernels": None if kernels is None else round(kernels / steps, 1)}


class KernelCounter(TorchDispatchMode):
    """Counts the ATen operators that reach a kernel and compute: not views (``is_view``), allocations or
    questions the host asks about shapes and kernels."""

    NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"}
    NOT_KERNELS |= {"_fused_sdp_choice"}

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__.split(".")[0] not in self.NOT_KERNELS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))
