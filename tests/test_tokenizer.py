"""SentencePiece tokenizer on a tiny real corpus (Genesis 1-3, Spanish-English)."""

import dataclasses
import json
import os
import shutil
import signal

import numpy as np
import pytest

from app.config.schema import DataConfig, TokenizerConfig
from app.data.prepare import prepare, read_tsv
from app.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer, build_tokenizer, model_paths
from app.run.errors import UserError
from app.run.files import file_hash, stable_hash
from app.run.folder_lock import Terminated
from app.train.stop_rules import StopNow

VOCAB = 250


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, genesis_pairs):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "genesis.tsv"
    corpus.write_text("".join(f"{ref}\t{es}\t{en}\n" for ref, es, en in genesis_pairs), encoding="utf-8")
    cfg = DataConfig(
        source="files", name="gen", dir=str(root / "prepared"), train=str(corpus), dev_fraction=0.05, test_fraction=0.05
    )
    prepare(cfg)
    return cfg.dir


@pytest.fixture
def data_dir(prepared, tmp_path):
    """A private copy of the prepared corpus, so each test trains its own models."""
    return shutil.copytree(prepared, tmp_path / "data")


def file_state(path):
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_special_ids(data_dir):
    tok = build_tokenizer(data_dir, TokenizerConfig(vocab_size=VOCAB))
    sp = tok.src
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD, UNK, BOS, EOS)
    assert tok.src_pieces([PAD, UNK, BOS, EOS]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert sp.is_control(PAD) and sp.is_control(BOS) and sp.is_control(EOS) and sp.is_unknown(UNK)
    assert 4 < tok.src_vocab_size <= VOCAB and tok.src_vocab_size == tok.tgt_vocab_size
    # encode adds no BOS/EOS (the Batcher does) and never produces PAD
    ids = tok.encode_src(["En el principio"])[0]
    assert ids and not {PAD, BOS, EOS} & set(ids)


def test_round_trip_on_training_sentences(data_dir):
    tok = build_tokenizer(data_dir, TokenizerConfig(vocab_size=VOCAB))
    assert tok.joint and tok.src is tok.tgt
    pairs = read_tsv(os.path.join(data_dir, "train.tsv"))
    assert len(pairs) > 50
    texts = [p.src for p in pairs] + [p.tgt for p in pairs]
    ids = tok.encode_src(texts)
    assert all(UNK not in seq for seq in ids)
    assert tok.decode_tgt(ids) == texts
    # subwords actually segment: far fewer pieces than characters, more than words
    total_pieces, total_chars = sum(map(len, ids)), sum(map(len, texts))
    assert sum(len(t.split()) for t in texts) <= total_pieces < total_chars


def test_second_build_reuses_model(data_dir):
    cfg = TokenizerConfig(vocab_size=VOCAB)
    model, _ = model_paths(data_dir, cfg)
    first = build_tokenizer(data_dir, cfg)
    before = file_state(model)
    second = build_tokenizer(data_dir, cfg)
    assert file_state(model) == before
    text = ["Y dijo Dios: Sea la luz."]
    assert second.encode_src(text) == first.encode_src(text)


def test_changed_corpus_retrains(data_dir):
    cfg = TokenizerConfig(vocab_size=VOCAB)
    model, _ = model_paths(data_dir, cfg)
    build_tokenizer(data_dir, cfg)
    before = file_state(model)
    train = os.path.join(data_dir, "train.tsv")
    with open(train, "a", encoding="utf-8") as f:
        f.write("extra\tzzzzqqqq xylofón\tzzzzqqqq xylophone\n")
    tok = build_tokenizer(data_dir, cfg)
    assert file_state(model) != before
    assert UNK not in tok.encode_src(["xylofón"])[0]


def test_a_vocabulary_below_the_corpus_characters_is_one_line_and_above_its_pieces_a_warning(data_dir, caplog):
    """SentencePiece checks the first only once it has read the corpus (a RuntimeError traceback before), and gives
    fewer pieces than asked for without a word where the corpus has no more (hard_vocab_limit=False)."""
    with pytest.raises(UserError, match=r"^tokenizer\.vocab_size=7 is too small for this corpus: its characters and "):
        build_tokenizer(data_dir, TokenizerConfig(vocab_size=7))
    pieces = build_tokenizer(data_dir, TokenizerConfig(vocab_size=20000)).src.get_piece_size()
    said = [r.getMessage() for r in caplog.records]
    warning = f"tokenizer.vocab_size=20000: this corpus gives {pieces} pieces only, "
    assert pieces < 20000 and any(warning in message for message in said), said


def test_separate_vocabularies(data_dir):
    cfg = TokenizerConfig(vocab_size=VOCAB, joint=False)
    src_model, tgt_model = model_paths(data_dir, cfg)
    assert src_model != tgt_model
    tok = build_tokenizer(data_dir, cfg)
    assert os.path.isfile(src_model) and os.path.isfile(tgt_model)
    assert not os.path.exists(model_paths(data_dir, TokenizerConfig(vocab_size=VOCAB))[0])
    assert not tok.joint and tok.src is not tok.tgt
    src_pieces = {tok.src.id_to_piece(i) for i in range(tok.src_vocab_size)}
    tgt_pieces = {tok.tgt.id_to_piece(i) for i in range(tok.tgt_vocab_size)}
    assert src_pieces != tgt_pieces
    pairs = read_tsv(os.path.join(data_dir, "train.tsv"))
    assert tok.src.decode(tok.encode_src([p.src for p in pairs])) == [p.src for p in pairs]
    assert tok.decode_tgt(tok.encode_tgt([p.tgt for p in pairs])) == [p.tgt for p in pairs]
    # reused on a second call
    before = (file_state(src_model), file_state(tgt_model))
    build_tokenizer(data_dir, cfg)
    assert (file_state(src_model), file_state(tgt_model)) == before


def test_joint_and_separate_models_coexist(data_dir):
    joint, separate = TokenizerConfig(vocab_size=VOCAB), TokenizerConfig(vocab_size=VOCAB, joint=False)
    model, _ = model_paths(data_dir, joint)
    build_tokenizer(data_dir, joint)
    build_tokenizer(data_dir, separate)
    before = file_state(model)
    build_tokenizer(data_dir, joint)
    assert file_state(model) == before


def test_missing_model_is_user_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer model not found"):
        Tokenizer(str(tmp_path / "a.model"), str(tmp_path / "a.model"))


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), Terminated(143), StopNow(signal.SIGINT)], ids=type)
def test_a_signal_while_sentencepiece_reads_the_corpus_is_raised_as_it_was(data_dir, monkeypatch, stop):
    """SentencePiece pulls the sentences from Python inside its C++ trainer and turns an exception raised there into
    a RuntimeError ("INTERNAL: KeyboardInterrupt"): Ctrl-C at that moment ended make data with a traceback. The
    signal's own exception reaches the command, which ends in one line; no model is written."""
    import app.data.tokenizer as tokenizer

    def sentences_then(error):
        def column(tsv, *columns):
            with open(tsv, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if i == 30:
                        raise error
                    yield line.split("\t")[1]

        return column

    cfg = TokenizerConfig(vocab_size=100)
    monkeypatch.setattr(tokenizer, "_column", sentences_then(stop))
    with pytest.raises(type(stop)):
        build_tokenizer(data_dir, cfg)
    assert not os.path.exists(model_paths(data_dir, cfg)[0])
    monkeypatch.setattr(tokenizer, "_column", sentences_then(ValueError("a bad line")))
    with pytest.raises(RuntimeError, match="a bad line"):  # an error is still the trainer's to report
        build_tokenizer(data_dir, cfg)


def test_byte_fallback_spells_unseen_characters_in_bytes(data_dir):
    """tokenizer.byte_fallback: a character the corpus never had is its UTF-8 bytes, not <unk>, and decodes back;
    the model is named apart, and without the setting the model and its cache key are those of before."""
    plain, fallback = (
        TokenizerConfig(vocab_size=VOCAB + 300),
        TokenizerConfig(vocab_size=VOCAB + 300, byte_fallback=True),
    )
    assert model_paths(data_dir, plain)[0].endswith(f"spm_unigram{VOCAB + 300}.model")
    assert model_paths(data_dir, fallback)[0].endswith(f"spm_unigram{VOCAB + 300}_bytes.model")
    text = ["Y dijo Dios: 光あれ"]
    tok = build_tokenizer(data_dir, plain)
    assert UNK in tok.encode_src(text)[0] and tok.decode_tgt(tok.encode_src(text)) != text
    tok = build_tokenizer(data_dir, fallback)
    ids = tok.encode_src(text)[0]
    assert UNK not in ids and "<0xE5>" in tok.src_pieces(ids) and tok.decode_tgt([ids]) == text
    with open(model_paths(data_dir, plain)[0] + ".json", encoding="utf-8") as f:
        key = json.load(f)["key"]  # that of a model from before the setting: its cache stays valid
    before = {k: v for k, v in dataclasses.asdict(plain).items() if k not in ("dir", "byte_fallback")}
    assert key == stable_hash({"train": file_hash(os.path.join(data_dir, "train.tsv")), "cfg": before})
    with pytest.raises(UserError, match=r"need at least \d+$") as small:
        build_tokenizer(data_dir, TokenizerConfig(vocab_size=100, byte_fallback=True))
    assert "and the 256 bytes (tokenizer.byte_fallback)" in str(small.value)


def test_a_byte_piece_that_spells_a_line_break_decodes_to_one_line(data_dir):
    """A model may write the byte pieces of a line break or a tab (tokenizer.byte_fallback has all 256): the text
    is still one line, its whitespace one space as the training text's, so a file keeps one translation a line."""
    tok = build_tokenizer(data_dir, TokenizerConfig(vocab_size=VOCAB + 300, byte_fallback=True))
    dios, luz = tok.encode_tgt(["Dios", "luz"])
    for spelled in ("\n", "\r", "\r\n", "\t", "\x0b", "\x1e", "\u2028"):
        breaks = [tok.tgt.piece_to_id(f"<0x{b:02X}>") for b in spelled.encode("utf-8")]
        assert UNK not in breaks and tok.tgt.decode([dios + breaks + luz]) != "Dios luz"  # what the fix mends
        assert tok.decode_tgt([dios + breaks + luz, breaks + dios + breaks]) == ["Dios luz", "Dios"], spelled
    assert tok.decode_tgt([dios + tok.encode_tgt(["  en  el "])[0] + luz]) == ["Dios en el luz"]


@pytest.mark.slow
def test_a_byte_fallback_run_trains_and_translates_what_its_corpus_never_had(tmp_path, corpus_tsv):
    from conftest import TINY, run_cli

    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    args = [a for a in TINY if not a.startswith("name=")] + ["name=bytes", "tokenizer.byte_fallback=true"]
    result = run_cli(tmp_path, "command=train", *args, "train.max_steps=10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "data" / "tiny" / "spm_unigram400_bytes.model").exists()
    out = run_cli(
        tmp_path, "command=translate", "name=bytes", "device=cpu", "translate.alignments=true", stdin="光 y luz\n"
    )
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1, out.stderr[-3000:]
    # sampled from a model 10 updates old: byte pieces (line breaks among them) come often; each is one line still
    lines = "".join(f"{line}\n" for line in ("Y dijo Dios", "Sea la luz", "y fue la tarde") * 40)
    sampled = run_cli(
        tmp_path,
        "command=translate",
        "name=bytes",
        "device=cpu",
        "decode.beam_size=1",
        "decode.sampling=true",
        "decode.sampling_temperature=2.0",
        stdin=lines,
    )
    assert sampled.returncode == 0 and sampled.stdout.count("\n") == 120, sampled.stderr[-3000:]
    assert len(sampled.stdout.splitlines()) == 120 and "\t" not in sampled.stdout


def test_on_ordinary_text_the_words_of_the_pieces_start_at_each_mark(data_dir):
    """Each piece's word, from the text it spells (app.data.tokenizer.span_words), is what SentencePiece's ▁ marks
    number on text whose whitespace is its own (every sentence of the corpus): of the text and of its sampled
    segmentations decoded, as hypotheses are; so ordinary corpora link the words they linked before."""
    from app.train.guided_alignment import piece_words, word_numbers

    tok = build_tokenizer(data_dir, TokenizerConfig(vocab_size=VOCAB))
    texts = [text for pair in read_tsv(os.path.join(data_dir, "train.tsv")) for text in (pair.src, pair.tgt)]
    marks = piece_words(tok.src_pieces(list(range(tok.src_vocab_size))))
    ids = tok.encode_src(texts)
    sampled = tok.src.encode(texts, enable_sampling=True, alpha=0.5, nbest_size=-1)
    by_marks = [word_numbers(np.array(i), *marks).tolist() for i in ids]
    assert tok.src_words(texts) == by_marks == tok.hyp_words(ids)
    assert tok.hyp_words(sampled) == [word_numbers(np.array(i), *marks).tolist() for i in sampled]
    assert [max(words) + 1 for words in by_marks] == [len(text.split()) for text in texts]


def test_characters_the_normalization_makes_a_space_stay_in_their_word(nfkc_tokenizer):
    """nmt_nfkc turns a ZWNJ (inside Persian words), LRM/RLM, ZWSP and "´" (a space and an accent) into a ▁ of its
    own: the pieces' words are still the text's, str.split()'s."""
    tok = nfkc_tokenizer
    for text in ("mi\u200cxahm ketab", "don\u00b4t go", "ra\u200e bexanam\u200f", "ke\u200btab ra"):
        words = tok.src_words([text])[0]
        assert max(words) + 1 == len(text.split()) and words == sorted(words), (
            text,
            tok.src_pieces(tok.encode_src([text])[0]),
        )
    assert tok.src_words(["mi\u200cxahm ketab"]) == [[0] * 7 + [1] * (len(tok.encode_src(["ketab"])[0]))]


def test_a_hypothesis_numbers_its_words_as_its_line_of_text(data_dir):
    """<unk> decodes as " ⁇ ", a word of its own, and a byte piece that spells a line break as a space
    (decode_tgt): the words hyp.align numbers are those of hyp.txt's line (glued to a neighbour, they were not)."""
    tok = build_tokenizer(data_dir, TokenizerConfig(vocab_size=VOCAB + 300, byte_fallback=True))
    dios, luz = tok.encode_tgt(["Dios", "luz"])
    line_break = tok.tgt.piece_to_id("<0x0A>")
    hypotheses = [dios + [UNK] + luz, dios + [line_break] + luz, [UNK] + dios + [UNK], dios + luz + [line_break]]
    words = tok.hyp_words(hypotheses)
    assert [max(w) + 1 for w in words] == [len(line.split()) for line in tok.decode_tgt(hypotheses)] == [3, 2, 3, 2]
    d, u = len(dios), len(luz)
    assert words[0] == [0] * d + [1] + [2] * u and words[1] == [0] * d + [-1] + [1] * u
    assert words[2] == [0] + [1] * d + [2] and words[3][-1] == -1


def test_a_tokenizer_trained_again_in_place_tokenizes_the_splits_with_its_new_model(data_dir):
    """A process that prepares twice (the Python API, a notebook): the corpus changed, so the tokenizer is trained
    again at the same path and the splits' cache is rebuilt, with the new model's ids (the loaded model was kept by
    its path, and every cached sentence had the old one's ids, which later runs then trusted)."""
    from app.data.corpus import load_tokenized, tokenized

    cfg = TokenizerConfig(vocab_size=VOCAB)
    tokenized(data_dir, "train", build_tokenizer(data_dir, cfg))
    train = os.path.join(data_dir, "train.tsv")
    with open(train, encoding="utf-8") as f:
        kept = f.readlines()[::2]
    with open(train, "w", encoding="utf-8") as f:
        f.writelines(kept)
    again = build_tokenizer(data_dir, cfg)
    assert model_paths(data_dir, cfg)[0] == again.src_path  # the same file, trained on other text
    cached = load_tokenized(data_dir, "train", again).src.to_pylist()
    assert cached == again.encode_src([pair.src for pair in read_tsv(train)]) and len(cached) == len(kept)
