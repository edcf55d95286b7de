"""``make eval``'s evaluation of a run: its checkpoint (or CTranslate2 export, or an ensemble) loaded, the split
or the pair of files ``eval.source``/``eval.target`` (or its first ``eval.max_sentences``) and its reference links
read, and the one evaluation of a split (app/evaluation/split.py) asked for everything a person reads of it:
app/report/evaluation_files.py writes it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from app.config.ranges import check_layer
from app.config.schema import Config, target_language
from app.data.corpus import ParallelData, load_split
from app.data.links import check_within, read_pharaoh, reference_links
from app.data.sources import SPLITS
from app.decode.ct2_engine import CT2Translator, check_ct2_decoding
from app.decode.ensemble import ensemble_of
from app.decode.line_files import read_lines, read_parallel
from app.decode.mbr import mbr_seconds
from app.decode.search import Hypotheses, check_lengths, describe
from app.decode.trained import TrainedModel, load_ct2, load_trained
from app.evaluation.alignment import align_scope
from app.evaluation.metrics import bleu_tokenizer, sentence_bleu
from app.evaluation.significance import in_words, paired_significance, sentence_wins
from app.evaluation.split import Alignment, Asked, SplitResult, evaluate_split, with_ter
from app.models import count_parameters, has_attention
from app.models.api import Copying, SelfAttending
from app.run.checkpoint import checkpoint_path, run_folder
from app.run.device import resolve_device
from app.run.errors import UserError, required
from app.run.host_worker import host_worker
from app.run.stopwatch import Stopwatch

# the share of the sentences whose TER the host worker counts while this process writes the attention files,
# heatmaps and explorer, then counts the rest: both end near together (docs/benchmarking.md, make eval)
TER_WORKER_SHARE = 0.6


@dataclass
class Baseline:
    """``eval.baseline``'s hypotheses (of the file ``path``) and each one's sentence BLEU on the same references."""

    path: str
    texts: list[str]
    bleu: list[float]


@dataclass
class EvaluatedRun:
    """What ``make eval`` evaluated and how: the settings, the run's model, the split (``data``, of
    ``split_size`` sentences), the CTranslate2 engine that decoded it (if any), the reference links AER read
    (``links``), the result, what metrics.json holds of it (``metrics``: TER once ``finish`` is called), the
    clock, and the baseline's hypotheses (``eval.baseline``)."""

    cfg: Config
    trained: TrainedModel
    data: ParallelData
    split_size: int
    ct2: Optional[CT2Translator]
    links: Optional[list]
    result: SplitResult
    clock: Stopwatch
    metrics: dict = field(default_factory=dict)
    baseline: Optional[Baseline] = None  # eval.baseline's hypotheses, when given

    @property
    def has_attention(self) -> bool:
        return self.result.hypotheses.attention is not None

    def checkpoint_name(self, form: str = "{checkpoint}.pt, step {step}") -> str:
        """What decoded: an ensemble's members, or the checkpoint in ``form``."""
        members, step = self.trained.members, self.trained.step
        return ensemble_of(members) or form.format(checkpoint=self.cfg.eval.checkpoint, step=step)

    def model_name(self) -> str:
        """The model's family and size: "transformer (6.6 M parameters)", "rnn bahdanau (...)"."""
        model = self.trained.config.model
        family = model.arch if model.arch == "transformer" else f"rnn {model.attention}"
        return f"{family} ({count_parameters(self.trained.model) / 1e6:.1f} M parameters)"

    def finish(self) -> dict:
        """The metrics with TER, of this process's share and the worker's (timed as scoring)."""
        with self.clock("score"):
            scores = self.result.finish()
        self.metrics = with_ter(self.metrics, {k: scores[k] for k in ("ter", "ter_signature")})
        return self.metrics


def evaluated(cfg: Config) -> bool:
    """Whether eval/<split>/metrics.json is newer than the checkpoint it would evaluate (and than eval.source and
    eval.target, where given), and of the whole split (an ``eval.max_sentences`` look at its first sentences is not
    its evaluation)."""
    metrics = os.path.join(cfg.run_dir, "eval", cfg.eval.set_name(), "metrics.json")
    files = (cfg.eval.source, cfg.eval.target, *cfg.eval.references)
    inputs = [checkpoint_path(cfg.run_dir, cfg.eval.checkpoint), *filter(None, files)]
    if not all(map(os.path.exists, (metrics, *inputs))) or os.path.getmtime(metrics) < max(
        map(os.path.getmtime, inputs)
    ):
        return False
    with open(metrics, encoding="utf-8") as f:
        return not json.load(f).get("subset")


def evaluate_run(cfg: Config) -> EvaluatedRun:
    """Decode ``eval.split`` or the files ``eval.source``/``eval.target`` (their first ``eval.max_sentences``) with
    the run's ``eval.checkpoint`` and evaluate it; the TER share of the worker is collected when the writer calls
    ``result.finish()``."""
    check_settings(cfg)
    clock = Stopwatch()
    with clock("load"):
        e = cfg.eval  # bad input fails before the model loads
        texts = read_parallel(e.source, e.target, "eval", "evaluate") if e.source and e.target else None
        trained = load_trained(
            cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device), "eval.checkpoint", cfg.ensemble
        )
        trained.check_decoding(cfg.decode)
        check_layer(cfg.viz.layer, trained.config.model)
        data = evaluated_data(cfg, trained, texts)
        more = [lines[: cfg.eval.max_sentences or None] for lines in more_references(cfg, len(data))]
        split_size, data = len(data), data.head(cfg.eval.max_sentences)
        exported = (
            "eval.checkpoint",
            cfg.eval.checkpoint,
        )  # the checkpoint, not only its step (best and last share one)
        ct2 = load_ct2(cfg, trained, "eval.engine", exported) if cfg.eval.engine == "ct2" else None
        baseline = baseline_hypotheses(cfg, len(data))
    if ct2:
        search = lambda src, attention, progress: ct2.translate(src, cfg.decode, need_attention=attention)  # noqa: E731
    else:
        search = lambda src, attention, progress: trained.translate(  # noqa: E731
            src, cfg.decode, progress=progress, need_attention=attention
        )
    alignment = alignment_asked(cfg, trained, data, split_size)
    own = cfg.viz.self_attention and cfg.eval.engine == "torch" and isinstance(trained.model, SelfAttending)
    copying = cfg.eval.engine == "torch" and getattr(trained.config.model, "copy_attention", False)
    copying = copying and isinstance(trained.model, Copying)  # an ensemble's members are not asked
    forced = own or copying or (alignment is not None and has_attention(trained.config.model))  # a forced pass
    asked = Asked(
        bleu_tokenizer(cfg.eval.bleu_tokenize, target_language(trained.config.data)),
        scores="split",
        length_buckets=cfg.eval.length_buckets,
        ter_share=1.0 if forced else TER_WORKER_SHARE,  # all of TER in the worker beside a teacher-forced pass
        records=None,
        keep=cfg.eval.attention,
        layer=cfg.viz.layer,
        references=alignment is not None,
        links=True,
        self_attention=own,
        copy_shares=copying,
        alignment=alignment,
        progress=True,
        more_references=more,
    )
    worker = host_worker(preload=("app.evaluation.metrics",)) if cfg.viz.worker else None
    plan = lambda hyps: print_plan(cfg, data, split_size, hyps, own, copying, alignment, clock)  # noqa: E731
    model, batch = trained.model, cfg.decode.batch_tokens
    result = evaluate_split(model, data, trained.tokenizer, search, asked, batch, trained.dtype, worker, clock, plan)
    if alignment is not None and result.alignment is None and cfg.eval.gold_align:
        raise UserError("eval.gold_align: this model has no attention to align with")
    links = alignment.links if alignment is not None and result.alignment is not None else None
    run = EvaluatedRun(cfg, trained, data, split_size, ct2, links, result, clock)
    run.metrics = {**result.metrics, **subset_stats(len(data), split_size), **decoding_stats(run)}
    if more:
        run.metrics["references"] = 1 + len(more)
    if result.alignment is not None:
        run.metrics["alignment"] = result.alignment
    if result.attention is not None:  # of the hypotheses' attention, the map plots show (viz.layer)
        run.metrics["attention"] = result.attention
    if result.links_view is not None:
        run.metrics["hyp_align_view"] = result.links_view
    if result.copy is not None:
        run.metrics["copy"] = result.copy
    if result.heads:
        run.metrics["self_attention_heads"] = {kind: heads.result() for kind, heads in result.heads.items()}
    if baseline is not None:
        with clock("significance"):
            path, lines = baseline
            run.baseline = Baseline(path, lines, sentence_bleu(lines, data.tgt_texts, asked.bleu_tokenize, more))
            significance = against_baseline(cfg, baseline, result.texts, data.tgt_texts, asked.bleu_tokenize, more)
            ours = required(result.sentence_bleu, "sentence BLEU")  # make eval scores the split
            run.metrics["significance"] = {**significance, "sentences": sentence_wins(ours, run.baseline.bleu)}
    return run


def evaluated_data(cfg: Config, trained: TrainedModel, texts: Optional[tuple[list[str], list[str]]]) -> ParallelData:
    """The pairs evaluated: ``texts``, the lines of eval.source and eval.target (numbered from 1, their ids),
    tokenized and each within the model's positions; else the split eval.split of the run's corpus."""
    if texts is None:
        return load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
    src, tgt = trained.tokenizer.encode_src(texts[0]), trained.tokenizer.encode_tgt(texts[1])
    for side, ids in (("source", src), ("target", tgt)):
        check_lengths(trained.max_positions, ids, f"eval.{side}={getattr(cfg.eval, side)!r}: line")
    return ParallelData([str(n) for n in range(1, len(src) + 1)], texts[0], texts[1], src, tgt)


def more_references(cfg: Config, sentences: int) -> list[list[str]]:
    """The lines of each file of eval.references, read before anything is decoded: a line per sentence evaluated."""
    return [
        lines_per_sentence(cfg, path, "eval.references", "score against", "a file of reference translations", sentences)
        for path in cfg.eval.references
    ]


def baseline_hypotheses(cfg: Config, sentences: int) -> Optional[tuple[str, list[str]]]:
    """``eval.baseline``'s hypotheses (a hypothesis file, or a run's eval/<split>/hyp.txt) and their file, read
    before anything is decoded: a line per sentence evaluated."""
    given = cfg.eval.baseline
    if not given:
        return None
    path = given if os.path.isfile(given) else os.path.join(run_folder(given), "eval", cfg.eval.set_name(), "hyp.txt")
    hint = "give a hypothesis file or an evaluated run"
    return path, lines_per_sentence(cfg, path, f"eval.baseline={given}", "compare against", hint, sentences)


def lines_per_sentence(cfg: Config, path: str, setting: str, purpose: str, hint: str, sentences: int) -> list[str]:
    """The lines of ``path`` (given by ``setting``), a line per each of the ``sentences`` evaluated in their order:
    a missing file, or one of another length, is refused in one line naming it (``hint``: what the file should be)."""
    if not os.path.isfile(path):
        raise UserError(f"{setting}: {path} does not exist ({hint}, a line per sentence)")
    lines = read_lines(path, setting, purpose)
    if len(lines) != sentences:
        raise UserError(
            f"{setting}: {path} has {len(lines)} lines for the {sentences} sentences of {cfg.eval.set_name()}: "
            "a line per sentence, in its order"
        )
    return lines


def against_baseline(
    cfg: Config,
    baseline: tuple[str, list[str]],
    texts: list[str],
    references: list[str],
    tokenize: str,
    more: list[list[str]],
) -> dict:
    """This evaluation's hypotheses tested against the baseline's on the same references (and ``more``; BLEU of
    ``tokenize``'s words): paired bootstrap and approximate randomization (app/evaluation/significance.py)."""
    path, lines = baseline
    baseline_name = required(cfg.eval.baseline, "eval.baseline")  # the baseline's name: set when compared
    compared = paired_significance([(baseline_name, lines), (cfg.name, texts)], references, tokenize, more)
    systems = [{"name": c.name, **c.scores} for c in compared]
    return {"baseline": path, "systems": systems, "in_words": in_words(compared)}


def subset_stats(sentences: int, split_size: int) -> dict:
    """How much of the split was scored: a subset is said so, so that nobody takes it for the split's score."""
    subset = f"first {sentences} of {split_size} sentences" if sentences < split_size else None
    return {"split_sentences": split_size, "subset": subset}


def check_settings(cfg: Config) -> None:
    if cfg.eval.split not in SPLITS:
        raise UserError(f"eval.split={cfg.eval.split!r} is not a split; the splits are {', '.join(SPLITS)}")
    if cfg.eval.set_name() in SPLITS and cfg.eval.source:  # eval/<split>/ holds the split's evaluation
        raise UserError(
            f"eval.source={cfg.eval.source!r}: its files would go to eval/{cfg.eval.set_name()}/, where the "
            f"{cfg.eval.set_name()} split's are: give the file another name"
        )
    if cfg.eval.engine == "ct2":
        check_ct2_decoding(cfg.decode, "eval.engine")
    if cfg.eval.max_sentences < 0:
        raise UserError(f"eval.max_sentences={cfg.eval.max_sentences}: the first N sentences of the split, 0 for all")


def alignment_asked(cfg: Config, trained: TrainedModel, data: ParallelData, split_size: int) -> Optional[Alignment]:
    """What AER is scored against: ``eval.gold_align``, else the corpus's own reference links of the split (none:
    None). The method reported (app/evaluation/extraction.py: ``align.method``'s, with ``align.reverse``'s run for
    the symmetrized ones) is the best on dev where the corpus has dev links (and the gold is its own; dev cut as the
    split is), else the best on this split (said so: an optimistic choice)."""
    own = None if cfg.eval.source else reference_links(trained.config.data.dir, cfg.eval.split)
    gold_path = cfg.eval.gold_align or own
    if not gold_path:
        return None
    tok, split = trained.tokenizer, cfg.eval.set_name()
    asked = Alignment(
        links=first_lines(read_pharaoh(gold_path), split_size, len(data), gold_setting(cfg, gold_path)),
        scope=align_scope(cfg.eval.align_scope, gold_file=bool(cfg.eval.gold_align)),
        split=split,
        gold=gold_path,
        keep=len(data),
        method=cfg.align.method,
    )
    if cfg.align.reverse:  # a run of the other direction: both directions symmetrized are methods too
        reverse_dir = run_folder(cfg.align.reverse)
        asked.reverse = load_trained(reverse_dir, cfg.align.checkpoint, trained.device, "align.checkpoint")
    if cfg.eval.gold_align:  # a user's file: links within each pair's words (the corpus's are checked when prepared)
        for n, ((_, possible), src, tgt) in enumerate(zip(asked.links, data.src_texts, data.tgt_texts), start=1):
            check_within(f"{gold_path}:{n}", possible, src, tgt)
    dev_path = reference_links(trained.config.data.dir, "dev")
    if split != "dev" and dev_path and not cfg.eval.gold_align:
        dev = load_split(trained.config.data.dir, "dev", tok)
        dev_size, dev = len(dev), dev.head(len(data) if len(data) < split_size else 0)
        asked.dev = dev, first_lines(read_pharaoh(dev_path), dev_size, len(dev), dev_path)
        asked.dev_name = "dev" if len(dev) == dev_size else f"dev (first {len(dev)} of {dev_size} sentences)"
    return asked


def gold_setting(cfg: Config, path: str) -> str:
    """How errors name the gold links: the setting that gave them, or the corpus's file."""
    return f"eval.gold_align={path}" if cfg.eval.gold_align else path


def first_lines(gold: list, split_size: int, n: int, where: str) -> list:
    """The links of the first ``n`` sentences, once the gold (``where``: how errors name it) is known to cover the
    whole split."""
    if len(gold) != split_size:
        raise UserError(f"{where}: {len(gold)} lines of reference links for the {split_size} sentences of the split")
    return gold[:n]


def print_plan(
    cfg: Config,
    data: ParallelData,
    split_size: int,
    hyps: Hypotheses,
    own: bool,
    copying: bool,
    alignment: Optional[Alignment],
    clock: Stopwatch,
) -> None:
    """What is left once the hypotheses exist (``own``: the self-attention too; ``copying``: how much of each
    hypothesis was copied): long work shows its own progress bar."""
    has_attention = hyps.attention is not None
    what = ["scores (TER in a worker process)"] + ["AER against the reference links"] * bool(alignment)
    what += ["the self-attention of every hypothesis (viz.self_attention)"] * own
    what += ["what each hypothesis copied (model.copy_attention)"] * copying
    if has_attention:
        plots = min(cfg.viz.eval_plots, len(data))
        what += [f"attention files, {plots} heatmap{'s' * (plots != 1)}, the explorer"]
    subset = f" (first {len(data)} of {split_size})" if len(data) < split_size else ""
    mbr = hyps.mbr and f" ({mbr_seconds(hyps.mbr)})"
    print(
        f"decoded {len(data)} {cfg.eval.set_name()} sentences{subset} in {clock.seconds['decode']:.1f} s{mbr or ''}; "
        f"now {', '.join(what)} and TensorBoard",
        flush=True,
    )


def decoding_stats(run: EvaluatedRun) -> dict:
    """How the split was decoded, on what, and how fast."""
    cfg, trained, ct2, hyps = run.cfg, run.trained, run.ct2, run.result.hypotheses
    seconds = run.clock.seconds["decode"]
    return {
        "split": cfg.eval.set_name(),
        "checkpoint": cfg.eval.checkpoint,
        "decoding": describe(cfg.decode),
        "decode_seconds": round(seconds, 2),
        "sentences_per_s": round(len(hyps.tokens) / seconds, 1),
        "tokens_per_s": round(sum(len(h) + 1 for h in hyps.tokens) / seconds),
        # the largest cache of one decoding batch (decode.batch_tokens, beam size): compare runs decoded alike
        "kv_cache_mib": None if hyps.kv_cache_bytes is None else round(hyps.kv_cache_bytes / 2**20, 3),
        "device": torch.cuda.get_device_name(trained.device) if trained.device.type == "cuda" else "cpu",
        "engine": f"ctranslate2 {ct2.info['ctranslate2_version']}, {ct2.info['quantization']}" if ct2 else "torch",
        **({"ensemble": trained.members} if trained.members else {}),
        **({"mbr": hyps.mbr} if hyps.mbr else {}),
    }
