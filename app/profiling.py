"""Where a training step's time goes: ``make bench ARGS="bench.profile_steps=5"`` runs that many more
steps under torch.profiler after the timed ones.

Each ATen op's *self* time (on a GPU: the kernels it launched itself; on a CPU: its own host time) is
put into one of a few kinds of work, so the shares add up to 100 %. On a GPU, ``device_busy`` is the
kernels' total time over the wall time of the profiled steps: well below 1, the GPU waits for the
host to launch work (many small kernels, as in an RNN decoder loop) rather than for its own compute.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

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


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "elementwise and other")


def profile_steps(run_step: Callable[[], None], steps: int, device: torch.device, trace_path: str) -> tuple[dict, str]:
    """Runs ``run_step`` ``steps`` times under the profiler; returns the summary (shares of time per
    kind, device busy fraction, milliseconds per step) and a table of the top ops. Writes a Chrome
    trace (chrome://tracing, Perfetto) to ``trace_path``."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    with profile(activities=activities) as prof:
        if cuda:
            start.record()
        for _ in range(steps):
            run_step()
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(trace_path)
    averages = prof.key_averages()
    self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    per_kind: dict[str, float] = defaultdict(float)
    for event in averages:
        # on a GPU each kernel is listed as an event of its own, and counted again in the self time of
        # the op (or compiled region) that launched it: count the ops only
        if event.device_type == DeviceType.CPU:
            per_kind[kind_of(event.key)] += self_time(event)
    total = sum(per_kind.values()) or 1.0
    summary = {
        "profiled_steps": steps,
        "measured_on": "GPU kernel time" if cuda else "CPU time of each op",
        "shares": {k: round(v / total, 3) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
    }
    if cuda:
        wall_ms = start.elapsed_time(end)
        summary["ms_per_step"] = round(wall_ms / steps, 2)
        summary["device_busy"] = round(total / 1e3 / wall_ms, 3)  # profiler times are microseconds
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return summary, averages.table(sort_by=sort_by, row_limit=20)
