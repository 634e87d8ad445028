"""Configuration for the framework: presets, command-line overrides, devices. Dataclasses are the schema, YAML
only overrides fields.

- :func:`load_preset` reads ``configs/<group>/<name>.yaml`` (or any YAML path) into a config dataclass.
- :func:`parse_overrides` turns command-line style ``key.sub=value`` overrides into a nested dict (values parsed
  as YAML), :func:`merge` lays it over a preset.
- :func:`resolve_device` checks a ``device`` setting against this machine.

The schema itself (:func:`~vla_rl.core.schema.from_dict`, :func:`~vla_rl.core.schema.to_dict`, declared ranges,
field docs) is the ground floor's (:mod:`vla_rl.core.schema`, :mod:`vla_rl.core.ranges`). Derived values live in
properties of the dataclasses, never in fields rewritten later.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.policies.policy_config import PolicyConfig


def _config_dir() -> Path:
    """The presets: ``vla_rl/configs`` in an installed wheel (pyproject maps ``configs/`` there), else the
    source tree's ``configs/`` (a checkout, or an editable install)."""
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parent / "configs"


CONFIG_DIR = _config_dir()
T = TypeVar("T")


def resolve_device(name: str, *, spelled: str = "device={}"):
    """``torch.device(name)``, checked: a malformed name, another device type, or a CUDA / MPS device on a machine
    without one (or without that index), is a :class:`ConfigError` (``device=cpu`` runs anywhere). ``spelled`` is how
    the user writes the setting (``"--device {}"`` for serve), so the advice is something they can type."""
    import torch  # here, not at the top: the CLI imports this module to parse, before any job needs torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{spelled.format(name)} is not a torch device ({e}); use cpu, cuda or "
                          "cuda:<index>") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{spelled.format(name)}, but CUDA is not available on this machine; use "
                              f"{spelled.format('cpu')}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{spelled.format(name)}, but this machine has {torch.cuda.device_count()} CUDA "
                              "device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{spelled.format(name)}, but Apple's MPS backend is not available on this machine; "
                              f"use {spelled.format('cpu')}")
    elif device.type != "cpu":
        raise ConfigError(f"{spelled.format(name)}: vla-rl runs on cpu, cuda or mps")
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
    """A model preset (:class:`~vla_rl.policies.policy_config.PolicyConfig`) from ``configs/model/<name>.yaml`` (or a
    YAML path), with optional overrides. It lives here, not in ``policies/``, which imports nothing of vla_rl."""
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
