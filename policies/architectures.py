"""The one place a policy class is named: ``policy.arch`` -> the model class, and :func:`make_policy`.

Adding an architecture: a module in ``policies/`` with a class that meets :class:`~vla_rl.policies.seam.FlowVLA`,
an entry here, its name in ``PolicyConfig.arch``, and a preset in ``configs/model/`` (docs/training.md, "Add a
policy architecture").
"""

from __future__ import annotations

import importlib

from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import FlowVLA

# arch -> "module:class" (imported on first use: an architecture's module may pull in what others do not need)
ARCHITECTURES = {"pi0": "vla_rl.policies.model:FlowPolicy", "pi05": "vla_rl.policies.model:FlowPolicy",
                 "smolvla": "vla_rl.policies.smolvla:SmolVLA"}


def policy_class(arch: str) -> type:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown policy architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    module, name = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), name)


def make_policy(cfg: PolicyConfig) -> FlowVLA:
    """A new policy of architecture ``cfg.arch`` (freshly initialised weights, on the current default device)."""
    return policy_class(cfg.arch)(cfg)
