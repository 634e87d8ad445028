"""Helpers shared by several test modules (fixtures live in conftest.py): small policies and observations,
the trainer's test config, and how a test needs an optional simulator.

Simulators (ManiSkill, LIBERO) and their file formats (h5py) are part of the test install, so a missing one
fails its tests, unless ``VLA_RL_SKIP_SIMULATORS=1`` turns that into a skip.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import os

import pytest
import torch

from vla_rl.core.schema import from_dict
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.presets import policy_preset

SKIP_SIMULATORS = os.environ.get("VLA_RL_SKIP_SIMULATORS") == "1"

# A smaller `tiny`: the end-to-end trainer tests run in seconds with it.
SMALL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 64, "mlp_dim": 128},
         "expert": {"width": 64, "mlp_dim": 128}}
SMALL_SMOLVLA = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 64, "mlp_dim": 128},
                 "expert": {"width": 48, "mlp_dim": 128}}


def needs_simulator(module: str, name: str | None = None) -> pytest.MarkDecorator:
    """Skip when ``module`` is not installed and ``VLA_RL_SKIP_SIMULATORS=1`` (without it, the test runs and
    fails on the missing simulator)."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(SKIP_SIMULATORS and missing,
                              reason=f"{name or module} not installed and VLA_RL_SKIP_SIMULATORS=1")


def simulator_import(module: str):
    """``import module`` for a module-level import of a simulator's dependency: with
    ``VLA_RL_SKIP_SIMULATORS=1`` a missing one skips the whole test module instead of failing its collection."""
    if SKIP_SIMULATORS:
        return pytest.importorskip(module)
    return importlib.import_module(module)


def make_obs(cfg: PolicyConfig, n: int, seed: int = 0, size: int | None = None) -> dict:
    """``n`` random raw observations for a policy of ``cfg`` (images of ``size``, default the encoder's)."""
    g = torch.Generator().manual_seed(seed)
    size = size or cfg.vision.image_size
    words = ["pick up the red cube", "push the blue block to the left", "open the drawer", "go"]
    return {
        "images": torch.randint(0, 256, (n, cfg.num_cameras, size, size, 3), dtype=torch.uint8, generator=g),
        "state": torch.randn(n, cfg.state_dim, generator=g) * 0.5,
        "instruction": [words[i % len(words)] for i in range(n)],
    }


def perturbed_model(preset: str = "tiny", overrides: dict | None = None, seed: int = 0) -> FlowPolicy:
    """A policy with every parameter perturbed (zero-initialised parts such as adaRMS gates then matter)."""
    torch.manual_seed(seed)
    model = make_policy(policy_preset(preset, overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def sft_policy(folder, model_overrides: dict, steps: int, preset: str = "tiny"):
    """Save into ``folder`` the ``preset`` policy with ``model_overrides`` after ``steps`` SFT steps on 4 built-in
    expert demos (seeded), and return the policy folder."""
    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.policies.actor import Actor
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.train.sft import SFTConfig, train_sft

    torch.manual_seed(0)
    data = collect_builtin_demos(4, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(make_policy(policy_preset(preset, model_overrides)), norm)
    train_sft(actor, data, SFTConfig(steps=steps, batch_size=16), progress=False)
    return save_policy(folder, actor.model, actor.norm)


def step_groups_like_one_batch(grouped, reference, groups: list[range], chunk: torch.Tensor):
    """Step ``chunk`` on ``grouped`` with every group's chunk in flight at once (what ``rollout_groups`` does) and
    on ``reference`` as one batch; assert each env got the same results and observations. Returns
    ``(parts, want)``: the groups' step results and the batch's."""
    for r in groups:
        grouped.step_async(r, chunk[r.start:r.stop])
    parts = [grouped.step_wait(r) for r in groups]
    want = reference.step(chunk)
    for key in ("rewards", "steps", "terminated", "truncated", "success"):
        assert torch.equal(torch.cat([getattr(p, key) for p in parts]), getattr(want, key)), key
    for key, value in want.obs.items():
        if torch.is_tensor(value):
            assert torch.equal(torch.cat([p.obs[key] for p in parts]), value), key
        else:
            assert sum((list(p.obs[key]) for p in parts), []) == list(value), key
    return parts, want


def train_config(init, out, **over):
    """A two-iteration built-in training of 8 envs from the policy folder ``init`` into ``out``."""
    from vla_rl.train.trainer import TrainConfig

    base = {"init": str(init), "env": {"num_envs": 8, "builtin": {"max_episode_steps": 16}},
            "rollout_chunks": 2, "execute": 8, "iterations": 2, "eval_every": 1, "eval_episodes": 8,
            "save_every": 1, "keep_last": 5, "out": str(out), "progress": False, "tensorboard": False,
            "learner": {"update_epochs": 2, "minibatches": 2}}
    return from_dict(TrainConfig, {**base, **over})


def disk_full_at(save_file, suffix: str, error: str):
    """A ``save_file`` that fills the disk when it writes a file ending in ``suffix``: an ``OSError`` (ENOSPC) for
    ``error="oserror"``, else the ``SafetensorError`` safetensors raises for it; other files are written by
    ``save_file``."""
    from safetensors import SafetensorError

    def full(tensors, path, *a, **k):
        if path.endswith(suffix):
            raise (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if error == "oserror" else
                   SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                   '"No space left on device" })'))
        return save_file(tensors, path, *a, **k)

    return full
