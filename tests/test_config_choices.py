"""Settings with a fixed set of values are checked by the schema when a section is built (from the command
line through OmegaConf, or from a checkpoint's stored dict), with one message for all of them."""

import dataclasses

import pytest

from app.config.commands import DecodeConfig, ExportConfig
from app.config.load import config_from_dict
from app.config.schema import RNNConfig, TrainConfig, TransformerConfig, check_choices
from app.run.errors import UserError

CHOICES = [
    (TrainConfig, "amp", "fp16", "train.amp='fp16' is not a choice: choose auto, bf16 or fp32"),
    (
        TrainConfig,
        "compile_mode",
        "fast",
        "train.compile_mode='fast' is not a choice: choose default, reduce-overhead, max-autotune or "
        "max-autotune-no-cudagraphs",
    ),
    (
        ExportConfig,
        "quantization",
        "int4",
        "export.quantization='int4' is not a choice: choose int8, int8_float16, float16 or none",
    ),
    (
        TransformerConfig,
        "pos",
        "relative",
        "model.pos='relative' is not a choice: choose sinusoidal, learned, rope or alibi",
    ),
    (RNNConfig, "cell", "rnn", "model.cell='rnn' is not a choice: choose gru or lstm"),
    (DecodeConfig, "mbr_utility", "comet", "decode.mbr_utility='comet' is not a choice: choose chrf or bleu"),
]


@pytest.mark.parametrize("section, name, value, message", CHOICES)
def test_a_value_outside_the_choices_is_refused_in_one_line(section, name, value, message):
    with pytest.raises(UserError) as err:
        section(**{name: value})
    assert str(err.value) == message


def test_an_optional_choice_may_stay_unset_and_says_so():
    from app.config.commands import EvalConfig

    assert EvalConfig(align_scope=None).align_scope is None
    with pytest.raises(
        UserError, match=r"eval.align_scope='some' is not a choice: choose all, linked or unset \(null\)"
    ):
        EvalConfig(align_scope="some")


def test_a_stored_configuration_is_checked_too():
    with pytest.raises(UserError, match="train.average_from='first' is not a choice"):
        config_from_dict({"train": {"average_from": "first"}})


def test_every_default_is_one_of_its_choices():
    from app.config.schema import Config

    cfg = Config()
    for section in [cfg.data, cfg.tokenizer, cfg.model, cfg.train, cfg.eval, cfg.translate, cfg.export, RNNConfig()]:
        check_choices(section)  # raises on a default outside its choices
        assert any(f.metadata.get("choices") for f in dataclasses.fields(section)), type(section).__name__
