"""CTranslate2 export (app/decode/export.py) against our own decoding: per-token log-probabilities of every
exportable variant (untrained models, fast), then greedy and beam search of models trained for real on
Genesis (slow), and the settings that must be refused."""

import io
import json
import os
import random
import re
from types import SimpleNamespace

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")
import sacrebleu  # noqa: E402
import sentencepiece as spm  # noqa: E402

from app.config.commands import DecodeConfig  # noqa: E402
from app.config.schema import RNNConfig, TransformerConfig  # noqa: E402
from app.data.batching import Batcher  # noqa: E402
from app.data.tokenizer import BOS, EOS, PAD  # noqa: E402
from app.decode.ct2_engine import CT2Translator  # noqa: E402
from app.decode.export import convert  # noqa: E402
from app.decode.passes import decode_corpus, forced_pass  # noqa: E402
from app.decode.penalties import coverage_penalty, length_penalty  # noqa: E402
from app.decode.sampling import Sampler  # noqa: E402
from app.decode.search import block_repeated_ngrams  # noqa: E402
from app.models import build_model, sequence_loss  # noqa: E402
from app.run.errors import UserError  # noqa: E402

SWORD = "/usr/share/sword"
CHAPTERS = {1: 31, 2: 25, 3: 24, 4: 26, 5: 32, 6: 22, 7: 24, 8: 22}  # Genesis 1-8: 206 verses
CPU = torch.device("cpu")

# every exportable switch, each on its own (untrained: what is compared is the arithmetic)
VARIANTS = {
    "sinusoidal": {},
    "learned": dict(pos="learned"),
    "rope": dict(pos="rope"),
    "alibi": dict(pos="alibi"),
    "alibi-6-heads": dict(pos="alibi", heads=6, d_model=48),  # CTranslate2's own ALiBi slopes differ here
    "rmsnorm": dict(norm_type="rmsnorm"),
    "gqa": dict(kv_heads=2),
    "mqa": dict(kv_heads=1),
    "post-norm": dict(norm="post"),
    "gelu": dict(activation="gelu"),
    "rope-rmsnorm-gqa-post": dict(pos="rope", norm_type="rmsnorm", kv_heads=2, norm="post"),
    "untied": dict(tie_embeddings=False),
}


def model_cfg(**overrides) -> TransformerConfig:
    base = dict(
        d_model=32, heads=4, enc_layers=2, dec_layers=2, ff_dim=64, dropout=0.0, attention_dropout=0.0, max_len=256
    )
    return TransformerConfig(**{**base, **overrides})


def train_spm(texts, vocab_size, path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        pad_id=PAD,
        unk_id=1,
        bos_id=BOS,
        eos_id=EOS,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    path.write_bytes(model.getvalue())
    return str(path), spm.SentencePieceProcessor(model_file=str(path))


@pytest.fixture(scope="module")
def genesis(tmp_path_factory):
    """Spanish -> English Genesis 1-8 as ids of a joint SentencePiece model (and separate ones)."""
    from app.data.osis import bible_verses

    refs = [f"Gen.{c}.{v}" for c, n in CHAPTERS.items() for v in range(1, n + 1)]
    es, en = bible_verses(SWORD, "spaRV1909eb", refs), bible_verses(SWORD, "engWEB2015eb", refs)
    refs = [r for r in refs if es.get(r) and en.get(r)]
    es, en = [es[r] for r in refs], [en[r] for r in refs]
    root = tmp_path_factory.mktemp("spm")
    joint_path, sp = train_spm(es + en, 500, root / "joint.model")
    src_path, src_sp = train_spm(es, 300, root / "es.model")
    tgt_path, tgt_sp = train_spm(en, 300, root / "en.model")
    return dict(
        spm=joint_path,
        sp=sp,
        src=sp.encode(es),
        tgt=sp.encode(en),
        references=en,
        src_spm=src_path,
        tgt_spm=tgt_path,
        sep_src=src_sp.encode(es),
        sep_tgt=tgt_sp.encode(en),
    )


def build(cfg, src_vocab: int, tgt_vocab: int, joint: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    vocabularies = SimpleNamespace(src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab, joint=joint)
    return build_model(cfg, vocabularies).eval()


def our_log_probs(model, src, tgt, renormalized: bool = False) -> list[list[float]]:
    """Teacher-forced log p of every target token and the final EOS, per sentence (``renormalized``:
    over every token but <pad> and <s>, and but EOS where decode.min_len holds it back, as CTranslate2's scores)."""
    batch = Batcher(src, tgt)(list(range(len(src))))
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in)
        if renormalized:
            logits[..., [PAD, BOS]] = float("-inf")
            logits[:, : DecodeConfig().min_len, EOS] = float("-inf")
        logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, batch.tgt_out[..., None]).squeeze(-1)
    return [picked[i, : len(t) + 1].tolist() for i, t in enumerate(tgt)]


def export(model, cfg, genesis, tmp_path, joint=True, **kwargs) -> CT2Translator:
    out = str(tmp_path / "ct2")
    paths = (genesis["spm"], genesis["spm"]) if joint else (genesis["src_spm"], genesis["tgt_spm"])
    convert(model, cfg, *paths, out, **kwargs)
    return CT2Translator(out, threads=1)


def equal_share(a, b) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


# ---- the arithmetic of every variant (fast) ----


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_scores_as_ours(name, genesis, tmp_path):
    """CTranslate2's log p of each reference token (``make score``'s score_batch: padded batches of various
    lengths) equals our teacher-forced log p (make score's forced_pass, and this test's own): embeddings,
    positions, every layer and the output projection."""
    cfg = model_cfg(**VARIANTS[name])
    joint = cfg.tie_embeddings
    src, tgt = (genesis["src"], genesis["tgt"]) if joint else (genesis["sep_src"], genesis["sep_tgt"])
    src, tgt = src[:24], tgt[:24]
    vocab = (
        (genesis["sp"].get_piece_size(),) * 2
        if joint
        else (
            spm.SentencePieceProcessor(model_file=genesis["src_spm"]).get_piece_size(),
            spm.SentencePieceProcessor(model_file=genesis["tgt_spm"]).get_piece_size(),
        )
    )
    model = build(cfg, *vocab, joint=joint)
    engine = export(model, cfg, genesis, tmp_path, joint=joint)
    theirs, attention = engine.score(src, tgt, batch_tokens=200)
    assert attention is None  # make score's: several batches, each of various lengths
    forced = {i: logp for i, logp, _ in forced_pass(model, src, tgt, CPU, batch_tokens=200)}
    for i, ours in enumerate(our_log_probs(model, src, tgt)):
        assert len(theirs[i]) == len(ours) == len(tgt[i]) + 1
        assert torch.allclose(torch.tensor(theirs[i]), torch.tensor(ours), atol=2e-4), name
        assert torch.allclose(forced[i], torch.tensor(ours), atol=1e-5), name


def test_export_directory(genesis, tmp_path):
    cfg = model_cfg()
    model = build(cfg, genesis["sp"].get_piece_size(), genesis["sp"].get_piece_size())
    engine = export(model, cfg, genesis, tmp_path, run_info={"checkpoint": "best.pt", "step": 7})
    out = tmp_path / "ct2"
    assert {"model.bin", "config.json", "shared_vocabulary.json", "spm.model", "export.json", "README.md"} <= set(
        os.listdir(out)
    )
    pieces = json.loads((out / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert pieces == [genesis["sp"].id_to_piece(i) for i in range(genesis["sp"].get_piece_size())]
    info = json.loads((out / "export.json").read_text())
    assert info["run"] == {"checkpoint": "best.pt", "step": 7} and info["model"]["d_model"] == 32
    assert json.loads((out / "config.json").read_text())["add_source_eos"] is True
    assert engine.tokenizer().decode_tgt([genesis["tgt"][0]]) == [genesis["references"][0]]
    # exporting again replaces the directory
    convert(model, cfg, genesis["spm"], genesis["spm"], str(out), quantization="int8")
    assert json.loads((out / "export.json").read_text())["quantization"] == "int8"


def test_separate_vocabularies_export_both(genesis, tmp_path):
    cfg = model_cfg(tie_embeddings=False)
    sizes = [
        spm.SentencePieceProcessor(model_file=p).get_piece_size() for p in (genesis["src_spm"], genesis["tgt_spm"])
    ]
    engine = export(build(cfg, *sizes, joint=False), cfg, genesis, tmp_path, joint=False)
    names = set(os.listdir(tmp_path / "ct2"))
    assert {"source_vocabulary.json", "target_vocabulary.json", "source.spm.model", "target.spm.model"} <= names
    assert len(engine.src_vocab) == sizes[0] and len(engine.tgt_vocab) == sizes[1]


# ---- what CTranslate2 cannot express, and wrong inputs ----


@pytest.mark.parametrize(
    "cfg, setting",
    [
        (model_cfg(window=2), "model.window=2"),
        (RNNConfig(emb_dim=16, hidden=32), "model.arch=rnn"),
        (model_cfg(copy_attention=True), "model.copy_attention=true"),
    ],
)
def test_refused_settings_name_themselves_in_one_line(cfg, setting, genesis, tmp_path):
    vocab = genesis["sp"].get_piece_size()
    with pytest.raises(UserError) as err:
        convert(build(cfg, vocab, vocab), cfg, genesis["spm"], genesis["spm"], str(tmp_path / "ct2"))
    assert str(err.value).startswith(setting + ":") and "\n" not in str(err.value)
    assert not (tmp_path / "ct2").exists()


def test_wrong_tokenizer_quantization_and_directory_are_refused(genesis, tmp_path):
    cfg = model_cfg()
    model = build(cfg, genesis["sp"].get_piece_size(), genesis["sp"].get_piece_size())
    with pytest.raises(UserError, match="not the tokenizer this model was trained with"):
        convert(model, cfg, genesis["src_spm"], genesis["src_spm"], str(tmp_path / "a"))
    with pytest.raises(UserError, match="export.quantization=int4"):
        convert(model, cfg, genesis["spm"], genesis["spm"], str(tmp_path / "b"), quantization="int4")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"weights")
    with pytest.raises(UserError, match="is not an earlier export"):
        convert(model, cfg, genesis["spm"], genesis["spm"], str(tmp_path / "run"))
    assert (tmp_path / "run" / "best.pt").read_bytes() == b"weights"


def test_a_hypothesis_cut_at_the_length_limit_gets_the_eos_row_ours_has(genesis, tmp_path):
    """An untrained model never ends a sentence: every hypothesis is cut at the limit, where ours reads one
    more attention row (the step that would emit EOS) and CTranslate2 returns none of its own."""
    cfg = model_cfg()
    vocab = genesis["sp"].get_piece_size()
    model = build(cfg, vocab, vocab)
    src, decode = genesis["src"][:6], DecodeConfig(beam_size=1, max_len_ratio=0.5, max_len_extra=0)
    ours = decode_corpus(model, src, CPU, decode, need_attention=True)
    theirs = export(model, cfg, genesis, tmp_path).translate(src, decode, need_attention=True)
    assert ours.tokens == theirs.tokens and all(len(t) == int((len(s) + 1) * 0.5) for t, s in zip(ours.tokens, src))
    for mine, other in zip(ours.attention, theirs.attention):
        assert torch.allclose(mine[-1].mean(0), other, atol=1e-4)  # the last row included


def test_empty_source_gives_empty_output(genesis, tmp_path):
    """CTranslate2 skips an empty input (ours would decode from the lone EOS): empty output, score 0."""
    cfg = model_cfg()
    model = build(cfg, genesis["sp"].get_piece_size(), genesis["sp"].get_piece_size())
    hyps = export(model, cfg, genesis, tmp_path).translate(
        [[], genesis["src"][0]], DecodeConfig(beam_size=2), need_attention=True
    )
    assert hyps.tokens[0] == [] and hyps.nbest[0][0] == ([], 0.0) and hyps.attention[0].tolist() == [[1.0]]
    assert hyps.tokens[1] and hyps.attention[1].shape[-1] == len(genesis["src"][0]) + 1
    # with a target prefix: the prefix alone, its rows (and the EOS's) over the one EOS column (it crashed)
    translator, prefix = export(model, cfg, genesis, tmp_path), [genesis["tgt"][0][:3], genesis["tgt"][1][:2]]
    for beam in (1, 2):
        sources = [[], genesis["src"][1]]
        hyps = translator.translate(sources, DecodeConfig(beam_size=beam), need_attention=True, prefix=prefix)
        assert hyps.tokens[0] == prefix[0] and hyps.attention[0].tolist() == [[1.0]] * 4
        assert hyps.tokens[1][:2] == prefix[1] and hyps.attention[1].shape == (
            len(hyps.tokens[1]) + 1,
            len(sources[1]) + 1,
        )


def test_too_long_input_is_refused_as_ours(genesis, tmp_path):
    cfg = model_cfg(max_len=16)
    model = build(cfg, genesis["sp"].get_piece_size(), genesis["sp"].get_piece_size())
    engine = export(model, cfg, genesis, tmp_path)
    with pytest.raises(UserError, match="model.max_len=16"):
        engine.translate([[5] * 16], DecodeConfig(beam_size=1))


# ---- trained models (slow) ----


def train(model, src, tgt, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0):
    torch.manual_seed(seed)
    rng, batcher = random.Random(seed), Batcher(src, tgt)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        batch = batcher(rng.sample(range(len(src)), batch_size))
        loss = sequence_loss(model(batch.src, batch.tgt_in), batch.tgt_out) / (batch.tgt_out != PAD).sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained(genesis, one_thread):
    """Half-trained (300 steps: about 70 s on one core of a 2-core CPU, most of it matrix products, CPU flash
    attention and dropout masks): outputs of every length, many of them cut at the limit."""
    cfg = model_cfg(d_model=64, ff_dim=128, dropout=0.1)
    vocab = genesis["sp"].get_piece_size()
    torch.manual_seed(0)
    return cfg, train(build(cfg, vocab, vocab).train(), genesis["src"], genesis["tgt"], steps=300)


def bleu(sp, tokens, references) -> float:
    return sacrebleu.corpus_bleu(sp.decode(tokens), [references]).score


@pytest.mark.slow
def test_trained_greedy_and_attention_match(trained, genesis, tmp_path):
    (cfg, model), src = trained, genesis["src"]
    engine = export(model, cfg, genesis, tmp_path)
    ours = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1), need_attention=True)
    theirs = engine.translate(src, DecodeConfig(beam_size=1), need_attention=True)
    assert equal_share(ours.tokens, theirs.tokens) >= 0.99
    compared = 0
    for mine, other, tokens, other_tokens in zip(ours.attention, theirs.attention, ours.tokens, theirs.tokens):
        if tokens == other_tokens:
            assert other.shape == (len(tokens) + 1, mine.size(-1))  # an EOS row, and the source's EOS column
            assert torch.allclose(mine[-1].mean(0), other, atol=1e-4)  # last layer, mean of heads
            compared += 1
    assert compared >= 0.99 * len(src)


@pytest.mark.slow
@pytest.mark.parametrize("beam,alpha", [(1, 0.0), (5, 1.0)])
def test_trained_prefix_decoding_matches_target_prefix(beam, alpha, trained, genesis, tmp_path):
    """A forced target prefix (the first pieces of the reference, of every other verse) decodes as CTranslate2's
    target_prefix does: the same hypotheses, each beginning with its prefix, scored with the prefix's log p (which
    CTranslate2's scores leave out and CT2Translator adds back)."""
    (cfg, model), src = trained, genesis["src"]
    prefix = [tgt[: 2 + i % 5] if i % 2 else [] for i, tgt in enumerate(genesis["tgt"])]
    decode = DecodeConfig(beam_size=beam, length_penalty=alpha, n_best=beam)
    engine = export(model, cfg, genesis, tmp_path)
    ours, theirs = decode_corpus(model, src, CPU, decode, prefix=prefix), engine.translate(src, decode, prefix=prefix)
    free = decode_corpus(model, src, CPU, decode)
    for hyps in (ours, theirs):
        assert all(tokens[: len(p)] == p for tokens, p in zip(hyps.tokens, prefix))
    assert [ours.tokens[i] for i in range(0, len(src), 2)] == [free.tokens[i] for i in range(0, len(src), 2)]
    assert (
        equal_share([ours.tokens[i] for i in range(1, len(src), 2)], [free.tokens[i] for i in range(1, len(src), 2)])
        < 0.5
    )
    same = [i for i in range(len(src)) if ours.tokens[i] == theirs.tokens[i]]
    # with α = 1 CTranslate2's search stops sooner after a prefix (89 % the same on 2026-11-26): where the two
    # differ, ours found the hypothesis that scores higher (22 of 23)
    assert len(same) >= (0.97 if alpha == 0 else 0.85) * len(src)
    if beam > 1:  # the scores agree (CTranslate2's leaves <pad> and <s> out of the softmax: a little higher)
        assert all(abs(ours.nbest[i][0][1] - theirs.nbest[i][0][1]) < 0.02 for i in same)
        other = [i for i in range(len(src)) if i not in same]
        assert sum(ours.nbest[i][0][1] >= theirs.nbest[i][0][1] - 1e-3 for i in other) >= 0.9 * len(other)


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_trained_beam_search_matches(alpha, trained, genesis, tmp_path):
    (cfg, model), src, sp = trained, genesis["src"], genesis["sp"]
    engine = export(model, cfg, genesis, tmp_path)
    ours = decode_corpus(
        model, src, CPU, DecodeConfig(beam_size=5, length_penalty=alpha, n_best=3), need_attention=True
    )
    theirs = engine.translate(src, DecodeConfig(beam_size=5, length_penalty=alpha, n_best=3), need_attention=True)
    ours_bleu, their_bleu = (bleu(sp, hyps.tokens, genesis["references"]) for hyps in (ours, theirs))
    print(
        f"alpha {alpha}: same best hypothesis {equal_share(ours.tokens, theirs.tokens):.1%}, BLEU ours "
        f"{ours_bleu:.2f}, CTranslate2 {their_bleu:.2f}"
    )
    assert abs(ours_bleu - their_bleu) <= 0.3
    # not all: CTranslate2 renormalizes without <pad> and <s>, and stops differently (CT2Translator)
    assert equal_share(ours.tokens, theirs.tokens) >= (0.97 if alpha == 0 else 0.9)
    same = [i for i in range(len(src)) if ours.tokens[i] == theirs.tokens[i]]
    best = [theirs.tokens[i] for i in same]
    # CTranslate2's score: our GNMT score of log p over every token but <pad> and <s>, which it suppresses
    limits = engine.length_limits([src[i] for i in same], DecodeConfig(max_len_ratio=1.5, max_len_extra=10)).tolist()
    cut = [len(theirs.tokens[i]) == limit for i, limit in zip(same, limits)]  # no EOS
    expected = [
        sum(logp[:-1] if at_limit else logp) / length_penalty(len(t) + 1, alpha)
        for t, logp, at_limit in zip(best, our_log_probs(model, [src[i] for i in same], best, renormalized=True), cut)
    ]
    assert torch.allclose(torch.tensor([theirs.nbest[i][0][1] for i in same]), torch.tensor(expected), atol=1e-3)
    # ... and ours is lower: the same sum with <pad> and <s> left in the softmax
    assert all(ours.nbest[i][0][1] <= theirs.nbest[i][0][1] + 1e-4 for i in same)
    for i in range(len(src)):
        scores = [s for _, s in theirs.nbest[i]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        if i in same and theirs.attention[i].size(0) == len(theirs.tokens[i]) + 1:
            assert torch.allclose(ours.attention[i][-1].mean(0), theirs.attention[i], atol=1e-4)


@pytest.mark.slow
def test_trained_decoding_without_repeated_ngrams_bans_what_ctranslate2_bans(trained, genesis, tmp_path):
    """decode.no_repeat_ngram_size is CTranslate2's no_repeat_ngram_size: greedy outputs are the same. Beam search
    ranks otherwise, as CTranslate2 renormalizes what a ban leaves (fairseq, as ours, does not): its scores are
    the log p of its hypotheses renormalized over the tokens our ban leaves at each step."""
    (cfg, model), src = trained, genesis["src"]
    engine = export(model, cfg, genesis, tmp_path)
    free = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1)).tokens
    assert sum(map(repeats, free)) >= 20  # the half-trained model loops: there is something to ban
    greedy = DecodeConfig(beam_size=1, no_repeat_ngram_size=3)
    ours, theirs = decode_corpus(model, src, CPU, greedy).tokens, engine.translate(src, greedy).tokens
    assert not any(map(repeats, ours)) and equal_share(ours, theirs) >= 0.99
    beam = DecodeConfig(beam_size=5, no_repeat_ngram_size=3)
    ours, theirs = decode_corpus(model, src, CPU, beam), engine.translate(src, beam)
    print(f"beam 5: the same best hypothesis for {equal_share(ours.tokens, theirs.tokens):.1%}")
    assert not any(map(repeats, ours.tokens)) and not any(map(repeats, theirs.tokens))
    limits = engine.length_limits(src, beam).tolist()
    expected = [
        sum(logp[:-1] if len(t) == limit else logp) / length_penalty(len(t) + 1, beam.length_penalty)
        for t, logp, limit in zip(theirs.tokens, renormalized_log_probs(model, src, theirs.tokens, 3), limits)
    ]
    assert torch.allclose(torch.tensor([n[0][1] for n in theirs.nbest]), torch.tensor(expected), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("topk,topp,temperature", [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.8, 2.0), (10, 0.9, 1.5)])
def test_sampling_draws_from_the_distribution_ctranslate2_draws_from(
    topk, topp, temperature, trained, genesis, tmp_path
):
    """decode.sampling_* are CTranslate2's sampling_*, applied in its order (the temperature before the nucleus cut):
    4,000 draws of a verse's first word by each engine, the 6 most probable tokens each within 0.03 (4 standard
    deviations at p = 0.5) of their probability in the model's narrowed distribution (the same seed, the same draws:
    tests/test_cli_end_to_end.py)."""
    (cfg, model), source = trained, genesis["src"][0]
    engine = export(model, cfg, genesis, tmp_path)
    decode = DecodeConfig(
        beam_size=1,
        sampling=True,
        sampling_topk=topk,
        sampling_topp=topp,
        sampling_temperature=temperature,
        max_len_ratio=0.0,
        max_len_extra=1,  # one token, then the end
    )
    with torch.no_grad():
        logits = model(torch.tensor([source + [EOS]]), torch.tensor([[BOS]]))[0, 0].float()
    logits[[PAD, BOS]] = float("-inf")
    scores, ids = Sampler(topk, topp, temperature, torch.Generator()).narrowed(logits.log_softmax(-1)[None])
    expected = torch.zeros_like(logits)
    expected[ids[0] if ids is not None else slice(None)] = scores[0].softmax(-1)
    copies = [source] * 4000
    ours, theirs = decode_corpus(model, copies, CPU, decode).tokens, engine.translate(copies, decode).tokens
    for token in expected.argsort(descending=True)[:6].tolist():
        for name, hypotheses in (("ours", ours), ("CTranslate2", theirs)):
            drew = sum(tokens[:1] == [token] if token != EOS else not tokens for tokens in hypotheses)
            assert drew / len(copies) == pytest.approx(expected[token].item(), abs=0.03), (name, token)


def repeats(tokens: list[int], n: int = 3) -> bool:
    return len({tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}) < len(tokens) - n + 1


def renormalized_log_probs(model, src, tgt, n: int) -> list[list[float]]:
    """Teacher-forced log p of every target token and the final EOS, renormalized over the tokens that are neither
    <pad>, <s> nor banned by block_repeated_ngrams after the tokens before it (nor EOS held back by decode.min_len)."""
    batch = Batcher(src, tgt)(list(range(len(src))))
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in).float()
    logits[..., [PAD, BOS]] = float("-inf")
    logits[:, : DecodeConfig().min_len, EOS] = float("-inf")
    out = []
    for i, tokens in enumerate(tgt):
        rows = logits[i, : len(tokens) + 1].clone()
        for j in range(len(tokens) + 1):
            block_repeated_ngrams(rows[j : j + 1], torch.tensor([tokens[:j]], dtype=torch.long), n)
        picked = rows.log_softmax(-1).gather(-1, torch.tensor(tokens + [EOS])[:, None])
        out.append(picked.squeeze(-1).tolist())
    return out


@pytest.mark.slow
def test_longer_patience_agrees_more(trained, genesis, tmp_path):
    """CTranslate2 stops after beam_size × patience ended hypotheses, ours when none can be beaten."""
    (cfg, model), src = trained, genesis["src"]
    engine = export(model, cfg, genesis, tmp_path)
    ours = decode_corpus(model, src, CPU, DecodeConfig(beam_size=5, length_penalty=1.0)).tokens
    agreement = [
        equal_share(ours, engine.translate(src, DecodeConfig(beam_size=5, length_penalty=1.0), patience=p).tokens)
        for p in (1, 4)
    ]
    print(f"same best hypothesis as ours: patience 1 {agreement[0]:.1%}, patience 4 {agreement[1]:.1%}")
    assert agreement[1] > agreement[0] and agreement[1] >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("quantization, min_agreement, max_bleu_drop", [("float16", 0.9, 0.3), ("int8", 0.4, 1.5)])
def test_quantized_exports(quantization, min_agreement, max_bleu_drop, trained, genesis, tmp_path):
    if quantization == "int8" and not cpu_has_vnni():
        # measured on an AMD EPYC with AVX2 and no VNNI, 2026-11-28, at 99cf5da and after: 1.9 % of greedy outputs
        # the same, BLEU 9.61 against 11.32; int8 GEMMs without VNNI saturate their 16-bit sums (vpmaddubsw)
        pytest.skip("int8 on a CPU without VNNI instructions: CTranslate2's int8 products saturate, not comparable")
    (cfg, model), src, sp = trained, genesis["src"], genesis["sp"]
    engine = export(model, cfg, genesis, tmp_path, quantization=quantization)
    ours = decode_corpus(model, src, CPU, DecodeConfig(beam_size=1)).tokens
    theirs = engine.translate(src, DecodeConfig(beam_size=1)).tokens
    print(
        f"{quantization}: same greedy output {equal_share(ours, theirs):.1%}, BLEU ours "
        f"{bleu(sp, ours, genesis['references']):.2f}, CTranslate2 {bleu(sp, theirs, genesis['references']):.2f}"
    )
    assert equal_share(ours, theirs) >= min_agreement
    assert bleu(sp, ours, genesis["references"]) - bleu(sp, theirs, genesis["references"]) <= max_bleu_drop


def cpu_has_vnni() -> bool:
    """Whether this CPU has VNNI int8 dot products (AVX512-VNNI or AVX-VNNI); unknown (no /proc/cpuinfo): True."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = info.read()
    except OSError:
        return True
    return bool(re.search(r"\bavx(512)?_vnni\b", flags))


# every switch of VARIANTS in a trained model, three trainings in all (each ~15 s); the untrained log-probabilities
# above check each switch on its own
TRAINED_VARIANTS = {
    "learned-mqa-gelu": dict(pos="learned", kv_heads=1, activation="gelu"),
    "rope-rmsnorm-gqa-post": VARIANTS["rope-rmsnorm-gqa-post"],
    "alibi": VARIANTS["alibi"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED_VARIANTS)
def test_trained_variant_greedy_matches(name, genesis, tmp_path, one_thread):
    cfg = model_cfg(**TRAINED_VARIANTS[name], dropout=0.1)
    vocab = genesis["sp"].get_piece_size()
    torch.manual_seed(0)
    model = train(build(cfg, vocab, vocab).train(), genesis["src"], genesis["tgt"], steps=150)
    engine = export(model, cfg, genesis, tmp_path)
    ours = decode_corpus(model, genesis["src"], CPU, DecodeConfig(beam_size=1)).tokens
    assert equal_share(ours, engine.translate(genesis["src"], DecodeConfig(beam_size=1)).tokens) >= 0.99


def test_loading_an_export_leaves_torchs_thread_count_alone(genesis, tmp_path):
    """CTranslate2 sets the OpenMP thread count torch shares: our decoding would run on its one thread."""
    cfg = model_cfg()
    vocab = genesis["sp"].get_piece_size()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        export(build(cfg, vocab, vocab), cfg, genesis, tmp_path)  # a CT2Translator of intra_threads=1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


SECOND = 7


def eager_to_end(cfg, genesis) -> torch.nn.Module:
    """A model whose every step puts EOS first, then the piece ``SECOND``: its final norm gives every position
    one vector, which the output projection scores."""
    vocab = genesis["sp"].get_piece_size()
    model = build(cfg, vocab, vocab)
    with torch.no_grad():
        model.dec_norm.weight.zero_()
        model.dec_norm.bias.zero_()[0] = 1.0
        model.out_proj.weight[:, 0] = 0.0
        model.out_proj.weight[EOS, 0], model.out_proj.weight[SECOND, 0] = 8.0, 4.0
    return model


@pytest.mark.parametrize("beam", [1, 3])
def test_min_len_holds_back_eos_as_ctranslate2_does(beam, genesis, tmp_path):
    """decode.min_len is CTranslate2's min_decoding_length: no EOS before that many pieces, a target prefix's
    counted; an empty source still translates to nothing."""
    cfg = model_cfg()
    model = eager_to_end(cfg, genesis)
    engine = export(model, cfg, genesis, tmp_path)
    src = genesis["src"][:3] + [[]]
    for min_len, lengths in [(0, [0, 0, 0, 0]), (1, [1, 1, 1, 0]), (3, [3, 3, 3, 0])]:
        decode = DecodeConfig(beam_size=beam, n_best=1, min_len=min_len)
        ours, theirs = decode_corpus(model, src, CPU, decode), engine.translate(src, decode)
        assert ours.tokens == theirs.tokens and [len(t) for t in ours.tokens] == lengths
        assert all(set(t) <= {SECOND} for t in ours.tokens)  # held back, the next best piece
    prefix = [[9, 10], [], [9, 10, 11, 12], []]
    decode = DecodeConfig(beam_size=beam, min_len=3)
    ours, theirs = decode_corpus(model, src, CPU, decode, prefix=prefix), engine.translate(src, decode, prefix=prefix)
    assert ours.tokens == theirs.tokens == [[9, 10, SECOND], [SECOND] * 3, [9, 10, 11, 12], []]


@pytest.mark.slow
def test_coverage_penalty_ranks_as_ctranslate2_attention_says(trained, genesis, tmp_path):
    """decode.coverage_penalty on both engines (GNMT's α = β = 0.2): each best hypothesis scored log p / lp(Y) +
    β Σ_i log min(coverage_i, 1), its coverage the attention of its steps (EOS included) in the last layer, mean of
    heads; CTranslate2's hypotheses ranked by that score, their coverage read from the attention it returns."""
    (cfg, model), src = trained, genesis["src"]
    engine = export(model, cfg, genesis, tmp_path)
    decode = DecodeConfig(beam_size=5, length_penalty=0.2, coverage_penalty=0.2, n_best=3)
    ours, theirs = decode_corpus(model, src, CPU, decode, need_attention=True), engine.translate(src, decode)
    free = decode_corpus(model, src, CPU, DecodeConfig(beam_size=5, length_penalty=0.2))
    changed = 1 - equal_share(ours.tokens, free.tokens)
    print(f"same best hypothesis {equal_share(ours.tokens, theirs.tokens):.1%}; changed by the penalty {changed:.1%}")
    assert equal_share(ours.tokens, theirs.tokens) >= 0.97 and changed >= 0.05  # 99.5 % and 10.2 % on 2026-11-28
    limits = engine.length_limits(src, decode).tolist()
    ended = [i for i in range(len(src)) if ours.tokens[i] == theirs.tokens[i] and len(ours.tokens[i]) < limits[i]]
    assert len(ended) >= 0.9 * len(src)
    hyps, sources = [ours.tokens[i] for i in ended], [src[i] for i in ended]
    penalties = [float(coverage_penalty(ours.attention[i][-1].mean(0).sum(0, keepdim=True), 0.2)) for i in ended]
    assert all(p < 0 for p in penalties)
    for log_p, scored in (
        (our_log_probs(model, sources, hyps), ours),
        (our_log_probs(model, sources, hyps, True), theirs),
    ):
        expected = [sum(lp) / length_penalty(len(t) + 1, 0.2) + p for lp, t, p in zip(log_p, hyps, penalties)]
        got = [scored.nbest[i][0][1] for i in ended]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-3)
