"""bf16 training on bf16 weights kept from fp32 master weights (Micikevicius et al. 2018, "Mixed Precision
Training", §3.1).

Under autocast alone every matrix multiply casts its fp32 weight to bf16 at each use, and the backward pass
casts that weight's gradient back to fp32: two copies per weight and use (docs/benchmarking.md, "A training
step's host work"). Here a step runs on a compute copy of the model whose linear
and embedding parameters are bf16 already, so autocast casts none of them (it still runs norms, softmax
and the loss in fp32, and the norms' parameters are the model's own fp32 ones, shared). After a
micro-batch, ``accumulate`` adds the copy's bf16 gradients into the fp32 gradients of the model's
parameters (one foreach operation); the optimizer updates those fp32 master weights, and ``refresh`` copies
them into the compute copy (one foreach operation per update). Checkpoints, validation and decoding read
the fp32 model as before.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

# the modules whose parameters autocast would cast to bf16 at each use (F.linear), or that feed them
# (an embedding tied to the output projection)
LOW_PRECISION_MODULES = (nn.Linear, nn.Embedding)


class MasterWeights:
    """The module a training step runs on (``compute``) and how its gradients reach the fp32 parameters the
    optimizer updates (``model``'s). Without a low-precision ``dtype`` the compute module is the model itself
    and every method does nothing."""

    def __init__(self, model: nn.Module, dtype: Optional[torch.dtype]):
        self.model = model
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (fp32 master, low-precision copy)
        if dtype is None or dtype == torch.float32:
            self.compute = model
            return
        self.compute = copy.deepcopy(model)  # keeps tied parameters tied
        converted: set[int] = set()
        for master_module, module in zip(model.modules(), self.compute.modules()):
            for name, param in list(module.named_parameters(recurse=False)):
                if not isinstance(module, LOW_PRECISION_MODULES):
                    setattr(module, name, getattr(master_module, name))  # shared: its gradient is the master's
                elif id(param) not in converted:
                    converted.add(id(param))
                    param.data = param.data.to(dtype)
                    if param.requires_grad:  # a frozen weight (train.freeze) keeps the copy made here
                        self.pairs.append((getattr(master_module, name), param))
        self.masters: list[torch.Tensor] = [master for master, _ in self.pairs]
        self.copies: list[torch.Tensor] = [low for _, low in self.pairs]

    @property
    def enabled(self) -> bool:
        return bool(self.pairs)

    def accumulate(self, first: bool) -> None:
        """Adds the compute copy's gradients into the masters' fp32 gradients (``first``: replaces them) and
        clears the copy's."""
        if not self.pairs:
            return
        for master in self.masters:
            if master.grad is None:  # once, and after an out-of-memory step cleared them
                master.grad = torch.zeros_like(master)
        grads = [low.grad if low.grad is not None else torch.zeros_like(low) for low in self.copies]
        master_grads = [m.grad for m in self.masters if m.grad is not None]  # every one (given above)
        if first:
            torch._foreach_copy_(master_grads, grads)
        else:
            torch._foreach_add_(master_grads, grads)
        for low in self.copies:
            low.grad = None

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After an update: gradients to None (fp32), or zeroed in place, keeping the masters' fp32 buffers."""
        optimizer.zero_grad(set_to_none=not self.pairs)

    @torch.no_grad()
    def refresh(self) -> None:
        """The compute copy's weights from the (updated) masters."""
        if self.pairs:
            torch._foreach_copy_(self.copies, self.masters)
