"""The API's request and response models (pydantic): a request with a field it does not know, or of the wrong
type, is refused naming the field; the limits of ``serve.*`` are checked by ``check_request``."""

from __future__ import annotations

import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from app.config.commands import DecodeConfig, ServeConfig


class TranslateRequest(BaseModel):
    """``text``: one line or a list of lines; ``beam_size`` (unset: decode.beam_size), ``n_best`` hypotheses per
    line, ``attention``: each hypothesis' cross-attention, its views and the word links read from them;
    ``self_attention``: a Transformer's self-attention, the encoder's and each hypothesis' decoder's;
    ``no_repeat_ngram_size``: no n-gram of pieces twice in a hypothesis (unset: decode.no_repeat_ngram_size);
    ``translation``: one per line of ``text``, scored instead of searched (make score's log p, and the attention that
    read it, as one hypothesis; beam size and n-gram ban do not apply); ``prefix``: one per line of ``text``, the
    words its hypotheses begin with (make translate's translate.prefix; an empty one: none); ``constraints``: one
    list per line of ``text``, the phrases each of its hypotheses contains (make translate's translate.constraints;
    an empty list: none)."""

    model_config = ConfigDict(extra="forbid")

    text: Union[StrictStr, list[StrictStr]]
    beam_size: Optional[StrictInt] = None
    n_best: StrictInt = 1
    attention: StrictBool = False
    self_attention: StrictBool = False
    no_repeat_ngram_size: Optional[StrictInt] = None
    translation: Union[StrictStr, list[StrictStr], None] = None
    prefix: Union[StrictStr, list[StrictStr], None] = None
    constraints: Optional[list[list[StrictStr]]] = None

    def lines(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def translations(self) -> Optional[list[str]]:
        return [self.translation] if isinstance(self.translation, str) else self.translation

    def prefixes(self) -> Optional[list[str]]:
        return [self.prefix] if isinstance(self.prefix, str) else self.prefix


class Hypothesis(BaseModel):
    text: str
    # beam search: log p(Y|X) / ((5 + |Y|) / 6)^α; greedy search (beam_size 1): null; a given translation: log p(Y|X)
    score: Optional[float]
    target_pieces: list[str]
    piece_log_probs: Optional[list[float]] = None  # a given translation: log p of each piece and the final </s>


class Translation(BaseModel):
    source_pieces: list[str]
    hypotheses: list[Hypothesis]
    attention: Optional[dict[str, Any]] = None  # app.serve.engine.attention_entry
    self_attention: Optional[dict[str, Any]] = None  # app.serve.engine.self_attention_entry


class TranslateResponse(BaseModel):
    translations: list[Translation]
    seconds: float  # from the request's arrival to its answer: waiting for a batch, decoding, building the answer


class RequestError(Exception):
    """A request refused: its HTTP status and one line saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# JSON's \ud800 escape parses to a lone surrogate: a str that no tokenizer or UTF-8 encoder takes
SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> Optional[str]:
    """Why ``text`` is not Unicode text, in words (None: it is)."""
    found = SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"not valid Unicode text (a lone surrogate \\u{ord(found.group()):04x} at character {found.start()}; "
        "a character's surrogate escapes come in a pair, e.g. \\ud83d\\ude00)"
    )


def check_chars(where: str, text: str, limits: ServeConfig, unit: str = "a line") -> None:
    """``text`` (the request's ``where``) within serve.max_chars characters and valid Unicode, else a
    RequestError naming ``where``."""
    if len(text) > limits.max_chars:
        raise RequestError(413, f"{where}: {len(text)} characters; at most {limits.max_chars} {unit} (serve.max_chars)")
    problem = lone_surrogate(text)
    if problem:
        raise RequestError(422, f"{where}: {problem}")


def max_body_bytes(limits: ServeConfig) -> int:
    """The largest body a request within ``serve.*``'s limits can take: per line of text, the line, its
    translation or prefix, and its phrases, each of serve.max_chars characters at up to 12 bytes of JSON each (a
    character beyond U+FFFF escaped as a surrogate pair, \\ud83d\\ude00), a string's quotes and separators (a
    phrase has at least a character: at most 8 more bytes per character), and 64 KiB for the rest."""
    line = 12 * limits.max_chars + 16
    phrases = (12 + 8) * limits.max_chars + 16
    return limits.max_lines * (2 * line + phrases) + 65536


def check_given(name: str, given: list[str], lines: list[str], limits: ServeConfig) -> None:
    """A translation or prefix per line, each within serve.max_chars and valid Unicode, else a RequestError naming
    ``name``."""
    if len(given) != len(lines):
        raise RequestError(422, f"{name}: {len(given)} for {len(lines)} lines of text; give one {name} a line")
    for i, line in enumerate(given):
        check_chars(f"{name}[{i}]", line, limits)


def check_request(
    request: TranslateRequest, limits: ServeConfig, defaults: DecodeConfig
) -> tuple[list[str], Optional[list[str]], tuple]:
    """The request's lines, their given translations or prefixes (None: neither), and how (the key its batch
    shares: beam size, n-best, attention, self-attention, n-gram ban, whether prefixes, constraints are given; a given
    translation's: "score", attention, self-attention), within ``serve.*``'s limits (else a RequestError); unset,
    ``defaults``' (decode.*)."""
    lines, translations, prefixes = request.lines(), request.translations(), request.prefixes()
    if not lines:
        raise RequestError(422, "text: give a line to translate (a string or a list of strings)")
    if len(lines) > limits.max_lines:
        raise RequestError(413, f"text: {len(lines)} lines; at most {limits.max_lines} a request (serve.max_lines)")
    for i, line in enumerate(lines):
        if not line.strip():
            raise RequestError(422, f"text[{i}]: an empty line; give text to translate")
        check_chars(f"text[{i}]", line, limits)
    constraints = request.constraints
    if translations is not None:
        if prefixes is not None:
            raise RequestError(422, "prefix: a given translation is scored whole; give a translation or a prefix")
        if constraints is not None:
            raise RequestError(422, "constraints: a given translation is scored whole; give one or the other")
        check_given("translation", translations, lines, limits)
        if request.n_best != 1:
            raise RequestError(
                422, f"n_best: {request.n_best}; a given translation is scored, not searched: leave it 1"
            )
        return lines, translations, ("score", request.attention, request.self_attention)
    if prefixes is not None:
        check_given("prefix", prefixes, lines, limits)
    if constraints is not None:
        check_constraints(constraints, lines, limits)
    beam = defaults.beam_size if request.beam_size is None else request.beam_size
    if not 1 <= beam <= limits.max_beam:
        raise RequestError(422, f"beam_size: {beam}; choose 1 to {limits.max_beam} (serve.max_beam)")
    if not 1 <= request.n_best <= beam:
        raise RequestError(422, f"n_best: {request.n_best}; choose 1 to beam_size ({beam})")
    ban = defaults.no_repeat_ngram_size if request.no_repeat_ngram_size is None else request.no_repeat_ngram_size
    if ban < 0:
        raise RequestError(422, f"no_repeat_ngram_size: {ban}; choose 0 (no ban) or more")
    key = (beam, request.n_best, request.attention, request.self_attention, ban, prefixes is not None)
    return lines, prefixes, (*key, constraints is not None)


def check_constraints(constraints: list[list[str]], lines: list[str], limits: ServeConfig) -> None:
    """A list of phrases per line, each phrase with words and valid Unicode, a line's phrases within serve.max_chars
    together, else a RequestError."""
    if len(constraints) != len(lines):
        raise RequestError(
            422, f"constraints: {len(constraints)} for {len(lines)} lines of text; give one list of phrases a line"
        )
    for i, phrases in enumerate(constraints):
        for j, phrase in enumerate(phrases):
            if not phrase.strip():
                raise RequestError(422, f"constraints[{i}][{j}]: an empty phrase; give its words ([]: no phrase)")
            check_chars(f"constraints[{i}][{j}]", phrase, limits, "a phrase")
        total = sum(map(len, phrases))
        if total > limits.max_chars:  # what bounds the body (max_body_bytes)
            raise RequestError(
                413,
                f"constraints[{i}]: {total} characters in its phrases; at most {limits.max_chars} a line "
                "(serve.max_chars)",
            )
