"""``make translate``: lines from a file or standard input to a file or standard output, by a run's
checkpoint or its CTranslate2 export; with ``decode.n_best`` > 1 in the Moses n-best format, with
``translate.alignments`` each line followed by its word links to the source (``translation ||| 0-0 1-2 ...``; an
n-best line ``index ||| hypothesis ||| score ||| 0-0 1-2 ...``),
with ``translate.prefix`` each translation beginning with the words given for it (interactive translation), with
``translate.constraints`` each containing the target phrases given for it (terminology)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import tempfile
import time
from typing import Any, Optional

from tqdm import tqdm

from app.config.ranges import check_layer
from app.config.schema import Config
from app.data.links import hard_alignment, pharaoh_line
from app.decode.constraints import encode_phrases, forced_lengths
from app.decode.ct2_engine import CT2Translator, check_ct2_decoding
from app.decode.ensemble import ensemble_of
from app.decode.line_files import LineFile, open_line_file, open_output, resume_point, windows
from app.decode.mbr import mbr_seconds, merged
from app.decode.search import check_lengths, describe
from app.decode.trained import TrainedModel, load_ct2, load_trained
from app.models import has_attention
from app.run.checkpoint import checkpoint_path
from app.run.device import resolve_device
from app.run.errors import UserError
from app.run.files import check_output_file


def translate_lines(cfg: Config) -> None:
    """translate.input (or stdin) to translate.output (or stdout), ``translate.window`` lines at a time (sorted by
    length inside it, written in input order as it goes); with decode.n_best > 1 the lines are
    ``index ||| hypothesis ||| score`` (and ``||| links`` with translate.alignments); with translate.resume an
    interrupted output is continued."""
    t = cfg.translate
    check_settings(cfg)
    with tempfile.TemporaryDirectory(prefix="translate-") as spool:  # bad input fails before the model loads
        source = open_line_file(t.input, "translate.input", "translate", spool)
        prefixes = constraints = None
        if t.prefix:
            prefixes = open_line_file(t.prefix, "translate.prefix", "begin the translations with", spool)
            check_lines(prefixes, source, "one prefix per line to translate (an empty line: none)")
        if t.constraints:
            constraints = open_line_file(
                t.constraints, "translate.constraints", "constrain the translations with", spool
            )
            check_lines(
                constraints, source, "one line of tab-separated phrases per line to translate (an empty line: none)"
            )
        engine, tokenizer, used = load_engine(cfg)
        first, byte = (0, None)
        if t.resume and t.output:
            first, byte = resume_point(t.output, source.lines, t.window, cfg.decode.n_best > 1)
        check_inputs(engine.max_positions, tokenizer, t.window, first, source, prefixes, constraints)
        # on stderr: stdout holds the translations alone
        count = f"{source.lines} line{'s' * (source.lines != 1)}"
        forced = "" if prefixes is None else f", {prefixes.filled} with a translate.prefix line"
        forced += "" if constraints is None else f", {constraints.filled} with translate.constraints"
        print(f"translating {count} with {used}: {describe(cfg.decode)}{forced}", file=sys.stderr, flush=True)
        if t.resume and first == source.lines:
            print(f"{t.output} holds every line's translation already: nothing left to translate", file=sys.stderr)
        elif t.resume:
            print(f"resuming {t.output} at line {first + 1} (window {first // t.window + 1})", file=sys.stderr)
        started = time.perf_counter()
        mbr: list[dict] = []  # minimum Bayes risk's figures of each window
        bar = tqdm(total=source.lines, initial=first, desc="translating", unit="line", file=sys.stderr, leave=False)
        streams = [
            windows(f, t.window, first) if f else itertools.repeat(None) for f in (source, prefixes, constraints)
        ]
        out = open_output(t.output, byte)
        try:
            for k, (lines, begin, phrases) in enumerate(zip(*streams), start=first // t.window):
                at = k * t.window
                pieces = phrase_pieces(tokenizer, phrases, at, constraints)
                out.write(translate_window(cfg, engine, tokenizer, lines, begin, pieces, k, mbr).encode("utf-8"))
                out.flush()
                bar.update(len(lines))
        finally:
            bar.close()
            if out is not sys.stdout.buffer:
                out.close()
    seconds, done = time.perf_counter() - started, source.lines - first
    where, lines = t.output or "standard output", f"{done} line{'s' * (done != 1)}"
    rate = f"{done / max(seconds, 1e-9):.1f} lines/s"
    spent = f"; minimum Bayes risk: {mbr_seconds(merged(mbr))}" if mbr else ""
    print(f"translated {lines} in {seconds:.1f} s ({rate}) into {where}{spent}", file=sys.stderr)


def check_settings(cfg: Config) -> None:
    """The translate settings that cannot go together, refused before the model loads."""
    t = cfg.translate
    if t.resume and not t.output:
        raise UserError("translate.resume=true continues the file translate.output names: set translate.output")
    if t.output:
        check_output_file(t.output, f"translate.output={t.output!r}")
    if t.alignments and cfg.decode.n_best > 1 and t.engine == "ct2":
        raise UserError(
            f"translate.alignments=true with decode.n_best={cfg.decode.n_best}: a CTranslate2 export returns the best "
            "hypothesis' attention only; translate.engine=torch links every hypothesis"
        )
    if t.engine == "ct2":
        check_ct2_decoding(cfg.decode, "translate.engine")
    if t.constraints and t.engine == "ct2":
        raise UserError(
            f"translate.constraints={t.constraints!r}: CTranslate2 has no constrained decoding; translate.engine=torch "
            "has"
        )
    for setting in ("input", "prefix", "constraints"):  # the output is opened (emptied) before they are read
        read = getattr(t, setting)
        if t.output and read and os.path.exists(t.output) and os.path.exists(read) and os.path.samefile(t.output, read):
            raise UserError(
                f"translate.output={t.output!r} is the file translate.{setting} names: it would be emptied before it "
                "is read; write the translations to another file"
            )


def check_lines(given: LineFile, source: LineFile, rule: str) -> None:
    """A file of a line per line to translate (``rule`` says what each is), else a UserError."""
    if given.lines != source.lines:
        has = f"{given.lines} line{'s' * (given.lines != 1)}"
        raise UserError(f"{given.where} has {has} and {source.where} {source.lines}: {rule}")


def check_inputs(
    max_positions: Optional[int],
    tokenizer,
    window: int,
    first: int,
    source: LineFile,
    prefixes: Optional[LineFile],
    constraints: Optional[LineFile],
) -> None:
    """Before anything is translated, from line ``first`` on: every line within the model's positions (its prefix,
    and its phrases with its prefix, too) and every phrase tokenized, else a UserError naming the file and line."""
    streams = [windows(f, window, first) if f else itertools.repeat(None) for f in (source, prefixes, constraints)]
    for k, (lines, begin, phrases) in enumerate(zip(*streams), start=first // window):
        at = k * window
        check_lengths(max_positions, tokenizer.encode_src(lines), f"{source.where}: line", at)
        prefix = None
        if prefixes is not None:
            prefix = tokenizer.encode_tgt(begin)
            check_lengths(max_positions, prefix, f"{prefixes.where}: line", at)
        if constraints is not None and (pieces := phrase_pieces(tokenizer, phrases, at, constraints)) is not None:
            forced, what = forced_lengths(pieces, prefix), " with translate.prefix" if prefix else ""
            check_lengths(max_positions, forced, f"{constraints.where}{what}: line", at)


def load_engine(cfg: Config) -> tuple[CT2Translator | TrainedModel, Any, str]:
    """The engine translate.engine names, its tokenizer, and what it is in words."""
    if cfg.translate.engine == "ct2":  # the export alone: no checkpoint, no training code
        ct2 = load_ct2(cfg, None, "translate.engine", ("translate.checkpoint", cfg.translate.checkpoint))
        run = ct2.info.get("run", {})
        used = (
            f"{ct2.model_dir}, the CTranslate2 export ({ct2.info.get('quantization')}) of "
            f"{run.get('checkpoint')}.pt (step {run.get('step')})"
        )
        return ct2, ct2.tokenizer(), used
    trained = load_trained(
        cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device), "translate.checkpoint", cfg.ensemble
    )
    used = (
        ensemble_of(trained.members)
        or f"{checkpoint_path(cfg.run_dir, cfg.translate.checkpoint)} (step {trained.step})"
    )
    trained.check_decoding(cfg.decode)
    check_layer(cfg.viz.layer, trained.config.model)
    if cfg.translate.alignments and not has_attention(trained.config.model):
        raise UserError("translate.alignments=true: this model has no attention to read word links from")
    return trained, trained.tokenizer, used


def phrase_pieces(
    tokenizer, rows: Optional[list[str]], at: int, file: Optional[LineFile]
) -> Optional[list[list[list[int]]]]:
    """The constraints of lines ``at`` ... (rows of tab-separated phrases of ``file``) as target pieces; None
    without any."""
    if rows is None or file is None:
        return None
    phrase_at = lambda i, j: f"{file.where} line {at + i + 1}, phrase {j + 1}"  # noqa: E731
    return encode_phrases(tokenizer.encode_tgt, [row.split("\t") if row else [] for row in rows], phrase_at)


def translate_window(
    cfg: Config,
    engine: CT2Translator | TrainedModel,
    tokenizer,
    lines: list[str],
    prefixes: Optional[list[str]],
    constraints: Optional[list[list[list[int]]]],
    k: int,
    mbr: Optional[list[dict]] = None,
) -> str:
    """The output text of window ``k`` (its ``lines``, beginning at line k × translate.window): decoded in batches
    sorted by length, written in input order. Sampling draws window k with seed decode.sampling_seed + k, so a
    resumed run draws what an uninterrupted one drew."""
    decode = cfg.decode
    if decode.sampling and k:
        decode = dataclasses.replace(decode, sampling_seed=decode.sampling_seed + k)
    src = tokenizer.encode_src(lines)
    prefix = None if prefixes is None else tokenizer.encode_tgt(prefixes)
    need_attention = cfg.translate.alignments
    hyps = engine.translate(src, decode, need_attention=need_attention, prefix=prefix, constraints=constraints)
    if hyps.mbr and mbr is not None:
        mbr.append(hyps.mbr)
    if decode.n_best > 1:
        assert hyps.nbest is not None  # a beam search's (beam_size >= n_best)
        at = k * cfg.translate.window
        ranked = [(at + i, tokens, score) for i, hypotheses in enumerate(hyps.nbest) for tokens, score in hypotheses]
        tails = [""] * len(ranked)
        if cfg.translate.alignments:  # the torch engine's (translate_lines): every hypothesis' attention
            assert isinstance(engine, TrainedModel) and hyps.attention is not None
            maps = engine.nbest_attention(src, hyps, decode.batch_tokens)
            words = tokenizer.src_words(lines)
            sources = [words[index - at] for index, _, _ in ranked]
            attention = [weights for per_sentence in maps for weights in per_sentence]
            hypotheses = tokenizer.hyp_words([tokens for _, tokens, _ in ranked])
            links = word_links(sources, hypotheses, attention, cfg.viz.layer)
            tails = [f" ||| {line}" for line in links]
        return "".join(
            f"{index} ||| {tokenizer.decode_tgt([tokens])[0]} ||| {score:.4f}{tail}\n"
            for (index, tokens, score), tail in zip(ranked, tails)
        )
    if cfg.translate.alignments:
        assert hyps.attention is not None  # asked of a model with attention
        links = word_links(tokenizer.src_words(lines), tokenizer.hyp_words(hyps.tokens), hyps.attention, cfg.viz.layer)
        return "".join(f"{t} ||| {line}\n" for t, line in zip(tokenizer.decode_tgt(hyps.tokens), links))
    return "".join(t + "\n" for t in tokenizer.decode_tgt(hyps.tokens))


def word_links(src_words: list[list[int]], tgt_words: list[list[int]], maps: list, layer: int) -> list[str]:
    """Per pair, the target's word links to the source as a Pharaoh line, read from its attention map in ``maps``
    (rows: the target pieces and EOS) in the view eval's plots show by default (app.evaluation.views.
    plotted_view): an RNN's map, a Transformer's layer ``layer`` (viz.layer) mean of heads; a CTranslate2 export
    returns that one map. The attention that wrote a hypothesis (make translate), or that read a given translation
    (make score). ``src_words``, ``tgt_words``: the word of each piece, EOS left out (app.data.tokenizer)."""
    lines = []
    for source, target, attention in zip(src_words, tgt_words, maps):
        weights = attention if attention.dim() == 2 else attention[layer].mean(0)
        lines.append(pharaoh_line(hard_alignment(weights, source + [-1], target + [-1])))
    return lines
