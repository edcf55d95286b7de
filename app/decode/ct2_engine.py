"""Translate with a CTranslate2 export (app/decode/export.py) under the project's decoding settings.

    CT2Translator(out_dir).translate(src_ids, decode_cfg)   app.decode.search.Hypotheses

docs/ctranslate2_export.md says how CTranslate2's decoding differs from ours and what is done about it.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Optional

import torch

from app.config.commands import DecodeConfig
from app.config.schema import Config
from app.data.tokenizer import Tokenizer
from app.decode.penalties import coverage_penalty, length_penalty
from app.decode.search import Hypotheses, check_lengths, length_limits
from app.run.errors import UserError

# An export's directory holds the CTranslate2 model, its vocabularies, the SentencePiece model(s) and this
# file: what was exported (model settings, run and step, quantization), written by app.decode.export.convert
EXPORT_INFO = "export.json"


def export_dir(cfg: Config) -> str:
    """Where ``make export`` writes a run's export and ``*.engine=ct2`` reads it."""
    return cfg.export.dir or os.path.join(cfg.run_dir, "ct2")


def export_command(cfg: Config, checkpoint: str = "best") -> str:
    """The ``make export`` that writes the export ``*.engine=ct2`` reads, of ``checkpoint``."""
    settings = [f"name={cfg.name}"]
    if checkpoint != "best":
        settings.append(f"export.checkpoint={checkpoint}")
    if cfg.export.dir:
        settings.append(f"export.dir={cfg.export.dir}")
    return f'make export ARGS="{" ".join(settings)}"'


def check_ct2_decoding(decode: DecodeConfig, setting: str) -> None:
    """A decoding that only the torch engine does is a UserError naming ``setting`` (the engine's): epsilon sampling,
    which CTranslate2 has not, and minimum Bayes risk (app/decode/mbr.py), which reads the torch model."""
    if decode.sampling and decode.sampling_epsilon:
        raise UserError(
            f"decode.sampling_epsilon={decode.sampling_epsilon}: CTranslate2 has no epsilon sampling; set "
            f"{setting}=torch"
        )
    if decode.mbr_candidates:
        raise UserError(
            f"decode.mbr_candidates={decode.mbr_candidates}: minimum Bayes risk decoding runs on the torch engine; "
            f"set {setting}=torch"
        )


class CT2Translator:
    """A CTranslate2 export behind the project's decoding settings; results as app.decode.search.Hypotheses.

    ``nbest`` is scored as ours, log p(Y|X) / ((5 + |Y|) / 6)^α with |Y| counting EOS, except that
    CTranslate2 removes <pad> and <s> before its softmax (suppress_sequences) where ours removes them
    after: its log p is over the other tokens, higher than ours by Σ_t -log(1 - p_t(<pad>) - p_t(<s>)); so too
    EOS at the steps decode.min_len holds it back (min_decoding_length).
    ``attention`` (need_attention): per sentence (target tokens + EOS, source tokens + EOS), the
    encoder-decoder attention of the exported alignment_layer (default: the last decoder layer)
    averaged over its heads (a hypothesis cut at the length limit gets its EOS row as ours does).
    """

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        compute_type: str = "default",
        threads: int = 0,
        device_index: int = 0,
    ):
        import ctranslate2

        info_path = os.path.join(model_dir, EXPORT_INFO)
        if not os.path.exists(info_path):
            raise UserError(f"{model_dir}: no {EXPORT_INFO}; not a directory written by app.decode.export.convert")
        self.info = _read_json(info_path)
        if not isinstance(self.info, dict) or not isinstance(self.info.get("max_positions"), int):
            raise DamagedExport(f"{info_path}: no max_positions in it")
        self.model_dir, self.max_positions = model_dir, self.info["max_positions"]
        torch_threads = torch.get_num_threads()
        try:
            self.translator = ctranslate2.Translator(
                model_dir, device=device, device_index=device_index, compute_type=compute_type, intra_threads=threads
            )
        except (RuntimeError, ValueError) as err:  # a model.bin cut short, a config.json that does not parse
            raise DamagedExport(f"{model_dir}: CTranslate2 cannot load it ({str(err).splitlines()[0]})") from None
        # CTranslate2 sets the process's OpenMP thread count, which torch's CPU kernels share: give torch its own
        # back (measured: 2 threads became 1, and our beam search on the CPU ran at half speed)
        torch.set_num_threads(torch_threads)
        src_vocab = _read_vocab(model_dir, "source")
        self.tgt_vocab = _read_vocab(model_dir, "target")
        self.src_vocab, self.tgt_index = src_vocab, {piece: i for i, piece in enumerate(self.tgt_vocab)}

    def tokenizer(self) -> Tokenizer:
        """The exported SentencePiece model(s) as the project's Tokenizer (text <-> ids)."""
        paths = [os.path.join(self.model_dir, self.info.get("spm", {}).get(side, "")) for side in ("source", "target")]
        for path in paths:
            if not os.path.isfile(path):
                raise DamagedExport(f"{path}: the export's SentencePiece model is missing")
        return Tokenizer(*paths)

    def translate(
        self,
        src: list[list[int]],
        decode: DecodeConfig,
        need_attention: bool = False,
        patience: float = 2.0,
        prefix: Optional[list[list[int]]] = None,
        constraints: Optional[list[list[list[int]]]] = None,
    ) -> Hypotheses:
        """Source token ids without EOS (as app.decode.passes.decode_corpus takes them) -> target ids, under the
        settings of ``decode``, each hypothesis beginning with its ``prefix`` where given (as
        app.decode.trained.TrainedModel.translate takes them). Terminology ``constraints`` are refused: CTranslate2
        has none."""
        if constraints is not None and any(constraints):
            raise UserError("constraints: CTranslate2 has no constrained decoding; translate.engine=torch has")
        check_ct2_decoding(decode, "translate.engine")
        if prefix is not None:
            check_lengths(self.max_positions, prefix, "translation prefix")
        pieces = None if prefix is None else [[self.tgt_vocab[i] for i in p] for p in prefix]
        src_pieces = [[self.src_vocab[i] for i in s] for s in src]
        # CTranslate2's scores leave a target prefix out: its log p is added back, so that both engines score the
        # whole hypothesis
        prefix_log_p = self._prefix_log_probs(src, prefix, decode.batch_tokens)
        hyps = self._translate_pieces(src_pieces, decode, need_attention, patience, pieces, prefix_log_p)
        ids = lambda pieces: [self.tgt_index[p] for p in pieces]  # noqa: E731
        return Hypotheses(
            [ids(t) for t in hyps.tokens],
            hyps.attention,
            [[(ids(t), s) for t, s in nbest] for nbest in hyps.nbest] if hyps.nbest is not None else None,
        )

    def score(
        self, src: list[list[int]], tgt: list[list[int]], batch_tokens: int, progress: bool = False, attention=False
    ) -> tuple[list, None]:
        """Per pair, log p of each target token and the EOS after them, as TrainedModel.score gives them
        (CTranslate2's score_batch, batched by ``batch_tokens``); no attention: score_batch returns none."""
        if attention:
            raise UserError("the CTranslate2 export scores without attention: score with the checkpoint")
        check_lengths(self.max_positions, src)
        results = self.translator.score_batch(
            [[self.src_vocab[i] for i in s] for s in src],
            [[self.tgt_vocab[i] for i in t] for t in tgt],
            max_batch_size=batch_tokens,
            batch_type="tokens",
            max_input_length=0,
        )
        return [list(result.log_probs) for result in results], None

    def _translate_pieces(
        self,
        src: list[list[str]],
        decode: DecodeConfig,
        need_attention: bool,
        patience: float,
        prefix: Optional[list[list[str]]] = None,
        prefix_log_p: Optional[list[float]] = None,
    ) -> Hypotheses:
        """Source SentencePiece pieces (no </s>) -> target pieces (no </s>), as Hypotheses of pieces; each begins
        with its ``prefix`` where given, scored with the prefix's log p (``prefix_log_p``).

        The length limit is ours, ratio × (source length + EOS) + extra below model.max_len, per sentence:
        CTranslate2 takes one max_decoding_length per translate_batch call, so sentences are grouped by
        their limit, one call per group (each batched by CTranslate2 within batch_tokens / beam_size).

        Beam search stops differently: ours when beam_size hypotheses have ended and no live beam can
        still beat them under the length penalty, CTranslate2 once beam_size × ``patience`` hypotheses
        have ended (Kasai et al. 2022). All of these come back and are ranked by our penalty; a larger
        patience searches longer and agrees with ours more often (measured in tests/test_export.py).
        """
        beam_size, n_best, length_penalty = decode.beam_size, decode.n_best, decode.length_penalty
        check_lengths(self.max_positions, src)
        patience = patience if beam_size > 1 else 1.0
        groups = defaultdict(list)
        for i, limit in enumerate(self.length_limits(src, decode, prefix).tolist()):
            groups[limit].append(i)
        tokens: list = [None] * len(src)
        nbest: list = [None] * len(src)
        attention: list = [None] * len(src)
        common = dict(
            max_batch_size=decode.batch_source_tokens,
            batch_type="tokens",
            max_input_length=0,
            suppress_sequences=[["<pad>"], ["<s>"]],
            return_end_token=True,
        )
        sampling = {}
        if decode.sampling:  # CTranslate2's top-k 0 is the whole vocabulary too (1: its greedy search)
            import ctranslate2

            ctranslate2.set_random_seed(decode.sampling_seed)
            sampling = dict(
                sampling_topk=decode.sampling_topk,
                sampling_topp=decode.sampling_topp,
                sampling_temperature=decode.sampling_temperature,
            )
        prefix_log_p = prefix_log_p or [0.0] * len(src)
        # the coverage penalty is ours, from the attention CTranslate2 returns (its own would read its wrong first
        # rows, below), added as each hypothesis is ranked
        beta = decode.coverage_penalty if beam_size > 1 else 0.0
        read_attention = need_attention or bool(beta)
        for limit, indices in groups.items():
            batch = [src[i] for i in indices]
            first_rows = [None] * len(batch)
            if read_attention and beam_size > 1:
                # CTranslate2 (4.8, CPU) returns the wrong first attention row for all but the first sentence
                # of a beam search batch: step 0 runs before the beams are expanded, and its attention is
                # gathered with batch indices into beam-expanded rows (src/decoding.cc, BeamSearch::search).
                # Every hypothesis starts from <s>, so one greedy step gives the right row.
                first = self.translator.translate_batch(
                    batch, beam_size=1, max_decoding_length=1, return_attention=True, **common
                )
                first_rows = [r.attention[0][0] if r.attention[0] else None for r in first]
            results = self.translator.translate_batch(
                batch,
                beam_size=beam_size,
                patience=patience,
                # every ended hypothesis comes back (up to the last step's surplus), to be ranked by our penalty
                num_hypotheses=max(round(beam_size * patience), 1),
                # CTranslate2 divides by |Y|^α (src/decoding.cc, finalize_hypothesis_score), which _rank
                # undoes; with α = 0 it stops once the best beam has ended (and num_hypotheses have)
                length_penalty=length_penalty,
                max_decoding_length=max(limit, 1),
                min_decoding_length=decode.min_len,
                target_prefix=None if prefix is None else [prefix[i] for i in indices],
                no_repeat_ngram_size=decode.no_repeat_ngram_size,
                **sampling,
                return_scores=True,
                return_attention=read_attention,
                **common,
            )
            for i, result, first_row in zip(indices, results, first_rows):
                ranked = _rank(result, length_penalty, read_attention, first_row, prefix_log_p[i], beta)[:n_best]
                tokens[i] = ranked[0][0]
                nbest[i] = [(t, s) for t, s, _ in ranked]
                if need_attention:
                    attention[i] = ranked[0][2]
        if need_attention:
            self._add_final_rows(src, tokens, attention, common)
        return Hypotheses(tokens, attention if need_attention else None, nbest if beam_size > 1 else None)

    def _prefix_log_probs(self, src: list[list[int]], prefix: Optional[list[list[int]]], batch_tokens: int) -> list:
        """Per sentence, the log p of its target prefix's pieces (0 for none), by ``score``."""
        log_p = [0.0] * len(src)
        given = [i for i, pieces in enumerate(prefix or []) if pieces]
        if prefix is not None and given:
            scores, _ = self.score([src[i] for i in given], [prefix[i] for i in given], batch_tokens)
            for i, logp in zip(given, scores):
                log_p[i] = sum(logp[:-1])  # not the </s> that scoring adds
        return log_p

    def _add_final_rows(self, src: list[list[str]], tokens: list, attention: list, common: dict) -> None:
        """Give each hypothesis cut at the length limit (it has no </s>, so CTranslate2 returned no row
        for it) the attention row ours has: the step after its last token, here read by forcing the
        hypothesis as a target prefix and decoding one more step."""
        cut = [i for i, rows in enumerate(attention) if rows.shape[0] == len(tokens[i])]
        if not cut:
            return
        results = self.translator.translate_batch(
            [src[i] for i in cut],
            target_prefix=[tokens[i] for i in cut],
            beam_size=1,
            max_decoding_length=max(len(tokens[i]) for i in cut) + 1,
            return_attention=True,
            **common,
        )
        for i, result in zip(cut, results):
            row = torch.tensor(result.attention[0][len(tokens[i])], dtype=torch.float32)
            row = torch.cat([row, (1 - row.sum(-1, keepdim=True)).clamp(min=0)])  # the </s> column, as in _rank
            attention[i] = torch.cat([attention[i], row[None]])

    def length_limits(self, src: list[list], decode: DecodeConfig, prefix: Optional[list[list]] = None) -> torch.Tensor:
        """Each sentence's output length limit, as our decoder computes it (sources without EOS)."""
        lengths = torch.tensor([len(sentence) + 1 for sentence in src])
        prefix_lengths = None if prefix is None else torch.tensor([len(p) for p in prefix])
        return length_limits(lengths, decode.max_len_ratio, decode.max_len_extra, self.max_positions, prefix_lengths)


def _rank(
    result,
    alpha: float,
    with_attention: bool,
    first_row: Optional[list[float]] = None,
    prefix_log_p: float = 0.0,
    beta: float = 0.0,
) -> list[tuple[list[str], float, Optional[torch.Tensor]]]:
    """(pieces without </s>, our GNMT score, attention (|Y| + 1, src + EOS) or None), best first;
    ``first_row`` replaces every hypothesis' first attention row; ``prefix_log_p`` is the log p of a target prefix
    the scores leave out; ``beta``: the coverage penalty's weight (app.decode.penalties.coverage_penalty), read from
    the attention (with_attention)."""
    ranked = []
    for k, (hyp, score) in enumerate(zip(result.hypotheses, result.scores)):
        ended = bool(hyp) and hyp[-1] == "</s>"
        pieces = hyp[:-1] if ended else hyp
        log_p = score * len(hyp) ** alpha + prefix_log_p  # CTranslate2's score is log p / |hyp|^α, </s> included
        weights = None
        if with_attention and not any(result.attention[k]):
            # an empty source: CTranslate2 skips it (its output: nothing, or its target prefix; score 0), its rows
            # empty; every row (its pieces' and the EOS's) is over its one column, the EOS
            weights = torch.ones(len(pieces) + 1, 1)
        elif with_attention:
            weights = torch.tensor(result.attention[k], dtype=torch.float32).reshape(len(hyp), -1)
            if first_row is not None:
                weights[0] = torch.tensor(first_row)
            # CTranslate2 drops the column of the </s> it appends to the source; rows sum to 1, so it is the rest
            weights = torch.cat([weights, (1 - weights.sum(-1, keepdim=True)).clamp(min=0)], dim=-1)
        # a hypothesis cut at the length limit has no </s>: ours adds one there, with log p 0
        score = log_p / length_penalty(len(pieces) + 1, alpha)
        if beta and weights is not None:  # (a cut one's coverage lacks the row of the step ours ends it at)
            score += float(coverage_penalty(weights.sum(0, keepdim=True), beta))
        ranked.append((pieces, score, weights))
    return sorted(ranked, key=lambda r: -r[1])  # stable: CTranslate2's order among equal scores


class DamagedExport(UserError):
    """An export folder whose files do not load: the message ends with what mends it."""

    def __init__(self, what: str):
        super().__init__(f"{what}: a damaged export; make export writes it again")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        raise DamagedExport(f"{path}: not JSON ({err})") from None


def _read_vocab(model_dir: str, side: str) -> list[str]:
    for name in (f"{side}_vocabulary.json", "shared_vocabulary.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            return _read_json(path)
    raise DamagedExport(f"{model_dir}: no {side}_vocabulary.json or shared_vocabulary.json")
