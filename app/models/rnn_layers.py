"""The RNN encoder-decoders' parts (app/models/rnn.py assembles them behind the model API): the encoder, the memory
and decoding state, and the three decoders.

- ``attention=none``: the bottleneck baseline (Cho et al. 2014; Sutskever et al. 2014): the decoder
  sees one fixed summary of the source, fed at every step.
- ``attention=bahdanau``: Bahdanau et al. 2014: additive attention queried by the previous state.
- ``attention=luong``: Luong et al. 2015: dot / general / concat scores queried by the current state,
  attentional state h̃_t = tanh(W_c [c_t; h_t]), optional input feeding; global, or local within a window around
  the target word's own position (local-m) or a position it predicts (local-p) (``model.local_window``).

With ``model.coverage`` an additive score (Bahdanau's, Luong's concat) also reads the coverage, the attention each
source piece has had so far (app/models/attention.py): the state carries it from step to step, so the decoder loops.

Every decoder has one ``forward(memory, tokens, state)`` that runs T >= 1 steps: ``decode`` calls it
on the whole target, ``step`` on one token. Decoders whose inputs do not depend on earlier outputs
(plain, Luong without input feeding) run the RNN over all T steps in one cuDNN call; the others loop,
one step at a time through the RNN's cell ops (``rnn_step``), as decoding does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from app.config.schema import RNNConfig
from app.models.attention import RNNAttention, rnn_attention

Hidden = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]  # GRU h, or LSTM (h, c): (layers, B, H)


def _top(hidden: Hidden) -> torch.Tensor:
    """The last layer's h: (B, H)."""
    return (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]


@dataclass
class RNNMemory:
    states: torch.Tensor  # (B, S, H) encoder outputs h_1..h_S
    src_mask: torch.Tensor  # (B, S) True at real tokens
    summary: torch.Tensor  # (B, H) final encoder state (both directions), the bottleneck's only view
    keys: Optional[torch.Tensor]  # attention's per-sentence precomputation (U h_j, W_a h̄_s, ...)
    src: torch.Tensor  # (B, S) the source pieces (what model.copy_attention copies)

    def select(self, index: torch.Tensor) -> RNNMemory:
        """Rows ``index`` of the batch (beam search: expand per beam)."""
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        keys = None if self.keys is None else pick(self.keys)
        return RNNMemory(pick(self.states), pick(self.src_mask), pick(self.summary), keys, pick(self.src))


@dataclass
class RNNState:
    hidden: Hidden
    feed: Optional[torch.Tensor] = None  # Luong input feeding: h̃_{t-1} (B, H)
    memory: Optional[RNNMemory] = None  # decoding (``start``): the encoder memory of every row
    position: int = 0  # target positions decoded so far: where local-m attention's window is (Luong's p_t = t)
    coverage: Optional[torch.Tensor] = None  # model.coverage: (B, S) the attention each source piece has had so far

    def select(self, index: torch.Tensor) -> RNNState:
        """Rows ``index`` of the batch (beam search: follow the surviving beams); hidden is batch-second. Fewer
        rows than now: the sentences still decoding, whose memory is the same for all their beams."""
        hidden = (
            (self.hidden[0].index_select(1, index), self.hidden[1].index_select(1, index))
            if isinstance(self.hidden, tuple)
            else self.hidden.index_select(1, index)
        )
        memory = self.memory
        if memory is not None and index.size(0) != memory.states.size(0):
            memory = memory.select(index)
        feed = None if self.feed is None else self.feed.index_select(0, index)
        coverage = None if self.coverage is None else self.coverage.index_select(0, index)
        return RNNState(hidden, feed, memory, self.position, coverage)


def _rnn(cell: str, *args, **kwargs) -> nn.RNNBase:
    return (nn.GRU if cell == "gru" else nn.LSTM)(*args, batch_first=True, **kwargs)


def rnn_step(rnn: nn.RNNBase, x: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
    """One time step of ``rnn`` (a multi-layer GRU/LSTM): x (B, D) -> top layer's output (B, H) and the
    new hidden state. Same weights and result as ``rnn`` on a length-1 sequence, but through the
    per-layer cell ops (one fused gate kernel each on CUDA): a cuDNN RNN call costs more to set up
    than one step of a decoder loop computes."""
    return cell_step(rnn.all_weights, x, hidden, rnn.dropout, rnn.training)


def cell_step(
    weights: Sequence[Sequence[torch.Tensor]], x: torch.Tensor, hidden: Hidden, dropout: float, training: bool
) -> tuple[torch.Tensor, Hidden]:
    """``rnn_step`` given the RNN's per-layer weights (``all_weights``) rather than the module: what a compiled
    decoder step calls (torch.compile does not trace through nn.GRU / nn.LSTM modules)."""
    new_h: list[torch.Tensor] = []
    new_c: list[torch.Tensor] = []  # an LSTM's cells
    for layer, layer_weights in enumerate(weights):
        if layer:
            x = F.dropout(x, dropout, training)  # nn.GRU/LSTM's dropout between layers
        if isinstance(hidden, tuple):
            x, c = torch.lstm_cell(x, (hidden[0][layer], hidden[1][layer]), *layer_weights)
            new_c.append(c)
        else:
            x = torch.gru_cell(x, hidden[layer], *layer_weights)
        new_h.append(x)
    if isinstance(hidden, tuple):
        return x, (torch.stack(new_h), torch.stack(new_c))
    return x, torch.stack(new_h)


class RNNEncoder(nn.Module):
    """Embeddings -> (bi)directional multi-layer GRU/LSTM over packed sequences. With two directions
    each gets hidden/2 units, so outputs are ``hidden`` wide either way (what dot scores need)."""

    def __init__(self, cfg: RNNConfig, embed: nn.Embedding):
        super().__init__()
        directions = 2 if cfg.bidirectional else 1
        if cfg.hidden % directions:
            raise ValueError(f"model.hidden={cfg.hidden} must be even for a bidirectional encoder")
        self.embed, self.dropout, self.directions = embed, nn.Dropout(cfg.dropout), directions
        self.rnn = _rnn(
            cfg.cell,
            cfg.emb_dim,
            cfg.hidden // directions,
            cfg.enc_layers,
            bidirectional=cfg.bidirectional,
            dropout=cfg.dropout if cfg.enc_layers > 1 else 0.0,
        )

    def forward(
        self, src: torch.Tensor, src_mask: torch.Tensor, lengths: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``lengths``: the host-side source lengths when known (training batches carry them); else read
        from the mask on the device, which makes the host wait for it."""
        lengths = src_mask.sum(-1).cpu() if lengths is None else lengths
        packed = pack_padded_sequence(self.dropout(self.embed(src)), lengths, batch_first=True, enforce_sorted=False)
        out, final = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        h = final[0] if isinstance(final, tuple) else final  # (layers * directions, B, H / directions)
        summary = h[-self.directions :].transpose(0, 1).flatten(1)  # last layer, directions concatenated
        return self.dropout(out), summary


class RNNDecoder(nn.Module):
    """What the three decoders share: target embeddings, the RNN, the vocabulary projection (``out_proj``, which
    the model applies to what ``forward`` returns: the output layer's inputs, (B, T, out_dim)).
    ``loops``: whether it runs target positions one ``loop_step`` at a time (what train.compile compiles);
    ``loop_dims``: per argument of ``loop_step``, the dimensions that vary between batches (batch, source
    length), which a compiled step takes as symbols from its first call on. ``loop_step`` gets the RNN's
    weights as its last argument, so that a compiled step never touches the RNN module."""

    ONCE_PER_SENTENCE = ("bridge",)  # the initial state from the encoder's summary (app/models/flops.py)
    loop_dims: tuple = ()
    loop_step: Callable[..., tuple]  # a decoder that loops: one target position
    attention: RNNAttention  # a decoder with attention (Bahdanau's, Luong's)

    def __init__(self, cfg: RNNConfig, embed: nn.Embedding, rnn_input: int, out_dim: int, vocab: int):
        super().__init__()
        self.cfg, self.embed, self.dropout = cfg, embed, nn.Dropout(cfg.dropout)
        activation = cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout
        self.output_dropout = nn.Dropout(activation)  # on the output layer's tanh activations
        self.rnn_dropout = cfg.dropout if cfg.dec_layers > 1 else 0.0  # between the RNN's layers
        self.rnn = _rnn(cfg.cell, rnn_input, cfg.hidden, cfg.dec_layers, dropout=self.rnn_dropout)
        self.bridge = nn.Linear(cfg.hidden, cfg.dec_layers * cfg.hidden)
        self.out_proj = nn.Linear(out_dim, vocab, bias=False)
        if cfg.tie_embeddings:
            if out_dim != cfg.emb_dim:
                raise ValueError(
                    f"model.tie_embeddings needs the output layer input ({out_dim}) to equal "
                    f"model.emb_dim ({cfg.emb_dim})"
                )
            self.out_proj.weight = embed.weight

    @property
    def loops(self) -> bool:
        return False

    def run_rnn(self, x: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        """The decoder RNN over x (B, T, D): one cuDNN call for a sequence, the cell ops for one step."""
        if x.size(1) > 1:
            return self.rnn(x, hidden)
        out, hidden = rnn_step(self.rnn, x[:, 0], hidden)
        return out[:, None], hidden

    def initial_state(self, memory: RNNMemory) -> RNNState:
        """Bridge: s_0 = tanh(W_b h_final) for every decoder layer (LSTM cells start at zero)."""
        h0 = (
            torch.tanh(self.bridge(memory.summary))
            .unflatten(-1, (self.cfg.dec_layers, self.cfg.hidden))
            .transpose(0, 1)
            .contiguous()
        )
        # zeros that require a gradient while training, as every later state does: a compiled loop step
        # then sees one kind of input at every position (its guards check requires_grad)
        hidden = (h0, torch.zeros_like(h0, requires_grad=h0.requires_grad)) if self.cfg.cell == "lstm" else h0
        coverage = None
        if self.cfg.coverage:  # in at least fp32: a bf16 sum of a hundred weights would lose their last steps
            states = memory.states
            dtype = torch.promote_types(states.dtype, torch.float32)
            coverage = torch.zeros(memory.src_mask.shape, dtype=dtype, device=states.device)
            coverage.requires_grad_(states.requires_grad)
        return RNNState(hidden, coverage=coverage)

    def attend_covering(self, query: torch.Tensor, keys, states, src_mask, coverage: Optional[torch.Tensor], **kw):
        """The context and weights of one target position's ``query`` (B, 1, Dq), and the coverage after it
        (c_{t+1} = c_t + α_t; None without model.coverage)."""
        c, alpha = self.attention(
            query, keys, states, src_mask, coverage=None if coverage is None else coverage[:, None], **kw
        )
        if coverage is not None:
            coverage = coverage + alpha[:, 0].to(coverage.dtype)
        return c, alpha, coverage


class PlainDecoder(RNNDecoder):
    """s_t = RNN([E y_{t-1}; c], s_{t-1}) with c the fixed source summary; output from [s_t; c; E y_{t-1}]."""

    def __init__(self, cfg: RNNConfig, embed: nn.Embedding, vocab: int):
        super().__init__(cfg, embed, cfg.emb_dim + cfg.hidden, cfg.emb_dim, vocab)
        self.pre_output = nn.Linear(2 * cfg.hidden + cfg.emb_dim, cfg.emb_dim)

    def forward(self, memory: RNNMemory, tokens: torch.Tensor, state: RNNState, need_attention: bool = False):
        y = self.dropout(self.embed(tokens))
        c = memory.summary[:, None, :].expand(-1, tokens.size(1), -1)
        s, hidden = self.run_rnn(torch.cat([y, c], -1), state.hidden)
        out = self.output_dropout(torch.tanh(self.pre_output(torch.cat([s, c, y], -1))))
        return out, None, RNNState(hidden)


class BahdanauDecoder(RNNDecoder):
    """Bahdanau et al. 2014: α_t from e_tj = vᵀ tanh(W s_{t-1} + U h_j); c_t = Σ_j α_tj h_j;
    s_t = RNN([E y_{t-1}; c_t], s_{t-1}); output from [s_t; c_t; E y_{t-1}]. The query is the
    *previous* state, so steps run one after another."""

    loops = True
    # y_t, hidden (layers, B, H), coverage (B, S) or None, keys, states, src_mask
    loop_dims = ((0,), (1,), (0, 1), (0, 1), (0, 1), (0, 1))

    def __init__(self, cfg: RNNConfig, embed: nn.Embedding, vocab: int):
        super().__init__(cfg, embed, cfg.emb_dim + cfg.hidden, cfg.emb_dim, vocab)
        self.attention = rnn_attention(
            "bahdanau", cfg.hidden, cfg.hidden, cfg.hidden, cfg.attention_dropout, coverage=cfg.coverage
        )
        self.pre_output = nn.Linear(2 * cfg.hidden + cfg.emb_dim, cfg.emb_dim)

    def forward(self, memory: RNNMemory, tokens: torch.Tensor, state: RNNState, need_attention: bool = False):
        y = self.dropout(self.embed(tokens))
        hidden, coverage, outputs, weights = state.hidden, state.coverage, [], []
        for t in range(tokens.size(1)):
            out, alpha, hidden, coverage = self.loop_step(
                y[:, t], hidden, coverage, memory.keys, memory.states, memory.src_mask, self.rnn.all_weights
            )
            outputs.append(out)
            weights.append(alpha)
        out = self.output_dropout(torch.tanh(self.pre_output(torch.stack(outputs, 1))))
        return out, torch.cat(weights, 1) if need_attention else None, RNNState(hidden, coverage=coverage)

    def loop_step(self, y_t, hidden, coverage, keys, states, src_mask, weights):
        """One target position: attend with s_{t-1}, then s_t. Returns [s_t; c_t; E y_{t-1}], α_t, hidden and the
        coverage after it."""
        c, alpha, coverage = self.attend_covering(_top(hidden)[:, None, :], keys, states, src_mask, coverage)
        c = c[:, 0]
        s, hidden = cell_step(weights, torch.cat([y_t, c], -1), hidden, self.rnn_dropout, self.training)
        return torch.cat([s, c, y_t], -1), alpha, hidden, coverage


class LuongDecoder(RNNDecoder):
    """Luong et al. 2015: h_t = RNN(E y_{t-1} [; h̃_{t-1}]), α_t from score(h_t, h̄_s),
    h̃_t = tanh(W_c [c_t; h_t]), p(y_t) = softmax(W_s h̃_t)."""

    # y_t, feed, hidden, coverage, keys, states, src_mask, position (feed and coverage: None when off)
    loop_dims = ((0,), (0,), (1,), (0, 1), (0, 1), (0, 1), (0, 1), ())

    def __init__(self, cfg: RNNConfig, embed: nn.Embedding, vocab: int):
        feed = cfg.hidden if cfg.input_feeding else 0
        super().__init__(cfg, embed, cfg.emb_dim + feed, cfg.hidden, vocab)
        monotonic = cfg.local_alignment == "monotonic"
        self.reads_positions = bool(cfg.local_window) and monotonic  # local-m: its window sits at the position
        self.attention = rnn_attention(
            cfg.score,
            cfg.hidden,
            cfg.hidden,
            cfg.hidden,
            cfg.attention_dropout,
            cfg.local_window,
            monotonic,
            cfg.coverage,
        )
        self.W_c = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)

    def initial_state(self, memory: RNNMemory) -> RNNState:
        state = super().initial_state(memory)
        if self.cfg.input_feeding:
            summary = memory.summary  # h̃_0 = 0, requiring a gradient when later feeds do (see RNNDecoder)
            state.feed = summary.new_zeros(summary.size(0), self.cfg.hidden, requires_grad=summary.requires_grad)
        return state

    @property
    def loops(self) -> bool:
        return self.cfg.input_feeding or self.cfg.coverage  # each step reads the last's h̃, or its coverage

    def attentional(self, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h̃ = tanh(W_c [c; h]) of contexts c and queries h."""
        return self.output_dropout(torch.tanh(self.W_c(torch.cat([c, h], -1))))

    def attend(self, h: torch.Tensor, keys, states, src_mask, positions: Optional[torch.Tensor]):
        """h̃ for queries h (B, T, H) at target ``positions`` (T,; None where the attention does not read them), with
        the weights α."""
        c, alpha = self.attention(h, keys, states, src_mask, positions)
        return self.attentional(c, h), alpha

    def forward(self, memory: RNNMemory, tokens: torch.Tensor, state: RNNState, need_attention: bool = False):
        y, steps = self.dropout(self.embed(tokens)), tokens.size(1)
        positions = None  # only local-m reads them: no op per step for the others
        if self.reads_positions:
            positions = torch.arange(state.position, state.position + steps, device=tokens.device)
        if not self.loops:  # all T steps in one RNN call and one batched attention
            h, hidden = self.run_rnn(y, state.hidden)
            h_tilde, alpha = self.attend(h, memory.keys, memory.states, memory.src_mask, positions)
            return h_tilde, alpha if need_attention else None, RNNState(hidden, position=state.position + steps)
        hidden, feed, coverage, outputs, weights = state.hidden, state.feed, state.coverage, [], []
        for t in range(steps):
            h_tilde, alpha, hidden, coverage = self.loop_step(
                y[:, t],
                feed,
                hidden,
                coverage,
                memory.keys,
                memory.states,
                memory.src_mask,
                None if positions is None else positions[t : t + 1],
                self.rnn.all_weights,
            )
            outputs.append(h_tilde)
            weights.append(alpha)
            feed = h_tilde if self.cfg.input_feeding else None
        out, attention = torch.stack(outputs, 1), torch.cat(weights, 1) if need_attention else None
        return out, attention, RNNState(hidden, feed, position=state.position + steps, coverage=coverage)

    def loop_step(self, y_t, feed, hidden, coverage, keys, states, src_mask, position, weights):
        """One target position (``position``, (1,), or None): h_t from [E y_{t-1}; h̃_{t-1}] with input feeding (from
        E y_{t-1} alone without: ``feed`` None), then h̃_t (the next feed), with the coverage after it."""
        x = y_t if feed is None else torch.cat([y_t, feed], -1)
        h, hidden = cell_step(weights, x, hidden, self.rnn_dropout, self.training)
        c, alpha, coverage = self.attend_covering(h[:, None], keys, states, src_mask, coverage, positions=position)
        return self.attentional(c, h[:, None])[:, 0], alpha, hidden, coverage


DECODERS = {"none": PlainDecoder, "bahdanau": BahdanauDecoder, "luong": LuongDecoder}
