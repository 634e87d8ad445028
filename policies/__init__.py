"""The flow policy package: model, flow math, normalisation, tokenizers, and exported policies for robots.

``from vla_rl.policies import load_exported`` loads a folder written by ``vla-rl export`` with this package and
the ground floor (:mod:`vla_rl.core`) alone; the submodules import lazily, so ``import vla_rl.policies.flow`` stays
light.
"""

_EXPORTED = ("load_exported", "ExportedPolicy", "ExportSpec", "CameraSpec", "ExportError", "ObservationError")


def __getattr__(name: str):
    if name in _EXPORTED:
        from . import exported

        return getattr(exported, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTED)
