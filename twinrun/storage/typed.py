"""Checking a JSON document against a TypedDict schema, field by field: a field typed `X | None` may be
null or absent, NotRequired[X] may be absent, Annotated marks ("hex digest", "positive", "safe name",
"non-negative", "not nan") add what a Python type cannot say. A failure is one StoreError naming the
file and the field's path (exit 2), never a traceback or a number. Each schema's hints are worked out once.
"""

import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Literal, NotRequired

from twinrun.errors import StoreError
from twinrun.files import safe_name

HEX = re.compile(r"[0-9a-f]+")


class Checker:
    """Field checks for one document; each failure names the file and the field's path."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def fail(self, field: str, problem: str) -> typing.NoReturn:
        raise StoreError(self.path, f"field {field}: {problem}; the file is damaged or was edited by hand")

    def get(self, obj: dict, key: str, field: str, types, optional: bool = False):
        if key not in obj:
            if optional:
                return None
            self.fail(field, "missing")
        value = obj[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a count or index must not be one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            self.fail(field, f"{show(value)} is not {_type_names(types)}")
        return value

    def number(self, obj: dict, key: str, field: str, low: float = -math.inf, optional: bool = False):
        value = self.get(obj, key, field, (int, float), optional)
        if value is not None and not (math.isfinite(value) and value > low):
            self.fail(field, f"{show(value)} must be finite and > {low:g}")
        return value

    def one_of(self, obj: dict, key: str, field: str, choices) -> str:
        value = self.get(obj, key, field, str)
        if value not in choices:
            self.fail(field, f"{show(value)} is not one of {', '.join(choices)}")
        return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "true/false",
                        "list": "a list", "dict": "an object"}[t.__name__] for t in _tuple(types))


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_typed(c: Checker, obj, schema: type, field: str):
    """`obj` checked against a TypedDict, field by field (extra keys allowed)."""
    if not isinstance(obj, dict):
        c.fail(field or "(document)", f"{show(obj)} is not an object")
    for key, spec, required in _fields(schema):
        _check_field(c, obj, key, f"{field}.{key}" if field else key, spec, required)
    return obj


class _Spec(typing.NamedTuple):
    """What a field's type hint asks, worked out once per hint (run.json is checked on every update: the
    typing module's introspection, repeated per unit, was most of the cost)."""

    nullable: bool
    marks: tuple
    choices: tuple | None  # a Literal's
    types: tuple  # the Python types the value may have
    items: "_Spec | None"  # a list's or dict's elements
    origin: type | None  # list, dict or None
    schema: type | None  # a TypedDict's


@functools.cache
def _fields(schema: type) -> tuple:
    hints = typing.get_type_hints(schema, include_extras=True)
    return tuple((key, _spec(hint), key in schema.__required_keys__) for key, hint in hints.items())


@functools.cache
def _spec(hint) -> _Spec:
    hint, nullable = _without_none(hint)
    base, marks = (hint.__origin__, hint.__metadata__) if typing.get_origin(hint) is Annotated else (hint, ())
    origin = typing.get_origin(base)
    if origin is Literal:
        return _Spec(nullable, (), typing.get_args(base), (str,), None, None, None)
    items = (_spec(typing.get_args(base)[0]) if origin is list
             else _spec(typing.get_args(base)[1]) if origin is dict else None)
    return _Spec(nullable, tuple(marks), None, _python_types(base), items,
                 origin if origin in (list, dict) else None, base if typing.is_typeddict(base) else None)


def _check_field(c: Checker, obj: dict, key: str, field: str, spec: _Spec, required: bool) -> None:
    if key not in obj and not (required and not spec.nullable):
        return
    if spec.choices is not None:
        c.one_of(obj, key, field, spec.choices)
        return
    value = c.get(obj, key, field, spec.types, optional=spec.nullable)
    if value is None:
        return
    for mark in spec.marks:
        _check_mark(c, value, field, mark)
    if spec.origin is list:
        for i, item in enumerate(value):
            _check_item(c, item, f"{field}[{i}]", spec.items)
    elif spec.origin is dict:
        for k, item in value.items():
            _check_item(c, item, f"{field}.{k}", spec.items)
    elif spec.schema is not None:
        check_typed(c, value, spec.schema, field)


def _check_item(c: Checker, item, field: str, spec: _Spec) -> None:
    """One element of a list or dict field, checked as a field of its own."""
    _check_field(c, {"item": item}, "item", field, spec, True)


def _without_none(hint):
    """(the hint without None (and without NotRequired, which __required_keys__ says), whether None is
    allowed)."""
    if typing.get_origin(hint) is NotRequired:
        hint = typing.get_args(hint)[0]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _python_types(base) -> tuple:
    if typing.is_typeddict(base):
        return (dict,)
    origin = typing.get_origin(base) or base
    return (int, float) if origin is float else (origin,)


def _check_mark(c: Checker, value, field: str, mark: str) -> None:
    if mark == "hex digest" and not HEX.fullmatch(value):
        c.fail(field, f"{show(value)} is not a hex digest")
    elif mark == "hex digest or blank" and value and not HEX.fullmatch(value):
        c.fail(field, f"{show(value)} is neither a hex digest nor blank")
    elif mark == "positive" and not (math.isfinite(value) and value > 0):
        c.fail(field, f"{show(value)} must be finite and > 0")
    elif mark == "not nan" and math.isnan(value):
        c.fail(field, "NaN is not a number twinrun writes (it writes null where a number is undefined)")
    elif mark == "non-negative" and value < 0:
        c.fail(field, f"{show(value)} must be ≥ 0")
    elif mark == "safe name":
        safe_name(value, field, c.path)
