"""Drawing each next token at random instead of taking the most probable one (``decode.sampling``): what
back-translation by sampling uses (Edunov et al. 2018, "Understanding Back-Translation at Scale": sampled
source sides train a better model than beam search's), with the usual ways to narrow the draw, in the order
CTranslate2 applies them: a temperature, the k most probable tokens (top-k; Fan et al. 2018), the smallest
set of tokens holding probability p (nucleus, top-p; Holtzman et al. 2020). Between the temperature and the two
cuts, the tokens less probable than ε can be dropped (epsilon sampling; Hewitt et al. 2022, "Truncation Sampling
as Language Model Desmoothing"): the candidates minimum Bayes risk decoding chooses best among (Freitag et al.
2023, "Epsilon Sampling Rocks"). CTranslate2 has no epsilon.

The draw is inverse transform sampling: one uniform number u per row, and the first token whose cumulative
probability passes u × their sum (in float64). It stays on the device (no host sync), costs one random number a
row where the Gumbel-max trick costs one a token (docs/benchmarking.md#measurements-behind-the-code), and
a seeded generator makes the same settings, batches and device give the same samples."""

from __future__ import annotations

from typing import Optional

import torch

from app.config.commands import DecodeConfig


def top_p_filter(logp: torch.Tensor, p: float) -> torch.Tensor:
    """``logp`` (rows, vocab) keeping per row the most probable tokens until their probability reaches ``p``
    (the smallest such set: a token is kept when the tokens above it hold less than p; the first always is)."""
    if p >= 1.0:
        return logp
    ordered, order = logp.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    # the probability of the tokens ranked above each, summed without subtracting (cumsum - probs rounds a sum that
    # is exactly p to just under it: 0.5, 0.4, 0.1 at p = 0.5 kept two)
    before = torch.cat([probs.new_zeros(*probs.shape[:-1], 1), probs[..., :-1].cumsum(-1)], -1)
    drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= p)  # in vocabulary order
    return logp.masked_fill(drop, float("-inf"))


def epsilon_filter(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``scores`` (rows, vocab) without, per row, the tokens whose probability softmax(scores) is below ``epsilon``;
    the most probable is always kept."""
    probs = scores.softmax(-1)
    drop = (probs < epsilon) & (probs < probs.amax(-1, keepdim=True))
    return scores.masked_fill(drop, float("-inf"))


class Sampler:
    """Draws one token per row of next-token log-probabilities, as ``decode.sampling_*`` say."""

    def __init__(
        self, topk: int, topp: float, temperature: float, generator: torch.Generator, epsilon: float = 0.0
    ) -> None:
        self.topk, self.topp, self.temperature, self.generator = topk, topp, temperature, generator
        self.epsilon = epsilon

    def narrowed(self, logp: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """What a token is drawn from: scores whose softmax is the sampling distribution, (rows, k) of the k most
        probable tokens with their ids (rows, k), or (rows, vocab) with None."""
        scores, ids = logp / self.temperature, None
        if self.epsilon > 0:
            scores = epsilon_filter(scores, self.epsilon)
        if 0 < self.topk < scores.size(-1):
            scores, ids = scores.topk(self.topk, dim=-1)
        return top_p_filter(scores, self.topp), ids

    def __call__(self, logp: torch.Tensor) -> torch.Tensor:
        scores, ids = self.narrowed(logp)
        cumulative = scores.softmax(-1).double().cumsum(-1)
        u = torch.rand(len(cumulative), 1, generator=self.generator, device=cumulative.device, dtype=torch.float64)
        # right: a token of probability 0 (a flat step of the sum) is never the first to pass
        choice = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True).clamp_(max=scores.size(-1) - 1)
        return (choice if ids is None else ids.gather(-1, choice)).squeeze(-1)


def make_sampler(decode: DecodeConfig, device: torch.device) -> Sampler | None:
    """The sampler ``decode`` asks for on ``device``, seeded with ``decode.sampling_seed``; None
    when it does not sample."""
    if not decode.sampling:
        return None
    generator = torch.Generator(device=device).manual_seed(decode.sampling_seed)
    d = decode
    return Sampler(d.sampling_topk, d.sampling_topp, d.sampling_temperature, generator, d.sampling_epsilon)
