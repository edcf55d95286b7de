"""``make score``: how probable a run's model finds given translations (fairseq-generate's --score-reference,
OpenNMT's gold score, CTranslate2's score_batch). Per pair of lines, the log-probability of the target given the
source, log p(Y|X) = Σ_t log p(y_t | y_<t, X) over the target's pieces and the final </s>, read while the model is
fed the target (teacher forcing): what filtering a corpus by its model's cross-entropy, reranking another system's
n-best lists, or finding the words a model does not expect reads. Output lines are tab-separated:
``log p(Y|X)``, the number of pieces scored, their mean log p, with ``score.pieces`` every ``piece:log p``, and
with ``score.alignments`` the pair's word links read from the attention of the same pass (Pharaoh)."""

from __future__ import annotations

import math
import sys
import time
from typing import Optional

from app.config.commands import ScoreConfig
from app.config.ranges import check_layer
from app.config.schema import Config
from app.data.corpus import load_split
from app.decode.ensemble import ensemble_of
from app.decode.line_files import read_parallel
from app.decode.search import check_lengths
from app.decode.trained import load_ct2, load_trained
from app.decode.translate import word_links
from app.models import has_attention
from app.run.checkpoint import checkpoint_path
from app.run.device import resolve_device
from app.run.errors import UserError
from app.run.files import atomic_write_text, check_output_file


def score_pairs(cfg: Config) -> None:
    """score.source / score.target (or the references of the run's split score.split) to score.output (or
    stdout); on stderr what was scored with what, the mean log p and perplexity per piece, and the seconds."""
    s, clock = cfg.score, time.monotonic()
    texts = read_pairs(s)  # bad input fails before the model loads
    engine, tokenizer, max_positions, used = load_scorer(cfg)
    if texts is not None:
        what = f"{s.source} → {s.target}"
        src, tgt = tokenizer.encode_src(texts[0]), tokenizer.encode_tgt(texts[1])
    else:
        data = load_split(engine.config.data.dir, s.split, tokenizer)
        what = f"the {s.split} split's references ({engine.config.data.dir})"
        src, tgt, texts = data.src, data.tgt, (data.src_texts, data.tgt_texts)
    for side, ids, path in (("source", src, s.source), ("target", tgt, s.target)):
        check_lengths(max_positions, ids, f"score.{side}={path!r}: line" if path else f"the {s.split} split: pair")
    pairs = f"{len(src):,} pair{'s' * (len(src) != 1)}"
    print(f"scoring {pairs} of {what} with {used}", file=sys.stderr, flush=True)
    loaded = time.monotonic()
    scores, maps = engine.score(src, tgt, cfg.decode.batch_tokens, sys.stderr.isatty(), s.alignments)
    scored = time.monotonic()
    words = (tokenizer.src_words(texts[0]), tokenizer.tgt_words(texts[1])) if s.alignments else None
    links = word_links(*words, maps, cfg.viz.layer) if words is not None else [None] * len(src)
    lines = (score_line(p, tokenizer.tgt_pieces(t) if s.pieces else None, a) for p, t, a in zip(scores, tgt, links))
    text = "".join(lines)
    if s.output:
        atomic_write_text(s.output, text)
    else:
        sys.stdout.write(text)
    pieces = sum(map(len, scores))
    mean = sum(map(sum, scores)) / max(pieces, 1)
    seconds = f"{time.monotonic() - clock:.1f} s (loading {loaded - clock:.1f} s, scoring {scored - loaded:.1f} s)"
    seconds += f"; wrote {s.output}" if s.output else ""
    print(
        f"scored {pairs}, {pieces:,} target pieces with </s>: log p per piece {mean:.4f}, perplexity "
        f"{math.exp(-mean):.2f}; {seconds}",
        file=sys.stderr,
    )


def read_pairs(s: ScoreConfig) -> Optional[tuple[list[str], list[str]]]:
    """The lines of score.source and score.target, as many of each; None: score a split. Settings that do not go
    together are refused here, before anything loads."""
    if (s.source is None) != (s.target is None):
        raise UserError("score.source and score.target go together: give both files, or neither to score a split")
    if s.engine == "ct2" and s.source is None:
        raise UserError("score.engine=ct2 scores files: give score.source and score.target (a split: engine torch)")
    if s.engine == "ct2" and s.alignments:
        raise UserError("score.alignments=true reads the checkpoint's attention: not with score.engine=ct2")
    if s.output:
        check_output_file(s.output, f"score.output={s.output!r}")
    if s.source is None or s.target is None:
        return None
    return read_parallel(s.source, s.target, "score", "score")


def load_scorer(cfg: Config) -> tuple:
    """The checkpoint score.checkpoint (or with score.engine=ct2 the run's export), its tokenizer, the positions
    its model has (None: any length), and what it is in words."""
    s = cfg.score
    if s.engine == "ct2":  # the export alone: no checkpoint, no training code
        ct2 = load_ct2(cfg, None, "score.engine", ("score.checkpoint", s.checkpoint))
        run = ct2.info.get("run", {})
        used = f"{ct2.model_dir}, the CTranslate2 export of {run.get('checkpoint')}.pt (step {run.get('step')})"
        return ct2, ct2.tokenizer(), ct2.max_positions, used
    engine = load_trained(cfg.run_dir, s.checkpoint, resolve_device(cfg.device), "score.checkpoint", cfg.ensemble)
    check_layer(cfg.viz.layer, engine.config.model)
    if s.alignments and not has_attention(engine.config.model):
        raise UserError("score.alignments=true: this model has no attention to read word links from")
    used = ensemble_of(engine.members) or f"{checkpoint_path(cfg.run_dir, s.checkpoint)} (step {engine.step})"
    return engine, engine.tokenizer, engine.max_positions, used


def score_line(logp: list[float], pieces: Optional[list[str]], links: Optional[str] = None) -> str:
    """``log p(Y|X)``, the pieces scored (</s> included) and their mean log p, tab-separated; with ``pieces``
    (the target's, without </s>) every ``piece:log p`` too; then the word links, where given."""
    line = f"{sum(logp):.4f}\t{len(logp)}\t{sum(logp) / len(logp):.4f}"
    if pieces is not None:
        line += "\t" + " ".join(f"{piece}:{p:.4f}" for piece, p in zip(pieces + ["</s>"], logp))
    if links is not None:
        line += "\t" + links
    return line + "\n"
