"""Policy folders and exported policies for the export / serve tests (tiny presets, perturbed weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from helpers import perturbed_model

from vla_rl.checkpoint.policy import save_policy
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats

BUILTIN_META = {"env": {"name": "builtin/color_reach", "state_dim": 4, "action_dim": 2},
                "env_config": {"kind": "builtin"}, "sft": {"execute": 4, "num_steps": 3}}


def norm_stats(state_dim: int, action_dim: int, *, action_scale: float = 2.0, seed: int = 0) -> NormStats:
    """Statistics with non-trivial means and spreads; ``action_scale`` > 1 makes some actions leave [-1, 1]
    (so clipping is exercised)."""
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(256, state_dim, generator=g) * 0.5 + 0.3
    action = torch.randn(256, action_dim, generator=g) * action_scale - 0.2
    return NormStats(Stats.of(state), Stats.of(action))


def policy_folder(path: Path, *, preset: str = "tiny", meta: dict | None = None, state_dim: int = 4,
                  action_dim: int = 2, overrides: dict | None = None) -> tuple[Path, FlowPolicy, NormStats]:
    model = perturbed_model(preset, overrides)
    norm = norm_stats(state_dim, action_dim)
    save_policy(path, model, norm, meta=BUILTIN_META if meta is None else meta)
    return path, model, norm


def observation(seed: int = 0, *, size: int = 32, prompt: str = "move to the red square", key: str = "image",
                state_dim: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    return {key: rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "state": rng.normal(size=state_dim).astype(np.float32), "prompt": prompt}
