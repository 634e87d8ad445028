"""Fixtures shared by several test modules (plain helpers are in helpers.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL

from vla_rl.config import policy_preset


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A policy folder: the SMALL tiny policy after 20 SFT steps on 4 built-in expert demos."""
    from vla_rl.checkpoint import save_policy
    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.policies.model import FlowPolicy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.rl.actor import Actor
    from vla_rl.sft import SFTConfig, train_sft

    torch.manual_seed(0)
    data = collect_builtin_demos(4, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(FlowPolicy(policy_preset("tiny", SMALL)), norm)
    train_sft(actor, data, SFTConfig(steps=20, batch_size=16), progress=False)
    return save_policy(tmp_path_factory.mktemp("sft") / "policy", actor.model, actor.norm)
