"""Several trained models decoding as one (``ensemble=``, fairseq's ensembles of checkpoints): behind the model API
(encode / start / step / state.select / decode), so greedy search, beam search, sampling and scoring run an ensemble
as they run one model. Each next token's probability is the mean of the members' (log p = logsumexp_i log p_i -
log n); the attention shown is the mean of the members' where their maps have one shape (the same layers and
heads), else the first member's. Members need the same target vocabulary; their families may differ (a Transformer
and an RNN decode together)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch

from app.models import Family
from app.models.api import AnySeq2Seq, DecodingState, KVCached, Seq2Seq


@dataclass
class EnsembleState:
    states: list[DecodingState]  # each member's

    def select(self, index: torch.Tensor) -> EnsembleState:
        self.states = [state.select(index) for state in self.states]
        return self

    def cache_bytes(self) -> Optional[int]:
        sizes = [size for s in self.states if isinstance(s, KVCached) and (size := s.cache_bytes()) is not None]
        return sum(sizes) if sizes else None


class Ensemble(torch.nn.Module):
    def __init__(self, members: Sequence[Family]):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        limits = [limit for m in members if (limit := getattr(m, "max_positions", None)) is not None]
        if limits:  # the API's length limit (absent: any length)
            self.max_positions = min(limits)

    @property
    def models(self) -> Sequence[AnySeq2Seq]:
        """The members, as the model API (an nn.ModuleList holds modules of any type)."""
        return cast("Sequence[AnySeq2Seq]", self.members)

    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> list[Any]:
        return [member.encode(src, src_mask) for member in self.models]

    def start(
        self, memory: list[Any], beam: int = 1, steps: Optional[int] = None, onednn: bool = False
    ) -> EnsembleState:
        return EnsembleState([m.start(mem, beam, steps, onednn=onednn) for m, mem in zip(self.models, memory)])

    def step(
        self, memory: list[Any], prev_tokens: torch.Tensor, state: EnsembleState, need_attention: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], EnsembleState]:
        outputs = [m.step(mem, prev_tokens, s, need_attention) for m, mem, s in zip(self.models, memory, state.states)]
        state.states = [new for _, _, new in outputs]
        return mean_log_probs([logits for logits, _, _ in outputs]), mean_attention([a for _, a, _ in outputs]), state

    def decode(
        self, memory: list[Any], tgt_in: torch.Tensor, need_attention: bool = False, need_logits: bool = True
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Teacher-forced log p (as logits: log_softmax leaves them as they are) and attention."""
        outputs = [
            m.decode(mem, tgt_in, need_attention=need_attention, need_logits=need_logits)
            for m, mem in zip(self.models, memory)
        ]
        logits = [logits for logits, _ in outputs if logits is not None]  # each member's, where asked for
        return mean_log_probs(logits) if need_logits else None, mean_attention([attention for _, attention in outputs])


def mean_log_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    """log of the mean of the members' next-token probabilities."""
    logp = torch.stack([x.float().log_softmax(-1) for x in logits])
    return logp.logsumexp(0) - math.log(len(logits))


def mean_attention(maps: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The mean of the members' attention where all have it in one shape, else the first member's (or None)."""
    first = maps[0]
    if first is None or any(m is None or m.shape != first.shape for m in maps):
        return first
    return torch.stack([m.float() for m in maps if m is not None]).mean(0).to(first.dtype)


def ensemble_of(members: Optional[list[str]]) -> str:
    """An ensemble's checkpoints in words ("ensemble of best.pt (step 721) + step_0000400.pt (step 400)"), or ""."""
    return "ensemble of " + " + ".join(members) if members else ""


_API: type[Seq2Seq[list[Any], EnsembleState]] = Ensemble  # mypy checks the ensemble against the model API
