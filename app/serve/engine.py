"""A trained run behind the one call the batcher makes: its checkpoint (the torch engine) or, with
``translate.engine=ct2``, its CTranslate2 export, loaded by app/decode/trained.py as ``make translate`` loads
them; lines decoded by the project's one decoding path (app/decode/passes.py, app/decode/search.py,
app/decode/beam.py, or the export's).

Attention, when asked for: the search's attention for each line's best hypothesis; for the other hypotheses of
an n-best list, the attention read while forcing that hypothesis through the decoder
(TrainedModel.nbest_attention, app/decode/trained.py: the same model on the same tokens, so the same weights up to
rounding).
A CTranslate2 export returns the best hypothesis' map only (one layer's mean of heads). Each map becomes the
views app.report.attention_files.store_attention keeps (every head of every layer, each layer's mean), and the
word links read from each view (app.data.links.hard_alignments: the most attended source word of every target
word). Self-attention, when asked for (a Transformer on the torch engine): the encoder's over the source, and
the decoder's over each hypothesis, read while forcing it through the decoder, kept as the same views. A model that
copies (model.copy_attention): each hypothesis row's share of its probability that came through copying. Forced
passes run in ``decode.batch_tokens`` batches on every device, as make eval's: their maps grow with squared
lengths."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from app.config.commands import DecodeConfig
from app.config.schema import Config
from app.data.links import hard_alignments, piece_links
from app.data.tokenizer import Tokenizer
from app.decode.constraints import encode_phrases, forced_lengths
from app.decode.ensemble import ensemble_of
from app.decode.passes import forced_copy_shares, forced_self_attention
from app.decode.search import check_lengths
from app.decode.trained import TrainedModel, load_ct2, load_trained
from app.evaluation.views import SCALE, self_attention_axes, store_attention
from app.models import count_parameters
from app.models.api import Copying, SelfAttending
from app.run.device import resolve_device


class Engine:
    """Lines in, translations out (``translate``), with what it loaded (``info``) and its one-line summary."""

    def __init__(self, translator, tokenizer: Tokenizer, decode: DecodeConfig, info: dict[str, Any]):
        self.translator, self.tokenizer, self.decode, self.info = translator, tokenizer, decode, info
        self.trained: Optional[TrainedModel] = translator if isinstance(translator, TrainedModel) else None

    def summary(self) -> str:
        i = self.info
        what = os.path.relpath(i["checkpoint"] if i["engine"] == "torch" else i["export"])
        params = f", {i['parameters']:,} parameters" if i.get("parameters") else ""
        what = ensemble_of(i.get("ensemble")) or f"{what} (step {i['step']})"
        return f"loaded {what}: {i['model']['arch']}{params}, engine {i['engine']} on {i['device']}"

    def encode_targets(self, texts: list[str], what: str = "translation") -> list[list[int]]:
        """Target token ids of given translations (or prefixes: ``what``); one longer than the model takes is a
        UserError naming it."""
        tgt = self.tokenizer.encode_tgt(texts)
        check_lengths(self.max_positions, tgt, what)
        return tgt

    def encode_constraints(self, phrases: list[list[str]]) -> list[list[list[int]]]:
        """Target token ids of each line's phrases; a phrase with none is a UserError naming it."""
        return encode_phrases(self.tokenizer.encode_tgt, phrases, lambda i, j: f"constraints[{i}][{j}]", "[]")

    def check_forced(self, phrases: list[list[list[int]]], prefix: Optional[list[list[int]]]) -> None:
        """Each line's phrases and prefix within the model's positions (a UserError naming the first that is not):
        checked for a request on its own, before it joins a batch, where it would fail every request beside it."""
        check_lengths(self.max_positions, forced_lengths(phrases, prefix), "constrained translation")

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Source token ids of ``texts``; a line longer than the model takes is a UserError naming it."""
        src = self.tokenizer.encode_src(texts)
        check_lengths(self.max_positions, src)
        return src

    @property
    def max_positions(self) -> Optional[int]:
        """The positions the model has (None: any length)."""
        return getattr(self.trained.model if self.trained else self.translator, "max_positions", None)

    def translate(
        self,
        src: list[list[int]],
        beam_size: int,
        n_best: int,
        attention: bool,
        self_attention: bool = False,
        no_repeat_ngram_size: int = 0,
        prefix: Optional[list[list[int]]] = None,
        constraints: Optional[list[list[list[int]]]] = None,
        lines: Optional[list[str]] = None,
    ) -> list[dict[str, Any]]:
        """One decoding call for every sentence of ``src``: per sentence its source pieces, its hypotheses (text,
        score, target pieces; best first; each beginning with its ``prefix`` where given and containing its
        ``constraints``' phrases) and, with ``attention``, the attention of each hypothesis; with ``self_attention``
        too, the self-attention of the encoder and of each hypothesis (``self_attention_entry``: None where the
        model has none). ``lines``: the text ``src`` encodes, whose words the attention's links number."""
        decode = dataclasses.replace(
            self.decode, beam_size=beam_size, n_best=n_best, no_repeat_ngram_size=no_repeat_ngram_size
        )
        hyps = self.translator.translate(src, decode, need_attention=attention, prefix=prefix, constraints=constraints)
        results, candidates = [], []  # candidates: per sentence, its hypotheses' tokens, best first
        for i, ids in enumerate(src):
            nbest = hyps.nbest[i] if hyps.nbest is not None else [(hyps.tokens[i], None)]  # greedy: no score kept
            candidates.append([tokens for tokens, _ in nbest])
            texts = self.tokenizer.decode_tgt(candidates[-1])
            hypotheses = [
                {"text": text, "score": None if score is None else round(score, 4), "target_pieces": self.pieces(t)}
                for (t, score), text in zip(nbest, texts)
            ]
            results.append({"source_pieces": self.tokenizer.src_pieces(ids), "hypotheses": hypotheses})
        if attention:  # None: a model without attention (rnn_plain)
            maps, copied = self.hypothesis_attention(src, hyps, candidates), self.copy_shares(src, candidates)
            source_words = self.source_words(src, lines)
            for i, result in enumerate(results):
                words = source_words[i], self.tokenizer.hyp_words(candidates[i])
                result["attention"] = (
                    attention_entry(result, maps[i], words, copied[i] if copied else None) if maps else None
                )
        if self_attention:
            own = self.hypothesis_self_attention(src, candidates)
            for i, result in enumerate(results):
                result["self_attention"] = self_attention_entry(result, *own[i]) if own else None
        return results

    def source_words(self, src: list[list[int]], lines: Optional[list[str]]) -> list[list[int]]:
        """Each source piece's word: in the line it was encoded from (``lines``), else in the text its ids decode to,
        where a character the normalization made a space (a ZWNJ inside a word) splits the word."""
        return self.tokenizer.src_words(lines) if lines is not None else self.tokenizer.decoded_src_words(src)

    def score(
        self,
        src: list[list[int]],
        tgt: list[list[int]],
        attention: bool,
        self_attention: bool = False,
        lines: Optional[list[str]] = None,
    ) -> list[dict[str, Any]]:
        """One teacher-forced call for every pair: per sentence its source pieces and its given translation as its
        one hypothesis (text, score: log p(Y|X), target pieces, the log p of each piece and </s>), with
        ``attention`` the attention that read it, with ``self_attention`` the self-attention, as ``translate``'s."""
        scores, maps = self.translator.score(src, tgt, self.decode.batch_tokens, attention=attention)
        results = []
        for ids, tokens, logp in zip(src, tgt, scores):
            hypothesis = {
                "text": self.tokenizer.decode_tgt([tokens])[0],
                "score": round(sum(logp), 4),
                "target_pieces": self.pieces(tokens),
                "piece_log_probs": [round(p, 4) for p in logp],
            }
            results.append({"source_pieces": self.tokenizer.src_pieces(ids), "hypotheses": [hypothesis]})
        if attention:  # maps None: a model without attention
            copied, source_words = self.copy_shares(src, [[tokens] for tokens in tgt]), self.source_words(src, lines)
            for i, result in enumerate(results):
                shares = copied[i] if copied else None
                words = source_words[i], self.tokenizer.hyp_words([tgt[i]])
                result["attention"] = attention_entry(result, [maps[i]], words, shares) if maps else None
        if self_attention:
            own = self.hypothesis_self_attention(src, [[tokens] for tokens in tgt])
            for i, result in enumerate(results):
                result["self_attention"] = self_attention_entry(result, *own[i]) if own else None
        return results

    def hypothesis_self_attention(self, src: list[list[int]], nbest: list[list[list[int]]]) -> list[tuple]:
        """Per sentence (its encoder's self-attention, [each hypothesis' decoder self-attention]), read while
        forcing each hypothesis through the decoder; [] for a model without self-attention (or an export)."""
        t = self.trained
        if t is None or not isinstance(t.model, SelfAttending):
            return []
        pairs = [(i, k) for i in range(len(src)) for k in range(len(nbest[i]))]
        batch = ([src[i] for i, _ in pairs], [nbest[i][k] for i, k in pairs], t.device, self.decode.batch_tokens)
        passes = forced_self_attention(t.model, *batch, t.dtype)
        encoders: list[Optional[torch.Tensor]] = [None] * len(src)
        decoders: list[list[Optional[torch.Tensor]]] = [[None] * len(nbest[i]) for i in range(len(src))]
        for j, encoder, decoder in passes:
            i, k = pairs[j]
            encoders[i] = encoder  # the same for every hypothesis of the sentence
            decoders[i][k] = decoder
        return list(zip(encoders, decoders))

    def copy_shares(self, src: list[list[int]], nbest: list[list[list[int]]]) -> list[list[list[float]]]:
        """Per sentence, per hypothesis: the share of each of its pieces' (and EOS's) probability that came through
        copying, read while forcing it through the decoder; [] for a model that does not copy (or an export)."""
        t = self.trained
        if t is None or not getattr(t.config.model, "copy_attention", False) or not isinstance(t.model, Copying):
            return []
        pairs = [(i, k) for i in range(len(src)) for k in range(len(nbest[i]))]
        batch = ([src[i] for i, _ in pairs], [nbest[i][k] for i, k in pairs], t.device, self.decode.batch_tokens)
        shares: list[list[list[float]]] = [[[] for _ in hypotheses] for hypotheses in nbest]
        found = False
        for j, copied in forced_copy_shares(t.model, *batch, t.dtype):
            i, k = pairs[j]
            shares[i][k], found = [round(x, 3) for x in copied.tolist()], True
        return shares if found else []

    def pieces(self, tokens: list[int]) -> list[str]:
        return self.tokenizer.tgt_pieces(tokens)

    def hypothesis_attention(self, src: list[list[int]], hyps, nbest: list[list[list[int]]]) -> list[list]:
        """Per sentence, per hypothesis: its attention (..., target + EOS, source + EOS), or None (an export's
        hypotheses after the best); [] for a model without attention."""
        if self.trained is not None:
            return self.trained.nbest_attention(src, hyps, self.decode.batch_tokens)
        if hyps.attention is None:
            return []
        return [[hyps.attention[i]] + [None] * (len(nbest[i]) - 1) for i in range(len(src))]


def attention_entry(
    result: dict[str, Any],
    maps: list[Optional[torch.Tensor]],
    words: tuple[list[int], list[list[int]]],
    copied: Optional[list[list[float]]] = None,
) -> dict[str, Any]:
    """The API's attention of one sentence: its columns (source pieces + EOS), the views kept (every head of every
    layer, then each layer's mean; one map for an RNN or an export), and per hypothesis its rows (target pieces +
    EOS), its maps as integers (weight × scale, rounded: within 1/510), the word links read from each view as
    [source word, target word] pairs (``words``: the word of each source piece, of each hypothesis' pieces), and
    those links as the [row, column] cells the page outlines; of a model that copies (``copied``, per hypothesis),
    each row's share of its probability that came through copying."""
    columns, column_words = result["source_pieces"] + ["</s>"], words[0] + [-1]
    entry: dict[str, Any] = {"columns": columns, "scale": SCALE, "hypotheses": []}
    for k, (hypothesis, weights) in enumerate(zip(result["hypotheses"], maps)):
        if weights is None:
            entry["hypotheses"].append(None)
            continue
        stored = store_attention(weights, keep="all")
        rows, row_words = hypothesis["target_pieces"] + ["</s>"], words[1][k] + [-1]
        links = [sorted(view) for view in hard_alignments(stored.maps / SCALE, column_words, row_words)]
        entry.update(layers=stored.layers, heads=stored.heads, head_layers=stored.head_layers, views=stored.names)
        entry["hypotheses"].append(
            {
                "rows": rows,
                "maps": stored.maps.tolist(),
                "links": [[list(link) for link in view] for view in links],
                "cells": [[list(cell) for cell in piece_links(set(view), column_words, row_words)] for view in links],
            }
        )
        if copied is not None:
            entry["hypotheses"][-1]["copied"] = copied[k]
    return entry


def self_attention_entry(result: dict[str, Any], encoder: torch.Tensor, decoders: list[torch.Tensor]) -> dict[str, Any]:
    """The API's self-attention of one sentence, as integer maps (weight × scale, rounded: within 1/510) of the views
    kept (every head of every layer, then each layer's mean): ``encoder`` with its maps over the source pieces + EOS
    (rows and columns: the attention's ``columns``); ``decoder`` with, per hypothesis, its ``columns`` (the inputs it
    read: <s> and its pieces), and its maps (rows: the hypothesis' pieces + EOS, as its attention's rows)."""

    def views(weights) -> dict[str, Any]:
        stored = store_attention(weights, keep="all")
        meta = {"layers": stored.layers, "heads": stored.heads, "head_layers": stored.head_layers}
        return {**meta, "views": stored.names, "maps": stored.maps.tolist()}

    decoded = [views(weights) for weights in decoders]
    hypotheses = [
        {
            "columns": self_attention_axes("decoder", [], hypothesis["target_pieces"] + ["</s>"])[1],
            "maps": entry.pop("maps"),
        }
        for hypothesis, entry in zip(result["hypotheses"], decoded)
    ]
    return {"scale": SCALE, "encoder": views(encoder), "decoder": {**decoded[0], "hypotheses": hypotheses}}


def load_engine(cfg: Config) -> Engine:
    """The run ``cfg.name`` on ``cfg.device``: its checkpoint ``serve.checkpoint``, or its CTranslate2 export
    (``translate.engine=ct2``)."""
    if cfg.translate.engine == "ct2":
        ct2 = load_ct2(cfg, None, "translate.engine", ("serve.checkpoint", cfg.serve.checkpoint))
        run = ct2.info.get("run", {})
        info = {
            "engine": "ct2",
            "export": ct2.model_dir,
            "quantization": ct2.info.get("quantization"),
            "checkpoint": run.get("checkpoint"),
            "step": run.get("step"),
            "model": ct2.info.get("model", {}),
            "parameters": None,
            "device": str(resolve_device(cfg.device)),
        }
        return Engine(ct2, ct2.tokenizer(), cfg.decode, {"run": cfg.name, **info})
    trained = load_trained(
        cfg.run_dir, cfg.serve.checkpoint, resolve_device(cfg.device), "serve.checkpoint", cfg.ensemble
    )
    trained.check_decoding(cfg.decode)  # at start, not at each request
    info = {
        "engine": "torch",
        "checkpoint": os.path.join(cfg.run_dir, f"{cfg.serve.checkpoint}.pt"),
        "step": trained.step,
        "model": dataclasses.asdict(trained.config.model),
        "parameters": count_parameters(trained.model),
        "device": str(trained.device),
        "dtype": str(trained.dtype or torch.float32).removeprefix("torch."),
        **({"ensemble": trained.members} if trained.members else {}),
    }
    return Engine(trained, trained.tokenizer, cfg.decode, {"run": cfg.name, **info})
