"""Tensor shapes in signatures: ``Float[Tensor, "n h a"]`` (jaxtyping's notation, as openpi writes them).

With jaxtyping installed (the ``test`` extra) these are its types, and the tests check the hot path's shapes at run
time (tests/policies/test_shapes.py); without it (a robot's install) they are inert placeholders, so the shapes stay
what they also are: documentation that cannot drift from the code it checks."""

from __future__ import annotations

from typing import Any

try:
    from jaxtyping import Bool, Float, Int
except ImportError:   # pragma: no cover (the base install)
    class _Shaped:
        """``X[Tensor, "dims"]`` is ``Any``."""

        def __class_getitem__(cls, item) -> Any:
            return Any

    Bool = Float = Int = _Shaped

__all__ = ["Bool", "Float", "Int"]
