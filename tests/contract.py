"""The env contract: every adapter's batched env must pass ``check_env_contract``.

Call it from the adapter's own test module with an env whose episodes are short (a small
``max_episode_steps``), so that the episode-end checks run quickly. Where the test can make one env end its
episode early (``end_first``), the partial-reset check runs that env's reset while the others are mid-episode.
"""

from __future__ import annotations

import pytest
import torch

from vla_rl.envs.base import EPISODE_METRICS, ChunkStep

CHUNK_FIELDS = ("rewards", "terminated", "truncated", "success", "steps")


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


def _rows(obs: dict, rows: list[int]) -> tuple:
    return (obs["images"][rows].cpu(), obs["state"][rows].cpu(), [obs["instruction"][i] for i in rows])


def check_partial_reset(env, *, horizon: int = 4, end_first=None, seed: int = 7) -> bool:
    """Envs 1..N-1 run the same actions twice from the same reset while env 0 acts differently: other random
    actions, or with ``end_first(env)`` (an action ``[A]`` that drives env 0 to the end of its episode, repeated
    over each chunk) an early end, so env 0 is reset in place while the others are mid-episode. Until their own
    first episode ends, the others' observations, rewards, flags and step counts must be identical in both runs:
    env 0's actions and its reset touch nothing of theirs. (After that their next episodes may differ: an
    adapter may draw every env's initial state from one generator.) Returns whether a partial reset of env 0
    happened; it must when ``end_first`` is given."""
    spec = env.spec
    n = spec.num_envs
    assert n >= 2, "the partial-reset check needs at least 2 envs"
    limit = spec.max_episode_steps // horizon + 2
    chunks = [_random_chunk(env, horizon, 100 + k) for k in range(limit)]

    def run(steer: bool) -> tuple[dict, list[ChunkStep]]:
        first = env.reset(seed=seed)
        trace = []
        for k in range(limit):
            chunk = chunks[k].clone()
            if steer:
                chunk[0] = (end_first(env).cpu().expand(horizon, spec.action_dim) if end_first is not None
                            else _random_chunk(env, horizon, 1000 + k)[0])
            out = env.step(chunk)
            trace.append(out)
            if bool(out.done[1:].any()):
                break
        return first, trace

    (obs_a, trace_a), (obs_b, trace_b) = run(False), run(True)
    others = list(range(1, n))
    for x, y in zip(_rows(obs_a, others), _rows(obs_b, others)):
        assert x == y if isinstance(x, list) else torch.equal(x, y)
    assert len(trace_a) == len(trace_b), "the other envs' episodes ended at another chunk when env 0 acted differently"
    partial = False
    for k, (a, b) in enumerate(zip(trace_a, trace_b)):
        for name in CHUNK_FIELDS:
            assert torch.equal(getattr(a, name)[1:].cpu(), getattr(b, name)[1:].cpu()), (
                f"chunk {k}: env 0's actions or reset changed the other envs' {name}")
        running = [i for i in others if not bool(a.done[i])]
        ended = [i for i in others if bool(a.done[i])]
        for x, y in zip(_rows(a.obs, running), _rows(b.obs, running)):
            assert x == y if isinstance(x, list) else torch.equal(x, y), f"chunk {k}: another env's obs changed"
        if ended:
            for x, y in zip(_rows(a.final_obs, ended), _rows(b.final_obs, ended)):
                assert x == y if isinstance(x, list) else torch.equal(x, y)
        partial |= bool(b.done[0]) and not bool(b.done[1:].all())
    if end_first is not None:
        assert partial, "end_first did not end env 0's episode while the others ran on"
    return partial


def check_env_contract(env, *, horizon: int = 4, end_first=None) -> None:
    """The interface's promises (see :mod:`vla_rl.envs.base`), then :func:`check_partial_reset` (``end_first``:
    see there)."""
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
    if n >= 2:
        check_partial_reset(env, horizon=horizon, end_first=end_first)
