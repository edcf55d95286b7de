"""Several trained models decoding as one (``ensemble=``, fairseq's ensembles of checkpoints): behind the model API
(encode / start / step / state.select / decode), so greedy search, beam search, sampling and scoring run an ensemble
as they run one model. Each next token's probability is the mean of the members' (log p = logsumexp_i log p_i -
log n); the attention shown is the mean of the members' where their maps have one shape (the same layers and
heads), else the first member's. Members need the same target vocabulary; their families may differ (a Transformer
and an RNN decode together)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class EnsembleState:
    states: list

    def select(self, index: torch.Tensor) -> EnsembleState:
        self.states = [state.select(index) for state in self.states]
        return self

    def cache_bytes(self) -> Optional[int]:
        sizes = [state.cache_bytes() for state in self.states if hasattr(state, "cache_bytes")]
        return sum(sizes) if sizes else None


class Ensemble(torch.nn.Module):
    def __init__(self, members: list[torch.nn.Module]):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        limits = [m.max_positions for m in members if getattr(m, "max_positions", None) is not None]
        if limits:  # the API's length limit (absent: any length)
            self.max_positions = min(limits)

    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> list:
        return [member.encode(src, src_mask) for member in self.members]

    def start(self, memory: list, beam: int = 1, steps: Optional[int] = None, onednn: bool = False) -> EnsembleState:
        return EnsembleState([m.start(mem, beam, steps, onednn=onednn) for m, mem in zip(self.members, memory)])

    def step(self, memory: list, prev_tokens: torch.Tensor, state: EnsembleState, need_attention: bool = False):
        outputs = [m.step(mem, prev_tokens, s, need_attention) for m, mem, s in zip(self.members, memory, state.states)]
        state.states = [new for _, _, new in outputs]
        return mean_log_probs([logits for logits, _, _ in outputs]), mean_attention([a for _, a, _ in outputs]), state

    def decode(self, memory: list, tgt_in: torch.Tensor, need_attention: bool = False, need_logits: bool = True):
        """Teacher-forced log p (as logits: log_softmax leaves them as they are) and attention."""
        outputs = [
            m.decode(mem, tgt_in, need_attention=need_attention, need_logits=need_logits)
            for m, mem in zip(self.members, memory)
        ]
        logits = mean_log_probs([logits for logits, _ in outputs]) if need_logits else None
        return logits, mean_attention([attention for _, attention in outputs])


def mean_log_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    """log of the mean of the members' next-token probabilities."""
    logp = torch.stack([x.float().log_softmax(-1) for x in logits])
    return logp.logsumexp(0) - math.log(len(logits))


def mean_attention(maps: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The mean of the members' attention where all have it in one shape, else the first member's (or None)."""
    if maps[0] is None or any(m is None or m.shape != maps[0].shape for m in maps):
        return maps[0]
    return torch.stack([m.float() for m in maps]).mean(0).to(maps[0].dtype)


def ensemble_of(members: Optional[list[str]]) -> str:
    """An ensemble's checkpoints in words ("ensemble of best.pt (step 721) + step_0000400.pt (step 400)"), or ""."""
    return "ensemble of " + " + ".join(members) if members else ""
