"""Each sentence's record of an evaluated split (its pieces, its hypothesis's attention and the views of it that
are kept, its self-attention, its word links), built once by the evaluation (app/evaluation/split.py): every
output reads them, ``make eval``'s files, heatmaps, explorer and TensorBoard figures
(app/report/evaluation_files.py) and validation's figures of a few dev sentences (app/train/validation.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from tqdm import tqdm

from app.data.tokenizer import EOS
from app.decode.passes import forced_copy_shares, forced_self_attention
from app.evaluation.head_roles import HeadRoles
from app.evaluation.views import SELF_ATTENTION, StoredAttention, store_attention
from app.models.api import Copying, SelfAttending


@dataclass
class SentenceRecord:
    """One decoded sentence as every output reads it. ``index``: its place in the split; ``src_words``,
    ``hyp_words``, ``ref_words``: the whitespace word of each of ``src_pieces``, ``hyp_pieces``, ``ref_pieces`` (-1:
    of none, EOS), what word links number (app.data.tokenizer); ``attention``: what produced the hypothesis, (tgt,
    src) or (layers, heads, tgt, src), None for a model without attention; ``stored``: the views of it the attention
    files and the explorer keep; ``ref_pieces``: the reference's pieces, the rows of its forced attention (both when
    asked for); ``self_attention``: the views kept of a
    Transformer's encoder and decoder self-attention over the sentence and its hypothesis ({"encoder": ...,
    "decoder": ...}, when asked for: ``add_self_attention``); ``hyp_links``: the word links hyp.align holds for it;
    ``copied``: a copying model's share of each hypothesis piece's probability that came through copying
    (``add_copy_shares``)."""

    index: int
    id: str
    src_pieces: list[str]
    hyp_pieces: list[str]
    src_words: list[int]
    hyp_words: list[int]
    attention: Any = None
    stored: Optional[StoredAttention] = None
    ref_pieces: Optional[list[str]] = None
    ref_words: Optional[list[int]] = None
    self_attention: Optional[dict[str, StoredAttention]] = None
    hyp_links: Optional[set[tuple[int, int]]] = None  # hyp.align's (source word, hypothesis word) links
    copied: Optional[list[float]] = None  # per hypothesis piece and EOS, the share of its probability copied


def sentence_records(
    data,
    hyps,
    tokenizer,
    indices: Optional[Sequence[int]] = None,
    keep: Optional[str] = None,
    layer: int = -1,
    references: bool = False,
    progress: str = "",
) -> list[SentenceRecord]:
    """The records of the sentences ``indices`` of ``data`` (a ParallelData; all of it by default), decoded
    as ``hyps`` (Hypotheses, in the order of ``indices``). ``keep`` (eval.attention: layer or all): also the
    views the attention files and the explorer keep, of layer ``layer``'s heads or every layer's;
    ``references``: also the reference's pieces (for the forced attention's rows). ``progress``: a progress
    bar's title (none without)."""
    indices = range(len(hyps.tokens)) if indices is None else indices
    src_words = tokenizer.src_words([data.src_texts[i] for i in indices])
    hyp_words = tokenizer.hyp_words(hyps.tokens)
    ref_words = tokenizer.tgt_words([data.tgt_texts[i] for i in indices]) if references else None
    records = []
    for n, i in enumerate(tqdm(indices, progress, leave=False, unit="sentence", disable=not progress)):
        attention = None if hyps.attention is None else hyps.attention[n]
        records.append(
            SentenceRecord(
                index=i,
                id=data.ids[i],
                src_pieces=tokenizer.src_pieces(data.src[i] + [EOS]),
                hyp_pieces=tokenizer.tgt_pieces(hyps.tokens[n] + [EOS]),
                src_words=src_words[n] + [-1],
                hyp_words=hyp_words[n] + [-1],
                attention=attention,
                stored=store_attention(attention, layer, keep) if keep and attention is not None else None,
                ref_pieces=tokenizer.tgt_pieces(data.tgt[i] + [EOS]) if references else None,
                ref_words=None if ref_words is None else ref_words[n] + [-1],
            )
        )
    return records


def add_self_attention(
    records: list[SentenceRecord],
    model: SelfAttending,
    src: list[list[int]],
    hyps: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
    keep: str = "layer",
    layer: int = -1,
    progress: str = "",
) -> dict[str, HeadRoles]:
    """Fill each record's ``self_attention`` with the views ``keep`` keeps (as of the cross-attention) of the
    model's self-attention over ``src[i]`` and, fed it (teacher forcing, one pass without logits), over the
    hypothesis ``hyps[n]`` (in the order of ``records``): the decoder's weights are those that wrote it. Returns
    what every head of the encoder and of the decoder did over these sentences (app/evaluation/head_roles.py)."""
    sources = [src[r.index] for r in records]
    passes = forced_self_attention(model, sources, hyps, device, batch_tokens, amp_dtype)
    roles = {kind: HeadRoles() for kind in SELF_ATTENTION}  # the order of forced_self_attention's maps
    for n, *weights in tqdm(passes, progress, len(records), leave=False, unit="sentence", disable=not progress):
        records[n].self_attention = own = {}
        for (kind, heads), w in zip(roles.items(), weights):
            own[kind] = store_attention(w, layer, keep)
            heads.add(w)
    return roles


def add_copy_shares(
    records: list[SentenceRecord],
    model: Copying,
    src: list[list[int]],
    hyps: list[list[int]],
    device: torch.device,
    batch_tokens: int,
    amp_dtype: Optional[torch.dtype] = None,
) -> Optional[dict]:
    """Fill each record's ``copied`` with the share of each of its hypothesis pieces' probability (``hyps[n]``, in
    the order of ``records``, and EOS) that came through copying, one teacher-forced pass; what ``metrics.json``
    says of them: the mean share over the pieces and the fraction of pieces mostly copied. None (and no record
    filled) for a model that does not copy."""
    sources = [src[r.index] for r in records]
    everything = []
    for n, shares in forced_copy_shares(model, sources, hyps, device, batch_tokens, amp_dtype):
        records[n].copied = [round(x, 4) for x in shares.tolist()]
        everything.append(shares[:-1])  # the pieces: EOS, which ends the source too, left out
    if not everything:
        return None
    pieces = torch.cat(everything)
    return {
        "pieces": pieces.numel(),
        "mean_share": round(pieces.mean().item(), 4) if pieces.numel() else 0.0,
        "mostly_copied": round((pieces > 0.5).float().mean().item(), 4) if pieces.numel() else 0.0,
    }
