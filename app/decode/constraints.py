"""Terminology constraints (lexically constrained decoding: ``translate.constraints``, the API's ``constraints``):
each sentence's hypotheses must contain each of its target phrases, its pieces in order and contiguous. Greedy and
beam search (app/decode/search.py, app/decode/beam.py) track them on the device, for every row at once.

Tracking: per row and phrase, the length of the longest beginning of the phrase that ends the hypothesis (the
state of the phrase's Knuth-Morris-Pratt automaton, its table built on the host once per batch), and whether the
phrase has been met. A phrase is met once its state reaches its length; a piece that breaks a partial match falls
back to the longest beginning still matched ("A A B" meets "A B"). Phrases are tracked apart: two of them may share
pieces ("A B" and "B C" are both met by "A B C"), and one met twice counts once.

Guarantee: a row may end (EOS) only once all its phrases are met, and it never takes a piece that leaves it more
pieces to write than the length limit allows. The pieces it still needs are counted as if it completed its
furthest-matched phrase and then wrote the others whole (``needed``); the next piece of that phrase always lowers
the count by one, so a row that fits keeps fitting: while the pieces of its unmet phrases all fit in the room left,
any token may follow, else only the next pieces of its phrases that keep it within the limit (the limit is raised
for the constraints as for a prefix: app.decode.search.length_limits). Greedy search, which would otherwise write on
until only room for the phrase is left, writes the phrase where the model would end: a row whose most probable
piece is EOS takes the most probable next piece of its unmet phrases instead, then that phrase's next pieces to its
end.

Beam slots (dynamic beam allocation, Post & Vilar 2018, in Hu et al. 2019's vectorized form as fairseq's
LexicallyConstrainedBeamSearch): the candidates of a sentence are its 2k best extensions, each beam's best token
and each beam's next piece of each unmet phrase; each goes to the bank of the constraint pieces it has met (the
pieces of the phrases met plus those of its furthest partial match: the total less ``needed``), and the beam takes
them round-robin over the banks, from the bank furthest along down, best first within each bank; all of it on the
device, with no host sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from app.data.tokenizer import EOS, PAD
from app.run.errors import UserError


def automaton(phrase: list[int]) -> list[list[int]]:
    """The phrase's matching table: row s (s pieces matched), column m: the pieces matched after the next piece is
    ``phrase[m]`` (the longest beginning of the phrase that ends ``phrase[:s] + [phrase[m]]``)."""
    n = len(phrase)
    table = []
    for s in range(n):
        row = []
        for m in range(n):
            seen = phrase[:s] + [phrase[m]]
            row.append(next(r for r in range(min(s + 1, n), -1, -1) if r == 0 or phrase[:r] == seen[-r:]))
        table.append(row)
    return table


def unique_phrases(phrases: list[list[int]]) -> list[list[int]]:
    """A sentence's phrases, each once (a phrase given twice is met by one occurrence)."""
    return [list(p) for p in dict.fromkeys(tuple(p) for p in phrases)]


class PhraseConstraints:
    """The phrases of a batch of sentences on the device and, per row (``beam`` rows a sentence), how far each
    phrase is matched (``state``) and whether it is met (``met``)."""

    def __init__(self, phrases: list[list[list[int]]], beam: int, device: torch.device) -> None:
        phrases = [unique_phrases(p) for p in phrases]
        sentences, count = len(phrases), max(len(p) for p in phrases)
        longest = max(len(x) for p in phrases for x in p)
        tokens = torch.full((sentences, count, longest), -1, dtype=torch.long)  # -1: past the phrase's end
        table = torch.zeros((sentences, count, longest, longest), dtype=torch.long)
        lengths = torch.zeros((sentences, count), dtype=torch.long)  # 0: no phrase there
        for s, sentence in enumerate(phrases):
            for j, phrase in enumerate(sentence):
                n = len(phrase)
                tokens[s, j, :n], lengths[s, j] = torch.tensor(phrase), n
                table[s, j, :n, :n] = torch.tensor(automaton(phrase))
        self.beam, self.count = beam, count
        self.tokens, self.table, self.lengths = tokens.to(device), table.to(device), lengths.to(device)
        self.total = self.lengths.sum(-1)  # (sentences,) the pieces of all a sentence's phrases
        # bank numbers are below span: the stripes of the round-robin (a host number: no sync)
        self.span = int(max(sum(map(len, p)) for p in phrases)) + 1
        self.state = torch.zeros((sentences * beam, count), dtype=torch.long, device=device)
        self.met = (self.lengths == 0).repeat_interleave(beam, 0)
        # greedy search (one row a sentence: eager): a row that would end with phrases unmet writes one of their next
        # pieces instead, and goes on with that phrase to its end (pushed: the rows doing so)
        self.eager = beam == 1
        self.pushed = torch.zeros(sentences * beam, dtype=torch.bool, device=device)

    def select_sentences(self, index: torch.Tensor) -> None:
        """Keep the phrases of the sentences of ``index`` (those still decoding, in their new order)."""
        self.tokens, self.table, self.lengths = self.tokens[index], self.table[index], self.lengths[index]
        self.total = self.total[index]

    def set_rows(self, state: torch.Tensor, met: torch.Tensor) -> None:
        self.state, self.met = state, met

    def advance(self, rows: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The states, met flags (..., phrases) and pieces still needed (...) of rows ``rows`` (any shape) after
        taking ``tokens`` (the same shape)."""
        sentence = rows // self.beam
        state, met, lengths = self.state[rows], self.met[rows], self.lengths[sentence]
        phrase = torch.arange(self.count, device=rows.device)
        moves = self.table[sentence[..., None], phrase, state]  # (..., phrases, longest): the next state per match
        match = self.tokens[sentence] == tokens[..., None, None]
        after = torch.where(match, moves, 0).amax(-1)
        met = met | (after == lengths)
        after = after.masked_fill(met, 0)
        return after, met, needed(after, met, lengths)

    def next_pieces(self) -> torch.Tensor:
        """(rows, phrases): each row's next piece of each unmet phrase (PAD for a phrase met or absent)."""
        sentence = torch.arange(self.state.size(0), device=self.state.device) // self.beam
        pieces = self.tokens[sentence].gather(-1, self.state[..., None]).squeeze(-1)
        return pieces.masked_fill(self.met, PAD)

    def mask(self, logp: torch.Tensor, pieces: torch.Tensor, t: int, limits: torch.Tensor) -> torch.Tensor:
        """Next-token scores (rows, vocab) with the constraints' rules, in place: no EOS before a row's phrases are
        all met; a row with less room left before its limit ``limits`` than the pieces of its unmet phrases takes
        only those of its next ``pieces`` (rows, phrases) that keep it within the limit."""
        left = (self.lengths.repeat_interleave(self.beam, 0) * ~self.met).sum(-1)
        ending = logp.argmax(-1) == EOS if self.eager else None  # what the model would do
        logp[:, EOS].masked_fill_(left > 0, float("-inf"))
        room = limits - t - 1  # pieces that may follow this one before the limit's EOS
        loose = (left <= room) | (left == 0)
        rows = torch.arange(logp.size(0), device=logp.device)[:, None].expand_as(pieces)
        _, _, still = self.advance(rows, pieces)
        keep, only = loose[:, None] | (still <= room[:, None]), ~loose
        if ending is not None:  # greedy: a phrase where the model would end, then the rest of the phrase
            furthest = (self.state * ~self.met).amax(-1, keepdim=True)
            going_on = self.pushed & (furthest[:, 0] > 0)
            push = (left > 0) & (ending | going_on)
            allowed = ~self.met & ((self.state == furthest) | ~going_on[:, None])
            same = pieces[:, :, None] == pieces[:, None, :]  # a piece that two phrases share: allowed by either
            keep &= (same & allowed[:, None, :]).any(-1) | ~push[:, None]
            only, self.pushed = only | push, push
        values = logp.gather(1, pieces).masked_fill(~keep, float("-inf"))
        return logp.masked_fill_(only[:, None], float("-inf")).scatter_(1, pieces, values)

    def step(self, tokens: torch.Tensor) -> None:
        """Every row (greedy search: a sentence each) takes its token of ``tokens`` (rows,)."""
        state, met, _ = self.advance(torch.arange(tokens.size(0), device=tokens.device), tokens)
        self.set_rows(state, met)

    def select_rows(self, index: torch.Tensor) -> None:
        self.state, self.met, self.pushed = self.state[index], self.met[index], self.pushed[index]

    def allocate(self, scores: torch.Tensor, k: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step of beam search (dynamic beam allocation), from the scores of every extension of every row
        (rows, vocab: the row's score plus log p) and each sentence's first row (``offsets``, (sentences, 1)).
        Ending: the k best candidates of a sentence that have met all its phrases, with the rows they extend
        (sentences, k): those that are EOS end a hypothesis with their score (-inf for the others), as EOS among
        the k best candidates does without constraints. Continuing: the first k other candidates in the order
        the beam takes them (round-robin over the banks of constraint pieces met, furthest first, best first
        within a bank): their scores, the rows they extend, their tokens (sentences, k), their states and met
        flags (sentences, k, phrases)."""
        rows_count, vocab = scores.shape
        sentences = rows_count // k
        best, end = scores.argmax(-1, keepdim=True), torch.full_like(scores[:, :1], EOS, dtype=torch.long)
        special = torch.cat([best, end, self.next_pieces()], 1)  # (rows, 2 + phrases)
        repeated = (special[:, :, None] == special[:, None, :]).tril(-1).any(-1)  # the same token earlier in the row
        special_scores = scores.gather(1, special).masked_fill_(repeated, float("-inf"))
        others, index = scores.scatter(1, special, float("-inf")).view(sentences, k * vocab).topk(2 * k, dim=1)
        own_rows = torch.arange(rows_count, device=scores.device)[:, None].expand_as(special)
        rows = torch.cat([index // vocab + offsets, own_rows.reshape(sentences, -1)], 1)
        tokens = torch.cat([index % vocab, special.reshape(sentences, -1)], 1)
        candidate_scores = torch.cat([others, special_scores.view(sentences, -1)], 1)  # (sentences, candidates)
        state, met, still = self.advance(rows, tokens)
        done_scores, done = candidate_scores.masked_fill(still > 0, float("-inf")).topk(k, dim=1)
        ends = done_scores.masked_fill(tokens.gather(1, done) != EOS, float("-inf"))
        is_eos = tokens == EOS
        bank = self.total[:, None] - still
        valid = (candidate_scores > float("-inf")) & ~is_eos
        # rank within the bank: the valid candidates of the same bank scored higher (or as high and earlier)
        n = candidate_scores.size(1)
        earlier = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril(-1)  # [i, j]: j before i
        mine, theirs = candidate_scores[:, :, None], candidate_scores[:, None, :]
        above = (theirs > mine) | ((theirs == mine) & earlier)
        rank = ((bank[:, :, None] == bank[:, None, :]) & above & valid[:, None, :]).sum(-1)
        key = (rank * self.span + (self.span - 1 - bank)).masked_fill(~valid, self.span * (n + 1))
        pick = key.topk(k, dim=1, largest=False).indices
        wide = pick[..., None].expand(-1, -1, self.count)
        alive = candidate_scores.masked_fill(is_eos, float("-inf")).gather(1, pick)
        picked = rows.gather(1, pick), tokens.gather(1, pick), state.gather(1, wide), met.gather(1, wide)
        return (ends, rows.gather(1, done), alive, *picked)


def needed(state: torch.Tensor, met: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The pieces a row still needs (..., from (..., phrases)): its unmet phrases' pieces, less those of its
    furthest partial match."""
    unmet = ~met
    return (lengths * unmet).sum(-1) - (state * unmet).amax(-1)


def phrase_constraints(
    phrases: Optional[list[list[list[int]]]], beam: int, device: torch.device
) -> Optional[PhraseConstraints]:
    """The constraints of a batch (per sentence, its phrases' target pieces) for ``beam`` rows a sentence; None when
    no sentence has any."""
    if phrases is None or not any(phrases):
        return None
    return PhraseConstraints(phrases, beam, device)


def encode_phrases(
    encode: Callable[[list[str]], list[list[int]]],
    lines: list[list[str]],
    where: Callable[[int, int], str],
    no_phrase: str = "an empty line",
) -> list[list[list[int]]]:
    """Per line, its phrases' target pieces (``encode``: the tokenizer's); a phrase with none (empty, or spaces)
    is a UserError naming it (``where(line, phrase)``, 0-based) and how a line says it has none (``no_phrase``)."""
    flat = [phrase for line in lines for phrase in line]
    pieces = iter(encode(flat) if flat else [])
    encoded = []
    for i, line in enumerate(lines):
        encoded.append([next(pieces) for _ in line])
        for j, (phrase, ids) in enumerate(zip(line, encoded[-1])):
            if not ids:
                raise UserError(
                    f"{where(i, j)}: the phrase {phrase!r} is empty after tokenization; give its words (no phrase: "
                    f"{no_phrase})"
                )
    return encoded


def forced_pieces(phrases: list[list[int]]) -> int:
    """The pieces a sentence's phrases take: what raises its length limit."""
    return sum(map(len, unique_phrases(phrases)))


def forced_lengths(constraints: list[list[list[int]]], prefix: Optional[list[list[int]]]) -> list[range]:
    """Per sentence, the target pieces its phrases and its prefix force, as a sequence of that length (what
    ``check_lengths`` holds to the model's positions)."""
    return [range(forced_pieces(c) + (len(prefix[i]) if prefix else 0)) for i, c in enumerate(constraints)]
