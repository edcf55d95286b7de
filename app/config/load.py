"""The configuration read: Hydra's composed settings (the schema registered in its ConfigStore) or a run's
stored dict (checkpoint, config.yaml) turned into the schema's dataclasses (app/config/schema.py), and a
configuration error of OmegaConf or Hydra as one line naming its key."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterator
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config.schema import MODEL_SCHEMAS, Config, ModelConfig
from app.run.errors import UserError


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
    assert isinstance(config, Config)  # the composed configuration is a structured one of the schema
    added = _added_keys(config)
    if added:  # ``+section.key=...`` adds a key the schema does not have: nothing would read it
        key, schema = added[0]
        raise UserError(
            f"{key}: Key {key.rpartition('.')[2]!r} not in {schema.__name__!r}{_suggestion(key, schema.__name__)}"
        )
    required = {"files": "train", "hf": "hf_path"}.get(config.data.source)
    if required and not getattr(config.data, required):
        raise UserError(
            f"data.{required} is not set: data.source={config.data.source} needs it "
            f"(see conf/data/{config.data.source}.yaml)"
        )
    return config


def parsed_override(parser: Any, line: str) -> Any:
    """One command-line override as Hydra's grammar reads it (``parser``: an OverridesParser); one it cannot read is
    a UserError naming it (Hydra's own message names no argument: ``mismatched input '<EOF>'`` for ``a.es,``), with
    its quoted form, which reads the value as it is."""
    from hydra.errors import HydraException

    try:
        return parser.parse_overrides([line])[0]
    except HydraException as err:
        message = config_error(err)
        key, _, value = line.partition("=")
        if message.startswith(f"{key}="):  # config_error's own line for it
            raise UserError(message) from None
        raise UserError(
            f"{line}: Hydra cannot read it ({message}); quoted, the value is read as it is: \"{key}='{value}'\""
        ) from None


def config_error(err: Exception) -> str:
    """One line for a configuration error of OmegaConf or Hydra, whatever the shape of its message: where it was
    raised (a preset), the key, the cause, and the closest known key of the section for a misspelled one."""
    chain = list(_chain(err))
    cause = next((e for e in reversed(chain) if getattr(e, "full_key", None)), chain[-1])
    key = getattr(cause, "full_key", None) or _field(chain, "full_key")
    text = "\n".join(str(e) for e in chain)
    missing = re.search(r"Could not find '(.+)/([^/']+)'", text)
    if missing and "Available options" in text:  # an unknown preset: list them
        listed = text.split("Available options", 1)[1].split("Config search path")[0]
        group, choice = missing.groups()
        available = ", ".join(listed.split(":", 1)[-1].split())
        return f"{group}={choice} is not a preset of conf/{group}/: available: {available}"
    # the first line that is not a heading: Hydra composing a preset's keys puts the cause on the next line
    lines = _lines(str(cause)) or _lines(text)
    message = next((line for line in lines if not line.endswith(":")), lines[0] if lines else type(err).__name__)
    where = re.match(r"In '([^']+)': \w+ raised while composing config", text)
    unreadable = re.fullmatch(r"LexerNoViableAltException: ([\w.+~]+)=(.*)", message)
    if unreadable:  # a value with characters Hydra's grammar reads only in quotes (<, >, =, ...)
        key, value = unreadable.groups()
        return f"{key}={value}: Hydra reads this value only in quotes: \"{key}='{value}'\""
    if "Missing mandatory value" in message and key:
        return f"{key} is not set: give {key}=..."
    if where:
        message = f"{message} (set by the preset {where.group(1)})"
    if key and key not in message:
        message = f"{key}: {message}"
    unknown = re.search(r"Key '([^']+)' not in '(\w+)'", message)
    if unknown and key:
        message += _suggestion(key, unknown.group(2))
    elif message.startswith("Could not override '") and "No match in the defaults list" in message:
        group, added = message.split("'")[1], re.search(r"use (\+\S+)", text)
        addition = added.group(1) if added else f"+{group}=..."
        message = f"{group} is not in the defaults list, so it is added, not overridden: {addition}"
    return message


def _added_keys(settings: Any, prefix: str = "") -> list[tuple[str, type]]:
    """Keys of a built section that are none of its schema's fields (given with a leading +), with the schema."""
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    added = [(f"{prefix}{name}", type(settings)) for name in vars(settings) if name not in fields]
    for name, value in fields.items():
        if dataclasses.is_dataclass(value):
            added += _added_keys(value, f"{prefix}{name}.")
    return added


def _chain(err: BaseException) -> Iterator[BaseException]:
    """The error and its causes, outermost first."""
    current: Optional[BaseException] = err
    while current is not None:
        yield current
        current = current.__cause__ or (current.__context__ if not current.__suppress_context__ else None)


def _lines(text: str) -> list[str]:
    """A message's lines, without OmegaConf's indented detail lines (full_key, object_type, ...)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("    ")]


def _field(chain: list, name: str) -> Optional[str]:
    """A detail line (``    full_key: model.x``) of a message that carries it only as text."""
    for err in chain:
        found = re.search(rf"^\s+{name}: (\S+)$", str(err), re.MULTILINE)
        if found:
            return found.group(1)
    return None


def _suggestion(key: str, schema_name: str) -> str:
    """For a key its section does not have: the closest key the section has, by similarity of spelling
    (difflib's ratio), or the model family that has it."""
    section, _, name = key.rpartition(".")
    schema = next((s for s in _schemas() if s.__name__ == schema_name), None)
    if schema is None:
        return ""
    family = next((arch for arch, s in MODEL_SCHEMAS.items() if s is schema), None)
    if family is not None:
        others = [arch for arch, s in MODEL_SCHEMAS.items() if name in {f.name for f in dataclasses.fields(s)}]
        if others:
            return f": a setting of the {others[0]} family; this model's family is {family!r}"
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(schema)], n=1, cutoff=0.6)
    return f": did you mean {section + '.' if section else ''}{close[0]}?" if close else ""


def _schemas() -> list[type]:
    """Every section's dataclass, from the root down."""
    found: list[type] = []
    todo: list[type] = [Config]
    while todo:
        schema = todo.pop()
        found.append(schema)
        for f in dataclasses.fields(schema):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default) and type(default) not in found:
                todo.append(type(default))
    return found + [s for s in MODEL_SCHEMAS.values() if s not in found]


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


def check_compatible(state: dict, path: str, vocab: dict, model_cfg: ModelConfig, free: tuple = ()) -> None:
    """A checkpoint must match the run's vocabulary and model settings (those of its family) but the ``free``
    ones; the error names what differs."""
    check_vocabulary(state, path, vocab)
    check_model_settings(state, path, model_cfg, free)


def check_vocabulary(state: dict, path: str, vocab: dict) -> None:
    """A checkpoint's vocabulary (its tokenizer's fingerprint) must be the run's."""
    if state.get("vocab") != vocab:
        raise UserError(
            f"{path}: trained with another vocabulary ({state.get('vocab')} vs this run's {vocab}); "
            "use the tokenizer settings of that run or another name="
        )


def check_model_settings(state: dict, path: str, model_cfg: ModelConfig, free: tuple = ()) -> None:
    """A checkpoint's model settings (those of its family) must be the run's, but the ``free`` ones."""
    theirs, ours = model_settings(state["config"]["model"]), model_settings(model_cfg)
    if theirs.get("arch") != ours.get("arch"):  # another family: its every setting differs, say only that
        theirs, ours = {"arch": theirs.get("arch")}, {"arch": ours.get("arch")}
    differ = [
        f"model.{k}={theirs.get(k)!r} there, {ours.get(k)!r} here"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k) and k not in free
    ]
    if differ:
        raise UserError(f"{path}: model settings differ from this run's: {'; '.join(differ)}")
