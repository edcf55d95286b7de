"""Batched beam search (``BeamSearch``) over the model API, on the device; the host reads its results once."""

from __future__ import annotations

from typing import Optional

import torch

from app.data.tokenizer import BOS, EOS, PAD
from app.decode.constraints import PhraseConstraints
from app.decode.penalties import coverage_penalty, length_penalty
from app.decode.search import Hypotheses, Search, attention_to_host, by_step, sentence_attention
from app.models.api import MemoryT, Seq2Seq, StateT
from app.run.errors import UserError


class BeamSearch(Search[MemoryT, StateT]):
    """Batched beam search: all sentences and beams of the batch advance together, on the device.

    Every step extends the live beams by every token, keeps the 2k best candidates per sentence, sets
    aside those ending in EOS among the first k (scored log p(Y|X) / lp(Y)), and continues with the k
    best others. A sentence is done when k hypotheses have ended and its best live beam, ended at the
    next step, would not rank among them; each beam ends at its length limit. With k = 1 and α = 0
    this is greedy search (with α > 0 one beam may go on past an EOS that a longer hypothesis beats).

    Per step only the k best ended scores are kept (what the stopping rule needs); every ended
    candidate is written out with the step and the beam it came from, and the n best of each sentence
    are ranked once, at the end (a stable sort of them in the order they ended ranks equal scores as
    the step-by-step merge would), then read back along the backpointers.

    With a coverage penalty β (``decode.coverage_penalty``), every row carries its coverage, the attention each
    source position got over its steps, and a hypothesis that ends adds β Σ log min(coverage, 1) to its score
    (``coverage_penalty``); the live beams are ranked by log p alone, as GNMT's and CTranslate2's are.

    With terminology ``constraints`` (``PhraseConstraints.allocate``: dynamic beam allocation), EOS among the k
    best candidates that have met every phrase ends a hypothesis, and the beam continues with the first k others
    taken round-robin over the banks of constraint pieces met. A sentence with phrases is done once its best live
    beam would not rank among the n best ended (``n_best``, what it returns): its banks that have met less keep
    beams of high scores that rarely end, and waiting for k ended hypotheses kept most sentences to their limit.
    """

    def __init__(
        self,
        model: Seq2Seq[MemoryT, StateT],
        src: torch.Tensor,
        beam_size: int = 5,
        alpha: float = 1.0,
        max_len_ratio: float = 1.5,
        max_len_extra: int = 10,
        n_best: int = 1,
        need_attention: bool = False,
        onednn: bool = True,
        no_repeat_ngram_size: int = 0,
        prefix: Optional[torch.Tensor] = None,
        constraints: Optional[PhraseConstraints] = None,
        min_len: int = 0,
        coverage_penalty: float = 0.0,
    ):
        settings = (max_len_ratio, max_len_extra, need_attention, onednn, no_repeat_ngram_size, prefix, constraints)
        super().__init__(model, src, beam_size, *settings, min_len)
        k, device, batch = beam_size, self.device, self.batch
        self.alpha, self.n_best = alpha, n_best
        # GNMT's coverage penalty β: each row's attention summed over its steps so far, per source position
        self.beta = coverage_penalty
        self.coverage = torch.zeros(batch * k, src.size(1), device=device) if coverage_penalty else None
        self.step_attention = need_attention or bool(coverage_penalty)
        scores = torch.full((batch, k), float("-inf"), device=device)
        scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
        self.scores = scores.view(-1, 1)  # (rows, 1) log p of each live beam
        self.row_limits = self.limits.repeat_interleave(k)
        self.prev = torch.full((batch * k,), BOS, dtype=torch.long, device=device)
        self.kth_best = torch.full((batch, k), float("-inf"), device=device)  # the k best ended scores so far
        self.live = torch.ones(batch, 1, dtype=torch.bool, device=device)  # not done
        self.offsets = (torch.arange(batch, device=device) * k)[:, None]
        # backpointers: after step t, row j continues row parents[t][j] of the rows entering step t, with
        # token tokens[t][j]; attention[t]: the rows entering step t
        self.history_tokens: list[torch.Tensor] = []
        self.history_parents: list[torch.Tensor] = []
        self.history_attention: list[torch.Tensor] = []
        # every ended candidate: (batch, steps, k) scores (-inf: none) and the row it ended from
        self.ended_scores = torch.full((batch, self.steps, k), float("-inf"), device=device)
        self.ended_rows = torch.zeros((batch, self.steps, k), dtype=torch.long, device=device)
        self.segment_scores: list[torch.Tensor] = []
        self.segment_rows: list[torch.Tensor] = []
        self.eos_only: Optional[torch.Tensor] = None
        # whether done sentences can stay in the batch for a while (else each leaves at the step it is done)
        self.riding = self.check_every > 1

    def step(self, check: bool) -> bool:
        """One token per beam; with ``check`` (a host sync), the sentences that are done leave. True: all done."""
        k, alpha, t = self.beam, self.alpha, self.t
        logits, attn = self.model_step()
        if self.need_attention and attn is not None:
            self.history_attention.append(attn)
        logp = self.next_token_scores(logits)
        vocab = logp.size(-1)
        covered = self.covered(attn)
        if t >= self.min_limit:  # only EOS may follow a beam at its length limit
            if self.eos_only is None:
                self.eos_only = torch.full((vocab,), float("-inf"), device=self.device)
                self.eos_only[EOS] = 0.0
            logp = torch.where((t >= self.row_limits)[:, None], self.eos_only, logp)
        sentences, c = self.offsets.size(0), self.constraints
        if c is None:
            top_scores, top_index = logp.add_(self.scores).view(sentences, k * vocab).topk(2 * k, dim=1)
            origin = top_index // vocab + self.offsets  # (sentences, 2k) the rows they extend
            token = top_index % vocab
            is_eos = token == EOS
            # EOS among the k best candidates ends a hypothesis; the k best others continue
            ends, end_rows = top_scores[:, :k].masked_fill(~is_eos[:, :k], float("-inf")), origin[:, :k]
            alive_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)
            rows, token = origin.gather(1, pick), token.gather(1, pick)
            best_alive = alive_scores[:, :1]
        else:  # dynamic beam allocation, with the constraint states of the rows that continue
            ends, end_rows, alive_scores, rows, token, c_state, c_met = c.allocate(
                logp.add_(self.scores), k, self.offsets
            )
            best_alive = alive_scores.max(1, keepdim=True).values
        if self.riding:  # a done sentence that rides along ends nothing (only one still searching does)
            ends = ends.masked_fill(~self.live, float("-inf"))
        ended = ends / length_penalty(t + 1, alpha)
        if covered is not None:
            ended = ended + coverage_penalty(covered, self.beta)[end_rows]
        self.segment_scores.append(ended)
        self.segment_rows.append(end_rows)
        self.kth_best = torch.cat([self.kth_best, ended], 1).topk(k, dim=1).values
        # Done when the best live beam, scored at its next possible end (length t + 2 with EOS), no longer
        # beats the k-th best ended hypothesis (with fewer than k ended: only when no live beam is left).
        bar = self.kth_best[:, -1:]
        if c is not None:  # a sentence with phrases: against its n-th best ended hypothesis (n-best: what it returns)
            bar = self.kth_best.gather(1, torch.where(c.total[:, None] > 0, min(self.n_best, k) - 1, k - 1))
        self.live &= best_alive / length_penalty(t + 2, alpha) > bar
        self.t += 1
        if check:
            index = None
            if not self.live.all():
                live = [row[0] for row in self.live.tolist()]
                index = self.keep(live) if self.compacts(live.count(False)) else None
            if index is not None:
                if not self.kept:
                    return True
                rows, token, alive_scores = rows[index], token[index], alive_scores[index]
                if c is not None:
                    c_state, c_met = c_state[index], c_met[index]
                self.live, self.kth_best = self.live[index], self.kth_best[index]
                self.offsets = self.offsets[: index.size(0)]
                self.row_limits = self.limits.repeat_interleave(k)
        self.prev, rows = token.view(-1), rows.view(-1)
        if self.history is not None:  # the rows continue those they extend
            self.history = torch.cat([self.history[rows], self.prev[:, None]], 1)
        self.history_tokens.append(self.prev)
        self.history_parents.append(rows)
        self.scores = alive_scores.view(-1, 1)
        self.state = self.state.select(rows)
        if covered is not None:
            self.coverage = covered[rows]
        if c is not None:
            c.set_rows(c_state.flatten(0, 1), c_met.flatten(0, 1))
        return False

    def covered(self, attention: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """With a coverage penalty: each row's coverage (rows, S) after this step's ``attention``, read in the view
        word links and CTranslate2 read (an RNN's map, a Transformer's last layer, mean of heads); else None."""
        if self.coverage is None:
            return None
        if attention is None:
            raise UserError("decode.coverage_penalty reads the attention: this model has none; set it to 0")
        view = attention if attention.dim() == 3 else attention[:, -1].mean(1)  # (rows, 1, S)
        return self.coverage + view[:, 0].float()

    def limits_of_rows(self) -> torch.Tensor:
        return self.row_limits

    def write_segment(self) -> None:
        if self.segment_scores:
            start, end = self.segment_start, self.t
            self.ended_scores[:, start:end].index_copy_(0, self.ids, torch.stack(self.segment_scores, 1))
            rows = torch.stack(self.segment_rows, 1)[..., : self.beam]
            self.ended_rows[:, start:end].index_copy_(0, self.ids, rows)
        self.segment_scores, self.segment_rows = [], []
        super().write_segment()

    def trace(
        self, steps: torch.Tensor, rows: torch.Tensor, with_attention: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens (N, max steps) of hypotheses that chose EOS at ``steps`` from row ``rows`` (PAD after the
        end), and their attention (N, max steps + 1, S, ...): steps 0..steps are theirs, EOS included; the
        steps after it are to be cut off. Rows are numbered among the rows of their step: in a batch
        compacted since, a hypothesis that ended already looks up a row there is (clamped), then ignores it."""
        n_steps = int(steps.max()) + 1 if steps.numel() else 1
        compacted = len(self.kept) < self.batch  # some sentences left the batch
        columns, attention = [], []  # each from the last step back
        cur = rows.clone()
        for s in reversed(range(n_steps)):
            if s < n_steps - 1:  # the hypotheses that were still going after step s step back
                back = s < steps
                at = cur.clamp(max=self.history_tokens[s].size(0) - 1) if compacted else cur
                columns.append(torch.where(back, self.history_tokens[s][at], PAD))
                cur = torch.where(back, self.history_parents[s][at], cur)
            if with_attention:
                attention.append(self.history_attention[s][cur.clamp(max=self.history_attention[s].size(0) - 1)])
        tokens = torch.stack(columns[::-1], 1) if columns else rows.new_full((rows.size(0), 1), PAD)
        return tokens, by_step(attention[::-1]) if with_attention else None

    def result(self) -> Hypotheses:
        n, batch = min(self.n_best, self.beam), self.batch
        ranked = self.ended_scores.view(batch, -1).sort(dim=1, descending=True, stable=True)
        norms, best = ranked.values[:, :n], ranked.indices[:, :n]
        steps = best // self.beam
        rows = self.ended_rows.view(batch, -1).gather(1, best)
        traced, _ = self.trace(steps.reshape(-1), rows.reshape(-1), with_attention=False)
        tokens, lengths, scores = traced.view(batch, n, -1).tolist(), steps.tolist(), norms.tolist()
        nbest = [
            [(tokens[b][i][: lengths[b][i]], scores[b][i]) for i in range(n) if scores[b][i] > float("-inf")]
            for b in range(batch)
        ]
        best_tokens = [hyps[0][0] for hyps in nbest]
        if not self.history_attention:
            return Hypotheses(best_tokens, None, nbest, self.kv_cache_bytes)
        _, attention = self.trace(steps[:, 0], rows[:, 0], with_attention=True)
        assert attention is not None  # asked for
        blocks = attention_to_host(attention, [n[0] + 1 for n in lengths], self.src_lengths)
        return Hypotheses(best_tokens, [sentence_attention([b]) for b in blocks], nbest, self.kv_cache_bytes)
