"""Typed configuration: dataclasses are the schema, YAML only overrides fields.

- :func:`from_dict` builds a (nested) dataclass from a plain dict; unknown keys and wrong types are
  errors that name the full key path (``model.expert.width``).
- :func:`load_preset` reads ``configs/<group>/<name>.yaml`` (or any YAML path).
- :func:`apply_overrides` applies command-line style ``key.sub=value`` overrides (values parsed as YAML).
Derived values live in properties of the dataclasses, never in fields rewritten later.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

# Declared ranges live in vla_rl.policies.ranges (policies/ and envs/ use them too and import no vla_rl);
# they are re-exported here, where the rest of the project looks for them.
from vla_rl.policies.ranges import (  # noqa: F401
    ConfigError,
    check_ranges,
    describe_range,
    fraction,
    nonneg,
    positive,
    ranged,
)


def _config_dir() -> Path:
    """The presets: ``vla_rl/configs`` in an installed wheel (pyproject maps ``configs/`` there), else the
    source tree's ``configs/`` (a checkout, or an editable install)."""
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parent / "configs"


CONFIG_DIR = _config_dir()
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
    if origin is dict:
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


def from_dict(cls: type[T], data: dict, *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; missing keys keep their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {type(data).__name__}")
    upgrade = getattr(cls, "upgrade", None)
    if upgrade is not None:  # a config that reads an older spelling of itself (e.g. EnvConfig's `options`)
        data = upgrade(data)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}.{k}" if prefix else k for k in unknown)
        raise ConfigError(f"unknown config key(s): {names} (valid: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _check_value(hints[name], value, key)
    try:
        obj = cls(**kwargs)
    except ConfigError as e:  # from __post_init__: messages start with the field's name, or are general
        msg = str(e)
        if prefix:
            head = msg.split(" ", 1)[0].split(".", 1)[0]
            msg = f"{prefix}.{msg}" if head in fields else f"{prefix}: {msg}"
        raise ConfigError(msg) from None
    except (TypeError, ValueError) as e:  # a field without default left out, or a check in __post_init__
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    return obj


def to_dict(cfg: Any) -> dict:
    """Plain-dict form of a config dataclass (tuples become lists, ready for YAML)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def resolve_device(name: str):
    """``torch.device(name)``, checked: a malformed name, or a CUDA device on a machine without one (or
    without that index), is a :class:`ConfigError` (``device=cpu`` runs anywhere)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device = {name!r} is not a torch device ({e}); use cpu, cuda or cuda:<index>") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device = {name!r} but CUDA is not available on this machine; use device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device = {name!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type not in ("cpu", "mps"):
        raise ConfigError(f"device = {name!r}: vla-rl runs on cpu or cuda")
    return device


def merge(base: dict, override: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line (its message spans several, with a caret drawing)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def preset_path(group: str, name: str) -> Path:
    """``configs/<group>/<name>.yaml``, or ``name`` itself if it is a path to a YAML file."""
    if name.endswith((".yaml", ".yml")):
        return Path(name)
    path = CONFIG_DIR / group / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
        raise ConfigError(f"unknown {group} preset {name!r}; known: {known}")
    return path


def load_preset(cls: type[T], group: str, name: str, overrides: dict | None = None) -> T:
    return from_dict(cls, merge(read_yaml(preset_path(group, name)), overrides or {}))


def policy_preset(name: str, overrides: dict | None = None):
    """A model preset (:class:`~vla_rl.policies.config.PolicyConfig`) from ``configs/model/<name>.yaml`` (or a
    YAML path), with optional overrides. It lives here, not in ``policies/``, which imports nothing of vla_rl."""
    from vla_rl.policies.config import PolicyConfig

    return load_preset(PolicyConfig, "model", name, overrides)


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=3", "c=[1, 2]"]`` -> ``{"a": {"b": 3}, "c": [1, 2]}`` (values parsed as YAML)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)})") from None
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {p}")
        node[last] = value
    return out
