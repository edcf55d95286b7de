"""How word links are read from a model's attention (make align, make eval's AER and hyp.align): the methods of
the literature, each a ``Method``.

- A **view** of the cross-attention (app/evaluation/views.py: each head of each layer, each layer's mean of heads,
  an RNN's one map), read at the row that *writes* each target token. The forced pass's rows are the positions
  that write the target tokens, then ``</s>``: row j writes y_j, its input being y_{j-1} (``<s>`` for j = 0).
- **shift-att** (Chen et al. 2020, "Accurate Word Alignment Induction from Neural Machine Translation"): the same
  view read one row later, at the step where y_j is the decoder's *input* (row j + 1, the step that writes y_{j+1},
  or ``</s>`` after the last token). A decoder's cross-attention tells more about the word it has just read than
  about the word it is about to write.
- **Both directions symmetrized**: a reading of this run's attention and one of a run of the other direction
  (``align.reverse``), joined by intersection, union or grow-diag-final-and (app/data/symmetrization.py).
- **Both directions' agreement**: the same two readings as probabilities over words, multiplied, the links at or
  above a threshold (Liang et al. 2006; app/data/symmetrization.py), the threshold chosen on dev too.

A *reading* is a view, read as it is (``layer 1 mean``) or shifted (``layer 1 mean, shift-att``). Pieces are summed
into whitespace words, and every target word links to its most attended source word (app.data.links).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from app.data.links import most_attended, word_links, word_probabilities
from app.data.symmetrization import AGREEMENT, AGREEMENT_DEFAULT, AGREEMENT_THRESHOLDS, SYMMETRIZATIONS
from app.evaluation.views import attention_views, plotted_view

SHIFT_ATT = "shift-att"
SHIFTED = f", {SHIFT_ATT}"  # a shifted reading's name: "<view>, shift-att"
# what align.method chooses among: the best on dev of every method (auto), or of one
METHODS = ("auto", "attention", SHIFT_ATT, *SYMMETRIZATIONS, AGREEMENT)


def shift_att(maps: np.ndarray) -> np.ndarray:
    """(views, rows, src) maps of a forced pass or a decoding -> shift-att's: row j becomes row j + 1, the step whose
    input is target token j; the last row (``</s>``'s, which links no word) is zeros."""
    maps = np.asarray(maps)
    return np.concatenate([maps[:, 1:], np.zeros_like(maps[:, :1])], axis=1)


def reading_names(views: Sequence[str]) -> list[str]:
    """Every reading of these views: each as it is, then each shifted."""
    return [*views, *(f"{view}{SHIFTED}" for view in views)]


def reading_view(reading: str) -> tuple[str, bool]:
    """(the view a reading reads, whether shifted)."""
    return (reading[: -len(SHIFTED)], True) if reading.endswith(SHIFTED) else (reading, False)


def reading_maps(attention, readings: Optional[Sequence[str]] = None) -> tuple[list[str], np.ndarray]:
    """(names, (readings, tgt pieces, src pieces) maps) of one pair's attention: every reading of every view, or
    only ``readings``."""
    views, maps = attention_views(attention)
    if readings is None:
        return reading_names(views), np.concatenate([maps, shift_att(maps)])
    names = list(readings)
    picked = [(views.index(view), shifted) for view, shifted in map(reading_view, names)]
    shifted_maps = shift_att(maps) if any(shifted for _, shifted in picked) else maps
    return names, np.stack([(shifted_maps if shifted else maps)[n] for n, shifted in picked])


def read_words(
    attention, src_words: Sequence[int], tgt_words: Sequence[int], readings: Optional[Sequence[str]] = None
) -> tuple[list[str], np.ndarray]:
    """(names, (readings, target words) most attended source word of each target word) of one pair's attention
    (``src_words``, ``tgt_words``: the word of each of its columns and rows, app.data.tokenizer): every reading of
    every view, or only ``readings``."""
    names, read = reading_maps(attention, readings)
    return names, most_attended(read, src_words, tgt_words)


def read_probabilities(
    attention, src_words: Sequence[int], tgt_words: Sequence[int], readings: Sequence[str]
) -> np.ndarray:
    """(readings, target words, source words): each target word's attention over the source words, as a
    distribution, by each of ``readings`` of one pair's attention (what agreement multiplies)."""
    return word_probabilities(reading_maps(attention, readings)[1], src_words, tgt_words)


def read_links(attention, src_words: Sequence[int], tgt_words: Sequence[int], reading: str) -> set[tuple[int, int]]:
    """The (source word, target word) links of one reading of one pair's attention."""
    return word_links(read_words(attention, src_words, tgt_words, [reading])[1][0])


def has_reading(attention, reading: str) -> bool:
    """Whether this attention has the view the reading reads (an export's one map has not a head's)."""
    return reading_view(reading)[0] in attention_views(attention)[0]


@dataclass(frozen=True)
class Method:
    """How a pair's links are read: a reading of this run's attention (``forward``), alone or joined
    (``symmetrization``, a SYMMETRIZATIONS name or AGREEMENT at ``threshold``) with a reading of the reverse run's
    attention (``reverse``)."""

    forward: str
    symmetrization: Optional[str] = None
    reverse: Optional[str] = None
    threshold: Optional[float] = None  # agreement's

    @property
    def name(self) -> str:
        """What the outputs call it: "layer 1 mean, shift-att", "grow-diag-final-and of layer 1 mean, shift-att
        and the reverse run's layer 2 mean, shift-att", "agreement ≥ 0.15 of layer 1 head 0 and the reverse run's
        layer 1 head 0"."""
        if self.symmetrization is None:
            return self.forward
        joined = self.symmetrization + (f" ≥ {self.threshold:g}" if self.symmetrization == AGREEMENT else "")
        return f"{joined} of {self.forward} and the reverse run's {self.reverse}"

    @property
    def view(self) -> str:
        """The view of this run's attention it reads (what plots of the chosen method show)."""
        return reading_view(self.forward)[0]

    @property
    def kind(self) -> str:
        """Its align.method: attention, shift-att, a symmetrization, or agreement."""
        return self.symmetrization or (SHIFT_ATT if reading_view(self.forward)[1] else "attention")


def candidates(
    readings: Sequence[str], forward: Optional[str] = None, reverse: Optional[str] = None, agreeing: bool = False
) -> list[Method]:
    """The methods to choose among: every reading of this run's attention and, given each direction's reading
    (``forward``, ``reverse``), every symmetrization of the two, and (``agreeing``: their probabilities were read)
    their agreement at every threshold."""
    methods = [Method(reading) for reading in readings]
    if forward is not None and reverse is not None:
        methods += [Method(forward, symmetrization, reverse) for symmetrization in SYMMETRIZATIONS]
        if agreeing:
            methods += [Method(forward, AGREEMENT, reverse, threshold) for threshold in AGREEMENT_THRESHOLDS]
    return methods


def agreement_asked(directions: tuple[str, Optional[str]], setting: str) -> bool:
    """Whether a choice among ``align.method``'s methods takes agreement in, which reads the probabilities of each
    direction's reading (a pass more of each model)."""
    return directions[1] is not None and setting in ("auto", AGREEMENT)


def allowed(methods: list[Method], setting: str) -> list[Method]:
    """The methods ``align.method`` allows: all (auto), or those of its kind."""
    return [m for m in methods if setting in ("auto", m.kind)]


def default_method(attention, layer: int, setting: str, reverse_attention=None) -> Method:
    """The method used where no reference links choose one: the view plots show (``layer``'s mean of heads, an RNN's
    map), shifted for shift-att; symmetrized with the reverse run's view (grow-diag-final-and for auto)."""
    forward = plotted_view(attention, layer)[0] + (SHIFTED if setting == SHIFT_ATT else "")
    if reverse_attention is None or setting in ("attention", SHIFT_ATT):
        return Method(forward)
    symmetrization = "grow-diag-final-and" if setting == "auto" else setting
    threshold = AGREEMENT_DEFAULT if symmetrization == AGREEMENT else None
    return Method(forward, symmetrization, plotted_view(reverse_attention, layer)[0], threshold)
