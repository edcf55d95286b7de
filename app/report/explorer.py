"""A self-contained HTML attention explorer for an evaluated split: a searchable, sortable list of the
sentences and, for the selected one, its attention heatmap (layer and head selectors for Transformers),
with hover highlighting and the view in the URL hash (#s=<index>&l=<layer>&h=<head|mean>[&r=1]).

A sentence shows the attention that produced its hypothesis and, where the corpus has reference word
links, also the attention read while forcing the reference through the decoder (rows: reference pieces),
with the links outlined over it; of a Transformer also its self-attention: the encoder's (source over source)
and the decoder's (each position writing a hypothesis piece over the pieces it has read, causal). Buttons
switch between these maps (``m=ref|encoder|decoder`` in the hash).

Everything is inline (no network); the map's drawing code is app/report/attention_map.js, shared with make
serve's page. A sentence's maps are the views ``app.report.attention_files.store_attention``
keeps, as the attention files hold them: by default the heads of one layer (``viz.layer``) and every
layer's mean of heads, or every head of every layer (``eval.attention=all``). Each map set (a sentence's
hypothesis attention, its forced attention) is quantized to uint8 (error <= 1/510), zlib-compressed and
written as text (``text7``) separately; the page inflates one set when it is first shown with the
browser's DecompressionStream, so opening the file parses only the sentence list.
"""

from __future__ import annotations

import html
import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional

import numpy as np
from matplotlib import colormaps

from app.data.links import piece_links
from app.evaluation.views import StoredAttention, store_attention
from app.run.errors import required
from app.run.files import atomic_write_text

LEVEL = 1  # zlib level of the maps: higher levels save little for much longer (docs/benchmarking.md)


@dataclass
class ExplorerRecord:
    """One sentence of an evaluated split.

    ``attention``: what produced the hypothesis, numpy or torch floats with rows summing to 1, (tgt, src)
    for an RNN or (layers, heads, tgt, src) for a Transformer; tgt = len(tgt_tokens) (the hypothesis
    pieces and EOS), src = len(src_tokens) (the source pieces and EOS). Or the views of it already kept
    (an ``app.report.attention_files.StoredAttention``, as ``make eval`` has them for its attention files).

    ``ref_attention`` (optional): the attention read while forcing the reference through the decoder,
    the same layout with rows = ``ref_tokens`` (the reference pieces and EOS) and the same layers and heads.
    ``src_words``, ``tgt_words``, ``ref_words`` (with ``links`` or ``hyp_links``): the whitespace word of each of
    ``src_tokens``, ``tgt_tokens``, ``ref_tokens`` (-1: of none, EOS), as app.data.tokenizer numbers them.
    ``links`` (optional, needs ``ref_attention``): the reference word links of the sentence over
    whitespace words, (source word, target word) pairs, given as ``(sure, possible)`` the way
    ``app.data.links.read_pharaoh`` reads a line (possible includes sure) or as
    ``{"sure": ..., "possible": ...}``; the page outlines the cells of their pieces (sure solid, the
    possible-only ones dashed).

    ``encoder_attention``, ``decoder_attention`` (optional, a Transformer's, both or neither): its self-attention,
    (layers, heads, src, src) over ``src_tokens`` and (layers, heads, tgt, tgt) with the rows of ``tgt_tokens``
    and the columns of the decoder's inputs (BOS and ``tgt_tokens`` but the last), with the heads of
    ``attention``.
    """

    id: str
    src_tokens: list[str]
    tgt_tokens: list[str]
    attention: Any
    source: str = ""
    hypothesis: str = ""
    reference: str = ""
    bleu: float | None = None  # sentence BLEU of the hypothesis (against every reference)
    ref_tokens: list[str] | None = None
    ref_attention: Any = None
    links: Any = None
    encoder_attention: Any = None  # a Transformer's encoder self-attention (layers, heads, src, src), or its views
    decoder_attention: Any = None  # its decoder self-attention (layers, heads, tgt, tgt): rows as tgt_tokens
    hyp_links: Any = None  # (source word, hypothesis word) links of the hypothesis (make eval's hyp.align), outlined
    copied: Optional[list[float]] = None  # per tgt_tokens piece, the share of its probability copied (copy_attention)
    more_references: Sequence[str] = ()  # the sentence's further references (make eval's eval.references), in order
    baseline: Optional[str] = None  # eval.baseline's hypothesis of the sentence, shown beside ours
    baseline_bleu: Optional[float] = None  # its sentence BLEU on the same references
    src_words: Optional[list[int]] = None  # the word of each src_tokens piece (-1: of none), for the links
    tgt_words: Optional[list[int]] = None  # of each tgt_tokens piece, for hyp_links
    ref_words: Optional[list[int]] = None  # of each ref_tokens piece, for links


def _stored(record_id: str, attention, rows: list[str], cols: list[str], name: str, layer: int, keep: str):
    """``attention`` as the views the page shows (StoredAttention), its (rows, cols) checked."""
    stored = attention if isinstance(attention, StoredAttention) else None
    shape = stored.maps.shape if stored else tuple(getattr(attention, "shape", np.shape(attention)))
    expected = (len(rows), len(cols))
    if (len(shape) not in (2, 4) and not stored) or tuple(shape[-2:]) != expected:
        raise ValueError(
            f"sentence {record_id}: {name} of shape {tuple(shape)}, expected (tgt, src) or "
            f"(layers, heads, tgt, src) with (tgt, src) = {expected}"
        )
    return stored or store_attention(attention, layer, keep)


def text7(data: bytes) -> str:
    """Bytes as text of 7 bits per character (base64 carries 6 in 8): most characters are one UTF-8 byte.
    The three values an HTML parser alters or stops a <script> at (NUL, CR, '<') are written as
    U+0100 + value; the page reads every character's low 7 bits."""
    chars = -(-len(data) * 8 // 7)
    groups = np.frombuffer(data + bytes(-len(data) % 7), np.uint8).reshape(-1, 7).astype(np.uint64)
    words = (groups << np.arange(48, -1, -8, dtype=np.uint64)).sum(1, dtype=np.uint64)  # 56 bits, big-endian
    values = ((words[:, None] >> np.arange(49, -1, -7, dtype=np.uint64)) & np.uint64(0x7F)).ravel()[:chars]
    escaped = (values == 0x00) | (values == 0x0D) | (values == 0x3C)
    values = values.astype("<u2") + 0x100 * escaped.astype("<u2")
    return values.tobytes().decode("utf-16-le")


def _blob(stored: StoredAttention) -> str:
    return text7(zlib.compress(stored.maps.tobytes(), LEVEL))


def link_cells(record: ExplorerRecord) -> dict | None:
    """The record's reference word links as the (target piece, source piece) cells the page outlines:
    {"sure": [[t, s], ...], "possible": [[t, s], ...]} with possible holding the possible-only cells."""
    if record.links is None:
        return None
    if isinstance(record.links, Mapping):
        sure, possible = record.links.get("sure", ()), record.links.get("possible", ())
    else:
        sure, possible = record.links
    sure, possible = ({(int(s), int(t)) for s, t in links} for links in (sure, possible))
    required(record.ref_tokens, f"sentence {record.id}: the reference tokens of its links")
    src, ref = words_of(record, "src"), words_of(record, "ref")
    n_src, n_ref = max(src, default=-1) + 1, max(ref, default=-1) + 1
    if any(not (0 <= s < n_src and 0 <= t < n_ref) for s, t in sure | possible):
        raise ValueError(
            f"sentence {record.id}: a reference link is outside the {n_src} source x {n_ref} "
            "reference words (links are over whitespace words, not pieces)"
        )
    cells = lambda links: [list(cell) for cell in piece_links(links, src, ref)]
    return {"sure": cells(sure), "possible": cells(possible - sure)}


def words_of(record: ExplorerRecord, side: str) -> list[int]:
    """The record's word numbers of ``side`` (src, tgt, ref), one per token of that side, else a ValueError."""
    words, tokens = getattr(record, f"{side}_words"), getattr(record, f"{side}_tokens")
    if words is None or len(words) != len(tokens):
        given = "none" if words is None else len(words)
        raise ValueError(f"sentence {record.id}: {side}_words ({given}) needs a word number per {side} token")
    return list(words)


def _self_attention(record: ExplorerRecord, stored: StoredAttention, place, layer: int, keep: str):
    """The page's entries of the self-attention maps (``place``d in the maps block), or None."""
    given = {"encoder": record.encoder_attention, "decoder": record.decoder_attention}
    if all(weights is None for weights in given.values()):
        return None
    if any(weights is None for weights in given.values()) or not stored.layers:
        raise ValueError(
            f"sentence {record.id}: encoder_attention and decoder_attention come together, from a Transformer "
            "(its attention has layers and heads)"
        )
    axes = {"encoder": (record.src_tokens, record.src_tokens), "decoder": (record.tgt_tokens, record.tgt_tokens)}
    entries = {}
    for kind, weights in given.items():
        own = _stored(record.id, weights, *axes[kind], f"{kind}_attention", layer, keep)
        if own.heads != stored.heads:
            raise ValueError(
                f"sentence {record.id}: {kind}_attention has {own.heads} heads, the attention {stored.heads}: both "
                "come from the same model"
            )
        entries[kind] = {"layers": own.layers, "headLayers": own.head_layers, "at": place(own)}
    return entries


def _reference(record: ExplorerRecord, stored: StoredAttention, place, layer: int, keep: str):
    """The page's entry for the forced attention (``place``d in the maps block), or None."""
    if record.ref_attention is None:
        if record.ref_tokens is not None or record.links is not None:
            raise ValueError(
                f"sentence {record.id}: ref_tokens and links need ref_attention (the attention read while "
                "forcing the reference): the hypothesis rows are not the reference words they link"
            )
        return None
    if record.ref_tokens is None:
        raise ValueError(f"sentence {record.id}: ref_attention needs ref_tokens (its rows)")
    ref = _stored(record.id, record.ref_attention, record.ref_tokens, record.src_tokens, "ref_attention", layer, keep)
    if (ref.layers, ref.heads, ref.names) != (stored.layers, stored.heads, stored.names):
        raise ValueError(
            f"sentence {record.id}: ref_attention has {ref.layers or 'an RNN map of'} layers x {ref.heads} heads, "
            f"the attention {stored.layers} x {stored.heads}: both come from the same model"
        )
    return {"tgt": list(record.ref_tokens), "links": link_cells(record), "at": place(ref)}


def write_explorer(
    path: str,
    records: Iterable[ExplorerRecord | dict],
    title: str,
    meta: dict,
    layer: int = -1,
    keep: str = "layer",
) -> None:
    """Write the explorer HTML for ``records`` (ExplorerRecord or dicts of its fields; any iterable, read
    once, so a generator need not hold every sentence's maps at once), in their order (the corpus order);
    ``meta`` (model, checkpoint, split, corpus BLEU, alignment...) is shown as key: value pairs in the
    header. ``layer`` and ``keep``: which heads a Transformer's maps keep
    (app.report.attention_files.store_attention)."""
    sentences, blobs, end = [], [], 0

    def place(stored: StoredAttention) -> list[int]:
        """The maps' blob appended to the maps block; its slice of the block, [start, length]."""
        nonlocal end
        blobs.append(_blob(stored))
        end += len(blobs[-1])
        return [end - len(blobs[-1]), len(blobs[-1])]

    for record in records:
        record = record if isinstance(record, ExplorerRecord) else ExplorerRecord(**record)
        stored = _stored(record.id, record.attention, record.tgt_tokens, record.src_tokens, "attention", layer, keep)
        sent = {
            "id": str(record.id),
            "src": list(record.src_tokens),
            "tgt": list(record.tgt_tokens),
            "source": record.source,
            "hypothesis": record.hypothesis,
            "reference": record.reference,
            "bleu": None if record.bleu is None else round(float(record.bleu), 2),
            "entropy": round(stored.entropy, 4),  # of the whole hypothesis attention
            "mono": round(stored.monotonicity, 3),  # of the map the plots show
            "again": round(stored.reattention, 3),  # of the map the plots show
            "layers": max(stored.layers, 1),
            "heads": max(stored.heads, 1),
            "headLayers": stored.head_layers,  # maps: these layers' heads, then each layer's mean
            "rnn": stored.layers == 0,  # one map: no layer/head selectors
        }
        if record.baseline is not None:  # eval.baseline's hypothesis; the list sorts by the BLEU difference
            sent["base"] = record.baseline
            sent["baseBleu"] = None if record.baseline_bleu is None else round(float(record.baseline_bleu), 2)
        if record.more_references:  # references 2, 3, ... (eval.references): their text; only the first is forced
            sent["more"] = list(record.more_references)
        if record.hyp_links is not None:  # hyp.align's links, as the cells of their pieces
            cells = piece_links(record.hyp_links, words_of(record, "src"), words_of(record, "tgt"))
            sent["hypLinks"] = [list(c) for c in cells]
        if record.copied is not None:  # a copying model's: per hypothesis row, and their mean over the pieces
            if len(record.copied) != len(record.tgt_tokens):
                raise ValueError(
                    f"sentence {record.id}: {len(record.copied)} copy shares for {len(record.tgt_tokens)} target pieces"
                )
            sent["copied"] = [round(float(x), 3) for x in record.copied]
            pieces = sent["copied"][:-1] or [0.0]  # EOS left out, as metrics.json's copy does
            sent["copy"] = round(sum(pieces) / len(pieces), 3)
        sent["at"] = place(stored)  # its slice of the maps block
        sent["ref"] = _reference(record, stored, place, layer, keep)  # rows: the reference pieces, forced
        sent["own"] = _self_attention(record, stored, place, layer, keep)  # the encoder's, then the decoder's
        sentences.append(sent)

    def script_json(value) -> str:  # JSON that cannot close the <script> element it sits in
        return json.dumps(value, ensure_ascii=False, default=str).replace("<", "\\u003c")

    parts = {
        "TITLE": html.escape(title),
        "META": script_json(meta),
        "SENTENCES": script_json(sentences),
        "MAPS": "".join(blobs),
        "ATTENTION_MAP": attention_map_script(),
    }
    template = resources.files("app.report").joinpath("explorer.html").read_text(encoding="utf-8")
    # one pass over the template: a placeholder-like string inside the data is never replaced
    atomic_write_text(
        path, re.sub(r"__(TITLE|META|SENTENCES|MAPS|ATTENTION_MAP)__", lambda m: parts[m.group(1)], template)
    )


def attention_map_script() -> str:
    """The attention map's drawing code (app/report/attention_map.js) with its colour map filled in: what the explorer
    inlines and make serve's page loads, one code for both."""
    viridis = (colormaps["viridis"](np.arange(256))[:, :3] * 255).round().astype(int)
    lut = "".join(f"{r:02x}{g:02x}{b:02x}" for r, g, b in viridis)
    script = resources.files("app.report").joinpath("attention_map.js").read_text(encoding="utf-8")
    return script.replace("__VIRIDIS__", lut)


def evaluation_records(
    data,
    records: list,
    texts: list[str],
    bleu: list[float],
    forced: Optional[dict] = None,
    links=None,
    more: Sequence[list[str]] = (),
    baseline=None,
) -> Iterable[ExplorerRecord]:
    """The explorer's records of an evaluated split (``make eval``), one sentence at a time, from the split's
    records (app.evaluation.records.SentenceRecord: pieces and the kept views of the attention that produced
    each hypothesis) and, when ``links`` (per sentence: sure, possible) are given, the forced attention of the
    reference (``forced``, by sentence index) with its links (those inside the sentence's words: a gold file made
    for other text scores its links as misses, but they have no cell to draw); the views of the self-attention
    where the records have them; ``more``: further reference streams (eval.references), shown under the first;
    ``baseline``: eval.baseline's hypotheses and their sentence BLEU (app.evaluation.eval_run.Baseline)."""
    for r in records:
        i = r.index
        record = ExplorerRecord(
            id=r.id,
            src_tokens=r.src_pieces,
            tgt_tokens=r.hyp_pieces,
            attention=r.stored if r.stored is not None else r.attention,
            source=data.src_texts[i],
            hypothesis=texts[i],
            reference=data.tgt_texts[i],
            more_references=[stream[i] for stream in more],
            baseline=None if baseline is None else baseline.texts[i],
            baseline_bleu=None if baseline is None else baseline.bleu[i],
            bleu=bleu[i],
            hyp_links=r.hyp_links,
            copied=r.copied,
            src_words=r.src_words,
            tgt_words=r.hyp_words,
        )
        own = r.self_attention or {}
        record.encoder_attention, record.decoder_attention = own.get("encoder"), own.get("decoder")
        if links is not None:
            record.ref_tokens, record.ref_words = r.ref_pieces, r.ref_words
            record.ref_attention = required(forced, "the forced attention of the references")[i]
            n_src, n_ref = len(data.src_texts[i].split()), len(data.tgt_texts[i].split())
            record.links = tuple({(s, t) for s, t in kind if s < n_src and t < n_ref} for kind in links[i])
        yield record
