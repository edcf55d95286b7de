"""Builds tests/data/decoding_reference.pt.xz: small models of every decoder kind trained on Genesis 1-45
(Spanish -> English, a joint 400-piece SentencePiece vocabulary), with the ids of held-out verses
(Genesis 46-50) to decode. Then records what the decoder of the time outputs for them in
tests/data/decoding_reference.json (tests/test_decoding_reference.py compares against it).

The recorded outputs are those of the decoder as it was before the inference-engine rework (commit
6f6219a, its concatenating key/value cache and uncompacted batches): run with ``--record`` only on a
decoder whose outputs are known to be right. Run from the repository root:

    .venv/bin/python tests/data/make_decoding_reference.py [--train] [--record]
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import SWORD, Vocab, model_config  # noqa: E402

from app.data.batching import Batcher  # noqa: E402
from app.data.tokenizer import BOS, EOS, PAD  # noqa: E402
from app.models import (
    build_model,  # noqa: E402
    sequence_loss,  # noqa: E402
)

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = os.path.join(HERE, "decoding_reference.pt.xz")  # xz: under 1 MB in the repository
OUTPUTS = os.path.join(HERE, "decoding_reference.json")
VOCAB = 400
HELD_OUT = 120  # verses decoded
ATTENTION_SENTENCES = 20  # whose attention argmax rows are kept
TRANSFORMER = dict(d_model=48, heads=4, enc_layers=2, dec_layers=2, ff_dim=96, dropout=0.1, attention_dropout=0.0)
MODELS = {
    "transformer": dict(TRANSFORMER, max_len=256),
    "transformer_rope_gqa_rmsnorm_post": dict(TRANSFORMER, pos="rope", kv_heads=2, norm_type="rmsnorm", norm="post"),
    "transformer_alibi_mqa_window": dict(TRANSFORMER, pos="alibi", kv_heads=1, window=4, max_len=256),
    "rnn_bahdanau": dict(arch="rnn", emb_dim=32, hidden=64, attention="bahdanau", dropout=0.1),
    "rnn_luong_lstm": dict(
        arch="rnn", emb_dim=64, hidden=64, attention="luong", cell="lstm", input_feeding=True, dropout=0.1
    ),
}


def corpus() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(train source ids, train target ids, held-out source ids)."""
    import sentencepiece as spm

    from app.data.osis import bible_verses

    chapters = [31, 25, 24, 26, 32, 22, 24, 22, 29, 32, 32, 20, 18, 24, 21, 16, 27, 33, 38, 18, 34, 24, 20, 67, 34]
    chapters += [35, 46, 22, 35, 43, 55, 32, 20, 31, 29, 43, 36, 30, 23, 23, 57, 38, 34, 34, 28, 34, 31, 22, 33, 26]
    refs = [f"Gen.{c}.{v}" for c, n in enumerate(chapters, 1) for v in range(1, n + 1)]
    es, en = bible_verses(SWORD, "spaRV1909eb", refs), bible_verses(SWORD, "engWEB2015eb", refs)
    refs = [r for r in refs if es.get(r) and en.get(r)]
    held = [r for r in refs if int(r.split(".")[1]) > 45]
    train = [r for r in refs if int(r.split(".")[1]) <= 45]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([es[r] for r in train] + [en[r] for r in train]),
        model_writer=model,
        vocab_size=VOCAB,
        pad_id=PAD,
        unk_id=1,
        bos_id=BOS,
        eos_id=EOS,
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return sp.encode([es[r] for r in train]), sp.encode([en[r] for r in train]), sp.encode([es[r] for r in held])


def train(name: str, settings: dict, src, tgt, steps: int = 800, batch_size: int = 48) -> dict:
    torch.manual_seed(0)
    model = build_model(model_config(**settings), Vocab(VOCAB, VOCAB))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / 100, 1.0) * (1 - s / steps))
    batcher, rng, start = Batcher(src, tgt), random.Random(0), time.time()
    model.train()
    for step in range(steps):
        batch = batcher(rng.sample(range(len(src)), batch_size))
        loss = sequence_loss(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1) / (batch.tgt_out != PAD).sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"{name} step {step} loss {loss.item():.3f} {time.time() - start:.0f}s", flush=True)
    # stored in float16; the tests load them into float32 models, so the weights are exactly these values
    return {k: v.detach().half() for k, v in model.state_dict().items()}


def load_saved() -> dict:
    with open(WEIGHTS, "rb") as f:
        return torch.load(io.BytesIO(lzma.decompress(f.read())))


def load(name: str, saved: dict) -> torch.nn.Module:
    model = build_model(model_config(**saved["settings"][name]), Vocab(VOCAB, VOCAB))
    model.load_state_dict({k: v.float() for k, v in saved["weights"][name].items()})
    return model.eval()


def record(saved: dict) -> dict:
    from app.config.commands import DecodeConfig
    from app.decode.passes import beam_search, decode_corpus, greedy_decode

    src = saved["src"]
    batch = Batcher(src)(list(range(len(src)))).src
    out = {}
    for name in saved["settings"]:
        model = load(name, saved)
        greedy = greedy_decode(model, batch, need_attention=True)
        beam = beam_search(model, batch, beam_size=5, alpha=1.0, n_best=5, need_attention=True)
        attention_argmax = (
            lambda hyps: [  # noqa: E731
                a.reshape(-1, *a.shape[-2:]).mean(0).argmax(-1).tolist() if a is not None else None
                for a in (hyps.attention or [None] * len(src))[:ATTENTION_SENTENCES]
            ]
        )
        corpus_beam = decode_corpus(
            model, src, torch.device("cpu"), DecodeConfig(beam_size=4, length_penalty=0.6, batch_tokens=1200)
        )
        out[name] = {
            "greedy": greedy.tokens,
            "greedy_attention_argmax": attention_argmax(greedy),
            "beam5_nbest": [[tokens for tokens, _ in nbest] for nbest in beam.nbest],
            "beam5_scores": [[score for _, score in nbest] for nbest in beam.nbest],
            "beam5_attention_argmax": attention_argmax(beam),
            "corpus_beam4_alpha0.6": corpus_beam.tokens,
        }
        moved = sum(g != b for g, b in zip(greedy.tokens, beam.tokens))
        print(f"{name}: beam 5 differs from greedy on {moved}/{len(src)} sentences")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.train:
        src, tgt, held = corpus()
        saved = {"vocab": VOCAB, "settings": MODELS, "src": held[:HELD_OUT], "weights": {}}
        for name, settings in MODELS.items():
            saved["weights"][name] = train(name, settings, src, tgt)
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        with open(WEIGHTS, "wb") as f:
            f.write(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    if args.record:
        saved = load_saved()
        with open(OUTPUTS, "w", encoding="utf-8") as f:
            outputs = record(saved)
            json.dump(
                {"threads": 1, "attention_sentences": ATTENTION_SENTENCES, "outputs": outputs}, f, separators=(",", ":")
            )


if __name__ == "__main__":
    main()
