"""Fine-tuning (train.init_from): a run starts from another run's weights and tokenizer, on another corpus,
with a fresh optimizer, schedule and step count; what it refuses, said in one line; eval, translate and a
resume of the fine-tuned run through the CLI."""

import json
import os

import pytest
import torch
from conftest import SWORD, TINY, compose_config, run_cli, trained_tiny_run

# Genesis 7-12: another corpus than the parent run's Genesis 1-6
OTHER_CHAPTERS = {7: 24, 8: 22, 9: 29, 10: 32, 11: 32, 12: 20}
OTHER = ["data.train=other.tsv", "data.name=other", "name=ft", "train.init_from=tiny"]


@pytest.fixture(scope="module")
def parent(tmp_path_factory, corpus_tsv):
    """A folder with a 40-step ``tiny`` run trained on Genesis 1-6 and ``other.tsv``, Genesis 7-12."""
    from app.data.osis import bible_verses

    root = trained_tiny_run(tmp_path_factory, corpus_tsv, "init_from")
    refs = [f"Gen.{c}.{v}" for c, n in OTHER_CHAPTERS.items() for v in range(1, n + 1)]
    es, en = bible_verses(SWORD, "spaRV1909eb", refs), bible_verses(SWORD, "engWEB2015eb", refs)
    (root / "other.tsv").write_text("".join(f"{r}\t{es[r]}\t{en[r]}\n" for r in refs), encoding="utf-8")
    return root


def test_a_fine_tuning_run_starts_from_the_runs_weights_and_tokenizer(parent, monkeypatch):
    from app.train.trainer import build_trainer

    monkeypatch.chdir(parent)
    # the dropout may change in fine-tuning: it shapes no weight
    cfg = compose_config(*TINY, *OTHER, "train.eval_every=0", "model.dropout=0.3", "tokenizer.vocab_size=300")
    trainer = build_trainer(cfg)
    trainer.writer.close()
    given = torch.load(parent / "checkpoints/tiny/best.pt", map_location="cpu", weights_only=True)
    weights = trainer.model.state_dict()
    assert given["model"].keys() == weights.keys()
    assert all(torch.equal(weights[k], v) for k, v in given["model"].items())
    assert trainer.progress.step == 0 and trainer.progress.best_bleu == -1.0 and not trainer.optimizer.state
    assert trainer.scheduler.last_epoch == 0  # the warm-up starts again
    assert trainer.progress.init_from == {"checkpoint": "checkpoints/tiny/best.pt", "step": 40}
    # the parent's tokenizer (its vocab_size, not this command line's) tokenizes Genesis 7-12, beside no own one
    assert cfg.tokenizer.dir == "data/tiny" and cfg.tokenizer.vocab_size == 400
    assert trainer.data.tokenizer.fingerprint() == given["vocab"]
    assert not list((parent / "data/other").glob("spm_*"))
    caches = sorted(p.name for p in (parent / "data/other/tokenized").iterdir())
    assert len(caches) == 1 and caches[0].startswith("spm_unigram400-")


def test_make_data_tokenizes_as_the_fine_tuning_run_will(parent, monkeypatch):
    """``make data ARGS="... train.init_from=tiny"`` prepares what the fine-tuning run reads, and no tokenizer of
    the corpus's own, whatever the model settings on its command line."""
    from app.cli import prepare_command

    monkeypatch.chdir(parent)
    prepare_command(compose_config(*TINY, *OTHER, "data.name=other_prepared", "model.d_model=64", command="prepare"))
    assert not list((parent / "data/other_prepared").glob("spm_*"))
    caches = [p.name for p in (parent / "data/other_prepared/tokenized").iterdir()]
    assert len(caches) == 1 and caches[0].startswith("spm_unigram400-")


def test_a_run_of_other_model_settings_is_refused_naming_them(parent, monkeypatch):
    """At once: before the corpus is prepared and tokenized (minutes for a big one)."""
    from app.run.errors import UserError
    from app.train import trainer

    monkeypatch.chdir(parent)
    monkeypatch.setattr(trainer, "load_data", lambda *a: pytest.fail("the data is prepared before the check"))
    cfg = compose_config(*TINY, *OTHER, "train.eval_every=0", "run_dir=checkpoints/ft_wide", "model.ff_dim=128")
    differ = r"checkpoints/tiny/best.pt: model settings differ.*model.ff_dim=64 there, 128 here"
    with pytest.raises(UserError, match=differ):
        trainer.build_trainer(cfg)


@pytest.mark.parametrize("given", ["no_such_run", "checkpoints/tiny/step_0000001.pt"])
def test_a_missing_starting_point_is_named(parent, monkeypatch, given):
    from app.run.errors import UserError
    from app.train.init_from import starting_point

    monkeypatch.chdir(parent)
    cfg = compose_config(*TINY, *OTHER, f"train.init_from={given}")
    with pytest.raises(UserError, match=rf"^train.init_from={given}: .* does not exist"):
        starting_point(cfg)


def test_a_run_name_a_run_folder_and_a_file_name_their_checkpoints(parent, monkeypatch):
    from app.train.init_from import start_checkpoint

    monkeypatch.chdir(parent)
    assert start_checkpoint("tiny") == start_checkpoint("checkpoints/tiny") == "checkpoints/tiny/best.pt"
    assert start_checkpoint("checkpoints/tiny/last.pt") == "checkpoints/tiny/last.pt"


def test_a_damaged_starting_point_is_named(parent, monkeypatch):
    from app.run.errors import UserError
    from app.train.init_from import starting_point

    monkeypatch.chdir(parent)
    (parent / "torn.pt").write_bytes((parent / "checkpoints/tiny/best.pt").read_bytes()[:5000])
    with pytest.raises(UserError, match=r"^train.init_from=torn.pt: torn.pt"):
        starting_point(compose_config(*TINY, *OTHER, "train.init_from=torn.pt"))


def test_a_tokenizer_dir_without_the_model_is_named(parent, monkeypatch):
    from app.data.tokenizer import build_tokenizer
    from app.run.errors import UserError

    monkeypatch.chdir(parent)
    cfg = compose_config(*TINY, "tokenizer.dir=data/tiny", "tokenizer.vocab_size=300")
    with pytest.raises(UserError, match=r"^tokenizer.dir=data/tiny: no spm_unigram300.model there"):
        build_tokenizer("data/other", cfg.tokenizer)


@pytest.mark.fresh_interpreter
@pytest.mark.slow
def test_fine_tune_then_eval_translate_and_resume_through_the_cli(parent):
    """The fine-tuned run as a user meets it: trained, evaluated and used to translate with the parent's
    tokenizer, resumed with its own command (which gives no tokenizer setting: it takes the parent's), and a refused
    command line leaves no run folder."""
    own = [a for a in TINY if not a.startswith("tokenizer.")]
    ft = [*own, *OTHER, "train.eval_every=10", "train.save_every=10"]
    trained = run_cli(parent, "command=train", *ft, "train.max_steps=20")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "fine-tuning from checkpoints/tiny/best.pt (step 40)" in trained.stdout
    summary = json.loads((parent / "checkpoints/ft/train_summary.json").read_text())
    assert summary["steps"] == 20 and summary["init_from"] == {"checkpoint": "checkpoints/tiny/best.pt", "step": 40}
    assert "dir: data/tiny" in (parent / "checkpoints/ft/config.yaml").read_text()

    evaluated = run_cli(parent, "command=eval", "name=ft", "device=cpu", "eval.max_sentences=4", "viz.eval_plots=0")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    metrics = json.loads((parent / "checkpoints/ft/eval/test/metrics.json").read_text())
    assert metrics["sentences"] == 4
    translated = run_cli(parent, "command=translate", "name=ft", "device=cpu", stdin="Y dijo Dios.\n")
    assert translated.returncode == 0 and translated.stdout.strip(), translated.stderr[-3000:]

    resumed = run_cli(parent, "command=train", *ft, "train.max_steps=30", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "fine-tuning from" not in resumed.stdout
    summary = json.loads((parent / "checkpoints/ft/train_summary.json").read_text())
    assert summary["steps"] == 30 and summary["init_from"]["step"] == 40

    refused = run_cli(parent, "command=train", *TINY, *OTHER, "name=ft_refused", "model.heads=4")
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].endswith("model.heads=2 there, 4 here")
    assert "Traceback" not in refused.stderr and not os.path.exists(parent / "checkpoints/ft_refused")
