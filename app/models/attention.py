"""The attention family.

Every module returns the context vectors and, when asked, the attention weights: a distribution over
key positions for every query (rows sum to 1, masked keys get exactly 0).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.models.positions import Rotation

# cuDNN's SDPA backend builds an execution plan for every new shape, which length-bucketed batches keep
# asking for (docs/benchmarking.md#measurements-behind-the-code). Flash / memory-efficient kernels need no
# plans, so leave those to the dispatcher.
torch.backends.cuda.enable_cudnn_sdp(False)


def attention_weights(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last axis with masked positions (mask == False) at exactly zero weight."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # softmax in at least fp32: under bf16 autocast the weights are what gets plotted and summed
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(scores.dtype)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """(length, length): query i may attend to keys j <= i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def band_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """(length, length): query i may attend to keys j with |i - j| <= window (sliding-window attention)."""
    position = torch.arange(length, device=device)
    return (position[:, None] - position[None, :]).abs() <= window


class MultiHeadAttention(nn.Module):
    """Scaled dot-product multi-head attention (Vaswani et al. 2017, "Attention Is All You Need", eq. 1):

        Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + B) V,   head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V),
        MultiHead(Q, K, V) = Concat(head_1 … head_h) W^O,

    with an optional additive score bias B (ALiBi) and an optional rotation of queries and keys (RoPE)
    by their positions (app/models/positions.py). With ``kv_heads`` < ``heads`` the keys and values
    have fewer heads, each shared by heads / kv_heads query heads: grouped-query attention (Ainslie
    et al. 2023), multi-query attention (Shazeer 2019) when kv_heads = 1. Keys and values, and so a
    decoder's cache of them, stay at kv_heads heads; they are shared out only inside the attention.

    The projections are fused: self-attention (``self_attention=True``) computes [Q K V] = x [W^Q W^K W^V]
    in one matrix multiply (``qkv_proj``); attention to another sequence computes its queries (``q_proj``)
    and the other sequence's [K V] (``kv_proj``) in one each. Inputs are (B, T, D), or (B·T, D) rows with
    ``batch`` = B: the Transformer keeps its residual stream in rows, so that no linear layer reshapes.

    The fast path calls ``F.scaled_dot_product_attention`` and never materializes the weights;
    ``need_weights=True`` computes them explicitly instead, for plots and alignments. Both paths
    compute the same function. On GPU, a mask or bias given as ``attn_mask`` rules out the flash
    kernel: key padding masks, the ALiBi bias and the sliding window run on the memory-efficient
    kernel, while causal self-attention without a bias (is_causal) and RoPE (a rotation before the
    call) keep flash. At sentence lengths the memory-efficient kernel is the fastest that takes a mask
    on an H200 (cuDNN wins from about 300 keys on: scripts/sdpa_backends.py, docs/gpu/2026-11-28-budget).
    """

    # its projections applied to the memory, once per source token (app/models/flops.py): [K V] of cross-attention
    SOURCE_SIDE = ("kv_proj",)

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0, kv_heads: int = 0, self_attention: bool = False):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.heads={heads}")
        if kv_heads < 0 or (kv_heads and heads % kv_heads):
            raise ValueError(
                f"model.kv_heads={kv_heads} must divide model.heads={heads} "
                "(1 = multi-query, 0 = heads: plain multi-head attention)"
            )
        self.heads, self.kv_heads, self.d_head, self.dropout = heads, kv_heads or heads, d_model // heads, dropout
        self.self_attention = self_attention
        # output rows of the fused projections: [Q K V] or [K V]
        self.sizes = [heads * self.d_head, self.kv_heads * self.d_head, self.kv_heads * self.d_head]
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, sum(self.sizes))
        else:
            self.q_proj = nn.Linear(d_model, self.sizes[0])
            self.kv_proj = nn.Linear(d_model, sum(self.sizes[1:]))
        self.out_proj = nn.Linear(d_model, d_model)

    def weight_blocks(self) -> dict[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The fused weight and its blocks (W^Q, W^K, W^V or W^K, W^V) as views, in that order."""
        if self.self_attention:
            return {self.qkv_proj.weight: self.qkv_proj.weight.split(self.sizes)}
        return {self.kv_proj.weight: self.kv_proj.weight.split(self.sizes[1:])}

    def split_heads(self, x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
        """(B·T, heads·d_head) rows -> (B, heads, T, d_head)."""
        return x.view(batch, -1, heads, self.d_head).transpose(1, 2)

    def project(
        self, query: torch.Tensor, key_value: Optional[torch.Tensor], batch: int, rotation: Optional[Rotation] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, heads, Tq, d_head), keys and values (B, kv_heads, Tk, d_head) of (B·T, D) rows; RoPE turns
        queries and keys by their positions."""
        if self.self_attention:
            if key_value is not None and key_value is not query:
                raise ValueError("a self-attention module attends over its own input: key_value must be None")
            qkv = self.split_heads(self.qkv_proj(query), batch, self.heads + 2 * self.kv_heads)
            if rotation is None:
                return qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            # queries and keys are neighbouring heads at the same positions: one rotation turns both
            qk, v = qkv.split([self.heads + self.kv_heads, self.kv_heads], dim=1)
            q, k = rotation(qk).split([self.heads, self.kv_heads], dim=1)
            return q, k, v
        q = self.split_heads(self.q_proj(query), batch, self.heads)
        k, v = self.split_heads(
            self.kv_proj(query if key_value is None else key_value), batch, 2 * self.kv_heads
        ).chunk(2, dim=1)
        if rotation is not None:
            q, k = rotation(q), rotation(k)
        return q, k, v

    def project_kv(self, x: torch.Tensor, rotation: Optional[Rotation] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, kv_heads, T, d_head) of x (B, T, D); RoPE keys come out already rotated."""
        _, k, v = self.project(x.flatten(0, 1), None, x.size(0), rotation)
        return k, v

    def share_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, kv_heads, T, d_head) -> (B, heads, T, d_head): query head h reads key/value head h // group."""
        group = self.heads // self.kv_heads
        return x if group == 1 else x.repeat_interleave(group, dim=1)

    def forward(
        self,
        query: torch.Tensor,  # (B, Tq, D), or (B·Tq, D) with batch
        key_value: Optional[torch.Tensor] = None,  # (B, Tk, D) or (B·Tk, D); None: the query's own sequence
        mask: Optional[torch.Tensor] = None,  # bool, broadcastable to (B, H, Tq, Tk); True = may attend
        causal: bool = False,
        need_weights: bool = False,
        rotation: Optional[Rotation] = None,  # RoPE angles of the queries and keys (self-attention)
        bias: Optional[torch.Tensor] = None,  # float, broadcastable to (B, H, Tq, Tk): added to the scores
        batch: Optional[int] = None,  # B when the inputs are rows
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The attention's output, shaped as ``query``, and with ``need_weights`` its weights (B, H, Tq, Tk)."""
        rows = batch is not None
        if batch is None:
            batch = query.size(0)
            query = query.flatten(0, 1)
            key_value = None if key_value is None else key_value.flatten(0, 1)
        q, k, v = self.project(query, key_value, batch, rotation)
        if causal and (need_weights or bias is not None):  # SDPA's is_causal excludes an attn_mask
            future = causal_mask(q.size(-2), q.device)
            mask, causal = (future if mask is None else mask & future), False
        dropout = self.dropout if self.training else 0.0
        if not need_weights:
            attn_mask = mask if bias is None else _masked_bias(bias.to(q.dtype), mask)
            grouped = self.kv_heads < self.heads
            if grouped and attn_mask is not None:  # SDPA's enable_gqa runs on GPU only in the flash and math kernels
                k, v = self.share_kv(k), self.share_kv(v)
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout,
                is_causal=causal,
                enable_gqa=grouped and attn_mask is None,
            )
            weights = None
        else:
            scores = q @ self.share_kv(k).transpose(-2, -1) / math.sqrt(self.d_head)
            weights = attention_weights(scores if bias is None else scores + bias, mask)
            context = F.dropout(weights, dropout) @ self.share_kv(v)
        out = self.out_proj(context.transpose(1, 2).reshape(query.size(0), -1))
        return (out if rows else out.view(batch, -1, out.size(-1))), weights

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Checkpoints written before the projections were fused hold q_proj, k_proj and v_proj: fused here."""
        old = [f"{prefix}{name}_proj." for name in ("q", "k", "v")]
        if all(f"{p}weight" in state_dict for p in old):
            parts = old if self.self_attention else old[1:]
            fused = f"{prefix}qkv_proj." if self.self_attention else f"{prefix}kv_proj."
            for kind in ("weight", "bias"):
                state_dict[f"{fused}{kind}"] = torch.cat([state_dict.pop(f"{p}{kind}") for p in parts])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _masked_bias(bias: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """One float attn_mask for SDPA: the bias, and -inf where the mask forbids."""
    return bias if mask is None else torch.where(mask, bias, float("-inf"))


class RNNAttention(nn.Module):
    """Attention over encoder states h_1..h_S for a recurrent decoder.

    ``prepare(states)`` computes whatever depends on the source alone, once per sentence;
    ``forward`` scores any number of queries at once (one decoding step, or every step of a target
    when the queries do not depend on earlier contexts) and returns the context vectors
    c = Σ_j α_j h_j with the weights α (batch, queries, S). ``dropout`` (model.attention_dropout) drops weights
    of the context while training, as a Transformer's attention does; the weights returned are never dropped.
    """

    dropout: float = 0.0

    def prepare(self, states: torch.Tensor) -> torch.Tensor:
        return states

    def score(self, query: torch.Tensor, keys: torch.Tensor, coverage: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T, S); ``coverage`` (B, T, S): the attention each source piece has had before (additive scores)."""
        raise NotImplementedError

    def forward(self, query, keys, values, mask, positions=None, coverage=None):
        """query (B, T, Dq), keys from prepare (B, S, ·), values (B, S, Dv), mask (B, S) True at tokens; ``positions``
        (T,): the queries' target positions, which local-m attention reads (LocalAttention); ``coverage`` (B, T, S):
        the attention each source piece had before each query (model.coverage, AdditiveAttention)."""
        weights = attention_weights(self.score(query, keys, coverage), mask[:, None, :])
        return F.dropout(weights, self.dropout, self.training) @ values, weights


class AdditiveAttention(RNNAttention):
    """Bahdanau, Cho & Bengio 2014, "Neural Machine Translation by Jointly Learning to Align and
    Translate" (arXiv:1409.0473), eq. 6 / appendix A.1.2:

        e_tj = vᵀ tanh(W s_{t-1} + U h_j),   α_tj = softmax_j(e_tj)

    U h_j does not depend on t: ``prepare`` computes it once per sentence.

    With ``coverage``, the coverage mechanism (Tu et al. 2016, "Modeling Coverage for Neural Machine Translation";
    See et al. 2017, "Get To The Point", eq. 11): the score also reads the coverage c_tj = Σ_{t'<t} α_t'j, the
    attention source piece j has had so far, so that the model can learn not to attend to it again:

        e_tj = vᵀ tanh(W s_{t-1} + U h_j + w_c c_tj)
    """

    SOURCE_SIDE = ("U",)  # U h_j: once per source token (app/models/flops.py)

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int, coverage: bool = False):
        super().__init__()
        self.W = nn.Linear(query_dim, attn_dim, bias=False)
        self.U = nn.Linear(key_dim, attn_dim, bias=False)
        self.v = nn.Linear(attn_dim, 1, bias=False)
        # w_c starts at 0, where the score is Bahdanau's: the mechanism can be added to a trained model
        self.w_c = nn.Parameter(torch.zeros(attn_dim)) if coverage else None

    def prepare(self, states):
        return self.U(states)

    def score(self, query, keys, coverage=None):
        energy = self.W(query)[:, :, None, :] + keys[:, None, :, :]  # (B, T, S, attn_dim)
        if self.w_c is not None:
            if coverage is None:
                raise ValueError("this attention has the coverage mechanism (model.coverage): give it the coverage")
            # in place, as the tanh: the (B, T, S, attn_dim) energies are the step's largest tensor, and no backward
            # reads them before the tanh (with a new tensor for each, beam search took 1.3× the plain model's time
            # on a CPU; in place, 1.17×)
            energy.addcmul_(coverage[..., None].to(energy.dtype), self.w_c)
        return self.v(energy.tanh_()).squeeze(-1)


class DotAttention(RNNAttention):
    """Luong, Pham & Manning 2015, "Effective Approaches to Attention-based Neural Machine
    Translation" (arXiv:1508.04025), eq. 8, dot:      score(h_t, h̄_s) = h_tᵀ h̄_s"""

    def score(self, query, keys, coverage=None):
        return query @ keys.transpose(1, 2)


class GeneralAttention(RNNAttention):
    """Luong et al. 2015, eq. 8, general:   score(h_t, h̄_s) = h_tᵀ W_a h̄_s

    W_a h̄_s does not depend on t: ``prepare`` computes it once per sentence."""

    SOURCE_SIDE = ("W_a",)  # W_a h̄_s: once per source token (app/models/flops.py)

    def __init__(self, query_dim: int, key_dim: int):
        super().__init__()
        self.W_a = nn.Linear(key_dim, query_dim, bias=False)

    def prepare(self, states):
        return self.W_a(states)

    def score(self, query, keys, coverage=None):
        return query @ keys.transpose(1, 2)


class ConcatAttention(AdditiveAttention):
    """Luong et al. 2015, eq. 8, concat:    score(h_t, h̄_s) = v_aᵀ tanh(W_a [h_t; h̄_s])

    Splitting W_a = [W_q  W_k] makes this the additive form: v_aᵀ tanh(W_q h_t + W_k h̄_s). The
    difference from Bahdanau is the query: the current state h_t, not the previous one."""


class LocalAttention(RNNAttention):
    """Luong et al. 2015, §3.2: each target word attends to a window of 2D + 1 source words around an aligned
    position p_t, with the scores of any global ``inner`` score within it.

    local-m (monotonic alignment): p_t = t, the target word's own position, and a_t = softmax of the scores over
    the window (eq. 7). local-p (predictive alignment), the position predicted (eq. 9) and the scores weighted by
    a Gaussian centred there (eq. 10):

        p_t = (S_x - 1) · sigmoid(v_pᵀ tanh(W_p h_t))
        a_t(s) ∝ exp(score(h_t, h̄_s)) · exp(-(s - p_t)² / 2σ²)   for |s - p_t| <= D, else 0;  σ = D / 2

    S_x is the sentence's source length, its EOS included (the paper's S, less one so that the window always holds
    a source position; local-m's p_t stops there too). The paper multiplies the window's softmax by the Gaussian;
    here the product is renormalized over the window, so that a row is a distribution as every attention of the
    model API is. p_t is learned through the Gaussian, which is differentiable in it."""

    def __init__(self, inner: RNNAttention, query_dim: int, window: int, monotonic: bool = False):
        super().__init__()
        self.inner, self.window, self.monotonic = inner, window, monotonic
        if not monotonic:
            self.W_p = nn.Linear(query_dim, query_dim, bias=False)
            self.v_p = nn.Linear(query_dim, 1, bias=False)

    def prepare(self, states):
        return self.inner.prepare(states)

    def aligned_positions(
        self, query: torch.Tensor, mask: torch.Tensor, positions: Optional[torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """p_t (B, T, 1) in ``dtype`` of queries (B, T, Dq) at target ``positions`` (T,) over sources whose tokens
        ``mask`` (B, S) marks."""
        last = (mask.sum(-1) - 1)[:, None, None]
        if self.monotonic:
            if positions is None:
                raise ValueError("local-m attention needs the target positions of its queries")
            return torch.minimum(positions[None, :, None], last).to(dtype)
        # the sigmoid in dtype too: under bf16 autocast its output's 8 significant bits would round p_t to steps of
        # up to 0.4 source words in a 100-word sentence
        return last.to(dtype) * torch.sigmoid(self.v_p(torch.tanh(self.W_p(query))).to(dtype))

    def forward(self, query, keys, values, mask, positions=None, coverage=None):
        dtype = torch.promote_types(query.dtype, torch.float32)  # positions and the Gaussian in at least fp32
        p = self.aligned_positions(query, mask, positions, dtype)
        distance = torch.arange(mask.size(-1), device=mask.device, dtype=dtype) - p  # (B, T, S)
        scores = self.inner.score(query, keys, coverage).to(dtype)
        if not self.monotonic:
            scores = scores - distance.square() / (2 * (self.window / 2) ** 2)
        weights = attention_weights(scores, mask[:, None, :] & (distance.abs() <= self.window)).to(values.dtype)
        return F.dropout(weights, self.dropout, self.training) @ values, weights


def rnn_attention(
    kind: str,
    query_dim: int,
    key_dim: int,
    attn_dim: int,
    dropout: float = 0.0,
    local_window: int = 0,
    monotonic: bool = False,
    coverage: bool = False,
) -> RNNAttention:
    """The attention ``kind`` (bahdanau, or Luong's dot, general, concat) for queries of ``query_dim`` over keys of
    ``key_dim``; with ``local_window`` D > 0, Luong's local attention within D of its aligned positions
    (LocalAttention: local-m when ``monotonic``, else local-p); with ``coverage``, an additive score that reads the
    coverage (AdditiveAttention)."""
    attention: RNNAttention
    if coverage and kind not in ("bahdanau", "concat"):
        raise ValueError(f"the coverage mechanism needs an additive score (bahdanau or concat), not {kind!r}")
    if kind == "bahdanau" or kind == "concat":
        attention = (AdditiveAttention if kind == "bahdanau" else ConcatAttention)(
            query_dim, key_dim, attn_dim, coverage
        )
    elif kind == "dot":
        if query_dim != key_dim:
            raise ValueError(f"dot attention needs equal decoder and encoder output sizes ({query_dim} != {key_dim})")
        attention = DotAttention()
    elif kind == "general":
        attention = GeneralAttention(query_dim, key_dim)
    else:
        raise ValueError(f"attention score {kind!r} is unknown; choose bahdanau, dot, general or concat")
    if local_window:
        attention = LocalAttention(attention, query_dim, local_window, monotonic)
    attention.dropout = dropout
    return attention
