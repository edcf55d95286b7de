"""``make translate``: lines from a file or standard input to a file or standard output, by a run's
checkpoint or its CTranslate2 export; with ``decode.n_best`` > 1 in the Moses n-best format, with
``translate.alignments`` each line followed by its word links to the source (``translation ||| 0-0 1-2 ...``),
with ``translate.prefix`` each translation beginning with the words given for it (interactive translation)."""

from __future__ import annotations

import os
import sys

from app.config.schema import Config
from app.data.links import hard_alignment, pharaoh_line
from app.data.tokenizer import EOS
from app.decode.ensemble import ensemble_of
from app.decode.search import describe
from app.decode.trained import load_ct2, load_trained
from app.models import has_attention
from app.run.checkpoint import checkpoint_path
from app.run.device import resolve_device
from app.run.errors import UserError
from app.run.files import atomic_write_text


def translate_lines(cfg: Config) -> None:
    """translate.input (or stdin) to translate.output (or stdout); with decode.n_best > 1 the lines are
    ``index ||| hypothesis ||| score``."""
    lines = read_translate_input(cfg.translate.input)  # bad input fails before the model loads
    prefixes = None
    if cfg.translate.prefix:
        prefixes = read_translate_input(cfg.translate.prefix, "translate.prefix", "begin the translations with")
        if len(prefixes) != len(lines):
            where = cfg.translate.input or "standard input"
            has = f"{len(prefixes)} line{'s' * (len(prefixes) != 1)}"
            raise UserError(
                f"translate.prefix={cfg.translate.prefix!r} has {has} and {where} {len(lines)}: one prefix per line "
                "to translate (an empty line: none)"
            )
    if cfg.translate.alignments and cfg.decode.n_best > 1:
        raise UserError(
            f"translate.alignments=true links the best hypothesis only: not with decode.n_best={cfg.decode.n_best}"
        )
    if cfg.translate.engine == "ct2":  # the export alone: no checkpoint, no training code
        engine = load_ct2(cfg, None, "translate.engine")
        tokenizer = engine.tokenizer()
        run = engine.info.get("run", {})
        used = (
            f"{engine.model_dir}, the CTranslate2 export ({engine.info.get('quantization')}) of "
            f"{run.get('checkpoint')}.pt (step {run.get('step')})"
        )
    else:
        engine = load_trained(
            cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device), "translate.checkpoint", cfg.ensemble
        )
        tokenizer = engine.tokenizer
        used = (
            ensemble_of(engine.members)
            or f"{checkpoint_path(cfg.run_dir, cfg.translate.checkpoint)} (step {engine.step})"
        )
        if cfg.translate.alignments and not has_attention(engine.config.model):
            raise UserError("translate.alignments=true: this model has no attention to read word links from")
    # on stderr: stdout holds the translations alone
    count = f"{len(lines)} line{'s' * (len(lines) != 1)}"
    forced = "" if prefixes is None else f", {sum(map(bool, prefixes))} with a translate.prefix line"
    print(f"translating {count} with {used}: {describe(cfg.decode)}{forced}", file=sys.stderr, flush=True)
    src = tokenizer.encode_src(lines)
    prefix = None if prefixes is None else tokenizer.encode_tgt(prefixes)
    hyps = engine.translate(src, cfg.decode, need_attention=cfg.translate.alignments, prefix=prefix)
    if cfg.translate.alignments:
        links = word_links(src, hyps.tokens, hyps.attention, tokenizer, cfg.viz.layer)
        text = "".join(f"{t} ||| {line}\n" for t, line in zip(tokenizer.decode_tgt(hyps.tokens), links))
    elif cfg.decode.n_best > 1:
        text = "".join(
            f"{i} ||| {tokenizer.decode_tgt([tokens])[0]} ||| {score:.4f}\n"
            for i, hypotheses in enumerate(hyps.nbest)
            for tokens, score in hypotheses
        )
    else:
        text = "".join(t + "\n" for t in tokenizer.decode_tgt(hyps.tokens))
    if cfg.translate.output:
        atomic_write_text(cfg.translate.output, text)
    else:
        sys.stdout.write(text)


def word_links(src: list[list[int]], tgt: list[list[int]], maps: list, tokenizer, layer: int) -> list[str]:
    """Per pair, the target's word links to the source as a Pharaoh line, read from its attention map in ``maps``
    (rows: the target pieces and EOS) in the view eval's plots show by default (app.evaluation.views.
    plotted_view): an RNN's map, a Transformer's layer ``layer`` (viz.layer) mean of heads; a CTranslate2 export
    returns that one map. The attention that wrote a hypothesis (make translate), or that read a given translation
    (make score)."""
    lines = []
    for source, tokens, attention in zip(src, tgt, maps):
        weights = attention if attention.dim() == 2 else attention[layer].mean(0)
        pieces = tokenizer.src_pieces(source + [EOS]), tokenizer.tgt_pieces(tokens + [EOS])
        lines.append(pharaoh_line(hard_alignment(weights, *pieces)))
    return lines


def read_translate_input(path: str | None, setting: str = "translate.input", purpose: str = "translate") -> list[str]:
    """Lines to translate (or score: ``purpose``) from the file ``path`` (the value of ``setting``) or stdin; an
    empty input or undecodable bytes is an error."""
    where = f"{setting}={path!r}" if path else "standard input"
    if path and os.path.isdir(path):
        raise UserError(f"{where}: a folder, not a file")
    try:  # any file that reads: also /dev/null, a named pipe, a shell's <(...)
        source = open(path, "rb") if path else sys.stdin.buffer
    except FileNotFoundError:
        raise UserError(f"{where}: file not found") from None
    except OSError as err:
        raise UserError(f"{where}: cannot be read ({err.strerror})") from None
    lines = []
    with source:
        for line_no, raw in enumerate(source, start=1):
            try:
                lines.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                raise UserError(f"{path or 'standard input'}:{line_no}: not valid UTF-8") from None
    if not lines:
        raise UserError(f"{where}: nothing to {purpose} (it is empty)")
    return lines
