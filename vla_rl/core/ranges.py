"""Config fields: their docs and declared valid ranges, checked when a config is built (before any work starts).

Every numeric field of a config dataclass says which values it accepts (``ranged`` / ``positive`` /
``nonneg`` / ``fraction``), and the class's ``__post_init__`` calls :func:`check_ranges`, which refuses a value
outside its range, and any non-finite float, with a :class:`ConfigError` naming the field, the value and the
range. Every field may say what it does (``doc=``; :func:`setting` for a field without a range): the text
``vla-rl <command> --help-config`` prints (:func:`~.schema.config_help`). This module imports nothing of the
project, so ``policies/``, ``envs/`` and ``vla_rl`` all use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A configuration key is unknown, missing, of the wrong type or out of its range."""


def setting(default: Any = dataclasses.MISSING, *, doc: str = "", **kwargs) -> Any:
    """A dataclass field with its documentation ``doc`` (one or two sentences: what it does, its values).
    ``default_factory=`` works as in :func:`dataclasses.field`."""
    meta = {**kwargs.pop("metadata", {}), **({"doc": doc} if doc else {})}
    return dataclasses.field(default=default, metadata=meta, **kwargs)


def ranged(default: Any = dataclasses.MISSING, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False, doc: str = "", **kwargs) -> Any:
    """A dataclass field whose value must lie in [lo, hi] (``lo_open`` / ``hi_open``: excluded; None: no
    bound), documented by ``doc``. None as a value is allowed only if the field's type allows it; floats must be
    finite."""
    meta = {**kwargs.pop("metadata", {}), "range": (lo, hi, lo_open, hi_open)}
    return setting(default, doc=doc, metadata=meta, **kwargs)


def positive(default: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field that must be > 0."""
    return ranged(default, 0, None, lo_open=True, **kwargs)


def nonneg(default: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field that must be >= 0."""
    return ranged(default, 0, None, **kwargs)


def fraction(default: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field in [0, 1]."""
    return ranged(default, 0, 1, **kwargs)


def describe_range(spec: tuple) -> str:
    """``(0, None, True, False)`` -> ``(0, inf)``."""
    lo, hi, lo_open, hi_open = (tuple(spec) + (False, False))[:4]
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def in_range(value: float, spec: tuple) -> bool:
    lo, hi, lo_open, hi_open = (tuple(spec) + (False, False))[:4]
    return not ((lo is not None and (value < lo or (lo_open and value == lo)))
                or (hi is not None and (value > hi or (hi_open and value == hi))))


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Check every field of dataclass ``obj`` that declares a range (and that float fields are finite);
    raise :class:`ConfigError` naming the field, the value and the range."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        spec = f.metadata.get("range")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} = {value!r} is not a finite number"
                              + (f"; valid range {describe_range(spec)}" if spec else ""))
        if spec is not None and not in_range(value, spec):
            raise ConfigError(f"{key} = {value!r} is outside its valid range {describe_range(spec)}")
