"""``make score``: how probable a run's model finds given translations (fairseq-generate's --score-reference,
OpenNMT's gold score, CTranslate2's score_batch). Per pair of lines, the log-probability of the target given the
source, log p(Y|X) = Σ_t log p(y_t | y_<t, X) over the target's pieces and the final </s>, read while the model is
fed the target (teacher forcing): what filtering a corpus by its model's cross-entropy, reranking another system's
n-best lists, or finding the words a model does not expect reads. Output lines are tab-separated:
``log p(Y|X)``, the number of pieces scored, their mean log p, and with ``score.pieces`` every ``piece:log p``."""

from __future__ import annotations

import math
import sys
import time

from app.checkpoint import checkpoint_path
from app.config import Config
from app.data.corpus import load_split
from app.decode.search import check_lengths
from app.decode.trained import load_ct2, load_trained
from app.decode.translate import read_translate_input
from app.errors import UserError
from app.utils import atomic_write_text, resolve_device


def score_pairs(cfg: Config) -> None:
    """score.source / score.target (or the references of the run's split score.split) to score.output (or
    stdout); on stderr what was scored with what, the mean log p and perplexity per piece, and the seconds."""
    s, clock = cfg.score, time.monotonic()
    if (s.source is None) != (s.target is None):
        raise UserError("score.source and score.target go together: give both files, or neither to score a split")
    if s.source is None and s.engine == "ct2":
        raise UserError("score.engine=ct2 scores files: give score.source and score.target (a split: engine torch)")
    texts = None
    if s.source is not None:  # bad input fails before the model loads
        texts = (
            read_translate_input(s.source, "score.source", "score"),
            read_translate_input(s.target, "score.target", "score"),
        )
        if len(texts[0]) != len(texts[1]):
            raise UserError(
                f"score.source={s.source!r} has {len(texts[0])} lines but score.target={s.target!r} has "
                f"{len(texts[1])}: give one target line per source line"
            )
    if s.engine == "ct2":  # the export alone: no checkpoint, no training code
        engine = load_ct2(cfg, None, "score.engine")
        tokenizer, max_positions = engine.tokenizer(), engine.max_positions
        run = engine.info.get("run", {})
        used = f"{engine.model_dir}, the CTranslate2 export of {run.get('checkpoint')}.pt (step {run.get('step')})"
    else:
        engine = load_trained(cfg.run_dir, s.checkpoint, resolve_device(cfg.device), "score.checkpoint")
        tokenizer, max_positions = engine.tokenizer, getattr(engine.model, "max_positions", None)
        used = f"{checkpoint_path(cfg.run_dir, s.checkpoint)} (step {engine.step})"
    if texts is not None:
        what = f"{s.source} → {s.target}"
        src, tgt = tokenizer.encode_src(texts[0]), tokenizer.encode_tgt(texts[1])
    else:
        data = load_split(engine.config.data.dir, s.split, tokenizer)
        what = f"the {s.split} split's references ({engine.config.data.dir})"
        src, tgt = data.src, data.tgt
    check_lengths(max_positions, tgt, f"score.target={s.target!r}: line" if s.target else f"the {s.split} split: pair")
    pairs = f"{len(src):,} pair{'s' * (len(src) != 1)}"
    print(f"scoring {pairs} of {what} with {used}", file=sys.stderr, flush=True)
    loaded = time.monotonic()
    scores = engine.score(src, tgt, cfg.decode.batch_tokens, progress=sys.stderr.isatty())
    scored = time.monotonic()
    text = "".join(score_line(logp, tokenizer.tgt_pieces(t) if s.pieces else None) for logp, t in zip(scores, tgt))
    if s.output:
        atomic_write_text(s.output, text)
    else:
        sys.stdout.write(text)
    pieces = sum(map(len, scores))
    mean = sum(map(sum, scores)) / max(pieces, 1)
    seconds = f"{scored - clock:.1f} s (loading {loaded - clock:.1f} s, scoring {scored - loaded:.1f} s)"
    seconds += f"; wrote {s.output}" if s.output else ""
    print(
        f"scored {pairs}, {pieces:,} target pieces with </s>: log p per piece {mean:.4f}, perplexity "
        f"{math.exp(-mean):.2f}; {seconds}",
        file=sys.stderr,
    )


def score_line(logp: list[float], pieces: list[str] | None) -> str:
    """``log p(Y|X)``, the pieces scored (</s> included) and their mean log p, tab-separated; with ``pieces``
    (the target's, without </s>) every ``piece:log p`` too."""
    line = f"{sum(logp):.4f}\t{len(logp)}\t{sum(logp) / len(logp):.4f}"
    if pieces is not None:
        line += "\t" + " ".join(f"{piece}:{p:.4f}" for piece, p in zip(pieces + ["</s>"], logp))
    return line + "\n"
