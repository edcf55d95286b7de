"""A request the schema refuses (``TranslateRequest``), in one line naming every unknown field, every missing one
and every wrong type, with what each field takes, in words."""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Optional, Union, get_args, get_origin

from fastapi.exceptions import RequestValidationError

from app.serve.messages import TranslateRequest, lone_surrogate

# what a value of a type is called in a refusal: one, and several (in a list)
TYPE_NAMES = {str: ("a string", "strings"), int: ("an integer", "integers"), bool: ("true or false", "true or false")}


def type_name(annotation: Any, plural: bool = False) -> str:
    """What a value of ``annotation`` is, in words: "a string or a list of strings", "an integer or null"."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0], plural)
    if origin in (Union, types.UnionType):
        names = [type_name(a, plural) for a in args if a is not type(None)] + ["null"] * (type(None) in args)
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if origin is list:
        return ("lists of " if plural else "a list of ") + type_name(args[0], plural=True) if args else "a list"
    known = TYPE_NAMES.get(annotation)
    return known[plural] if known else getattr(annotation, "__name__", str(annotation))


def expected(field: str) -> str:
    """What the request's ``field`` takes, in words (a field it does not have: "")."""
    info = TranslateRequest.model_fields.get(field)
    return "" if info is None else type_name(info.annotation)


# what each wrong type of a value inside a field (a line of a list) should have been
ELEMENT_TYPES = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "true or false",
    "list_type": "a list",
}


def shown(value: Any, limit: int = 40) -> str:
    """A value as the JSON that sent it, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


JSON_KINDS: dict[type, str] = {list: "array", str: "string", dict: "object"}


def json_kind(value: Any) -> str:
    """What a JSON value is: "a JSON array", "JSON null"."""
    if value is None or isinstance(value, bool):
        return f"JSON {json.dumps(value)}"
    return "a JSON " + JSON_KINDS.get(type(value), "number")


def field_problems(field: str, errors: list[dict]) -> list[str]:
    """The wrong types (or other wrong values) of one field (``errors``' loc: inside the field): its lines' where it
    is a list with wrong lines, else the field's, with what it takes (a union is refused once, not per member)."""
    inside = [e for e in errors if any(isinstance(part, int) for part in e["loc"])]
    if inside:  # a list, some of whose lines are wrong: name each line
        problems = []
        for e in inside:
            where = field + "".join(f"[{part}]" for part in e["loc"] if isinstance(part, int))
            if e["type"] in ELEMENT_TYPES:
                problems.append(f'wrong type: "{where}" should be {ELEMENT_TYPES[e["type"]]} (got {shown(e["input"])})')
            else:
                problems.append(f'"{where}": {e["msg"]}')
        return problems
    if expected(field) and all(e["type"].endswith("_type") for e in errors):
        return [f'wrong type: "{field}" should be {expected(field)} (got {shown(errors[0].get("input"))})']
    return list(dict.fromkeys(f'"{field}": {e["msg"]}' for e in errors))


def validation_message(err: RequestValidationError) -> tuple[int, str]:
    """A refused body in one line: 400 for JSON that does not parse; 422 for no body, a body that is not a JSON
    object, or fields that are wrong, naming every unknown field, every missing one and every wrong type (in groups,
    "; " between them)."""
    errors = err.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            at = [part for part in e.get("loc", ()) if isinstance(part, int)]
            return 400, f"malformed JSON: {e.get('ctx', {}).get('error', e.get('msg'))}" + (
                f" (at character {at[0]})" if at else ""
            )
    required = [
        f'"{name}" ({expected(name)})' for name, info in TranslateRequest.model_fields.items() if info.is_required()
    ]
    send = f'send a JSON object with {", ".join(required)}, e.g. {{"text": "Hola"}}'
    unknown: list[str] = []
    missing: list[str] = []
    fields: dict[str, list[dict]] = {}  # the errors inside each field
    other: list[str] = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        loc = loc[1:] if loc[:1] == ("body",) else loc  # the field, then union members and list indices
        if not loc:  # the body as a whole
            value = e.get("input")
            if e["type"] == "missing":
                other.append(f"no body: {send}")
            elif isinstance(value, bytes) and e["type"] == "model_attributes_type":  # not sent as JSON
                other.append("the body was not read as JSON: send it with Content-Type: application/json")
            elif e["type"] == "model_attributes_type":
                other.append(f"the body is {json_kind(value)}, not an object: {send}")
            elif e["type"] == "string_unicode" and isinstance(value, str):  # a field's name (the key)
                other.append(f"a field's name: {lone_surrogate(value) or e['msg']}")
            else:
                other.append(f"the body: {e['msg']}")
        elif e["type"] == "extra_forbidden":
            unknown.append(str(loc[0]))
        elif e["type"] == "missing" and len(loc) == 1:
            missing.append(str(loc[0]))
        else:
            fields.setdefault(str(loc[0]), []).append({**e, "loc": loc[1:]})
    problems = []
    if unknown:
        names = ", ".join(f'"{name}"' for name in dict.fromkeys(unknown))
        known = ", ".join(TranslateRequest.model_fields)
        problems.append(f"unknown field{'s' * (len(set(unknown)) > 1)} {names} (known: {known})")
    if missing:
        names = ", ".join(f'"{name}" ({expected(name)})' if expected(name) else f'"{name}"' for name in missing)
        problems.append(f"missing field{'s' * (len(missing) > 1)} {names}")
    for field, field_errors in fields.items():
        problems += field_problems(field, field_errors)
    return 422, "; ".join(problems + other)


def unreadable_body(cause: Optional[BaseException]) -> Optional[tuple[int, str]]:
    """A body FastAPI could not read as JSON for another reason than its syntax (``cause``: what its JSON parser
    raised), as a status and one line: bytes that are not UTF-8, nesting deeper than the parser goes; None for
    another cause."""
    if isinstance(cause, UnicodeDecodeError):
        return 400, f"malformed JSON: not valid {cause.encoding.upper()} (at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return 400, "malformed JSON: nested too deep to read (a request's values nest 2 lists deep at most)"
    return None
