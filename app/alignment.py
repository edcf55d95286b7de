"""What attention says about alignment: the views of a sentence's attention that plots and files
use, its entropy and monotonicity, and hard word alignments scored against gold alignments with AER
(Och & Ney 2003). Also the attention files of an evaluation (``alignments.npz`` beside the
``alignments.jsonl`` index) and the helper that reads a sentence's maps back.

Gold files use the Pharaoh format: one line per sentence pair, ``i-j`` for a sure link between
source word i and target word j (0-based, whitespace words), ``i?j`` for a possible one.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from tqdm import tqdm

from app.data.tokenizer import EOS
from app.decoding import forced_attention
from app.errors import UserError
from app.utils import atomic_open, atomic_write_text


def layer_views(attention: torch.Tensor, layer: int = -1) -> dict:
    """The views of one sentence's attention that plots and alignment files use.

    RNN (tgt, src): ``weights`` is the map itself. Transformer (layers, heads, tgt, src): ``weights``
    is the head average of ``layer``, ``head_weights`` its heads, ``layer_means`` every layer's head average.
    """
    attention = attention.float()
    if attention.dim() == 2:
        return {"weights": attention}
    if attention.dim() != 4:
        raise ValueError(
            f"attention of shape {tuple(attention.shape)}: expected (tgt, src) or (layers, heads, tgt, src)"
        )
    layer = layer % attention.size(0)
    return {
        "weights": attention[layer].mean(0),
        "head_weights": attention[layer],
        "layer": layer,
        "layer_means": attention.mean(1),
    }


def as_array(weights) -> np.ndarray:
    """Attention (a torch tensor on any device, or an array) as float32 numpy, without a copy where it can.
    Per-sentence arithmetic is done in numpy: torch's small ops wait on its second thread when the
    cores are busy (10 times slower on the 2-core CPU while the TER worker runs)."""
    if isinstance(weights, torch.Tensor):
        return weights.detach().float().cpu().numpy()
    return np.asarray(weights, dtype=np.float32)


def figure_views(attention, layer: int = -1, every_layer: bool = False) -> dict[str, tuple[np.ndarray, list[str]]]:
    """name -> (maps, their titles) of the figures of one sentence's attention: the alignment map; for
    Transformers also the head average of every layer (one column) and the heads of the chosen layer
    (``heads_layerN``; of every layer with ``every_layer``), each layer's heads in one figure."""
    views = layer_views(attention, layer)
    if "head_weights" not in views:
        return {"alignment": (np.asarray(views["weights"])[None], ["attention"])}
    chosen, attention = views["layer"], np.asarray(attention.float())
    layers, heads = attention.shape[:2]
    out = {
        "alignment": (np.asarray(views["weights"])[None], [f"layer {chosen}, mean of heads"]),
        "layers": (np.asarray(views["layer_means"]), [f"layer {i}, mean of heads" for i in range(layers)]),
    }
    for i in range(layers) if every_layer else [chosen]:
        out[f"heads_layer{i}"] = (attention[i], [f"layer {i}, head {h}" for h in range(heads)])
    return out


def attention_entropy(weights) -> float:
    """Mean entropy (nats) of the attention rows: low when each target token looks at few source tokens."""
    w = np.maximum(as_array(weights), np.float32(1e-12))
    return float(-(w * np.log(w)).sum(-1).mean())


def monotonicity(weights) -> float:
    """Share of target tokens whose most-attended source position does not move backwards: a
    diagonality score of an alignment (1.0 for a monotone one)."""
    argmax = as_array(weights).argmax(-1)
    if argmax.size < 2:
        return 1.0
    return float((argmax[1:] >= argmax[:-1]).mean())


def attention_shape(attentions: list[torch.Tensor], layer: int = -1) -> dict:
    """Mean entropy and monotonicity over sentences of the map plots show (an RNN's attention, a
    Transformer layer's head average): how sharp and how diagonal attention is, one number each."""
    first = attentions[0]
    if first.dim() not in (2, 4):
        raise ValueError(f"attention of shape {tuple(first.shape)}: expected (tgt, src) or (layers, heads, tgt, src)")
    # layer_views' "weights", without the other views: only the chosen layer is read
    maps = [as_array(a) if a.dim() == 2 else as_array(a[layer % a.size(0)]).mean(0) for a in attentions]
    return {
        "view": f"layer {layer % first.size(0)} mean" if first.dim() == 4 else "attention",
        "entropy": round(sum(map(attention_entropy, maps)) / len(maps), 6),
        "monotonicity": round(sum(map(monotonicity, maps)) / len(maps), 6),
    }


WORD_START = "▁"  # SentencePiece marks the first piece of each whitespace word


def read_pharaoh(path: str) -> list[tuple[set, set]]:
    """Per line: (sure links, possible links); possible includes sure, as AER requires."""
    gold = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            sure, possible = set(), set()
            for link in line.split():
                sep = "-" if "-" in link else "?"
                try:
                    i, j = (int(x) for x in link.split(sep))
                except ValueError:
                    raise UserError(f"{path}:{line_no}: {link!r} is not an i-j or i?j alignment link") from None
                possible.add((i, j))
                if sep == "-":
                    sure.add((i, j))
            gold.append((sure, possible))
    return gold


def word_index(pieces: list[str]) -> list[int]:
    """Word number of every subword piece; -1 for special tokens such as </s>."""
    out, word = [], -1
    for piece in pieces:
        if piece.startswith("<") and piece.endswith(">"):
            out.append(-1)
            continue
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        out.append(word)
    return out


def pieces_to_words(pieces: list[str]) -> np.ndarray:
    """(words, pieces) 0/1 matrix: which pieces make up each whitespace word (special tokens: none)."""
    words = np.asarray(word_index(pieces))
    return (np.arange(max(words.max(initial=-1) + 1, 0))[:, None] == words[None, :]).astype(np.float64)


def hard_alignments(maps, src_pieces: list[str], tgt_pieces: list[str]) -> list[set[tuple[int, int]]]:
    """Attention maps (views, tgt pieces, src pieces) -> per view {(source word, target word)}: pieces
    summed into words, then the most attended source word for every target word."""
    to_src, to_tgt = pieces_to_words(src_pieces), pieces_to_words(tgt_pieces)
    if not len(to_src) or not len(to_tgt):
        return [set() for _ in maps]
    merged = to_tgt @ np.asarray(maps, dtype=np.float64) @ to_src.T  # (views, tgt words, src words)
    return [{(int(i), j) for j, i in enumerate(best)} for best in merged.argmax(-1)]


def hard_alignment(weights, src_pieces: list[str], tgt_pieces: list[str]) -> set[tuple[int, int]]:
    """``hard_alignments`` of one (tgt pieces, src pieces) map."""
    return hard_alignments(np.asarray(weights, dtype=np.float64)[None], src_pieces, tgt_pieces)[0]


def piece_links(links: set[tuple[int, int]], src_pieces: list[str], tgt_pieces: list[str]) -> list[tuple[int, int]]:
    """(source word, target word) links -> the (target piece, source piece) cells of those words."""
    src_words, tgt_words = (np.asarray(word_index(pieces), dtype=np.intp) for pieces in (src_pieces, tgt_pieces))
    linked = np.zeros((tgt_words.max(initial=-1) + 2, src_words.max(initial=-1) + 2), dtype=bool)  # row/col -1: none
    for s, t in links:
        if 0 <= s < linked.shape[1] - 1 and 0 <= t < linked.shape[0] - 1:
            linked[t, s] = True
    cells = np.nonzero(linked[tgt_words[:, None], src_words[None, :]])  # row-major: by target piece, then source
    return list(zip(cells[0].tolist(), cells[1].tolist()))


def attention_views(attention: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Every map an alignment can be read from, named: an RNN's one map; for a Transformer (layers,
    heads, tgt, src), each head of each layer and each layer's mean of heads."""
    attention = as_array(attention)
    if attention.ndim == 2:
        return ["attention"], torch.from_numpy(attention[None])
    layers, heads = attention.shape[:2]
    names = [f"layer {layer} head {head}" for layer in range(layers) for head in range(heads)]
    names += [f"layer {layer} mean" for layer in range(layers)]
    return names, torch.from_numpy(np.concatenate([attention.reshape(-1, *attention.shape[2:]), attention.mean(1)]))


ALIGN_SCOPES = ("all", "linked")


def align_scope(setting: Optional[str], gold_file: bool) -> str:
    """eval.align_scope, or where unset: "all" for a gold file (it annotates every word), "linked" for the
    corpus's own reference links (Strong's numbers leave function words untagged)."""
    return setting or ("all" if gold_file else "linked")


def alignment_view(a: dict) -> str:
    """Which attention an AER of metrics.json's ``alignment`` read, and over which words."""
    return f"{a['view']}, chosen on {a['chosen_on']}; {a['scope']} target words"


class AlignmentScore:
    """AER, precision and recall (Och & Ney 2003) of several views of the attention at once, over a
    corpus: AER = 1 - (|A∩S| + |A∩P|) / (|A| + |S|); precision = |A∩P| / |A|; recall = |A∩S| / |S|.

    ``scope``: "all" counts the predicted link of every target word (a gold file that annotates every
    word, a word without links being unaligned); "linked" only those of target words the gold links
    (a partial reference, such as Strong's numbers, which leave function words untagged: a link from
    "the" is then unknown, not wrong)."""

    def __init__(self, views: list[str], scope: str = "all"):
        if scope not in ALIGN_SCOPES:
            raise UserError(f"alignment scope {scope!r}: choose {' or '.join(ALIGN_SCOPES)}")
        self.views, self.scope = views, scope
        self.counts = np.zeros((len(views), 4), dtype=np.int64)  # |A|, |S|, |A∩S|, |A∩P| per view

    def add(self, links: list[set], sure: set, possible: set) -> None:
        """One sentence: each view's predicted links against the gold ones (possible includes sure)."""
        if self.scope == "linked":
            linked = {t for _, t in possible}
            links = [{(s, t) for s, t in predicted if t in linked} for predicted in links]
        for counts, predicted in zip(self.counts, links):
            counts += (len(predicted), len(sure), len(predicted & sure), len(predicted & possible))

    def result(self, view: str) -> dict:
        a, s, a_s, a_p = self.counts[self.views.index(view)].tolist()
        return {
            "aer": round(1 - (a_s + a_p) / max(a + s, 1), 4),
            "precision": round(a_p / max(a, 1), 4),
            "recall": round(a_s / max(s, 1), 4),
            "links": a,
        }

    def best(self) -> str:
        """The view with the lowest AER (the first of equals)."""
        return min(self.views, key=lambda view: self.result(view)["aer"])


def alignment_error_rate(predicted: list[set], gold: list[tuple[set, set]], scope: str = "all") -> dict:
    """AER, precision and recall of one set of predicted links per sentence."""
    if len(predicted) != len(gold):
        raise UserError(f"{len(predicted)} sentences to align but the gold file has {len(gold)} lines")
    score = AlignmentScore(["links"], scope)
    for links, (sure, possible) in zip(predicted, gold):
        score.add([links], sure, possible)
    return score.result("links")


def score_alignments(
    model,
    data,
    gold: list[tuple[set, set]],
    tokenizer,
    device,
    dtype,
    batch_tokens: int,
    keep: int = 0,
    scope: str = "all",
    progress: str = "",
) -> tuple[Optional[AlignmentScore], dict]:
    """Every view of the teacher-forced attention of ``data`` (a ParallelData) scored against ``gold``
    (per pair: sure, possible links; ``scope`` as AlignmentScore's), and the attention of the first
    ``keep`` pairs (float16: for plots and the explorer). None, {} for a model without attention.
    ``progress``: a progress bar's title (none without)."""
    if len(gold) != len(data):
        raise UserError(f"{len(data)} sentences to align but the reference links have {len(gold)} lines")
    score, kept = None, {}
    pairs = forced_attention(model, data.src, data.tgt, device, batch_tokens, dtype)
    for i, attention in tqdm(pairs, progress, len(data), leave=False, unit="sentence", disable=not progress):
        names, maps = attention_views(attention)
        score = score or AlignmentScore(names, scope)
        links = hard_alignments(
            maps.numpy(), tokenizer.src_pieces(data.src[i] + [EOS]), tokenizer.tgt_pieces(data.tgt[i] + [EOS])
        )
        score.add(links, *gold[i])
        if i < keep:
            kept[i] = attention.half()
    return score, kept


# ---- the attention files of an evaluation ----
ATTENTION_KEEP = ("layer", "all")  # eval.attention: the heads of viz.layer, or of every layer
SCALE = 255  # stored value v means weight v / 255 (within 1/510 of the weight)
INDEX, ARCHIVE = "alignments.jsonl", "alignments.npz"


@dataclass
class StoredAttention:
    """What the attention files and the explorer keep of one sentence's attention: named views
    (``attention_views`` names) as uint8 maps (views, rows, src), and the attention's own shape."""

    names: list[str]
    maps: np.ndarray  # uint8: weight = value / SCALE
    layers: int  # 0 for an RNN's (or CTranslate2's) single map
    heads: int
    head_layers: list[int]  # the layers whose heads are kept
    entropy: float  # mean row entropy (nats) of the whole attention, every head of every layer


def store_attention(attention, layer: int = -1, keep: str = "layer") -> StoredAttention:
    """The views of ``attention`` (tgt, src) or (layers, heads, tgt, src) that ``keep`` keeps: an RNN's one
    map; of a Transformer, the heads of layer ``layer`` ("layer") or of every layer ("all"), then every
    layer's mean of heads. Quantized to uint8 (rounded, so within 1/510 of the weight)."""
    if keep not in ATTENTION_KEEP:
        raise UserError(f"eval.attention={keep!r}: choose layer (the heads of viz.layer) or all (every head)")
    attention = as_array(attention)
    entropy = attention_entropy(attention)
    if attention.ndim == 2:
        names, maps, layers, heads, kept = ["attention"], attention[None], 0, 0, []
    elif attention.ndim == 4:
        layers, heads = attention.shape[:2]
        kept = list(range(layers)) if keep == "all" else [layer % layers]
        names = [f"layer {n} head {h}" for n in kept for h in range(heads)] + [f"layer {n} mean" for n in range(layers)]
        maps = np.concatenate([attention[kept].reshape(-1, *attention.shape[2:]), attention.mean(1)])
    else:
        raise ValueError(f"attention of shape {attention.shape}: expected (tgt, src) or (layers, heads, tgt, src)")
    quantized = np.rint(np.clip(maps, 0.0, 1.0) * SCALE).astype(np.uint8)
    return StoredAttention(names, quantized, layers, heads, kept, entropy)


def write_attention_files(out_dir: str, sentences: Iterable[tuple[dict, StoredAttention]], level: int = 1) -> None:
    """``alignments.jsonl`` and ``alignments.npz`` in ``out_dir``: per sentence, its entry (index in the
    split, id, tokens ...) with its maps' array name, shape and view names as one JSON line, and the maps
    as that array of the archive (numpy's .npz: a zip of .npy files, deflated at zlib ``level``)."""
    lines = []
    with atomic_open(os.path.join(out_dir, ARCHIVE)) as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as archive:
            for entry, stored in sentences:
                name = str(entry["index"])
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, stored.maps, allow_pickle=False)
                row = {**entry, "array": name, "shape": list(stored.maps.shape), "views": stored.names}
                lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(os.path.join(out_dir, INDEX), "".join(line + "\n" for line in lines))


def read_attention(eval_dir: str, sentence: Union[int, str]) -> dict:
    """One sentence of an evaluation's attention files (``eval/<split>/``), by its index in the split (an
    int) or its id (a str): its ``alignments.jsonl`` entry, with ``maps`` the float32 (views, rows, src)
    weights (within 1/510 of the attention) and ``views`` their names ("layer 5 head 3", "layer 5 mean",
    or "attention" for an RNN's map)."""
    index, archive = os.path.join(eval_dir, INDEX), os.path.join(eval_dir, ARCHIVE)
    for path in (index, archive):
        if not os.path.exists(path):
            raise UserError(f"{path} does not exist: make eval writes it (a model with attention)")
    key = "index" if isinstance(sentence, int) else "id"
    with open(index, encoding="utf-8") as f:
        entry = next((e for e in map(json.loads, f) if e[key] == sentence), None)
    if entry is None:
        raise UserError(f"{index} has no sentence with {key} {sentence!r}")
    with np.load(archive) as arrays:
        maps = arrays[entry["array"]]
    return {**entry, "maps": maps.astype(np.float32) / SCALE}
