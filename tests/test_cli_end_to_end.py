"""A tiny real run through the real CLI: prepare -> train -> eval -> translate -> resume.

The corpus is Genesis 1-6 from the installed SWORD modules (real text, a few hundred verses), fed
through the ``files`` source; the model is a 1+1-layer Transformer, so the whole module runs in
about a minute on 2 CPU cores.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import sacrebleu
import torch
from conftest import REPO, TINY, run_cli, trained_tiny_run

from app.cli import COMMANDS

pytestmark = pytest.mark.slow  # every test here runs the real CLI in a subprocess, or compiles


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    return trained_tiny_run(tmp_path_factory, corpus_tsv, "e2e")


def test_train_writes_run_folder(workdir):
    run = workdir / "checkpoints" / "tiny"
    for name in ("config.yaml", "last.pt", "best.pt", "train_summary.json", ".hydra/train/config.yaml"):
        assert (run / name).exists(), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tb"))
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 40 and summary["device"] == "cpu"
    # best.pt: the weights users evaluate; last.pt also holds what a resume needs (optimizer, trained weights)
    best, last = (torch.load(run / f"{name}.pt", weights_only=True) for name in ("best", "last"))
    assert "optimizer" not in best and "trained_model" not in best and {"optimizer", "trained_model"} <= set(last)
    assert (run / "best.pt").stat().st_size < 0.4 * (run / "last.pt").stat().st_size
    for split in ("train", "dev", "test"):
        assert (workdir / "data" / "tiny" / f"{split}.tsv").stat().st_size > 0


def validation_history(run) -> list[dict]:
    return [json.loads(line) for line in (run / "validations.jsonl").read_text().splitlines()]


def test_every_validation_is_a_line_of_the_runs_history(workdir):
    run = workdir / "checkpoints" / "tiny"
    history = validation_history(run)
    if history[-1]["step"] > 40:  # the resume test ran first here
        history = [e for e in history if e["step"] <= 40]
    assert [e["step"] for e in history] == [20, 40]
    events = tensorboard(run)
    for key in ("bleu", "chrf", "loss"):
        logged = {e.step: e.value for e in events.Scalars(f"dev/{key}")}
        assert [e[f"dev_{key}"] for e in history] == pytest.approx([logged[20], logged[40]], abs=1e-4)
    train_loss = {e.step: e.value for e in events.Scalars("train/loss")}  # log_every=10: the window ending there
    assert [e["train_loss"] for e in history] == pytest.approx([train_loss[20], train_loss[40]], abs=1e-4)
    assert history[0]["minutes"] < history[1]["minutes"] and 0 < history[0]["tgt_tokens"] < history[1]["tgt_tokens"]
    assert all(0 <= e["attention_entropy"] and -1 <= e["attention_monotonicity"] <= 1 for e in history)
    reattention = {e.step: e.value for e in events.Scalars("dev/attention_reattention")}
    assert [e["attention_reattention"] for e in history] == pytest.approx([reattention[20], reattention[40]], abs=1e-4)
    assert all(0 <= e["attention_reattention"] <= 1 for e in history)
    assert history[0]["best"] and history[1]["best"] == (history[1]["dev_bleu"] > history[0]["dev_bleu"])


def test_eval_writes_hypotheses_and_sacrebleu_scores(workdir):
    # without the self-attention's pass, beside which the host worker counts all of TER
    result = run_cli(workdir, "command=eval", "name=tiny", "device=cpu", "viz.self_attention=false")
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = [line.rstrip("\n").split("\t")[2] for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    assert len(hyps) == len(refs) == metrics["sentences"]
    assert metrics["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2))
    assert metrics["chrf"] == pytest.approx(round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))
    # TER counted in two parts, 60 % of the sentences in the host worker (no reference links here), is sacrebleu's
    assert metrics["ter"] == pytest.approx(round(sacrebleu.corpus_ter(hyps, [refs]).score, 2))
    assert metrics["ter_worker_share"] == round(round(0.6 * len(hyps)) / len(hyps), 3)
    assert metrics["bleu_signature"].startswith("nrefs:1|")
    step = torch.load(workdir / "checkpoints" / "tiny" / "best.pt", weights_only=True)["progress"]["step"]
    assert f"test (beam 5, length penalty 1.0; best.pt, step {step}): BLEU " in result.stdout
    # hyp.align: every hypothesis word linked to one source word, read from the plotted view (no reference links)
    assert metrics["hyp_align_view"] == "layer 0 mean" and "hyp.align (word links, layer 0 mean)" in result.stdout
    links = (out / "hyp.align").read_text(encoding="utf-8").split("\n")[:-1]
    sources = [line.split("\t")[1] for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    assert len(links) == len(hyps)
    for line, hyp, source in zip(links, hyps, sources):
        pairs = [tuple(int(x) for x in link.split("-")) for link in line.split()]
        assert [j for _, j in pairs] == list(range(len(hyp.split()))), (line, hyp)
        assert all(0 <= i < len(source.split()) for i, _ in pairs), (line, source)
    lines = result.stdout.splitlines()
    at = lines.index("  sacrebleu signatures (how each score was computed):")
    assert lines[at + 1 : at + 4] == [
        f"    BLEU {metrics['bleu_signature']}",
        f"    chrF {metrics['chrf_signature']}",
        f"    TER  {metrics['ter_signature']}",
    ]


def test_translate_reads_stdin_and_writes_one_line_per_input(workdir):
    lines, ban = "En el principio.\nY dijo Dios.\n", "decode.no_repeat_ngram_size=2"
    result = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", ban, stdin=lines)
    assert result.returncode == 0, result.stderr[-3000:]
    translations = result.stdout.split("\n")
    assert len(translations) == 3  # two translations and the final newline
    step = torch.load(workdir / "checkpoints" / "tiny" / "best.pt", weights_only=True)["progress"]["step"]
    used = rf"translating 2 lines with \S*checkpoints/tiny/best\.pt \(step {step}\): beam 5, length penalty 1\.0"
    assert re.search(used + ", no repeated 2-grams\n", result.stderr)
    free = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", stdin=lines)
    assert re.search(used + "\n", free.stderr) and free.stdout != result.stdout  # the tiny model repeats itself
    # translate.alignments: each translation, then its word links to the source (the best hypothesis only)
    linked = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", "translate.alignments=true", stdin=lines)
    assert linked.returncode == 0, linked.stderr[-3000:]
    for line, translation, source in zip(linked.stdout.splitlines(), free.stdout.splitlines(), lines.splitlines()):
        text, links = line.split(" ||| ")
        pairs = [tuple(int(x) for x in link.split("-")) for link in links.split()]
        assert text == translation and [j for _, j in pairs] == list(range(len(text.split())))
        assert all(0 <= i < len(source.split()) for i, _ in pairs)
    # with decode.n_best: every hypothesis' links, a fourth field; the best's are the 1-best line's
    nbest = run_cli(
        workdir,
        "command=translate",
        "name=tiny",
        "device=cpu",
        "translate.alignments=true",
        "decode.n_best=3",
        stdin=lines,
    )
    assert nbest.returncode == 0, nbest.stderr[-3000:]
    rows = [line.split(" ||| ") for line in nbest.stdout.splitlines()]
    assert [int(index) for index, *_ in rows] == [0, 0, 0, 1, 1, 1] and all(len(row) == 4 for row in rows)
    firsts = [rows[0], rows[3]]
    assert [f"{text} ||| {links}" for _, text, _, links in firsts] == linked.stdout.splitlines()
    for index, text, _, links in rows:
        pairs = [tuple(int(x) for x in link.split("-")) for link in links.split()]
        assert [j for _, j in pairs] == list(range(len(text.split())))
        assert all(0 <= i < len(lines.splitlines()[int(index)].split()) for i, _ in pairs)
    refused = run_cli(
        workdir,
        "command=translate",
        "name=tiny",
        "translate.alignments=true",
        "decode.n_best=2",
        "translate.engine=ct2",
        stdin=lines,
    )
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: translate.alignments=true with decode.n_best=2: a CTranslate2 export returns the best hypothesis' "
        "attention only; translate.engine=torch links every hypothesis"
    )


@pytest.mark.fresh_interpreter
def test_translate_samples_the_same_translations_for_the_same_seed(workdir):
    lines = "En el principio.\nY dijo Dios.\nY fue la tarde y la mañana.\n"
    sample = ("command=translate", "name=tiny", "device=cpu", "decode.beam_size=1", "decode.sampling=true")
    drawn = [run_cli(workdir, *sample, f"decode.sampling_seed={seed}", stdin=lines) for seed in (3, 3, 4)]
    assert all(result.returncode == 0 for result in drawn), drawn[0].stderr[-3000:]
    assert ": sampling the whole distribution, seed 3\n" in drawn[0].stderr
    assert len(drawn[0].stdout.splitlines()) == 3 and drawn[0].stdout == drawn[1].stdout != drawn[2].stdout
    greedy = run_cli(workdir, *sample[:4], stdin=lines)
    assert drawn[0].stdout != greedy.stdout  # the tiny model is unsure of every word
    top1 = run_cli(workdir, *sample, "decode.sampling_topk=1", "decode.sampling_temperature=0.5", stdin=lines)
    assert ": sampling top-k 1, temperature 0.5, seed 0\n" in top1.stderr and top1.stdout == greedy.stdout


def test_translate_and_eval_choose_by_minimum_bayes_risk(workdir):
    """decode.mbr_candidates: the n-best list ranks the distinct samples by expected chrF, its first the 1-best's
    translation; make eval says what it chose among and where its seconds went, and links the chosen translations'
    words; the CTranslate2 engine and make serve refuse it in one line."""
    lines = "En el principio.\nY dijo Dios.\nY fue la tarde y la mañana.\n"
    mbr = ("name=tiny", "device=cpu", "decode.beam_size=1", "decode.sampling=true", "decode.mbr_candidates=6")
    ranked = run_cli(workdir, "command=translate", *mbr, "decode.n_best=3", "translate.alignments=true", stdin=lines)
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    said = ": minimum Bayes risk (chrF) of 6 candidates, the samples: sampling the whole distribution, seed 0\n"
    assert said in ranked.stderr
    spent = r"; minimum Bayes risk: the candidates \d+\.\d s, chrF of [\d.]+ distinct a sentence [\d.]+ s, the chosen"
    assert re.search(spent + r" ones' attention [\d.]+ s\n", ranked.stderr)  # translate.alignments: a forced pass
    rows = [line.split(" ||| ") for line in ranked.stdout.splitlines()]
    firsts = {}
    for index, text, _, links in rows:
        firsts.setdefault(index, text)
        assert [j for _, j in (map(int, link.split("-")) for link in links.split())] == list(range(len(text.split())))
    for k in range(3):
        scores = [float(score) for index, _, score, _ in rows if index == str(k)]
        assert 1 <= len(scores) <= 3 and scores == sorted(scores, reverse=True) and all(0 < s <= 100 for s in scores)
    best = run_cli(workdir, "command=translate", *mbr, stdin=lines)  # the same seed draws the same candidates
    assert best.returncode == 0 and best.stdout.splitlines() == [firsts[str(k)] for k in range(3)]
    rows = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    (workdir / "mbr.es").write_text("".join(r[1] + "\n" for r in rows[:5]), encoding="utf-8")
    (workdir / "mbr.en").write_text("".join(r[2] + "\n" for r in rows[:5]), encoding="utf-8")
    files = ("eval.source=mbr.es", "eval.target=mbr.en", "viz.self_attention=false")
    beam = ("name=tiny", "device=cpu", "decode.beam_size=4", "decode.mbr_candidates=4", "decode.mbr_utility=bleu")
    evaluated = run_cli(workdir, "command=eval", *beam, *files)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert re.search(r"decoded 5 mbr.es sentences in [\d.]+ s \(the candidates [\d.]+ s, BLEU of", evaluated.stdout)
    out = workdir / "checkpoints" / "tiny" / "eval" / "mbr.es"
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["decoding"]
        == "minimum Bayes risk (BLEU) of 4 candidates, the best of the beam: beam 4, length penalty 1.0"
    )
    assert metrics["mbr"]["candidates"] == 4 and metrics["mbr"]["sentences"] == 5
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").splitlines()
    links = (out / "hyp.align").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(links) == 5
    for line, hyp in zip(links, hyps):  # the chosen translation's own attention: a link for each of its words
        assert [j for _, j in (map(int, link.split("-")) for link in line.split())] == list(range(len(hyp.split())))
    for command, settings, message in [
        ("translate", (*mbr, "translate.engine=ct2"), "minimum Bayes risk decoding runs on the torch engine; set"),
        ("eval", (*mbr, "eval.engine=ct2"), "minimum Bayes risk decoding runs on the torch engine; set eval.engine="),
        (
            "serve",
            (*mbr[:2], "decode.beam_size=6", "decode.mbr_candidates=6"),
            "make serve decodes each request as it asks (beam size,",
        ),
    ]:
        refused = run_cli(workdir, f"command={command}", *settings, stdin=lines)
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: decode.mbr_candidates=6: {message}")
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    epsilon = run_cli(workdir, "command=translate", *mbr[:4], "decode.sampling_epsilon=0.1", "translate.engine=ct2")
    assert epsilon.returncode == 2 and epsilon.stderr == (
        "error: decode.sampling_epsilon=0.1: CTranslate2 has no epsilon sampling; set translate.engine=torch\n"
    )


def test_translate_begins_each_translation_with_its_prefix(workdir, tmp_path):
    """translate.prefix: a line per input line, each translation begins with its line (an empty one leaves it free),
    in the n-best list too; a prefix file of another length is refused in one line."""
    lines = "En el principio.\nY dijo Dios.\nY fue la tarde y la mañana.\n"
    (tmp_path / "prefix.txt").write_text("In the end\n\nAnd there was\n", encoding="utf-8")
    base = ("command=translate", "name=tiny", "device=cpu", "decode.beam_size=3")
    free = run_cli(workdir, *base, stdin=lines)
    forced = run_cli(workdir, *base, f"translate.prefix={tmp_path / 'prefix.txt'}", stdin=lines)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "length penalty 1.0, 2 with a translate.prefix line\n" in forced.stderr
    first, second, third = forced.stdout.splitlines()
    assert first.startswith("In the end") and third.startswith("And there was")
    assert second == free.stdout.splitlines()[1]
    nbest = run_cli(workdir, *base, "decode.n_best=3", f"translate.prefix={tmp_path / 'prefix.txt'}", stdin=lines)
    rows = [line.split(" ||| ") for line in nbest.stdout.splitlines()]
    assert len(rows) == 9 and all(text.startswith("In the end") for i, text, _ in rows if i == "0")
    (tmp_path / "short.txt").write_text("In the end\n", encoding="utf-8")
    refused = run_cli(workdir, *base, f"translate.prefix={tmp_path / 'short.txt'}", stdin=lines)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: translate.prefix='{tmp_path / 'short.txt'}' has 1 line and standard input 3: one prefix per line "
        "to translate (an empty line: none)"
    )


def test_score_reads_how_probable_each_translation_is(workdir, tmp_path):
    """Files: one tab-separated line per pair, log p(Y|X) the sum of its pieces' log p; the dev split: its mean log p
    per piece is minus the dev loss of the validation best.pt comes from."""
    (tmp_path / "a.es").write_text("En el principio.\nY dijo Dios.\n\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("In the beginning.\nGod said.\nAnd\n", encoding="utf-8")
    files = (f"score.source={tmp_path / 'a.es'}", f"score.target={tmp_path / 'a.en'}")
    result = run_cli(workdir, "command=score", "name=tiny", "device=cpu", *files, "score.pieces=true")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == 3 and all(len(row) == 4 for row in rows)
    for total, count, mean, pieces in rows:
        logp = [float(piece.rsplit(":", 1)[1]) for piece in pieces.split(" ")]
        assert pieces.endswith(f" </s>:{logp[-1]:.4f}") and len(logp) == int(count) >= 2
        assert float(total) == pytest.approx(sum(logp), abs=1e-3) and float(mean) == pytest.approx(
            sum(logp) / len(logp), abs=1e-3
        )
        assert all(p < 0 for p in logp)
    step = torch.load(workdir / "checkpoints" / "tiny" / "best.pt", weights_only=True)["progress"]["step"]
    assert re.search(
        rf"scoring 3 pairs of \S*a\.es → \S*a\.en with \S*checkpoints/tiny/best\.pt \(step {step}\)", result.stderr
    )
    said = re.search(
        r"scored 3 pairs, (\d+) target pieces with </s>: log p per piece (-[\d.]+), perplexity ([\d.]+); ",
        result.stderr,
    )
    assert said and int(said[1]) == sum(int(row[1]) for row in rows)
    assert "(loading " in result.stderr and "scoring " in result.stderr
    dev = run_cli(workdir, "command=score", "name=tiny", "device=cpu", "score.split=dev")
    assert dev.returncode == 0, dev.stderr[-3000:]
    mean = float(re.search(r"log p per piece (-[\d.]+)", dev.stderr)[1])
    best = [e for e in validation_history(workdir / "checkpoints" / "tiny") if e["best"] and e["step"] <= step][-1]
    assert best["step"] == step and -mean == pytest.approx(best["dev_loss"], abs=2e-4)
    lines = len((workdir / "data" / "tiny" / "dev.tsv").read_text(encoding="utf-8").splitlines())
    assert (
        len(dev.stdout.splitlines()) == lines and f"scoring {lines} pairs of the dev split's references" in dev.stderr
    )
    for args, message in [
        (files[:1], "score.source and score.target go together: give both files, or neither to score a split"),
        (("score.engine=ct2",), "score.engine=ct2 scores files: give score.source and score.target"),
        ((files[0], f"score.target={tmp_path / 'a.es'}x"), "a.esx': file not found"),
    ]:
        refused = run_cli(workdir, "command=score", "name=tiny", *args)
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, args
    (tmp_path / "long.en").write_text("In the beginning.\n" + "and the light " * 1000 + "\nGod.\n", encoding="utf-8")
    refused = run_cli(workdir, "command=score", "name=tiny", files[0], f"score.target={tmp_path / 'long.en'}")
    assert refused.returncode == 2 and re.fullmatch(
        rf"error: score\.target='{re.escape(str(tmp_path / 'long.en'))}': line 2 has \d+ subword tokens; this model "
        r"takes at most \d+ \(model\.max_len=\d+\): split it",
        refused.stderr.strip(),
    )
    (tmp_path / "long.es").write_text("Hola.\n" * 2 + "y la luz " * 1000 + "\n", encoding="utf-8")
    refused = run_cli(workdir, "command=score", "name=tiny", f"score.source={tmp_path / 'long.es'}", files[1])
    assert refused.returncode == 2 and "long.es': line 3 has " in refused.stderr and "Traceback" not in refused.stderr
    (tmp_path / "b.en").write_text("In the beginning.\n", encoding="utf-8")
    refused = run_cli(workdir, "command=score", "name=tiny", files[0], f"score.target={tmp_path / 'b.en'}")
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "has 3 lines but score.target=" + repr(str(tmp_path / "b.en")) + " has 1: give one target line per source line"
    )


def test_score_alignments_of_a_models_own_translations_are_the_links_it_translated_with(workdir, tmp_path):
    """score.alignments: the word links read from the attention that read a given translation. Given the model's own
    greedy translations, teacher forcing replays the decoding: the links are make translate's."""
    sources = [line.split("\t")[1] for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    (tmp_path / "src.es").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    greedy = ("decode.beam_size=1", "translate.alignments=true", f"translate.input={tmp_path / 'src.es'}")
    translated = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", *greedy)
    assert translated.returncode == 0, translated.stderr[-3000:]
    texts, links = zip(*(line.split(" ||| ") for line in translated.stdout.splitlines()))
    (tmp_path / "hyp.en").write_text("".join(text + "\n" for text in texts), encoding="utf-8")
    files = (f"score.source={tmp_path / 'src.es'}", f"score.target={tmp_path / 'hyp.en'}", "score.alignments=true")
    scored = run_cli(workdir, "command=score", "name=tiny", "device=cpu", *files)
    assert scored.returncode == 0, scored.stderr[-3000:]
    rows = [line.split("\t") for line in scored.stdout.splitlines()]
    assert len(rows) == len(sources) >= 10 and all(len(row) == 4 for row in rows)
    # a translation re-encoded may split into other pieces than the decoder wrote (then its links may differ)
    assert sum(row[3] == link for row, link in zip(rows, links)) >= 0.9 * len(rows)
    refused = run_cli(workdir, "command=score", "name=tiny", *files, "score.engine=ct2")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: score.alignments=true reads the checkpoint's attention: not with score.engine=ct2"
    )


def test_bleu_counts_the_words_of_eval_bleu_tokenize(workdir):
    """make eval's BLEU (corpus, buckets, each sentence's in the explorer) counts the words of the tokenizer asked
    for, said in metrics.json and in the signature it prints."""
    args = ("name=tiny", "device=cpu", "viz.self_attention=false", "eval.max_sentences=6", "eval.bleu_tokenize=char")
    result = run_cli(workdir, "command=eval", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = [line.split("\t")[2].rstrip("\n") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    assert metrics["bleu_tokenize"] == "char" and "|tok:char|" in metrics["bleu_signature"]
    assert metrics["bleu"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [refs[:6]], tokenize="char").score, 2))
    assert metrics["bleu"] != pytest.approx(round(sacrebleu.corpus_bleu(hyps, [refs[:6]]).score, 2))
    assert "|tok:char|" in result.stdout


def test_eval_of_a_test_set_of_ones_own_files(workdir):
    """eval.source/eval.target: two plain files evaluated as a split is (scores, hyp.txt, the explorer), into
    eval/<source's file name>/; the split's first pairs written as files translate and score as the split's do."""
    rows = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    (workdir / "mine.es").write_text("".join(r[1] + "\n" for r in rows[:6]), encoding="utf-8")
    (workdir / "mine.en").write_text("".join(r[2] + "\n" for r in rows[:6]), encoding="utf-8")
    common = ("name=tiny", "device=cpu", "viz.self_attention=false")
    split = run_cli(workdir, "command=eval", *common, "eval.max_sentences=6")
    assert split.returncode == 0, split.stderr[-3000:]
    run = workdir / "checkpoints" / "tiny" / "eval"
    of_split = json.loads((run / "test" / "metrics.json").read_text())
    result = run_cli(workdir, "command=eval", *common, "eval.source=mine.es", "eval.target=mine.en")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decoded 6 mine.es sentences in" in result.stdout
    metrics = json.loads((run / "mine.es" / "metrics.json").read_text())
    hyps = (run / "mine.es" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    assert (metrics["split"], metrics["sentences"], metrics["subset"]) == ("mine.es", 6, None)
    assert hyps == (run / "test" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    assert (
        metrics["bleu"]
        == of_split["bleu"]
        == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [[r[2] for r in rows[:6]]]).score, 2))
    )
    assert (run / "mine.es" / "alignments.html").exists() and "mine.es" in (
        run / "mine.es" / "alignments.html"
    ).read_text()
    (workdir / "short.en").write_text("".join(r[2] + "\n" for r in rows[:5]), encoding="utf-8")
    (workdir / "test").write_text("Hola\n", encoding="utf-8")
    for args, message in [
        (("eval.source=mine.es", "eval.target=short.en"), "eval.source='mine.es' has 6 lines but eval.target="),
        (("eval.source=mine.es",), "eval.source and eval.target go together: give both files, or neither"),
        (("eval.source=test", "eval.target=test"), "eval.source='test': its files would go to eval/test/, where"),
        (("eval.source=nothing.es", "eval.target=mine.en"), "eval.source='nothing.es': file not found"),
    ]:
        refused = run_cli(workdir, "command=eval", *common, *args)
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {message}"), refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1


def test_a_bleu_tokenizer_that_is_not_installed_stops_training_before_its_data(workdir):
    if importlib.util.find_spec("MeCab") is not None:
        pytest.skip("sacrebleu's Japanese extras are installed")
    prepared = sorted(p.name for p in (workdir / "data").iterdir())
    result = run_cli(workdir, "command=train", *TINY, "name=ja", "data.name=tiny_ja", "data.tgt_lang=ja")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: eval.bleu_tokenize=ja-mecab (sacrebleu's choice for the target language ja) needs sacrebleu's ja "
        "extras: .venv/bin/pip install 'sacrebleu[ja]', or set eval.bleu_tokenize=char"
    )
    assert sorted(p.name for p in (workdir / "data").iterdir()) == prepared  # no corpus made for it


def test_an_ensemble_of_checkpoints_evaluates_and_translates_as_one_model(workdir):
    run = workdir / "checkpoints" / "tiny"
    steps = [torch.load(run / f"{n}.pt", weights_only=True)["progress"]["step"] for n in ("best", "step_0000020")]
    both = ("name=tiny", "device=cpu", "ensemble=[step_0000020]")
    result = run_cli(workdir, "command=eval", *both, "viz.self_attention=false", "eval.max_sentences=6")
    assert result.returncode == 0, result.stderr[-3000:]
    members = [f"best.pt (step {steps[0]})", f"step_0000020.pt (step {steps[1]})"]
    assert f"(beam 5, length penalty 1.0; ensemble of {members[0]} + {members[1]}): BLEU" in result.stdout
    metrics = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    assert metrics["ensemble"] == members
    lines = "En el principio.\nY dijo Dios.\n"
    alone, together = (run_cli(workdir, "command=translate", *args, stdin=lines) for args in (both[:2], both))
    assert together.returncode == 0 and len(together.stdout.splitlines()) == 2, together.stderr[-3000:]
    assert together.stdout != alone.stdout  # the tiny model at step 20 and at its best translate apart
    assert f"translating 2 lines with ensemble of {members[0]} + {members[1]}: beam 5" in together.stderr
    # the run named by its name is a checkpoint of the same run folder: named as the first, not by another path
    twice = run_cli(workdir, "command=translate", *both[:2], "ensemble=[tiny]", stdin=lines)
    assert f"translating 2 lines with ensemble of {members[0]} + {members[0]}: beam 5" in twice.stderr, twice.stderr
    state = torch.load(run / "best.pt", weights_only=True)
    state["vocab"] = {**state["vocab"], "src": "0" * 64}  # as if trained with another tokenizer
    torch.save(state, workdir / "other_vocab.pt")
    for args, message in [
        (("ensemble=[other_vocab.pt]",), "other_vocab.pt was trained with another vocabulary than "),
        (
            ("translate.engine=ct2",),
            "translate.engine=ct2: an export is one model; an ensemble= decodes with the torch",
        ),
        (("ensemble=[step_0000099]",), "ensemble: step_0000099: "),
        (("ensemble=[nosuchrun]",), "checkpoints/nosuchrun/best.pt does not exist (give a checkpoint of this run"),
    ]:
        refused = run_cli(workdir, "command=translate", *both, *args, stdin=lines)
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, args


@pytest.mark.fresh_interpreter
def test_resume_continues_from_last_checkpoint(workdir):
    result = run_cli(workdir, "command=train", *TINY, "train.max_steps=60", "train.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr and "at step 40" in result.stdout + result.stderr
    assert "up to date" in result.stdout + result.stderr  # data and tokenizer were not redone
    summary = json.loads((workdir / "checkpoints" / "tiny" / "train_summary.json").read_text())
    assert summary["steps"] == 60
    # the history went on from the checkpoint's: the validations before the resume, then the new one
    assert [e["step"] for e in validation_history(workdir / "checkpoints" / "tiny")] == [20, 40, 60]


def test_config_typo_fails_at_start_up_with_a_clear_message(workdir):
    result = run_cli(workdir, "command=train", *TINY, "train.max_stepz=3")
    assert result.returncode != 0
    assert "max_stepz" in result.stderr and "Traceback" not in result.stderr


def test_missing_run_is_a_one_line_error(workdir):
    result = run_cli(workdir, "command=eval", "name=never_trained", "device=cpu")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:") and "best.pt" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["command=eval", "eval.checkpoint=newest"], "error: eval.checkpoint='newest': choose best, last, averaged"),
        (["command=score", "score.checkpoint=step_0000099"], "checkpoint not found; intact checkpoints of "),
        (["command=average", "name=never_trained"], "checkpoint not found (train first, or check name=)"),
    ],
)
def test_a_checkpoint_that_is_not_there_is_named_with_its_setting_and_those_that_are(workdir, args, message):
    result = run_cli(workdir, *[a for a in TINY if not a.startswith("name=")], "name=tiny", *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    if "score.checkpoint=step_0000099" in args:  # the snapshots there are, and the setting that picks one
        assert "step_0000020 (step 20)" in result.stderr and result.stderr.strip().endswith("with score.checkpoint=")


@pytest.mark.parametrize(
    "args, message",
    [
        (["command=fly"], "error: command='fly' is unknown: python -m app command={prepare,train,eval,"),
        ([], "error: command is not set: python -m app command={prepare,train,eval,"),
        (["train", "name=x"], "error: the command is a setting: python -m app command=train name=x"),
        (["command=prepare", "data.train=a.es,a.en"], "error: data.train=a.es,a.en is a sweep, which runs with "),
    ],
)
def test_a_missing_or_unknown_command_prints_the_usage_line(workdir, args, message):
    result = run_cli(workdir, *args)
    assert result.returncode == 2 and result.stderr.startswith(message) and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["command=eval", "--help"]])
def test_help_lists_every_command_the_presets_and_the_settings(tmp_path, args):
    result = run_cli(tmp_path, *args)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for name, run in COMMANDS.items():  # each command with what it does
        assert re.search(rf"^  {name} +{re.escape(run.__doc__.strip())}$", result.stdout, re.M), name
    assert "model: rnn_bahdanau, rnn_luong, rnn_plain, transformer, transformer_small" in result.stdout
    assert "  batch_tokens: 32000" in result.stdout  # the settings, as the defaults
    assert os.listdir(tmp_path) == []  # asking for help makes no run folder and no log


PREPARE = ["command=prepare", "data=files", "data.name=p", "data.train=corpus.tsv", "tokenizer.vocab_size=400"]


def run_watched(cwd, corpus_tsv, watch: str, args: list[str]) -> subprocess.CompletedProcess:
    """A fresh ``python -m app ARGS`` in ``cwd`` (with the tiny corpus), ``watch`` run first in it: Python code
    with atexit, gc and sys imported, that registers what the interpreter is to report."""
    probe = f"import atexit, gc, runpy, sys; {watch}; sys.argv = ['app', *sys.argv[1:]]; "
    probe += "runpy.run_module('app', run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"}
    shutil.copy(corpus_tsv, cwd / "corpus.tsv")
    return subprocess.run(
        [sys.executable, "-c", probe, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args, code", [(["command=fly"], 2), (["command=train", "train.max_stepz=3"], 2), (PREPARE, 0)]
)
def test_a_command_ends_without_collecting_what_its_imports_made(tmp_path, corpus_tsv, args, code):
    """``python -m app`` freezes the collector's objects as the command ends, however it ends: the shutdown
    of the interpreter then skips collecting what torch and its companions made at import (about half a
    second after every command's last line on a CPU), and the exit handlers still run. A refused command
    line is told before torch is imported (0.4 s, where it took 2)."""
    watch = "atexit.register(lambda: print('frozen', gc.get_freeze_count(), 'torch' in sys.modules))"
    result = run_watched(tmp_path, corpus_tsv, watch, args)
    assert result.returncode == code, result.stderr[-2000:]
    frozen, torch_imported = re.fullmatch(r"frozen (\d+) (True|False)", result.stdout.strip().splitlines()[-1]).groups()
    assert int(frozen) > 10000
    if code:
        assert torch_imported == "False" and len(result.stderr.splitlines()) == 1, result.stderr


def test_a_training_command_never_collects_what_torch_made_at_import(tmp_path, corpus_tsv):
    """The collector is paused while ``python -m app`` starts and resumed, with torch imported and everything
    frozen, as the command starts: a training runs no full collection over torch's ~170,000 objects. Without the
    pause its imports alone ran five to seven, 1.4 s of a tiny training's start."""
    watch = (
        "frozen = []; gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2 "
        "and frozen.append(gc.get_freeze_count())); "
        "atexit.register(lambda: print('frozen at each full collection', *frozen))"
    )
    args = ["command=train", *TINY, "train.max_steps=2", "train.evaluate=false"]
    result = run_watched(tmp_path, corpus_tsv, watch, args)
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    frozen = [int(count) for count in line.removeprefix("frozen at each full collection").split()]
    assert frozen and min(frozen) > 100_000, line  # the training's own collections still run, after the freeze


@pytest.mark.parametrize(
    "preset, settings",
    [("rnn_plain", ()), ("rnn_bahdanau", ()), ("rnn_luong", ()), ("rnn_luong", ("model.local_window=3",))],
    ids=["rnn_plain", "rnn_bahdanau", "rnn_luong", "rnn_luong_local"],
)
def test_rnn_presets_train_and_evaluate_through_the_cli(workdir, preset, settings):
    name = f"tiny_{preset}{'_local' * bool(settings)}"
    overrides = [a for a in TINY if not a.startswith(("model", "name="))] + [
        f"model={preset}",
        "model.emb_dim=16",
        "model.hidden=32",
        *settings,
        f"name={name}",
        "train.max_steps=10",
        "train.eval_every=10",
    ]
    result = run_cli(workdir, "command=train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "command=eval", f"name={name}", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "checkpoints" / name / "eval" / "test" / "metrics.json").read_text())
    assert metrics["sentences"] > 0 and "bleu" in metrics
    assert "self-attention" not in metrics["seconds"]  # an RNN has none: viz.self_attention has nothing to read
    links = workdir / "checkpoints" / name / "eval" / "test" / "hyp.align"
    assert links.exists() == (preset != "rnn_plain")  # word links where there is attention to read them from
    if preset == "rnn_plain":
        refused = run_cli(workdir, "command=translate", f"name={name}", "translate.alignments=true", stdin="Y dijo\n")
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "error: translate.alignments=true: this model has no attention to read word links from"
        )
        refused = run_cli(workdir, "command=translate", f"name={name}", "decode.coverage_penalty=0.2", stdin="Y dijo\n")
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "error: decode.coverage_penalty=0.2 reads the attention: this model (model.attention=none) has none; set "
            "it to 0"
        )
    refused = run_cli(workdir, "command=heads", f"name={name}", "device=cpu")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: make heads measures a Transformer's attention heads: {name} is an RNN (model.arch=rnn), whose one "
        "attention has none"
    )


def test_copy_attention_trains_evaluates_translates_and_is_not_exported_through_the_cli(workdir, monkeypatch):
    """model.copy_attention=true through the real commands: train, eval (scores, word links, the explorer), a
    beam-search translation with its word links, make serve's engine (each hypothesis row's copied share, as the
    model reads it here), then make export's one-line refusal."""
    name = "tiny_copy"
    overrides = [a for a in TINY if not a.startswith("name=")]
    overrides += ["model.copy_attention=true", f"name={name}", "train.max_steps=10", "train.eval_every=10"]
    result = run_cli(workdir, "command=train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "command=eval", f"name={name}", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = workdir / "checkpoints" / name / "eval" / "test"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["sentences"] > 0 and metrics["copy"]["pieces"] > 0 and 0 <= metrics["copy"]["mean_share"] <= 1
    assert "copy shares" in metrics["seconds"] and "what each hypothesis copied" in result.stdout
    assert (folder / "hyp.align").exists() and '"copied": [' in (folder / "alignments.html").read_text()
    result = run_cli(
        workdir, "command=translate", f"name={name}", "device=cpu", "translate.alignments=true", stdin="Y dijo\n"
    )
    assert result.returncode == 0 and result.stdout.count(" ||| ") == 1, result.stderr[-3000:]
    refused = run_cli(workdir, "command=export", f"name={name}")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: model.copy_attention=true: CTranslate2's decoder cannot copy source pieces (no pointer-generator)"
    )
    from app.config.commands import DecodeConfig
    from app.data.tokenizer import BOS, EOS
    from app.decode.trained import load_trained
    from app.serve.engine import Engine

    monkeypatch.chdir(workdir)  # the run's paths are the project's, relative
    trained = load_trained(str(workdir / "checkpoints" / name), "best", torch.device("cpu"), "serve.checkpoint")
    engine = Engine(trained, trained.tokenizer, DecodeConfig(), {})
    src = trained.tokenizer.encode_src(["Y dijo Dios", "En el principio"])
    translated = engine.translate(src, beam_size=2, n_best=2, attention=True)
    scored = engine.score(src, [trained.tokenizer.encode_tgt(["And God said"])[0]] * 2, attention=True)
    for ids, result in zip(src + src, translated + scored):
        for hypothesis, entry in zip(result["hypotheses"], result["attention"]["hypotheses"]):
            tokens = [trained.tokenizer.tgt.piece_to_id(p) for p in hypothesis["target_pieces"]]
            model = trained.model
            expected = model.copy_shares(
                model.encode(torch.tensor([ids + [EOS]])),
                torch.tensor([[BOS] + tokens]),
                torch.tensor([tokens + [EOS]]),
            )
            assert len(entry["copied"]) == len(entry["rows"]) == len(tokens) + 1
            assert max(abs(a - b) for a, b in zip(entry["copied"], expected[0].tolist())) <= 1e-3


def test_heads_masks_each_head_of_the_transformer_and_writes_what_it_found(workdir):
    result = run_cli(
        workdir, "command=heads", "name=tiny", "device=cpu", "heads.max_sentences=8", "heads.prune_steps=2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "tiny" / "heads" / "dev"
    report = json.loads((out / "importance.json").read_text())
    step = torch.load(workdir / "checkpoints" / "tiny" / "best.pt", weights_only=True)["progress"]["step"]
    assert report["split"] == "dev" and report["sentences"] == 8 and report["step"] == step
    heads = report["heads"]  # 3 attentions (encoder, decoder, cross) of 1 layer, 2 heads each
    assert sorted((h["kind"], h["layer"], h["head"]) for h in heads) == [
        (kind, 0, head) for kind in ("cross", "decoder", "encoder") for head in (0, 1)
    ]
    assert [h["rank"] for h in heads] == list(range(1, 7))
    increases = [h["loss_increase"] for h in heads]
    assert increases == sorted(increases, reverse=True)
    assert [p["heads_masked"] for p in report["pruning"]] == [0, 2, 3]  # all but one head of each attention
    assert report["pruning"][0]["loss"] == report["loss"]
    assert all(0 <= p["bleu"] <= 100 for p in report["pruning"])  # the 8 sources decoded at each point (heads.bleu)
    assert (
        "the pruning curve's BLEU decodes the 8 sources" in result.stdout
        and "(share of all heads: loss / BLEU)" in (result.stdout)
    )
    assert (out / "importance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss increase with one head masked:" in result.stdout and "cross-attention" in result.stdout
    assert f"wrote {out}/importance.json and importance.png in " in result.stdout
    events = tensorboard(workdir / "checkpoints" / "tiny")  # in the run's TensorBoard, at the checkpoint's step
    (image,) = [e for e in events.Images("heads/dev/importance") if e.step == step][-1:]
    assert image.width == 350 and image.height > image.width  # the IMAGES tab's width, the panels one under another
    (loss,) = [e for e in events.Scalars("heads/dev/loss") if e.step == step][-1:]
    assert loss.value == pytest.approx(report["loss"], abs=1e-5)
    assert [e.value for e in events.Scalars("heads/dev/gradient_agreement")][-1] == pytest.approx(
        report["gradient_agreement"], abs=1e-6
    )


def sweep_and_compare(workdir, sweep, *overrides) -> str:
    """What ``make compare`` runs: ``--multirun command=train`` with the compare experiment into ``sweep``,
    then ``compare``; returns compare.md."""
    result = run_cli(
        workdir,
        "--multirun",
        "command=train",
        "experiment=compare",
        f"hydra.sweep.dir={sweep}",
        "train.evaluate=true",
        "train.auto_resume=true",
        *overrides,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(workdir, "command=compare", f"compare.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    return (sweep / "compare.md").read_text()


TINY_PRESETS = {  # a user's own model presets, found through hydra.searchpath
    "tiny_rnn": "defaults:\n  - /schema/model/rnn@_here_\nemb_dim: 16\nhidden: 32\n",
    "tiny_transformer": "defaults:\n  - /schema/model/transformer@_here_\n"
    "d_model: 32\nheads: 2\nenc_layers: 1\ndec_layers: 1\nff_dim: 64\n",
}


def test_compare_trains_evaluates_and_reports_a_sweep_over_families(workdir):
    sweep, presets = workdir / "checkpoints" / "compare" / "test", workdir / "presets" / "model"
    presets.mkdir(parents=True, exist_ok=True)
    for name, text in TINY_PRESETS.items():
        (presets / f"{name}.yaml").write_text(text)
    overrides = [a for a in TINY if not a.startswith(("model", "name="))] + [
        f"hydra.searchpath=[file://{presets.parent}]",
        "train.max_steps=6",
        "train.eval_every=6",
        "decode.beam_size=2",
    ]
    table = sweep_and_compare(workdir, sweep, "model=tiny_rnn,tiny_transformer", *overrides)
    rows = [line for line in table.split("\n## ")[0].splitlines() if line.startswith("| model=")]
    assert [row.split(" | ")[0] for row in rows] == ["| model=tiny_rnn", "| model=tiny_transformer"]
    assert rows[0].split(" | ")[-2] == "-" and float(rows[1].split(" | ")[-2]) > 0  # KV cache: Transformers only
    assert "beam 2" in table
    from PIL import Image

    with Image.open(sweep / "bleu_by_length.png") as image:
        assert image.size[0] > 400 and image.size[1] > 300
    assert "## Learning curves" in (sweep / "compare.md").read_text() and (sweep / "learning_curves.png").exists()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(sweep / "tb"))


def test_transformer_variant_trains_and_evaluates_through_the_cli(workdir):
    overrides = [a for a in TINY if not a.startswith("name=")] + [
        "name=tiny_rope",
        "model.pos=rope",
        "model.norm_type=rmsnorm",
        "model.kv_heads=1",
        "model.window=4",
        "train.max_steps=30",
        "train.eval_every=30",
        "train.evaluate=true",
        "decode.beam_size=2",
    ]
    result = run_cli(workdir, "command=train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "tiny_rope" / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    n = -(-metrics["sentences"] // 10)  # ⌈10 %⌉
    assert metrics["longest_10pct_sentences"] == n
    rows = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    longest = sorted(range(len(rows)), key=lambda i: -len(rows[i][1].split()))[:n]  # stable: earlier ties first
    expected = sacrebleu.corpus_bleu([hyps[i] for i in longest], [[rows[i][2] for i in longest]]).score
    assert metrics["bleu_longest_10pct"] == pytest.approx(round(expected, 2))
    assert metrics["kv_cache_mib"] > 0


def test_compare_assembles_runs_trained_by_separate_calls(workdir):
    """A sweep over model.pos trained one value per call into one folder (as on a lent GPU, a call per
    model): one row per value in the order trained, labelled by it, with each run's own longest-sentence
    BLEU and KV cache; the same call again keeps the finished run as it is."""
    sweep = workdir / "checkpoints" / "compare" / "positions"
    overrides = [a for a in TINY if not a.startswith("name=")] + [
        "model.heads=4",
        "model.kv_heads=2",
        "train.max_steps=10",
        "train.eval_every=10",
        "decode.beam_size=1",
    ]
    sweep_and_compare(workdir, sweep, "model.pos=learned", *overrides)
    report = sweep_and_compare(workdir, sweep, "model.pos=alibi", *overrides)
    lines = report.split("\n## ")[0].splitlines()  # the main table; the length table follows
    header = next(line for line in lines if line.startswith("| run |")).split(" | ")
    rows = [line.split(" | ") for line in lines if line.startswith("| model.pos=")]
    assert [row[0] for row in rows] == ["| model.pos=learned", "| model.pos=alibi"]
    folders = [p for p in sweep.iterdir() if (p / "train_summary.json").exists()]
    assert len(folders) == 2 and not any(p.name[0].isdigit() for p in folders)  # named by settings, not numbers

    def run_of(setting):
        return next(p for p in folders if setting in (p / ".hydra/train/overrides.yaml").read_text())

    for row in rows:  # each cell is its run's own figure
        metrics = json.loads((run_of(row[0][2:]) / "eval" / "test" / "metrics.json").read_text())
        assert row[header.index("BLEU longest 10 %")] == f"{metrics['bleu_longest_10pct']:.2f}"
        assert row[header.index("KV cache MiB")] == f"{metrics['kv_cache_mib']:.3f}" and metrics["kv_cache_mib"] > 0
        assert row[header.index("attention entropy")] == f"{metrics['attention']['entropy']:.3f}"
    learned = run_of("model.pos=learned")
    before = {f: (learned / f).stat().st_mtime_ns for f in ("last.pt", "eval/test/metrics.json")}
    again = sweep_and_compare(workdir, sweep, "model.pos=learned", *overrides)
    # the main table, the length table and the significance table, two runs each
    assert again.count("| model.pos=") == 6 and "## Significance against model.pos=learned" in again
    assert {f: (learned / f).stat().st_mtime_ns for f in before} == before


def tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    return events


def text_at(events, tag: str, step: int) -> str:
    from tensorboard.util import tensor_util

    # where add_text puts it; the newest of the events at that step (each eval of a checkpoint writes one)
    event = [e for e in events.Tensors(f"{tag}/text_summary") if e.step == step][-1]
    return tensor_util.make_ndarray(event.tensor_proto).item().decode("utf-8")


def hparams_record(events) -> dict:
    """The HPARAMS tab's record of a run: its settings by name."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    data = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    return {
        name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for name, value in data.session_start_info.hparams.items()
    }


def test_training_logs_alignment_images_and_scalars_to_tensorboard(workdir, monkeypatch):
    events = tensorboard(workdir / "checkpoints" / "tiny")
    images = set(events.Tags()["images"])
    for i in range(2):  # a 1-layer model: its layer's heads in one figure; its self-attention (viz.self_attention)
        assert {f"alignment/{i}/alignment", f"alignment/{i}/layers", f"alignment/{i}/heads_layer0"} <= images
        assert {f"alignment/{i}/encoder_self", f"alignment/{i}/decoder_self"} <= images
    steps = [e.step for e in events.Images("alignment/0/alignment")]
    assert 20 in steps and 40 in steps  # one per validation: the slider shows alignment emerging
    # the scalars of the validation at step 40: greedy decoding of the 2 dev sentences shown, by that model
    from app.config.commands import DecodeConfig
    from app.data.corpus import load_split
    from app.decode.passes import decode_corpus
    from app.decode.trained import load_trained
    from app.evaluation.views import attention_entropy, monotonicity, plotted_view
    from app.report.board import tensorboard_sentences

    monkeypatch.chdir(workdir)  # the run's settings name its data folder relative to where it ran
    trained = load_trained("checkpoints/tiny", "step_0000040", torch.device("cpu"))
    dev = load_split("data/tiny", "dev", trained.tokenizer)
    chosen = tensorboard_sentences(dev.src, 2)
    src = [dev.src[i] for i in chosen]
    hyps = decode_corpus(trained.model, src, trained.device, DecodeConfig(beam_size=1), need_attention=True)
    weights = [plotted_view(a)[1] for a in hyps.attention]
    last = lambda tag: [e for e in events.Scalars(tag) if e.step == 40][0].value  # noqa: E731
    assert last("dev/attention_entropy") == pytest.approx(sum(map(attention_entropy, weights)) / 2, rel=1e-5)
    assert last("dev/attention_monotonicity") == pytest.approx(sum(map(monotonicity, weights)) / 2, rel=1e-5)
    # the text table of the same sentences at each validation, with that model's translations at step 40
    for step in (20, 40):
        table = text_at(events, "dev/samples", step)
        assert [dev.ids[i] in table for i in chosen] == [True, True]
    assert all(text in text_at(events, "dev/samples", 40) for text in trained.tokenizer.decode_tgt(hyps.tokens))
    # the run's settings and final figures in HPARAMS
    record = hparams_record(events)
    assert record["model.arch"] == "transformer" and record["model.d_model"] == 32 and record["name"] == "tiny"
    summary = json.loads((workdir / "checkpoints" / "tiny" / "train_summary.json").read_text())
    [dev_bleu] = [e.value for e in events.Scalars("hparams/dev_bleu") if e.step == summary["steps"]]
    assert dev_bleu == pytest.approx(summary["best_dev_bleu"])


def test_eval_logs_scores_figures_samples_and_hparams_into_the_runs_tensorboard(workdir):
    run = workdir / "checkpoints" / "tiny"
    result = run_cli(workdir, "command=eval", "name=tiny", "device=cpu", "viz.sentences=2")
    assert result.returncode == 0, result.stderr[-3000:]
    step = torch.load(run / "best.pt", weights_only=True)["progress"]["step"]  # the evaluated checkpoint's
    metrics = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    events = tensorboard(run)
    for key in ("bleu", "chrf", "ter"):
        assert [(e.step, round(e.value, 2)) for e in events.Scalars(f"eval/test/{key}")][-1] == (step, metrics[key])
    expected = {f"eval/test/alignment/{i}/{name}" for i in range(2) for name in ("alignment", "layers", "heads_layer0")}
    assert expected <= set(events.Tags()["images"])  # (an earlier eval of this module may have shown more sentences)
    own = {f"eval/test/alignment/{i}/{kind}_self" for i in range(2) for kind in ("encoder", "decoder")}
    assert own <= set(events.Tags()["images"]) and events.Images("eval/test/alignment/1/decoder_self")[-1].step == step
    assert events.Images("eval/test/alignment/0/heads_layer0")[-1].step == step
    samples = text_at(events, "eval/test/samples", step)
    assert "**best by sentence BLEU**" in samples and "**worst by sentence BLEU**" in samples
    hyps = (run / "eval" / "test" / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    rows = [line for line in samples.splitlines() if line.startswith("| ") and not line.startswith(("| id", "| ---"))]
    assert len(rows) >= 10 and all(any(h.replace("|", "\\|") in row for h in hyps) for row in rows)
    assert [e.value for e in events.Scalars("hparams/test_bleu") if e.step == step][-1] == pytest.approx(
        metrics["bleu"]
    )
    assert hparams_record(events)["model.heads"] == 2


def test_eval_writes_an_explorer_that_chromium_draws(workdir):
    """The explorer of a real evaluation, in headless Chromium: the sentence and head of the hash, the
    hypothesis tokens of alignments.jsonl as rows, and the colour of a cell from its weight in alignments.npz."""
    import io

    import numpy as np
    from browser import Browser, find_chromium
    from matplotlib import colormaps
    from PIL import Image

    from app.data.links import piece_links
    from app.report.attention_files import read_attention

    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    result = run_cli(workdir, "command=eval", "name=tiny", "device=cpu", "viz.eval_plots=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "alignments.html" in result.stdout
    rows = [json.loads(line) for line in (out / "alignments.jsonl").read_text(encoding="utf-8").splitlines()]
    if find_chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    viridis = (colormaps["viridis"](np.arange(256))[:, :3] * 255).round().astype(int)
    with Browser(1280, 800) as b:
        b.open(out / "alignments.html", "s=1&l=0&h=1")
        b.wait_for("document.getElementById('view').dataset.shown === '1,0,1,hypothesis'", timeout=10)
        assert b.evaluate("SENTENCES.length") == len(rows)

        def labels(axis: str) -> list[str]:
            return b.evaluate(f"[...document.querySelectorAll('#{axis}labels .tok')].map(e => e.textContent)")

        def colour(t: int, s: int) -> tuple:  # in the middle of the cell (t, s) of the map shown
            x, y, cell = b.evaluate(
                "(() => { const r = document.getElementById('heat').getBoundingClientRect();"
                " return [r.x, r.y, heatmap.cell]; })()"
            )
            with Image.open(io.BytesIO(b.screenshot())) as image:
                return image.convert("RGB").getpixel((int(x + (s + 0.5) * cell), int(y + (t + 0.5) * cell)))

        assert labels("y") == rows[1]["hyp_tokens"] and labels("x") == rows[1]["src_tokens"]
        drawn = colour(0, 0)
        # hyp.align's links of the sentence, outlined over the pieces of their words; a linked cell says so
        line = (out / "hyp.align").read_text(encoding="utf-8").splitlines()[1]
        links = {tuple(int(x) for x in link.split("-")) for link in line.split()}
        cells = [list(c) for c in piece_links(links, rows[1]["src_words"], rows[1]["hyp_words"])]
        assert cells and b.evaluate("SENTENCES[1].hypLinks") == cells
        assert "hyp.align's word links (links read from layer 0 mean)" in b.evaluate("$('legend').textContent")
        x, y, cell = b.evaluate(
            "(() => { const r = document.getElementById('heat').getBoundingClientRect();"
            " return [r.x, r.y, heatmap.cell]; })()"
        )
        b.hover(x + (cells[0][1] + 0.5) * cell, y + (cells[0][0] + 0.5) * cell)
        assert b.evaluate("$('readout').textContent").endswith("(a link of hyp.align)")
        b.evaluate("location.hash = 's=1&l=0&h=1&m=encoder'")  # its encoder's self-attention
        b.wait_for("document.getElementById('view').dataset.shown === '1,0,1,encoder'", timeout=10)
        assert labels("y") == labels("x") == rows[1]["src_tokens"]
        drawn_own = colour(0, 1)
    maps = read_attention(str(out), 1)
    weight = maps["maps"][maps["views"].index("layer 0 head 1"), 0, 0]  # first hypothesis piece, first source piece
    assert all(abs(a - b) <= 1 for a, b in zip(drawn, viridis[round(weight * 255)])), (drawn, weight)
    weight = maps["encoder"]["maps"][maps["encoder"]["views"].index("layer 0 head 1"), 0, 1]  # first over second
    assert all(abs(a - b) <= 1 for a, b in zip(drawn_own, viridis[round(weight * 255)])), (drawn_own, weight)


def test_eval_writes_alignment_heatmaps_and_attention_files(workdir):
    import numpy as np
    from PIL import Image

    out = workdir / "checkpoints" / "tiny" / "eval" / "test"
    result = run_cli(workdir, "command=eval", "name=tiny", "device=cpu", "viz.eval_plots=2")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["ter_worker_share"] == 1.0 and metrics["seconds"]["self-attention"] > 0  # TER beside the pass
    for kind in ("encoder", "decoder"):  # what each of the 2 heads of the 1 layer did over the split
        [heads] = metrics["self_attention_heads"][kind]
        assert len(heads) == 2 and all(0 < h["confidence"] <= 1 and sum(h["offsets"].values()) <= 1 for h in heads)
        assert re.search(rf"^  {kind} self-attention heads: confidence \d\.\d\d; positional: ", result.stdout, re.M)
    pngs = sorted(os.listdir(out / "alignments"))
    assert pngs == [f"000{i}{name}.png" for i in range(2) for name in ("", "_heads_layer0", "_layers")]
    with Image.open(out / "alignments" / "0000.png") as image:
        assert image.size[0] >= 300 and image.size[1] >= 200
    rows = [json.loads(line) for line in (out / "alignments.jsonl").read_text(encoding="utf-8").splitlines()]
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(rows) == len(hyps) and [row["index"] for row in rows] == list(range(len(hyps)))
    test_ids = [line.split("\t")[0] for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    assert [row["id"] for row in rows] == test_ids  # the split's order
    with np.load(out / "alignments.npz") as archive:  # numpy alone reads the maps
        for row in rows:
            assert row["src_tokens"][-1] == "</s>" and row["hyp_tokens"][-1] == "</s>"
            # 1 layer of 2 heads: both heads of layer 0 (viz.layer), then its mean
            assert row["layer"] == 0 and row["views"] == ["layer 0 head 0", "layer 0 head 1", "layer 0 mean"]
            maps = archive[row["array"]]
            assert maps.dtype == np.uint8 and maps.shape == (3, len(row["hyp_tokens"]), len(row["src_tokens"]))
            # rows sum to 1 within the rounding of each weight to 1/255
            assert np.abs(maps.sum(-1) / 255 - 1).max() <= len(row["src_tokens"]) / 510
            # the self-attention (viz.self_attention, on by default): the encoder's over the source, the decoder's
            # over the hypothesis (causal), the same views
            for kind, tokens in (("encoder", row["src_tokens"]), ("decoder", row["hyp_tokens"])):
                own = archive[row[kind]["array"]]
                assert row[kind]["array"] == f"{row['array']}.{kind}" and row[kind]["views"] == row["views"]
                assert own.dtype == np.uint8 and own.shape == (3, len(tokens), len(tokens))
                assert np.abs(own.sum(-1) / 255 - 1).max() <= len(tokens) / 510
            assert not np.triu(archive[row["decoder"]["array"]], 1).any()


@pytest.mark.parametrize(
    "gold_kind, expected",
    [
        ("every pair possible", {"aer": 0.0, "precision": 1.0}),  # whatever the model links is allowed
        ("links past the end of the words", None),  # refused: scored, they read as misses (AER 1.0 here before)
    ],
)
def test_eval_reports_alignment_error_rate_against_a_gold_file(workdir, gold_kind, expected):
    """Gold files whose AER is known whatever the model learned: the whole path from the CLI setting
    through forced decoding, hard word links and scoring; a gold file linking words a pair does not have is
    refused in one line naming its line."""
    refs = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    gold = workdir / "gold.align"
    if gold_kind == "every pair possible":
        lines = [
            " ".join(f"{i}?{j}" for i in range(len(src.split())) for j in range(len(tgt.split())))
            for _, src, tgt in refs
        ]
    else:
        lines = [" ".join(f"{len(src.split()) + 5}-{j}" for j in range(len(tgt.split()))) for _, src, tgt in refs]
    gold.write_text("".join(line + "\n" for line in lines))
    result = run_cli(
        workdir,
        "command=eval",
        "name=tiny",
        "device=cpu",
        "decode.beam_size=1",
        "viz.eval_plots=0",
        f"eval.gold_align={gold}",
    )
    if expected is None:
        _, src, tgt = refs[0]
        past = f"link {len(src.split()) + 5}-0 is past the end of the pair's words ({len(src.split())} source, "
        assert result.returncode == 2 and result.stderr.startswith(f"error: {gold}:1: {past}"), result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AER" in result.stdout
    metrics = json.loads((workdir / "checkpoints" / "tiny" / "eval" / "test" / "metrics.json").read_text())
    alignment = metrics["alignment"]
    assert {key: alignment[key] for key in expected} == expected
    assert alignment["links"] == sum(len(tgt.split()) for _, _, tgt in refs)  # one link per reference word
    # the explorer holds each sentence's forced reference rows, with the links that have cells to draw
    from test_explorer import read_explorer

    _, meta, sentences = read_explorer(workdir / "checkpoints" / "tiny" / "eval" / "test" / "alignments.html")
    assert meta["AER"].startswith(f"{alignment['aer']:.3f}") and len(sentences) == len(refs)
    drawn = [len(s["ref"]["links"]["sure"]) + len(s["ref"]["links"]["possible"]) for s in sentences]
    assert all(drawn)


def test_eval_of_the_first_sentences_says_it_is_a_subset(workdir):
    """eval.max_sentences=3: the first 3 test pairs in the split's order, said so in the output, metrics.json,
    the explorer and TensorBoard (its own tags, no test HPARAMS); the AER reads the same 3 pairs' links
    (a gold file right on them and wrong on every other pair scores 0)."""
    from test_explorer import read_explorer

    run, n = workdir / "checkpoints" / "tiny", 3
    refs = [line.rstrip("\n").split("\t") for line in open(workdir / "data" / "tiny" / "test.tsv", encoding="utf-8")]
    gold = workdir / "gold_first.align"
    right = [" ".join(f"{i}?{j}" for i in range(len(s.split())) for j in range(len(t.split()))) for _, s, t in refs[:n]]
    wrong = [" ".join(f"{len(s.split()) + 5}-{j}" for j in range(len(t.split()))) for _, s, t in refs[n:]]
    gold.write_text("".join(line + "\n" for line in right + wrong))
    hparams_before = len(tensorboard(run).Scalars("hparams/test_bleu"))
    args = ["command=eval", "name=tiny", "device=cpu", "decode.beam_size=1", "viz.eval_plots=0"]
    result = run_cli(workdir, *args, f"eval.max_sentences={n}", f"eval.gold_align={gold}", "viz.self_attention=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(first {n} of {len(refs)} sentences: a subset, not the split's score;" in result.stdout
    assert "self-attention" not in result.stdout  # viz.self_attention=false: no pass, no stage
    out = run / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["sentences"], metrics["split_sentences"]) == (n, len(refs))
    assert metrics["subset"] == f"first {n} of {len(refs)} sentences"
    hyps = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == n and metrics["bleu"] == round(sacrebleu.corpus_bleu(hyps, [[r[2] for r in refs[:n]]]).score, 2)
    alignment = metrics["alignment"]
    assert alignment["aer"] == 0.0 and alignment["links"] == sum(len(t.split()) for _, _, t in refs[:n])
    index = [json.loads(line) for line in (out / "alignments.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["id"] for row in index] == [r[0] for r in refs[:n]]
    assert not any("encoder" in row or "decoder" in row for row in index)
    _, meta, sentences = read_explorer(out / "alignments.html")
    assert len(sentences) == n and meta["sentences"] == metrics["subset"]
    assert all(s["own"] is None for s in sentences)
    events = tensorboard(run)
    assert [e.value for e in events.Scalars(f"eval/test_first{n}/bleu")][-1] == pytest.approx(metrics["bleu"])
    assert len(events.Scalars("hparams/test_bleu")) == hparams_before  # a subset is not the test score
    # a gold file that is not the split's length is refused, though its first lines would do
    (workdir / "short.align").write_text("".join(line + "\n" for line in right))
    short = run_cli(workdir, *args, f"eval.max_sentences={n}", f"eval.gold_align={workdir / 'short.align'}")
    gold = f"eval.gold_align={workdir / 'short.align'}"
    named = f"error: {gold}: {n} lines of reference links for the {len(refs)} sentences"
    assert short.returncode == 2 and short.stderr.startswith(named), short.stderr
    negative = run_cli(workdir, *args, "eval.max_sentences=-1")
    assert negative.returncode == 2 and "eval.max_sentences=-1" in negative.stderr


def test_bench_prints_and_writes_the_table(workdir, monkeypatch):
    result = run_cli(
        workdir,
        "command=bench",
        *TINY,
        "bench.steps=3",
        "bench.warmup=1",
        "bench.decode_sentences=4",
        "decode.beam_size=2",
        "bench.checkpoint_path=checkpoints/tiny/best.pt",
        "bench.profile_steps=2",
        "bench.ablate=true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((workdir / "checkpoints" / "bench" / "tiny.json").read_text())
    assert table["device"] == "cpu" and table["timed_steps"] == 3 and table["mfu"] is None  # no peak known for CPUs
    assert table["train_src_tgt_tokens_per_s"] > table["train_tgt_tokens_per_s"] > 0
    assert 0 <= table["padding_ratio"] < 1 and table["model_tflops_per_s"] > 0
    assert table["ema_update_ms"] > 0 and 0 < table["ema_vs_step"] < 1  # the moving average's cost per step
    assert table["decode_sentences"] == 4 and table["decode_beam2"]["sentences_per_s"] > 0
    # operators per step (app/profiling.count_ops): a training step launches far more than a decoding step
    train_ops, decode_ops = table["train_step_operators"], table["decode_step_operators"]
    assert train_ops["ops"] > decode_ops["beam2"]["ops"] > 0 and train_ops["kernels"] > decode_ops["beam2"]["kernels"]
    # host milliseconds per update, on a batch of the shortest pairs within bench.host_tokens
    assert table["host_step_ms"] > 0 and 0 < table["host_step_tokens"] <= 256
    assert decode_ops["beam1"]["kernels"] > 0 and decode_ops["beam2"]["kernels"] >= decode_ops["beam1"]["kernels"]
    for search in ("beam1", "beam2"):  # with the attention weights kept, as make eval keeps them: more
        assert decode_ops[f"{search}_attention"]["ops"] > decode_ops[search]["ops"]
    # the decoding rows score the checkpoint's weights, not the ones the timed training steps left
    from app.config.commands import DecodeConfig
    from app.data.corpus import load_split
    from app.decode.passes import decode_corpus
    from app.decode.trained import load_trained

    monkeypatch.chdir(workdir)
    trained = load_trained("checkpoints/tiny", "best", torch.device("cpu"))
    test = load_split("data/tiny", "test", trained.tokenizer).head(4)
    hyps = decode_corpus(trained.model, test.src, trained.device, DecodeConfig(beam_size=2)).tokens
    bleu = sacrebleu.corpus_bleu(trained.tokenizer.decode_tgt(hyps), [test.tgt_texts]).score
    assert table["decode_beam2"]["bleu"] == round(bleu, 2)
    for engine in ("float32", "int8"):  # the same beam by the CTranslate2 export of the same weights
        row = table[f"decode_beam2_ct2_{engine}"]
        assert row["seconds"] > 0 and row["speedup_vs_ours"] > 0 and 0 <= row["bleu"] <= 100
    assert "padding_ratio" in result.stdout and "decode_beam1 sentences_per_s" in result.stdout
    shares = table["profile"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and shares["matrix multiply"] > 0.05
    assert "profile shares matrix multiply" in result.stdout and "aten::" in result.stdout
    assert "aten::" in (workdir / "checkpoints" / "bench" / "tiny_profile.txt").read_text()
    trace = json.loads((workdir / "checkpoints" / "bench" / "tiny_trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    settings = [row["setting"] for row in table["ablation"]]  # no bf16 row: the CPU trains in fp32
    assert settings == [
        "all speed features on (the defaults)",
        "without fused AdamW (its non-finite check then syncs)",
        "without fused SDPA kernels (math attention)",
        "reading the loss every step (host sync)",
        "without length bucketing (random batches)",
        "with train.batch_shapes=16 (fixed padded shapes)",
        "with train.compile=true",
    ]
    assert all(row["train_tgt_tokens_per_s"] > 0 and row["vs_defaults"] > 0 for row in table["ablation"])
    padding = {row["setting"]: row["padding_ratio"] for row in table["ablation"]}
    assert padding["without length bucketing (random batches)"] > padding["all speed features on (the defaults)"]
    # a whole epoch's batches: the tiny corpus's few length-bucketed batches, each its own shape
    assert table["epoch_batch_shapes"] <= table["epoch_batches"] and 0 <= table["epoch_padding_ratio"] < 1
    markdown = (workdir / "checkpoints" / "bench" / "tiny_ablation.md").read_text()
    assert markdown.count("\n| ") == 9 and "| with train.compile=true |" in result.stdout  # header, rule, 7 rows


def test_a_new_users_files_corpus_trains_without_naming_it(workdir):
    """The issue's new-user command: data=files with three files and no data.name."""
    rows = (workdir / "corpus.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    for name, part in (("a.tsv", rows[:120]), ("b.tsv", rows[120:140]), ("c.tsv", rows[140:])):
        (workdir / name).write_text("".join(part), encoding="utf-8")
    sizes = [a for a in TINY if a.startswith(("model", "tokenizer", "train.", "device"))]
    args = ["data=files", "data.train=a.tsv", "data.dev=b.tsv", "data.test=c.tsv", "name=new_user", "train.max_steps=4"]
    result = run_cli(workdir, "command=train", *args, *sizes)
    assert result.returncode == 0, result.stderr[-3000:]
    prepared = [p.name for p in (workdir / "data").iterdir() if p.name.startswith("a_")]
    assert len(prepared) == 1 and len(prepared[0]) == len("a_") + 6  # the train file's name and a digest
    counts = json.loads((workdir / "data" / prepared[0] / "prepare.json").read_text())["pairs"]
    assert counts == {"train": 120, "dev": 20, "test": len(rows) - 140}


def test_a_corpus_with_reference_links_is_scored_and_guides_training(workdir):
    """data.train_align carries links through preparation; training with train.align_weight logs its loss
    and dev/aer; make eval scores AER against test.align without a setting, on the view chosen on dev."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [line.split("\t") for line in (workdir / "corpus.tsv").read_text(encoding="utf-8").splitlines()]
    diagonal = [" ".join(f"{i}-{i}" for i in range(min(len(src.split()), len(tgt.split())))) for _, src, tgt in rows]
    (workdir / "corpus.align").write_text("".join(line + "\n" for line in diagonal))
    args = [a for a in TINY if not a.startswith(("name=", "data.name="))]
    args += [
        "data.name=linked",
        "data.train_align=corpus.align",
        "name=guided",
        "train.max_steps=20",
        "train.align_weight=1.0",
        "train.log_every=10",
        "model.align_layer=0",
        "decode.beam_size=1",
    ]
    result = run_cli(workdir, "command=train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(workdir / "checkpoints" / "guided" / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("dev/aer")] == [20] and 0 < events.Scalars("dev/aer")[0].value < 1
    assert [e.step for e in events.Scalars("train/align_loss")] == [10, 20]
    result = run_cli(workdir, "command=eval", "name=guided", "device=cpu", "decode.beam_size=1", "viz.eval_plots=1")
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "checkpoints" / "guided" / "eval" / "test"
    metrics = json.loads((out / "metrics.json").read_text())
    alignment = metrics["alignment"]
    assert metrics["ter_worker_share"] == 1.0  # all of TER beside the AER's forced passes
    assert alignment["gold"] == "data/linked/test.align" and alignment["chosen_on"] == "dev"
    # every view (2 heads, their mean), each as it is and shift-att: the method and the view it reads
    assert alignment["method"] in alignment["aer_by_view"] and len(alignment["aer_by_view"]) == (1 * 2 + 1) * 2
    assert alignment["aer"] == alignment["aer_by_view"][alignment["method"]]
    assert alignment["view"] == alignment["method"].removesuffix(", shift-att")
    row = json.loads((out / "alignments.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert row["alignment_view"] == {"view": alignment["view"], "chosen_on": "dev"}
    assert metrics["hyp_align_view"] == alignment["method"]  # the hypotheses' word links: the method AER chose
    assert (out / "alignments" / "0000_reference.png").exists() and (out / "alignments" / "0000.png").exists()
    assert alignment["scope"] == "linked"  # the corpus's own links: only the target words they link count
    assert f"({alignment['method']}, chosen on dev; linked target words)" in result.stdout


def test_guided_alignment_without_links_is_a_one_line_error(workdir):
    result = run_cli(workdir, "command=train", *TINY, "name=unguided", "train.align_weight=0.5")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "train.align_weight=0.5 needs reference links of the train split, data/tiny/train.align" in result.stderr


def test_an_export_of_another_checkpoint_or_a_damaged_one_is_refused_in_one_line(workdir, tmp_path):
    """make export says how to read what it wrote; translate and score read it only for the checkpoint it holds;
    a damaged export names the file and what mends it (tracebacks before)."""
    folder = tmp_path / "first"
    exported = run_cli(workdir, "command=export", "name=tiny", "export.checkpoint=step_0000020", f"export.dir={folder}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    reads = f"translate.checkpoint=step_0000020 export.dir={folder}"
    assert f'  make translate ARGS="name=tiny translate.engine=ct2 {reads}"' in exported.stdout.splitlines()
    ct2 = ("name=tiny", "translate.engine=ct2", f"export.dir={folder}")
    result = run_cli(workdir, "command=translate", *ct2, stdin="Hola\n")
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: translate.engine=ct2: {folder} holds step_0000020 (step 20), not translate.checkpoint=best: export "
        f'that one (make export ARGS="name=tiny export.dir={folder}") or give translate.checkpoint=step_0000020'
    )
    held = run_cli(workdir, "command=translate", *ct2, "translate.checkpoint=step_0000020", stdin="Hola\n")
    assert held.returncode == 0, held.stderr[-3000:]
    (tmp_path / "s.es").write_text("Hola\n", encoding="utf-8")
    (tmp_path / "s.en").write_text("Hello\n", encoding="utf-8")
    pairs = (f"score.source={tmp_path / 's.es'}", f"score.target={tmp_path / 's.en'}")
    scored = run_cli(workdir, "command=score", "name=tiny", "score.engine=ct2", f"export.dir={folder}", *pairs)
    assert scored.returncode == 2 and "not score.checkpoint=best" in scored.stderr
    damaged = {
        "model.bin": lambda path: path.write_bytes(path.read_bytes()[:1000]),
        "export.json": lambda path: path.write_text("{"),
        "spm.model": lambda path: path.unlink(),
    }
    for name, damage in damaged.items():
        broken = tmp_path / name
        shutil.copytree(folder, broken)
        damage(broken / name)
        of_step_20 = ("translate.checkpoint=step_0000020", f"export.dir={broken}")
        result = run_cli(workdir, "command=translate", *ct2[:2], *of_step_20, stdin="Hola\n")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.startswith(f"error: {broken}") and result.stderr.strip().endswith(
            ": a damaged export; make export writes it again"
        ), result.stderr
    into_a_file = run_cli(workdir, "command=export", "name=tiny", "export.dir=corpus.tsv")
    assert into_a_file.returncode == 2
    assert into_a_file.stderr.strip() == "error: export.dir=corpus.tsv: a file, not a folder"
    # viz.layer: the export's alignment layer, the one plots and word links read; one the model lacks is refused
    # (an export baked it in, and CTranslate2 then crashed reading it; make translate raised IndexError)
    lacking = "error: viz.layer=3: this model has 1 decoder layer; give -1 to 0 (-1: the last)"
    for command in ("export", "translate", "train"):
        args = ("name=tiny", "viz.layer=3", f"export.dir={tmp_path / 'layer3'}", "translate.alignments=true")
        where = tmp_path if command == "train" else workdir  # a new run: refused before its data is read
        refused = run_cli(where, f"command={command}", *(TINY if command == "train" else ()), *args, stdin="Hola\n")
        assert (refused.returncode, refused.stderr.strip()) == (2, lacking), refused.stderr[-2000:]
    assert not (tmp_path / "layer3").exists()


def test_export_to_ctranslate2_then_translate_and_eval_with_it(workdir):
    run = workdir / "checkpoints" / "tiny"
    result = run_cli(workdir, "command=export", "name=tiny", "export.quantization=none")
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((run / "ct2" / "export.json").read_text())
    assert info["quantization"] == "none" and info["run"]["checkpoint"] == "best"
    assert info["run"]["step"] == torch.load(run / "best.pt", weights_only=True)["progress"]["step"]
    assert (run / "ct2" / "model.bin").stat().st_size > 0 and (run / "ct2" / "spm.model").exists()
    assert (run / "ct2").stat().st_mode == run.stat().st_mode  # readable as the run folder is (mkdtemp's was 0700)
    assert re.search(r"in load \d+\.\d s, convert \d+\.\d s \(total \d+\.\d s\)", result.stdout)  # where it waited
    assert result.stdout.splitlines()[-2:] == [  # the commands that use it, each as it is typed
        '  make translate ARGS="name=tiny translate.engine=ct2"',
        '  make eval ARGS="name=tiny eval.engine=ct2"',
    ]

    # greedy float32: CTranslate2 translates as our decoder does
    lines = "En el principio creó Dios los cielos y la tierra.\nY dijo Dios: Sea la luz.\n"
    outputs = [
        run_cli(
            workdir,
            "command=translate",
            "name=tiny",
            "decode.beam_size=1",
            f"translate.engine={engine}",
            "translate.alignments=true",  # the word links of the same attention (one map from the export)
            stdin=lines,
        )
        for engine in ("torch", "ct2")
    ]
    assert [o.returncode for o in outputs] == [0, 0], outputs[1].stderr[-3000:]
    step = info["run"]["step"]
    used = r"translating 2 lines with \S*checkpoints/tiny/ct2, the CTranslate2 export \(none\) of best\.pt"
    used += rf" \(step {step}\): greedy"
    assert re.search(used, outputs[1].stderr), outputs[1].stderr
    assert outputs[0].stdout == outputs[1].stdout and len(outputs[1].stdout.splitlines()) == 2
    for line in outputs[1].stdout.splitlines():  # an empty translation has no links
        assert re.fullmatch(r".* \|\|\| (\d+-\d+( \d+-\d+)*)?", line), line
    # a target prefix: CTranslate2's target_prefix continues it as our decoder does
    (workdir / "prefix.txt").write_text("In the end\n\n", encoding="utf-8")
    continued = [
        run_cli(
            workdir,
            "command=translate",
            "name=tiny",
            "decode.beam_size=1",
            "translate.prefix=prefix.txt",
            f"translate.engine={e}",
            stdin=lines,
        )
        for e in ("torch", "ct2")
    ]
    assert [o.returncode for o in continued] == [0, 0], continued[1].stderr[-3000:]
    assert continued[0].stdout == continued[1].stdout and continued[1].stdout.startswith("In the end")

    # make score: the export's score_batch reads the log p the checkpoint gives
    (workdir / "pair.es").write_text(lines, encoding="utf-8")
    (workdir / "pair.en").write_text("In the beginning God created the heavens.\nGod said: Let there be light.\n")
    scored = [
        run_cli(
            workdir, "command=score", "name=tiny", "score.source=pair.es", "score.target=pair.en", f"score.engine={e}"
        )
        for e in ("torch", "ct2")
    ]
    assert [o.returncode for o in scored] == [0, 0], scored[1].stderr[-3000:]
    assert re.search(
        rf"with \S*checkpoints/tiny/ct2, the CTranslate2 export of best\.pt \(step {step}\)", scored[1].stderr
    )
    (torch_rows, ct2_rows) = ([[float(x) for x in line.split("\t")] for line in o.stdout.splitlines()] for o in scored)
    assert len(torch_rows) == 2 and torch.allclose(torch.tensor(torch_rows), torch.tensor(ct2_rows), atol=2e-3)

    hyps = {}
    for engine in ("torch", "ct2"):
        result = run_cli(workdir, "command=eval", "name=tiny", "decode.beam_size=1", f"eval.engine={engine}")
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = json.loads((run / "eval" / "test" / "metrics.json").read_text())
        hyps[engine] = (run / "eval" / "test" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    assert metrics["engine"].startswith("ctranslate2 ") and metrics["engine"].endswith(", none")
    assert "no per-head maps" in result.stdout
    assert sum(a == b for a, b in zip(hyps["torch"], hyps["ct2"])) >= 0.9 * len(hyps["torch"])
    # sampling: in each process CTranslate2 draws the same for the same seed (it seeds a thread at its first draw)
    sample = ("command=translate", "name=tiny", "translate.engine=ct2", "decode.beam_size=1", "decode.sampling=true")
    drawn = [run_cli(workdir, *sample, f"decode.sampling_seed={seed}", stdin=lines * 4) for seed in (1, 1, 2)]
    assert drawn[0].returncode == 0 and "greedy" not in drawn[0].stderr, drawn[0].stderr[-3000:]
    assert drawn[0].stdout == drawn[1].stdout != drawn[2].stdout and len(drawn[0].stdout.splitlines()) == 8
    rows = [json.loads(line) for line in (run / "eval" / "test" / "alignments.jsonl").read_text().splitlines()]
    assert rows[0]["views"] == ["attention"]  # one map: the mean of the heads of decoder layer viz.layer
    assert rows[0]["shape"] == [1, len(rows[0]["hyp_tokens"]), len(rows[0]["src_tokens"])]

    # an export of another checkpoint is not scored as this one; a run without an export says how to make one
    other = "step_0000040" if info["run"]["step"] == 20 else "step_0000020"
    stale = run_cli(workdir, "command=eval", "name=tiny", "eval.engine=ct2", f"eval.checkpoint={other}")
    assert stale.returncode == 2 and "make export again" in stale.stderr and len(stale.stderr.splitlines()) == 1
    same_step = f"step_{info['run']['step']:07d}"  # another checkpoint of the exported one's step: still another one
    twin = run_cli(workdir, "command=eval", "name=tiny", "eval.engine=ct2", f"eval.checkpoint={same_step}")
    assert twin.returncode == 2 and twin.stderr.strip().endswith(f"give eval.checkpoint={info['run']['checkpoint']}")
    assert (
        f"holds {info['run']['checkpoint']} (step {info['run']['step']}), not eval.checkpoint={same_step}"
        in twin.stderr
    )
    missing = run_cli(workdir, "command=translate", "name=nothing", "translate.engine=ct2", stdin="Hola.\n")
    assert missing.returncode == 2 and 'make export ARGS="name=nothing"' in missing.stderr
    wrong = run_cli(workdir, "command=eval", "name=tiny", "eval.engine=onnx")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: eval.engine='onnx' is not a choice: choose torch")
