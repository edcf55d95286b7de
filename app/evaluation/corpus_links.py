"""``make align``: the word links of every pair of a parallel corpus (a split of the run's corpus, or
``align.source``/``align.target`` files) from a trained run, in Pharaoh format, a line per pair.

The method (app/evaluation/extraction.py: a view of the attention, shift-att, both directions symmetrized with
``align.reverse``) is chosen first, by its AER on the run's dev reference links (as make eval chooses); then the
corpus is read ``align.chunk`` pairs at a time, each chunk through the forced pass in batches of
``decode.batch_tokens`` and written before the next is read. A pair that is empty, or too long for a model's
positions, gets an empty line, counted at the end. With reference links (``align.gold``, or the split's own) the
links' AER, precision and recall are printed and kept in ``<output>.json`` beside the links.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
from tqdm import tqdm

from app.config.commands import AlignConfig
from app.config.ranges import check_layer
from app.config.schema import Config
from app.data.corpus import load_split
from app.data.links import check_within, pharaoh_line, read_pharaoh, reference_links
from app.data.sources import SPLITS
from app.data.symmetrization import AGREEMENT
from app.data.text_files import check_file, text_lines
from app.decode.trained import TrainedModel, load_trained
from app.evaluation.alignment import AlignmentScore, LinkCandidates, align_scope, link_candidates
from app.evaluation.extraction import Method, default_method
from app.models import has_attention
from app.run.checkpoint import run_folder
from app.run.device import resolve_device
from app.run.errors import UserError
from app.run.files import atomic_write_text, check_output_file


@dataclass
class Corpus:
    """The pairs to align: their texts, a name for the output, and the reference links to score against."""

    name: str
    src: list[str]
    tgt: list[str]
    gold: Optional[str] = None  # a Pharaoh file, a line per pair
    gold_file: bool = False  # given by align.gold (it annotates every word), not the corpus's own links


def align_corpus(cfg: Config) -> dict:
    """Align the corpus ``cfg.align`` names with the run's model (and the reverse run's), write the links as they
    are read, and return what ``<output>.json`` holds."""
    a = cfg.align
    output = a.output or os.path.join(cfg.run_dir, "align", f"{corpus_name(a)}.align")
    where = f"align.output={a.output!r}" if a.output else f"align's output {output!r} (align.output unset)"
    check_output_file(output, where)
    if summary_path(output) == output:
        raise UserError(f"{where}: the summary <output>.json would replace the links: name them .align")
    check_output_file(summary_path(output), f"{where}: its summary {summary_path(output)!r}")
    device = resolve_device(cfg.device)
    forward = load_trained(cfg.run_dir, a.checkpoint, device, "align.checkpoint")
    check_layer(cfg.viz.layer, forward.config.model)
    if not has_attention(forward.config.model):
        raise UserError(f"{cfg.run_dir}: this model has no attention to read word links from")
    reverse = None
    if a.reverse:
        reverse = load_trained(run_folder(a.reverse), a.checkpoint, device, "align.checkpoint")
        if not has_attention(reverse.config.model):
            raise UserError(f"align.reverse={a.reverse}: this model has no attention to read word links from")
    corpus = read_corpus(cfg, forward)
    gold = read_pharaoh(corpus.gold) if corpus.gold else None
    if gold is not None and len(gold) != len(corpus.src):
        raise UserError(f"{corpus.gold} has {len(gold)} lines for {len(corpus.src)} pairs to align")
    for n, ((_, possible), src, tgt) in enumerate(zip(gold or [], corpus.src, corpus.tgt), start=1):
        check_within(f"{corpus.gold}:{n}", possible, src, tgt)
    scope = align_scope(cfg.eval.align_scope, corpus.gold_file)
    method, chosen_on = choose_method(cfg, forward, reverse)
    print(
        f"aligning {len(corpus.src)} pairs ({corpus.name}) with {method.name} ({chosen_on}) into {output}", flush=True
    )
    score = AlignmentScore([method.name], scope)
    skipped: Counter = Counter()
    start = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as out, tqdm(total=len(corpus.src), desc="aligning", unit="pair") as bar:
        for at in range(0, len(corpus.src), a.chunk):
            lines = align_chunk(cfg, forward, reverse, method, corpus, at, skipped)
            for n, links in enumerate(lines):
                out.write(pharaoh_line(links) + "\n")
                if gold is not None:
                    score.add([links], *gold[at + n])
            out.flush()
            bar.update(len(lines))
    seconds = time.perf_counter() - start
    summary = {
        "output": output,
        "pairs": len(corpus.src),
        "skipped": dict(skipped),
        "method": method.name,
        "kind": method.kind,
        "chosen_on": chosen_on,
        "seconds": round(seconds, 2),
        "lines_per_s": round(len(corpus.src) / max(seconds, 1e-9), 1),
        **({"alignment": {**score.result(method.name), "gold": corpus.gold, "scope": scope}} if gold else {}),
    }
    atomic_write_text(summary_path(output), json.dumps(summary, indent=1) + "\n")
    report(summary)
    return summary


def report(summary: dict) -> None:
    print(
        f"aligned {summary['pairs']} pairs in {summary['seconds']:.1f} s ({summary['lines_per_s']:.1f} lines/s) "
        f"into {summary['output']}"
    )
    if skipped := summary["skipped"]:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        print(f"  skipped {sum(skipped.values())} pairs, an empty line each: {reasons}")
    print(f"  method: {summary['method']} ({summary['chosen_on']})")
    if a := summary.get("alignment"):
        print(
            f"  AER {a['aer']:.4f}  precision {a['precision']:.4f}  recall {a['recall']:.4f}  "
            f"against {a['gold']} ({a['scope']} target words)"
        )


def corpus_name(a: AlignConfig) -> str:
    """What the links are named by: align.source's file name without its extension, else align.split."""
    return os.path.splitext(os.path.basename(a.source))[0] if a.source else a.split


def summary_path(output: str) -> str:
    """``<output>.json``, beside the links: what was aligned, how, and the links' AER."""
    return os.path.splitext(output)[0] + ".json"


def read_corpus(cfg: Config, forward: TrainedModel) -> Corpus:
    """``align.source``/``align.target``, else the split ``align.split`` of the run's corpus (and its reference
    links, where ``align.gold`` is not given)."""
    a = cfg.align
    if a.source and a.target:
        sides = []
        for path, setting in ((a.source, "align.source"), (a.target, "align.target")):
            check_file(path, f"{setting}={path!r}")
            sides.append([line for _, line in text_lines(path)])  # lines end at \n, as the corpus files' do
        if len(sides[0]) != len(sides[1]):
            raise UserError(
                f"align: {a.source} has {len(sides[0])} lines, {a.target} {len(sides[1])}: pairs, line by line"
            )
        return Corpus(corpus_name(a), sides[0], sides[1], a.gold, gold_file=True)
    if a.split not in SPLITS:
        raise UserError(f"align.split={a.split!r} is not a split; the splits are {', '.join(SPLITS)}")
    data = load_split(forward.config.data.dir, a.split, forward.tokenizer)
    gold = a.gold or reference_links(forward.config.data.dir, a.split)
    return Corpus(a.split, data.src_texts, data.tgt_texts, gold, gold_file=bool(a.gold))


def choose_method(cfg: Config, forward: TrainedModel, reverse: Optional[TrainedModel]) -> tuple[Method, str]:
    """The method ``align.method`` allows with the lowest AER on the run's dev reference links (each direction's
    reading the best of its own there), and where it was chosen; without dev links, the default (the view plots
    show)."""
    data_dir = forward.config.data.dir
    dev_links = reference_links(data_dir, "dev")
    if dev_links is None:
        sample = lambda trained: attention_shape(trained.config.model)  # noqa: E731
        method = default_method(sample(forward), cfg.viz.layer, cfg.align.method, reverse and sample(reverse))
        return method, "not chosen: the run's corpus has no dev reference links"
    dev = load_split(data_dir, "dev", forward.tokenizer)
    pairs, texts = (dev.src, dev.tgt), (dev.src_texts, dev.tgt_texts)
    batch, trained = cfg.decode.batch_tokens, forward
    passes = (trained.device, trained.dtype, batch, reverse)
    found, _ = link_candidates(trained.model, trained.tokenizer, pairs, texts, *passes, progress="on dev")
    if found is None:
        raise UserError(f"{cfg.run_dir}: this model has no attention to read word links from")

    def read_two(directions: tuple[str, str]) -> Optional[LinkCandidates]:
        """The two readings agreement joins, with their probabilities, over dev."""
        two = ([directions[0]], [directions[1]])
        return link_candidates(trained.model, trained.tokenizer, pairs, texts, *passes, two, soft=two)[0]

    gold, scope = read_pharaoh(dev_links), align_scope(cfg.eval.align_scope, gold_file=False)
    method, _, on_dev = found.choose(gold, scope, cfg.align.method, read_two)
    aer = on_dev.result(method.name)["aer"]
    return method, f"chosen on dev: AER {aer:.4f} against {dev_links}"


def attention_shape(model) -> np.ndarray:
    """An empty attention of a model's shape (layers, heads, ...; an RNN's one map): what names its views."""
    if model.arch == "transformer":
        return np.zeros((model.dec_layers, model.heads, 1, 1), dtype=np.float32)
    return np.zeros((1, 1), dtype=np.float32)


def align_chunk(
    cfg: Config,
    forward: TrainedModel,
    reverse: Optional[TrainedModel],
    method: Method,
    corpus: Corpus,
    at: int,
    skipped: Counter,
) -> list[set[tuple[int, int]]]:
    """The links of the pairs ``at`` ... ``at + align.chunk`` of the corpus by ``method``; a pair that is empty or
    too long for either model links nothing, counted in ``skipped`` by its reason."""
    src, tgt = corpus.src[at : at + cfg.align.chunk], corpus.tgt[at : at + cfg.align.chunk]
    ids = forward.tokenizer.encode_src(src), forward.tokenizer.encode_tgt(tgt)
    lengths = [ids]
    if reverse is not None:
        lengths.append((reverse.tokenizer.encode_src(tgt), reverse.tokenizer.encode_tgt(src)))
    limits = [positions(forward)] + ([positions(reverse)] if reverse is not None else [])
    kept = []
    for n in range(len(src)):
        if not src[n].split() or not tgt[n].split():
            skipped["empty"] += 1
        elif any(max(len(s[n]), len(t[n])) + 1 > limit for (s, t), limit in zip(lengths, limits)):
            skipped["too long for the model"] += 1
        else:
            kept.append(n)
    lines: list[set[tuple[int, int]]] = [set() for _ in src]
    if not kept:
        return lines
    pairs = [ids[0][n] for n in kept], [ids[1][n] for n in kept]
    texts = [src[n] for n in kept], [tgt[n] for n in kept]
    readings = [method.forward], None if method.reverse is None else [method.reverse]
    soft = (readings[0], readings[1] or []) if method.symmetrization == AGREEMENT else ((), ())
    passes = (forward.device, forward.dtype, cfg.decode.batch_tokens, reverse if method.reverse else None, readings)
    found, _ = link_candidates(forward.model, forward.tokenizer, pairs, texts, *passes, soft=soft)
    for k, n in enumerate(kept):
        lines[n] = found.links(k, method) if found is not None else set()
    return lines


def positions(trained: TrainedModel) -> float:
    """The pieces a sequence of this model may hold, its ``</s>`` included."""
    return getattr(trained.model, "max_positions", None) or float("inf")
