"""The model API that every family decodes through, written once (shared/DESIGN.md, "The model API"):

    encode(src, src_mask)                         -> memory
    decode(memory, tgt_in)                        -> logits, attention          # teacher forcing
    start(memory, beam, steps)                    -> state
    step(memory, prev_tokens, state)              -> logits, attention, state   # one cached decoding step
    state.select(indices)                         -> state                      # beam reordering

``attention`` is (batch, tgt, src) for an RNN and (batch, layers, heads, tgt, src) for a Transformer's
cross-attention: padding exactly 0, rows summing to 1; None for a model without attention, or where it was not
asked for (returning it is opt-in: the fast paths never materialize it). The memory is the family's own (the search
only hands it back). Greedy and beam search (app/decode/search.py, beam.py), the teacher-forced passes
(app/decode/passes.py) and the evaluation use only this API; the Transformer (app/models/transformer.py), the RNNs
(app/models/rnn.py) and the ensemble (app/decode/ensemble.py) are checked against it by mypy where each is defined.

Members that only some families have, each a small protocol of its own: ``self_attention`` (``SelfAttending``,
the Transformer's), ``copy_shares`` (``Copying``, the families', None unless model.copy_attention), a state's
``cache_bytes`` (``KVCached``). A family whose inputs and outputs are bounded says so
in ``max_positions`` (an int; absent: any length), read with ``getattr(model, "max_positions", None)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, TypeVar, runtime_checkable

import torch

_Self = TypeVar("_Self", bound="DecodingState")


@runtime_checkable
class DecodingState(Protocol):
    """What decoding keeps between steps (a key/value cache, RNN hidden states), for ``beam`` consecutive rows
    per sentence."""

    def select(self: _Self, index: torch.Tensor) -> _Self:
        """Rows ``index`` (rows',) of the batch: beam search's surviving beams (each new row the row it continues)
        and, with fewer rows than now, the sentences still decoding (``beam`` rows of each kept sentence, in
        order). It may work in place: the state returned is the one to use."""
        ...


@runtime_checkable
class KVCached(Protocol):
    """A state with a key/value cache (a Transformer's)."""

    def cache_bytes(self) -> Optional[int]:
        """Bytes of its key/value cache (None: none). Tensor metadata only: no device sync."""
        ...


MemoryT = TypeVar("MemoryT")
StateT = TypeVar("StateT", bound=DecodingState)


@runtime_checkable
class Seq2Seq(Protocol[MemoryT, StateT]):
    """An encoder-decoder behind the model API; ``MemoryT`` is what its encoder returns, ``StateT`` its decoding
    state. B: sentences, S: source length, T: target length, V: target vocabulary, rows: B · beam."""

    training: bool  # nn.Module's mode, which the passes set and restore

    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> MemoryT:
        """The memory of ``src`` (B, S) token ids; ``src_mask`` (B, S) True at real tokens (None: not PAD)."""
        ...

    def decode(
        self, memory: MemoryT, tgt_in: torch.Tensor, *, need_attention: bool = False, need_logits: bool = True
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Teacher forcing on ``tgt_in`` (B, T) (BOS and the target before its last token): logits (B, T, V) (None
        with ``need_logits=False``) and, with ``need_attention``, the cross-attention (B, .., T, S)."""
        ...

    def start(self, memory: MemoryT, beam: int = 1, steps: Optional[int] = None, onednn: bool = False) -> StateT:
        """The decoding state of ``beam`` consecutive rows per sentence of ``memory`` for at most ``steps`` steps
        (None: unknown); ``onednn``: a CPU's matrix multiplies through oneDNN where the family has them."""
        ...

    def step(
        self, memory: MemoryT, prev_tokens: torch.Tensor, state: StateT, need_attention: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], StateT]:
        """One token for every row: ``prev_tokens`` (rows,) -> next-token logits (rows, V), with
        ``need_attention`` the cross-attention (rows, .., 1, S), and the state after the step."""
        ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


AnySeq2Seq = Seq2Seq[Any, Any]  # a model of any family, as the search and the passes take it


@dataclass
class SelfAttention:
    """A teacher-forced pass's self-attention weights (rows sum to 1, masked keys exactly 0). ``encoder``
    (B, enc_layers, heads, S, S): each source token over the source; ``decoder`` (B, dec_layers, heads, T, T):
    each target position (its row: the token it predicts) over the inputs so far (its columns: BOS and the
    target tokens before it), causal: zero above the diagonal."""

    encoder: torch.Tensor
    decoder: torch.Tensor


@runtime_checkable
class SelfAttending(Seq2Seq[Any, Any], Protocol):
    """A model with self-attention (the Transformer): what the attention views show beside the cross-attention."""

    def self_attention(self, src: torch.Tensor, tgt_in: torch.Tensor) -> SelfAttention:
        """The encoder's self-attention over ``src`` (B, S) and the decoder's fed ``tgt_in`` (B, T); no logits."""
        ...


@runtime_checkable
class Copying(Seq2Seq[Any, Any], Protocol):
    """A family that can copy source pieces through its attention (the pointer-generator, app/models/copy.py)."""

    def copy_shares(self, memory: Any, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, T): the share of each ``tgt_out`` piece's probability that came through copying, teacher-forced
        on ``tgt_in``; None where the model was built without model.copy_attention."""
        ...
