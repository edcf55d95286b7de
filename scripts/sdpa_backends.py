"""Which kernel runs the Transformer's masked attention fastest on this GPU (issue 63: the lead left).

The encoder's self-attention and the cross-attention take a key padding mask, and an ``attn_mask`` rules out
PyTorch's flash kernel: they run the memory-efficient one, built for sm80 (docs/gpu/2026-11-28-fused). This
times one attention call, forward and backward, at the default Transformer's shapes (8 heads of 64, bf16) for
every kernel that computes the same function:

- ``efficient``: SDPA's memory-efficient kernel with the boolean key mask (what the model runs now);
- ``cudnn``: SDPA's cuDNN kernel with the same mask (PyTorch turns it into a float bias for cuDNN);
- ``flex``: ``flex_attention`` compiled with a key-padding block mask (Triton);
- ``varlen``: flash attention over the real tokens only, packed (``torch.nn.attention.varlen``): the
  padding is not computed at all, but the model would have to pack and unpack around it (not timed here);
- ``flash_unmasked``: flash with no mask, a bound rather than a candidate (it attends to the padding).

Each candidate's output and gradients are compared with the math kernel's in float32 over the real rows
(``max_err``); a kernel that refuses the inputs is listed with its error. Usage (a GPU; on a CPU it runs
the kernels the CPU has, to check the script):

    python scripts/sdpa_backends.py --out sdpa_backends.json [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 8, 64
# (sentences, source length, target length) of 32 k-token batches of short, middle and long verses
SHAPES = [(400, 40, 44), (160, 100, 104), (48, 320, 330)]
TINY_SHAPES = [(3, 7, 5)]


def lengths_of(batch: int, longest: int, generator: torch.Generator) -> torch.Tensor:
    """Key lengths as padded batches have them: the longest pair fills the shape, the others up to 30 % shorter."""
    shortest = max(1, int(longest * 0.7))
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=generator)
    lengths[0] = longest
    return lengths


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Milliseconds a call of ``fn``, after three warm-up calls (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1000 / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def measure(
    device: torch.device, batch: int, queries: int, keys: int, repeats: int, dtype: torch.dtype, with_flex: bool
) -> dict[str, dict[str, object]]:
    """Each kernel's milliseconds for forward + backward of one (batch, heads, queries, keys) attention."""
    generator = torch.Generator().manual_seed(batch * 1000 + keys)
    lengths = lengths_of(batch, keys, generator)
    q, k, v, grad = (
        torch.randn(batch, HEADS, n, HEAD_DIM, generator=generator).to(device) for n in (queries, keys, keys, queries)
    )
    key_mask = (torch.arange(keys)[None, :] < lengths[:, None]).to(device)  # (B, S), True at real keys
    mask = key_mask[:, None, None, :]

    def reference() -> tuple[torch.Tensor, ...]:
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(*inputs, attn_mask=mask)
        out.backward(grad.double())
        return (out.detach(), *(t.grad for t in inputs))

    expected = reference()
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    low_grad = grad.to(dtype)

    def sdpa(backend: SDPBackend, masked: bool = True) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            for t in inputs:
                t.grad = None
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*inputs, attn_mask=mask if masked else None)
            out.backward(low_grad)
            return (out, *(t.grad for t in inputs))

        return run

    candidates: dict[str, Optional[Callable[[], tuple[torch.Tensor, ...]]]] = {
        "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "varlen": varlen_call(inputs, key_mask, low_grad),
        "flash_unmasked": sdpa(SDPBackend.FLASH_ATTENTION, masked=False),
        "math": sdpa(SDPBackend.MATH),
        # last, and on the first shape only: each shape compiles anew (tens of seconds)
        "flex": flex_call(inputs, key_mask, low_grad, device) if with_flex else None,
    }
    rows: dict[str, dict[str, object]] = {}
    for name, call in candidates.items():
        if call is None:
            continue
        try:
            started = time.perf_counter()
            got = call()  # the first call: its compile, where it has one
            first_s = time.perf_counter() - started
            row: dict[str, object] = {"ms": round(timed(call, repeats, device), 3)}
            if first_s > 1.0:
                row["first_call_s"] = round(first_s, 1)
            if name != "flash_unmasked":
                row["max_err"] = round(max_error(got, expected, key_mask), 5)
            rows[name] = row
        except Exception as error:  # a kernel that refuses these inputs: say which and why
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return rows


def max_error(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], key_mask: torch.Tensor) -> float:
    """The largest absolute difference of output, dQ, dK and dV from the float64 math kernel's, at real keys."""
    real = key_mask[:, None, :, None]  # dK and dV rows of padding keys are 0 by definition in some kernels only
    worst = 0.0
    for index, (a, b) in enumerate(zip(got, expected)):
        difference = (a.detach().double() - b).abs()
        if index >= 2:
            difference = difference.masked_fill(~real, 0.0)
        worst = max(worst, float(difference.max()))
    return worst


def flex_call(
    inputs: list[torch.Tensor], key_mask: torch.Tensor, grad: torch.Tensor, device: torch.device
) -> Optional[Callable[[], tuple[torch.Tensor, ...]]]:
    """flex_attention, compiled, with a block mask that hides the padding keys; None without CUDA."""
    if device.type != "cuda":
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths = key_mask.sum(-1)
    block_mask = create_block_mask(
        lambda b, h, q_index, kv_index: kv_index < lengths[b],
        key_mask.size(0),
        None,
        inputs[0].size(2),
        inputs[1].size(2),
        device=device,
    )
    compiled = torch.compile(flex_attention)

    def run() -> tuple[torch.Tensor, ...]:
        for t in inputs:
            t.grad = None
        out = compiled(*inputs, block_mask=block_mask)
        out.backward(grad)
        return (out, *(t.grad for t in inputs))

    return run


def varlen_call(
    inputs: list[torch.Tensor], key_mask: torch.Tensor, grad: torch.Tensor
) -> Optional[Callable[[], tuple[torch.Tensor, ...]]]:
    """Flash attention over the packed real keys, every query row kept; None where PyTorch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    q, k, v = inputs
    batch, _, queries, _ = q.shape
    lengths = key_mask.sum(-1)
    zero = lengths.new_zeros(1)
    cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * queries
    cu_k = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    max_k = int(lengths.max())
    # packed once: the packing would be the model's to do; this times the kernel
    packed_q = q.detach().transpose(1, 2).reshape(batch * queries, HEADS, HEAD_DIM).requires_grad_()
    real = key_mask.flatten()
    packed_k, packed_v = (
        t.detach().transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)[real].contiguous().requires_grad_() for t in (k, v)
    )
    packed_grad = grad.transpose(1, 2).reshape(batch * queries, HEADS, HEAD_DIM)

    def run() -> tuple[torch.Tensor, ...]:
        for t in (packed_q, packed_k, packed_v):
            t.grad = None
        out = varlen_attn(packed_q, packed_k, packed_v, cu_q, cu_k, queries, max_k)
        out.backward(packed_grad)
        unpack = out.new_zeros(batch * key_mask.size(1), HEADS, HEAD_DIM)
        grads = []
        for g in (packed_k.grad, packed_v.grad):
            full = unpack.clone()
            full[real] = g
            grads.append(full.view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2))
        as_bhtd = out.view(batch, queries, HEADS, HEAD_DIM).transpose(1, 2)
        dq = packed_q.grad.view(batch, queries, HEADS, HEAD_DIM).transpose(1, 2)
        return (as_bhtd, dq, *grads)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="sdpa_backends.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "dtype": str(dtype),
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "repeats": args.repeats,
        "shapes": [],
    }
    for index, (batch, source, target) in enumerate(SHAPES if cuda else TINY_SHAPES):
        for kind, queries in (("self", source), ("cross", target)):
            rows = measure(device, batch, queries, source, args.repeats, dtype, with_flex=index == 0)
            report["shapes"].append({"attention": kind, "batch": batch, "queries": queries, "keys": source, **rows})
            print(kind, batch, queries, source, json.dumps(rows), flush=True)
            with open(args.out, "w") as handle:  # after each shape: a run cut by its time limit keeps the rest
                json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
