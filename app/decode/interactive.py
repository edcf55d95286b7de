"""``make translate`` at a terminal: with standard input a terminal and no ``translate.input``, the model loads first
and each line is translated as it is entered, its translation written at once (JoeyNMT's interactive translate,
fairseq-interactive). A line is a window of its own (``translate_window`` with translate.window=1), so its output
is what a file of the same lines gives with translate.window=1: n-best indices count the lines typed, and
sampling draws line k with seed decode.sampling_seed + k. A line that cannot be translated (too long for the
model, not UTF-8) is refused in one line and the session goes on; Ctrl-D ends it."""

from __future__ import annotations

import dataclasses
import sys
import time

from app.config.schema import Config
from app.decode.line_files import open_output
from app.decode.search import check_lengths, describe
from app.decode.translate import check_settings, load_engine, translate_window
from app.run.errors import UserError

FROM_A_FILE = "give the lines to translate in a file (translate.input=...) or a pipe, not typed at a terminal"


def translate_typed(cfg: Config) -> None:
    """Translate the lines typed on standard input (a terminal) one at a time, until it ends."""
    t = cfg.translate
    if t.prefix or t.constraints:
        setting, value = ("translate.prefix", t.prefix) if t.prefix else ("translate.constraints", t.constraints)
        raise UserError(f"{setting}={value!r} holds a line per line to translate: {FROM_A_FILE}")
    if t.resume:
        raise UserError(f"translate.resume=true continues the translation of a file: {FROM_A_FILE}")
    check_settings(cfg)
    engine, tokenizer, used = load_engine(cfg)
    one_line = dataclasses.replace(cfg, translate=dataclasses.replace(t, window=1))
    where = f"to {t.output}" if t.output else "here"
    print(f"translating the lines typed here with {used}: {describe(cfg.decode)}", file=sys.stderr)
    print(f"type a line and press Enter: its translation is written {where}; Ctrl-D ends", file=sys.stderr, flush=True)
    out = open_output(t.output, None)
    typed = translated = 0
    started = time.perf_counter()
    try:
        while raw := sys.stdin.buffer.readline():
            typed += 1
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
                check_lengths(engine.max_positions, tokenizer.encode_src([line]), "line", typed - 1)
            except UnicodeDecodeError:
                print(f"error: line {typed}: not valid UTF-8", file=sys.stderr, flush=True)
                continue
            except UserError as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                continue
            out.write(translate_window(one_line, engine, tokenizer, [line], None, None, typed - 1).encode("utf-8"))
            out.flush()
            translated += 1
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    seconds = time.perf_counter() - started
    print(f"translated {translated} of {typed} typed lines in {seconds:.1f} s", file=sys.stderr)
