"""Settings with a fixed set of values: declared with ``choice`` in the schema (app/config/schema.py) and checked
once, with one message, when their section is built (from the command line or a checkpoint's stored dict).
OmegaConf, which builds the sections, does not take ``Literal`` annotations, so the choices ride in the
field's metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar, Optional

from app.run.errors import UserError


def choice(default: Optional[str], *others: Optional[str]) -> Any:
    """A setting with a fixed set of values (``default`` and ``others``), checked when its section is built."""
    return field(default=default, metadata={"choices": (default, *others)})


def check_choices(settings: Any) -> None:
    """One message for every setting given a value outside its choices (``choice`` fields)."""
    for f in dataclasses.fields(settings):
        choices = f.metadata.get("choices")
        value = getattr(settings, f.name)
        if choices and value not in choices:
            named = [str(c) for c in choices if c is not None] + ["unset (null)"] * (None in choices)
            raise UserError(
                f"{settings.section}.{f.name}={value!r} is not a choice: choose {', '.join(named[:-1])} or {named[-1]}"
            )


class Checked:
    """A section whose ``choice`` settings are checked when it is built (also from a checkpoint's dict)."""

    section: ClassVar[str]  # its name on the command line: class TrainConfig(Checked, section="train")

    def __init_subclass__(cls, section: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = section or getattr(cls, "section", "")

    def __post_init__(self) -> None:
        check_choices(self)
