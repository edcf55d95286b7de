"""What a user types wrong on the command line: an unknown preset of any config group is refused listing the
group's presets, a misspelled key of any section gets the closest key, and every one-line error names its key
and cause, whatever the shape of OmegaConf's or Hydra's message."""

import dataclasses
import json
import os
import shutil
import subprocess

import pytest
from conftest import REPO, TINY, compose_config, run_cli

from app.cli import CONF_DIR, check_arguments, typed_arguments
from app.config.load import config_error
from app.config.schema import MODEL_SCHEMAS, Config
from app.run.errors import UserError

# the config groups a user names on the command line: every folder of conf/ (a later one is found too)
GROUPS = sorted(d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d)))


def refusal(*overrides: str) -> str:
    with pytest.raises(UserError) as caught:
        check_arguments(["command=train", *overrides])
    message = str(caught.value)
    assert "\n" not in message
    return message


def presets(group: str) -> list[str]:
    return sorted(f[: -len(".yaml")] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))


def in_defaults(group: str) -> bool:
    with open(os.path.join(CONF_DIR, "config.yaml"), encoding="utf-8") as f:
        return f"  - {group}:" in f.read()


def test_the_groups_are_found():
    assert {"data", "experiment", "model", "variant"} <= set(GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_an_unknown_preset_of_any_group_is_refused_listing_the_groups_presets(group):
    override = f"{group}=nosuch" if in_defaults(group) else f"+{group}=nosuch"
    message = refusal(override)
    assert message == f"{group}=nosuch is not a preset of conf/{group}/: available: {', '.join(presets(group))}"


def test_a_group_outside_the_defaults_list_says_to_add_it():
    assert (
        refusal("variant=rope") == "variant is not in the defaults list, so it is added, not overridden: +variant=rope"
    )


def misspelled(name: str) -> str:
    """A near miss: the last character dropped, or doubled for a short name."""
    return name[:-1] if len(name) > 4 else name + name[-1]


def sections() -> list:
    """(section path, schema) for every section of the configuration, each model family's too."""
    found, todo = [], [("", Config)]
    while todo:
        path, schema = todo.pop()
        found.append((path, schema))
        for f in dataclasses.fields(schema):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default) and f.name != "model":
                todo.append((f"{path}{f.name}.", type(default)))
    return found + [("model.", schema) for schema in MODEL_SCHEMAS.values()]


@pytest.mark.parametrize("path, schema", sections(), ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_misspelled_key_of_every_section_gets_the_closest_key(path, schema):
    family = (
        [f"model={'rnn_bahdanau' if schema is MODEL_SCHEMAS['rnn'] else 'transformer'}"] if path == "model." else []
    )
    # a key of this section whose near miss is closer to it than to any other of the section's keys
    names = [f.name for f in dataclasses.fields(schema) if len(f.name) > 2 and f.name not in ("run_dir", "model")]
    name = next(n for n in names if not any(m != n and misspelled(n) in m for m in names))
    value = "1" if path else "x"  # a top-level key may be a plain string
    message = refusal(*family, f"{path}{misspelled(name)}={value}")
    assert f"did you mean {path}{name}?" in message, message
    assert f"{path}{misspelled(name)}" in message and f"not in '{schema.__name__}'" in message


def test_a_key_of_another_model_family_says_which_family_has_it():
    message = refusal("model=rnn_bahdanau", "model.d_model=256")
    assert message == (
        "model.d_model: Key 'd_model' not in 'RNNConfig': a setting of the transformer family; this model's family is "
        "'rnn'"
    )


def test_a_key_added_with_a_plus_is_refused_rather_than_ignored():
    assert refusal("+train.max_minute=2") == (
        "train.max_minute: Key 'max_minute' not in 'TrainConfig': did you mean train.max_minutes?"
    )


def test_a_value_hydra_reads_only_in_quotes_shows_the_quoted_form():
    assert (
        refusal("data.extra_tag=<BT>")
        == "data.extra_tag=<BT>: Hydra reads this value only in quotes: \"data.extra_tag='<BT>'\""
    )
    check_arguments(["command=train", "data.extra_train=a.tsv", "data.extra_tag='<BT>'"])  # the quoted form composes


@pytest.mark.parametrize("line", ["data.train=a.es,", "name=a]b", "eval.length_buckets=[1,2"])
def test_an_argument_hydras_grammar_cannot_read_is_named_with_its_quoted_form(line):
    """Hydra's message named no argument ("mismatched input '<EOF>' expecting {...}" for a trailing comma)."""
    key, value = line.split("=", 1)
    message = refusal("train.max_steps=3", line)
    assert message.startswith(f"{line}: Hydra cannot read it (") and message.endswith(f"\"{key}='{value}'\""), message


def test_a_null_command_is_refused_as_a_missing_one():
    # command=null passed the check for a missing command and failed in difflib with a TypeError (found by mypy)
    with pytest.raises(UserError, match="^command is not set: python -m app command="):
        check_arguments(["command=null"])


def test_adam_betas_of_other_than_two_values_are_refused():
    # AdamW failed at the first step with a ValueError (three values) or at its start with an IndexError (one)
    assert refusal("train.adam_betas=[0.9,0.98,0.5]") == (
        "train.adam_betas=[0.9, 0.98, 0.5]: give two values, [beta1, beta2]"
    )
    assert refusal("train.adam_betas=[0.9]") == "train.adam_betas=[0.9]: give two values, [beta1, beta2]"


RNN = "model=rnn_bahdanau"
# A number outside what its setting takes, refused when the settings are composed: before, each gave a traceback
# (SentencePiece's C++ check, torch's ValueError or ZeroDivisionError mid-training, a crash at the closing
# validation), a message that named no setting or torch's name for it, or was taken silently (a negative count
# read as 0, a negative time budget that stopped at step 0).
OUT_OF_RANGE = [
    (
        ["tokenizer.vocab_size=0"],
        "tokenizer.vocab_size=0 must be at least 6: the 4 special pieces (pad, unk, bos, eos), the word boundary ▁ "
        "and a character",
    ),
    (
        ["tokenizer.character_coverage=2"],
        "tokenizer.character_coverage=2.0 must be in [0.98, 1] (SentencePiece's range; 1: every character)",
    ),
    (
        ["tokenizer.max_sentence_length=9"],
        "tokenizer.max_sentence_length=9 must be in [10, 1073741824]: bytes of the longest sentence SentencePiece "
        "trains on (its range)",
    ),
    (
        ["tokenizer.input_sentence_size=100"],
        "tokenizer.input_sentence_size=100 must be 0 (every sentence) or more than 100 (SentencePiece's range)",
    ),
    (["train.batch_tokens=0"], "train.batch_tokens=0 must be >= 1: tokens of a batch, padding included"),
    (["train.tokens_per_update=-1"], "train.tokens_per_update=-1 must be >= 0 (0: train.accum_steps decides)"),
    (["train.log_every=0"], "train.log_every=0 must be >= 1: updates between log lines"),
    (["train.eval_every=-1"], "train.eval_every=-1 must be >= 0 (0: no validation)"),
    (["train.save_every=-5"], "train.save_every=-5 must be >= 0 (0: saved at the end only)"),
    (["train.max_minutes=-1"], "train.max_minutes=-1.0 must be >= 0 (0: no time budget)"),
    (["train.max_steps=-1"], "train.max_steps=-1 must be >= 0: updates in all"),
    (["train.lr=0"], "train.lr=0.0 must be > 0: the peak learning rate"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1 must be >= 0 (0: no warm-up)"),
    (["train.label_smoothing=1"], "train.label_smoothing=1.0 must be in [0, 1) (0: none)"),
    (["train.clip_norm=-1"], "train.clip_norm=-1.0 must be > 0: every update's gradient is clipped to this norm"),
    (["train.weight_decay=-0.01"], "train.weight_decay=-0.01 must be >= 0 (0: none)"),
    (["train.adam_betas=[0.9,1.0]"], "train.adam_betas=[0.9, 1.0]: each must be in [0, 1)"),
    (["train.patience=-1"], "train.patience=-1 must be >= 0 (0: never stop early)"),
    (["train.keep_best=-2"], "train.keep_best=-2 must be >= 0 (0: none)"),
    (["train.max_bad_steps=-1"], "train.max_bad_steps=-1 must be >= 0 (0: never abort)"),
    (["train.max_dev_sentences=-1"], "train.max_dev_sentences=-1 must be >= 0 (0: the whole dev split)"),
    (["model.enc_layers=0"], "model.enc_layers=0 must be at least 1 (encoder layers)"),
    (["model.heads=0"], "model.heads=0 must be at least 1 (attention heads)"),
    (["model.dropout=1.5"], "model.dropout=1.5 must be in [0, 1): a probability of dropping, 0 for none"),
    (["model.max_len=1"], "model.max_len=1 must be at least 2: a sentence takes max_len - 1 pieces"),
    (  # it guided and copied through layer 1 (3 % 2), silently
        ["model.align_layer=3", "model.dec_layers=2"],
        "model.align_layer=3: this model has 2 decoder layers; give -2 to 1 (-2: the penultimate)",
    ),
    (
        ["model.align_layer=-3", "model.dec_layers=1"],
        "model.align_layer=-3: this model has 1 decoder layer; give -1 to 0 (-2: the penultimate)",
    ),
    ([RNN, "model.dec_layers=0"], "model.dec_layers=0 must be at least 1 (decoder layers)"),
    ([RNN, "model.emb_dim=0"], "model.emb_dim=0 must be at least 1 (the embeddings' width)"),
    (
        [RNN, "model.activation_dropout=1"],
        "model.activation_dropout=1.0 must be in [0, 1): a probability of dropping, 0 for none",
    ),
    (
        ["data.dev_fraction=-0.1"],
        "data.dev_fraction=-0.1 must be in [0, 1): the share of the pairs carved out of train for dev (unless data.dev "
        "is given)",
    ),
    (
        ["data.dev_fraction=0.5", "data.test_fraction=0.5"],
        "data.dev_fraction=0.5 and data.test_fraction=0.5 must add up to less than 1: the rest is the train split",
    ),
    (["data.max_train_pairs=-1"], "data.max_train_pairs=-1 must be >= 0 (0: all)"),
    (
        ["data.filters.min_chars=50", "data.filters.max_chars=10"],
        "data.filters.max_chars=10 must be >= 1 and >= data.filters.min_chars=50: every pair would be dropped",
    ),
    (
        ["data.filters.max_ratio=-1"],
        "data.filters.max_ratio=-1.0 must be 0 (off) or at least 1: the longer side's length over the shorter's",
    ),
    (["decode.n_best=0"], "decode.n_best=0 must be >= 1: hypotheses per input"),
    (
        ["model=rnn_luong", "model.local_alignment=predictive"],
        "model.local_alignment=predictive places a local window: set model.local_window (0: global attention)",
    ),
    (["model=rnn_luong", "model.local_window=-1"], "model.local_window=-1 must be >= 0 (0: global attention)"),
    (
        ["model=rnn_bahdanau", "model.local_window=5"],
        "model.local_window=5: local attention is Luong's (model.attention=luong); model.attention=bahdanau attends "
        "globally",
    ),
    (["decode.mbr_candidates=1"], "decode.mbr_candidates=1 must be 0 (off) or >= 2: the candidates to choose among"),
    (
        ["decode.mbr_candidates=8"],
        "decode.mbr_candidates=8 chooses among the beam's 8 best: decode.beam_size must be >= 8 (it is 5), or "
        "decode.sampling=true draws 8 samples",
    ),
    (
        ["decode.beam_size=1", "decode.sampling=true", "decode.mbr_candidates=4", "decode.n_best=5"],
        "decode.n_best=5 must be <= decode.mbr_candidates=4: the candidates ranked",
    ),
    (["decode.sampling_epsilon=1"], "decode.sampling_epsilon=1.0 must be in [0, 1) (0: no cut)"),
    (["decode.max_len_extra=-1"], "decode.max_len_extra=-1 must be in [0, 100000]: pieces beyond the ratio"),
    # a traceback in the beam search (no hypothesis with a finite score), in the cache's allocation (a length limit
    # past int64), or garbage with exit status 0 (a temperature of nan: the last piece of the vocabulary, repeated)
    (["decode.length_penalty=nan"], "decode.length_penalty=nan must be in [-10, 10] (GNMT's α; 0: off)"),
    (["decode.length_penalty=1000"], "decode.length_penalty=1000.0 must be in [-10, 10] (GNMT's α; 0: off)"),
    (["decode.coverage_penalty=inf"], "decode.coverage_penalty=inf must be in [0, 10] (GNMT's β; 0: off)"),
    (["decode.sampling_temperature=nan"], "decode.sampling_temperature=nan must be in [0.001, 1000]"),
    (["decode.sampling_temperature=1e-300"], "decode.sampling_temperature=1e-300 must be in [0.001, 1000]"),
    (["decode.max_len_ratio=inf"], "decode.max_len_ratio=inf must be in [0, 100]: a limit per source piece"),
    (
        ["decode.max_len_extra=9223372036854775807"],
        "decode.max_len_extra=9223372036854775807 must be in [0, 100000]: pieces beyond the ratio",
    ),
    (
        ["decode.max_len_ratio=0", "decode.max_len_extra=0"],
        "decode.max_len_ratio=0 with decode.max_len_extra=0 limits every output to 0 pieces",
    ),
    (
        ["eval.length_buckets=[30,10,-5]"],  # its figures counted 26 sentences of a 14-sentence split, status 0
        "eval.length_buckets=[30, 10, -5] must be source lengths in words, each >= 1 and larger than the one before: "
        "the buckets' edges (e.g. [10,20,30])",
    ),
    (["bench.steps=1"], "bench.steps=1 must be >= 2: the timed steps, in two rounds"),  # an AssertionError at the end
    (["bench.decode_rounds=0"], "bench.decode_rounds=0 must be >= 1: decodings timed"),
    (["decode.batch_tokens=0"], "decode.batch_tokens=0 must be >= 1: tokens of a decoding batch"),
]


@pytest.mark.parametrize("overrides, message", OUT_OF_RANGE, ids=[" ".join(o) for o, _ in OUT_OF_RANGE])
def test_a_number_out_of_its_range_is_refused_naming_the_setting(overrides, message):
    assert refusal(*overrides) == message


@pytest.mark.parametrize(
    "overrides",
    [
        # 0 where training reads it as off, none or all
        ["train.eval_every=0", "train.save_every=0", "train.patience=0", "train.keep_last=0", "train.max_bad_steps=0"],
        ["train.max_steps=0", "train.max_minutes=0", "train.warmup_steps=0", "train.tokens_per_update=0"],
        ["train.label_smoothing=0", "train.weight_decay=0", "train.adam_betas=[0,0.999]", "train.max_dev_sentences=0"],
        # the ends of SentencePiece's ranges
        ["tokenizer.vocab_size=6", "tokenizer.character_coverage=0.98", "tokenizer.max_sentence_length=10"],
        ["tokenizer.input_sentence_size=0", "tokenizer.character_coverage=1"],
        ["model.dropout=0", "model.attention_dropout=0", "model.activation_dropout=0", "model.max_len=2"],
        ["model.dec_layers=1"],  # the default align_layer -2: its one layer
        ["model.dec_layers=3", "model.align_layer=-3"],
        ["model.dec_layers=3", "model.align_layer=2"],
        [RNN, "model.dropout=0", "model.activation_dropout=null", "model.enc_layers=1", "model.dec_layers=1"],
        ["data.dev_fraction=0", "data.test_fraction=0.99", "data.filters.max_ratio=0", "data.max_train_pairs=0"],
        ["data.filters.max_ratio=1", "data.filters.max_chars=1"],
        ["decode.max_len_ratio=0", "decode.max_len_extra=1", "decode.batch_tokens=1", "decode.length_penalty=0"],
        ["decode.max_len_ratio=100", "decode.max_len_extra=100000", "decode.length_penalty=-10"],
        ["decode.length_penalty=10", "decode.coverage_penalty=10", "decode.sampling_temperature=0.001"],
        ["decode.sampling_temperature=1000", "eval.length_buckets=[1,2]", "eval.length_buckets=[]", "bench.steps=2"],
    ],
)
def test_the_ends_of_each_range_compose(overrides):
    check_arguments(["command=train", *overrides])


def test_an_unknown_command_gets_the_closest_one():
    assert refusal("command=trian").startswith("command='trian' is unknown: did you mean command=train?")


@pytest.mark.parametrize("model", sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "model"))))
def test_the_quick_preset_composes_with_every_model_without_dropout(model):
    cfg = compose_config("experiment=quick", f"model={model}")
    assert cfg.model.dropout == 0 and cfg.train.max_minutes == 12
    if cfg.model.arch == "rnn":
        assert cfg.model.attention_dropout == 0 and cfg.model.activation_dropout == 0


def test_a_presets_bad_key_is_one_line_with_the_key_the_section_and_the_preset(tmp_path):
    """Hydra puts the cause of a preset's bad key on the second line of its message: the one line keeps it."""
    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "mine.yaml").write_text("# @package _global_\nmodel:\n  d_model: 128\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(Exception) as caught:
            compose("config", overrides=["command=train", "model=rnn_luong", "experiment=mine"])
    assert "\n" in str(caught.value)  # the shape this test is about
    assert config_error(caught.value) == (
        "model.d_model: Key 'd_model' not in 'RNNConfig' (set by the preset experiment/mine): a setting of the "
        "transformer family; this model's family is 'rnn'"
    )


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_the_cli_refuses_an_unknown_preset_before_making_any_folder(tmp_path, group):
    override = f"{group}=nosuch" if in_defaults(group) else f"+{group}=nosuch"
    result = run_cli(tmp_path, "command=train", *TINY, "name=refused", override)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {refusal(override)}"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "data").exists()


@pytest.mark.slow
def test_make_refuses_a_setting_outside_args():
    # As typed in a terminal: not inside make test's own make, whose level and flags a child make inherits
    # (it would print "Entering directory" lines).
    shell = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(
        ["make", "-n", "eval", "ARGS=name=quick", "decode.beam_size=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=shell,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert (
        'decode.beam_size=1 is a setting outside ARGS: quote them all, make eval ARGS="name=quick decode.beam_size=1"'
        in (result.stderr)
    )


def test_args_are_split_at_spaces_outside_quotes_and_keep_them():
    assert typed_arguments("""a=1  b='x,y' c='<BT>' d='my file.tsv' e=[1,2] f="q r" g="it's" """) == [
        "a=1",
        "b='x,y'",
        "c='<BT>'",
        "d='my file.tsv'",
        "e=[1,2]",
        'f="q r"',
        'g="it\'s"',
    ]
    assert typed_arguments("") == typed_arguments("  ") == []
    with pytest.raises(UserError, match="^ARGS=a='x: its ' quote is not closed$"):
        typed_arguments("a='x")


@pytest.mark.slow
def test_make_hands_args_over_as_typed_quotes_and_all(tmp_path):
    """The shell strips quotes from a command line, and Hydra reads a value holding a comma or <, > only in quotes:
    make passes ARGS to the app as typed, so the forms the docs and the refusals show work through make."""
    shell = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    rows = [(f"frase numero {i} de prueba", f"test sentence number {i}") for i in range(100)]
    for name, column in (("a.es", 0), ("a.en", 1), ("b.es", 0), ("b.en", 1)):
        bt = name.startswith("b")
        (tmp_path / name).write_text("".join(("otra " * bt) + r[column] + "\n" for r in rows), encoding="utf-8")
    args = (
        f"data=files data.train='{tmp_path}/a.es,{tmp_path}/a.en' data.dir={tmp_path}/d tokenizer.vocab_size=60 "
        "data.dev_fraction=0.1 data.test_fraction=0.1 "
        f"data.extra_train='{tmp_path}/b.es,{tmp_path}/b.en' data.extra_tag='<BT>'"
    )
    result = subprocess.run(
        ["make", "-s", "data", f"ARGS={args}"], cwd=REPO, capture_output=True, text=True, env=shell, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "d" / "prepare.json", encoding="utf-8") as f:
        report = json.load(f)
    assert report["extra"] == {"pairs": 100, "dropped": {}} and report["pairs"]["train"] > 150
