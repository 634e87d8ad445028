"""Strict dict -> dataclass building for the policy package's own files (exported folders).

:mod:`vla_rl.config` has the framework's full builder (presets, overrides); this one is the small subset an
exported policy needs to load with the policy package alone: nested dataclasses, ``Literal``, ``Optional``,
``bool`` / ``int`` / ``float`` / ``str``, lists and tuples, and free-form ``dict`` fields. Unknown keys and
wrong types are errors that name the full key path (``policy.vision.width``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


class SchemaError(ValueError):
    """A key of a policy file is unknown, missing, of the wrong type or out of range."""


def _value(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, prefix=key)
    if origin is Literal:
        if value not in get_args(tp):
            raise SchemaError(f"{key}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for arm in get_args(tp):
            if arm is type(None):
                continue
            try:
                return _value(arm, value, key)
            except SchemaError:
                pass   # try the next arm
        raise SchemaError(f"{key}: {value!r} does not match {tp}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{key}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise SchemaError(f"{key}: expected {len(args)} items, got {len(value)}")
            items = [_value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item = args[0] if args else Any
            items = [_value(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(f"{key}: expected a string, got {value!r}")
        return value
    raise SchemaError(f"{key}: unsupported field type {tp}")


def build(cls: type[T], data: Any, *, prefix: str = "") -> T:
    """Dataclass ``cls`` from the mapping ``data`` (missing keys keep their defaults, unknown ones are errors).
    Errors raised by ``cls.__post_init__`` come back as :class:`SchemaError` naming ``prefix``."""
    where = prefix or cls.__name__
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in set(data) - fields)
    if unknown:
        names = ", ".join(f"{prefix}.{k}" if prefix else k for k in unknown)
        raise SchemaError(f"unknown key(s): {names} (valid: {', '.join(sorted(fields))})")
    kwargs = {name: _value(hints[name], v, f"{prefix}.{name}" if prefix else name) for name, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:   # a required field left out, or a check in __post_init__
        raise SchemaError(f"{where}: {e}") from None


def to_plain(obj: Any) -> Any:
    """Plain (JSON / YAML ready) form of a dataclass: nested dataclasses become dicts, tuples lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
