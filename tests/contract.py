"""The env contract: every adapter's batched env must pass ``check_env_contract``.

Call it from the adapter's own test module with an env whose episodes are short (a small
``max_episode_steps``), so that the episode-end checks run quickly.
"""

from __future__ import annotations

import pytest
import torch

from vla_rl.envs.base import EPISODE_METRICS, ChunkStep


def _check_obs(env, obs: dict) -> None:
    spec = env.spec
    n = spec.num_envs
    s = spec.image_size
    assert obs["images"].dtype == torch.uint8
    assert tuple(obs["images"].shape) == (n, spec.num_cameras, s, s, 3)
    assert obs["state"].dtype == torch.float32 and tuple(obs["state"].shape) == (n, spec.state_dim)
    assert torch.isfinite(obs["state"]).all()
    assert isinstance(obs["instruction"], list) and len(obs["instruction"]) == n
    assert all(isinstance(t, str) and t for t in obs["instruction"])


def _random_chunk(env, horizon: int, seed: int) -> torch.Tensor:
    spec = env.spec
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(spec.num_envs, horizon, spec.action_dim, generator=g)
    return spec.action_low + u * (spec.action_high - spec.action_low) * 0.5 + (
        spec.action_high - spec.action_low) * 0.25


def check_env_contract(env, *, horizon: int = 4) -> None:
    spec = env.spec
    n = spec.num_envs
    # Reset: shapes, and the same seed gives the same episodes.
    obs = env.reset(seed=123)
    _check_obs(env, obs)
    again = env.reset(seed=123)
    assert torch.equal(obs["images"], again["images"]) and torch.allclose(obs["state"], again["state"])
    assert obs["instruction"] == again["instruction"]
    # One chunk step.
    out: ChunkStep = env.step(_random_chunk(env, horizon, 0))
    _check_obs(env, out.obs)
    assert tuple(out.rewards.shape) == (n, horizon) and out.rewards.is_floating_point()
    for flag in (out.terminated, out.truncated, out.success):
        assert flag.dtype == torch.bool and tuple(flag.shape) == (n,)
    assert ((out.steps >= 1) & (out.steps <= horizon)).all()
    for i in range(n):  # nothing is earned after an env's episode ended inside the chunk
        assert (out.rewards[i, int(out.steps[i]):] == 0).all()
    # Run until every env has ended at least one episode (the time limit guarantees it).
    ended = torch.zeros(n, dtype=torch.bool, device=out.done.device)  # the env's device (cuda for GPU envs)
    limit = spec.max_episode_steps // horizon + 2
    for k in range(limit):
        out = env.step(_random_chunk(env, horizon, k + 1))
        _check_obs(env, out.obs)
        if out.done.any():
            assert out.final_obs is not None
            _check_obs(env, out.final_obs)
            assert set(EPISODE_METRICS) <= set(out.episodes)
            idx = out.episodes["env_index"]
            assert torch.equal(idx.cpu(), out.done.nonzero(as_tuple=True)[0].cpu())
            assert (out.episodes["length"] >= 1).all()
            assert (out.episodes["length"] <= spec.max_episode_steps).all()
            trunc = out.truncated[idx]
            assert (out.episodes["length"][trunc] == spec.max_episode_steps).all()
            ended |= out.done
        if ended.all():
            break
    assert ended.all(), "some env never ended an episode within its time limit"
    # Bad input gets errors that name the problem.
    with pytest.raises(ValueError, match="shape"):
        env.step(torch.zeros(n, horizon, spec.action_dim + 1))
    with pytest.raises(ValueError, match="NaN"):
        env.step(torch.full((n, horizon, spec.action_dim), float("nan")))
    with pytest.raises(ValueError, match="out of range"):
        env.step(torch.full((n, horizon, spec.action_dim), spec.action_high + 1.0))
    with pytest.raises(TypeError):
        env.step(torch.zeros(n, horizon, spec.action_dim, dtype=torch.long))
