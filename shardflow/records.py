"""Typed values read back from JSON (a record a store keeps, a flow's result): a frozen dataclass whose fields
are JSON's kinds (int, float, str, bool, dict, None, tuples of them) or such dataclasses, each field checked
against its annotation and the first bad one named, as zarr's `parse_*` functions check its documents.

A field with a default may be absent (a record written before the field existed); a key the
dataclass does not name is left out (a record of a later version of the field list).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from shardflow.errors import InputError

T = TypeVar("T")


def parse_record(cls: type[T], values: object, where: str, prefix: str = "") -> T:
    """`values` as a `cls` (each field under its name with `prefix`); an InputError naming `where`, the key and
    what is accepted for the first bad one."""
    return cls(**parse_fields(cls, values, where, prefix))


def parse_fields(cls: type, values: object, where: str, prefix: str = "",
                 skip: tuple[str, ...] = ()) -> dict[str, object]:
    """The fields of `cls` but `skip` found in `values`, checked as parse_record checks them (a field with a
    default may be missing)."""
    if not isinstance(values, dict):
        raise InputError(f"{where}: a {type(values).__name__}; accepted: a JSON object")
    hints = typing.get_type_hints(cls)
    given = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if f.name in skip:
            continue
        if key in values:
            given[f.name] = _checked(values[key], hints[f.name], key, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InputError(f"{where}: {key} = missing; accepted: {_accepted(hints[f.name])}")
    return given


def record_of(value: object) -> dict[str, Any]:
    """A dataclass's fields as JSON holds them (plain); a TypeError for anything else."""
    out = plain(value)
    if not isinstance(out, dict):
        raise TypeError(f"a {type(value).__name__} has no record: not a dataclass")
    return out


def plain(value: object) -> object:
    """A field's value as JSON holds it: tuples as lists, a dataclass as an object."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return [plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _options(hint: object) -> tuple[object, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _accepted(hint: object) -> str:
    names: dict[object, str] = {int: "int", float: "int or float", str: "str", bool: "bool", dict: "dict",
                                type(None): "none"}
    return " or ".join(names.get(typing.get_origin(o) or o, "dict" if dataclasses.is_dataclass(o) else "list")
                       for o in _options(hint))


def _checked(value: object, hint: object, key: str, where: str) -> object:
    """`value` as `hint` says (a list becomes a tuple, an int a float where a float is asked), or an InputError."""
    for option in _options(hint):
        if option is type(None) and value is None:
            return None
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(option)[0]
            return tuple(_checked(v, item, key, where) for v in value)
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option in (int, str, bool, dict) and type(value) is option:
            return value
        if typing.get_origin(option) is dict and type(value) is dict:
            return value
        if isinstance(option, type) and dataclasses.is_dataclass(option) and isinstance(value, dict):
            return parse_record(option, value, f"{where} {key}")
    raise InputError(f"{where}: {key} = {value!r}; accepted: {_accepted(hint)}")
