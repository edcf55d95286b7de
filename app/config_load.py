"""The configuration read: Hydra's composed settings (the schema registered in its ConfigStore) or a run's
stored dict (checkpoint, config.yaml) turned into the schema's dataclasses (app/config.py), and a
configuration error of OmegaConf or Hydra as one line naming its key."""

from __future__ import annotations

import dataclasses

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config import MODEL_SCHEMAS, Config, ModelConfig
from app.errors import UserError


def register_configs() -> None:
    """The root schema, with ``model`` open: each model preset brings its family's schema
    (``/schema/model/transformer`` or ``/schema/model/rnn`` in its defaults list)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    root = OmegaConf.structured(Config)
    root.command, root.model = MISSING, MISSING  # given on the command line; by a model= preset
    # derived when the dataclasses are built (__post_init__), from the values the user gave: unset here
    root.run_dir = None
    for key in ("name", "dir", "src_field", "tgt_field"):
        root.data[key] = None
    store.store(name="config_schema", node=root)
    for arch, schema in MODEL_SCHEMAS.items():
        store.store(group="schema/model", name=arch, node=schema)


def load_config(cfg: DictConfig) -> Config:
    """The composed configuration as the schema's dataclasses; a setting that is missing, unresolvable
    or of the wrong type is a one-line UserError naming its key."""
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise UserError(config_error(err)) from None
    required = {"files": "train", "hf": "hf_path"}.get(config.data.source)
    if required and not getattr(config.data, required):
        raise UserError(
            f"data.{required} is not set: data.source={config.data.source} needs it "
            f"(see conf/data/{config.data.source}.yaml)"
        )
    return config


def config_error(err: Exception) -> str:
    """One line for a configuration error of OmegaConf or Hydra, naming the key where known."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    key = getattr(cause, "full_key", None)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip() and not line.startswith("    ")]
    message = lines[0] if lines else type(err).__name__
    if "Missing mandatory value" in message and key:
        return f"{key} is not set: give {key}=..."
    if "Could not find" in message and "Available options" in str(cause):  # an unknown preset: list them
        listed = str(cause).split("Available options", 1)[1].split("Config search path")[0]
        return f"{message}; available: {', '.join(listed.split(':', 1)[-1].split())}"
    return f"{key}: {message}" if key and key not in message else message


def config_from_dict(stored: dict) -> Config:
    """A configuration stored with a run (checkpoint, config.yaml) as the schema's dataclasses. Keys
    this version does not know (an older checkpoint's) are left out; the model section keeps the keys
    of its own family."""
    return _from_dict(Config, stored)


def _from_dict(schema: type, values: dict):
    kwargs = {}
    for f in dataclasses.fields(schema):
        if f.name not in values:
            continue
        value = values[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if f.name == "model" and schema is Config:
            value = _from_dict(MODEL_SCHEMAS[value.get("arch", "transformer")], value)
        elif dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = _from_dict(type(default), value)
        kwargs[f.name] = value
    return schema(**kwargs)


def model_settings(model_cfg: ModelConfig | dict) -> dict:
    """The settings of a model's family (a dataclass, or a stored dict that may hold every family's keys)."""
    values = model_cfg if isinstance(model_cfg, dict) else dataclasses.asdict(model_cfg)
    schema = MODEL_SCHEMAS.get(values.get("arch", "transformer"))
    return dataclasses.asdict(_from_dict(schema, values)) if schema else dict(values)
