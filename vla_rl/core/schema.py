"""The one config schema: typed dataclasses built from plain dicts (YAML, JSON, ``key=value`` overrides), and
their field docs as help text.

- :func:`from_dict` builds a (nested) dataclass from a mapping; missing keys keep their defaults, unknown keys and
  wrong types are :class:`~.ranges.ConfigError` naming the full key path (``model.expert.width``); a key a class
  moved elsewhere (its ``MOVED`` mapping, old key -> new key) is refused with the new spelling.
- :func:`to_dict` is the plain form (nested dicts, lists), ready for YAML or JSON.
- :func:`config_help` lists every field of a config class: key, type, default, valid range and its doc (the
  ``doc`` of :func:`~.ranges.setting` / :func:`~.ranges.ranged`); ``vla-rl <command> --help-config`` prints it.

Ranges are declared and checked in :mod:`.ranges`. This module imports nothing of vla_rl, so the policy package
(exported folders), the envs and the framework all use it.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from vla_rl.core.ranges import ConfigError, describe_range

T = TypeVar("T")


def _check_value(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, prefix=key)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check_value(arm, value, key)
            except ConfigError:
                pass  # try the next arm
        raise ConfigError(f"{key}: {value!r} is not {' or '.join(_describe(a) for a in get_args(tp))}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            items = [_check_value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_tp = args[0] if args else Any
            items = [_check_value(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-4` (no dot) as a string; a float field takes it as the number.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")


def _describe(tp: Any) -> str:
    """What a value of type ``tp`` looks like, for error messages (``int | Literal["auto"]``: "an integer or
    'auto'")."""
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if get_origin(tp) in (list, tuple):
        return "a list"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(
        get_origin(tp) or tp, str(tp))


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_keys(cls: type, data: dict, *, prefix: str = "") -> None:
    """Refuse (:class:`ConfigError`) keys of ``data`` that ``cls`` (a dataclass, nested sections followed) does not
    have, naming them as the user wrote them: for partial settings merged into values made elsewhere (an imported
    checkpoint's inferred config), where :func:`from_dict` on the merge would blame the wrong source."""
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in set(data) - fields)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(_key(prefix, k) for k in unknown)} "
                          f"(valid: {', '.join(sorted(fields))})")
    for name, value in data.items():
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict):
            check_keys(hints[name], value, prefix=_key(prefix, name))


def from_dict(cls: type[T], data: Any, *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from the mapping ``data``; missing keys keep their defaults.

    ``cls.upgrade(data)``, where a class has it, first rewrites an older spelling that it still reads (e.g. an
    env section's ``options``); keys in ``cls.MOVED`` are refused with their new place. Errors raised by
    ``cls.__post_init__`` come back as :class:`ConfigError` naming ``prefix``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {type(data).__name__}")
    upgrade = getattr(cls, "upgrade", None)
    if upgrade is not None:
        data = upgrade(data)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    moved = getattr(cls, "MOVED", {})
    stale = sorted(set(data) & set(moved))
    if stale:
        old, new = _key(prefix, stale[0]), _key(prefix, moved[stale[0]])
        raise ConfigError(f"{old} is now {new}: write {new}={data[stale[0]]} instead")
    unknown = sorted(str(k) for k in set(data) - set(fields))
    if unknown:
        names = ", ".join(_key(prefix, k) for k in unknown)
        raise ConfigError(f"unknown config key(s): {names} (valid: {', '.join(sorted(fields))})")
    kwargs = {name: _check_value(hints[name], value, _key(prefix, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:  # from __post_init__: messages start with the field's name, or are general
        msg = str(e)
        if prefix:
            head = msg.split(" ", 1)[0].split(".", 1)[0]
            msg = f"{prefix}.{msg}" if head in fields else f"{prefix}: {msg}"
        raise ConfigError(msg) from None
    except ValueError as e:  # a check in __post_init__: the top level's keys are the user's own (no class name)
        raise ConfigError(f"{prefix}: {e}" if prefix else str(e)) from None
    except TypeError as e:  # a field without default left out
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Plain (YAML / JSON ready) form of a config dataclass: nested dataclasses and dicts become dicts, tuples
    lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------------------------------
# Help text
# ----------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_help(cls: type, *, prefix: str = "", width: int = 100) -> str:
    """Every field of config class ``cls`` (nested sections flattened to ``section.key``): type, default, valid
    range and doc, one entry per key, in declaration order."""
    hints = get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp, default = _key(prefix, f.name), hints[f.name], _default(f)
        if dataclasses.is_dataclass(tp):
            doc = f.metadata.get("doc") or (tp.__doc__ or "").strip().split("\n\n")[0]
            out.append(f"{key}:  section" + (f"\n{_wrap(doc, width)}" if doc else ""))
            out.append(config_help(tp, prefix=key, width=width))
            continue
        head = f"{key}: {_type_name(tp)}"
        if default is not dataclasses.MISSING:
            head += f" = {to_dict(default)!r}"
        if "range" in f.metadata:
            head += f"  in {describe_range(f.metadata['range'])}"
        doc = f.metadata.get("doc", "")
        out.append(head + (f"\n{_wrap(doc, width)}" if doc else ""))
    return "\n".join(x for x in out if x)


def _wrap(text: str, width: int) -> str:
    return textwrap.fill(" ".join(text.split()), width, initial_indent="    ", subsequent_indent="    ")


def check_one_section(cfg: Any, chosen: str, sections: tuple[str, ...], key: str) -> None:
    """A config that picks one of its ``sections`` by the field ``key`` (``env.kind``, ``algorithm.name``) and reads
    only that one: another section set away from its defaults would silently do nothing, so it is refused."""
    if chosen not in sections:
        raise ConfigError(f"{key}: {chosen!r} is not one of {list(sections)}")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for other in sections:
        if other != chosen and getattr(cfg, other) != fields[other].default_factory():
            raise ConfigError(f"{other} is set but {key} is {chosen!r}: set {key}={other} "
                              f"or move those settings to the {chosen} section")

