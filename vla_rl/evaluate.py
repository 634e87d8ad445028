"""Policy evaluation on a batched env: each env's first episode counts, on fixed seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vla_rl.actor import Actor, SamplerConfig


@torch.inference_mode()
def evaluate(actor: Actor, env, *, num_episodes: int, sampler: SamplerConfig | None = None,
             execute: int | None = None, seed: int = 1000, prefix: str = "eval") -> dict[str, float]:
    """Success rate and returns over ``num_episodes`` episodes.

    Counting only each env's first episode (rather than whatever ends first) keeps short, successful
    episodes from being over-represented. Round ``r`` of ``env.num_envs`` episodes resets with seed
    ``seed + r * num_envs`` (fixed seeds: a result is reproducible). ``execute`` actions of each chunk are
    run (default: the whole chunk).

    Why that stride: worker envs (ManiSkill, LIBERO) give env ``i`` the seed ``seed + i``, so the earlier
    ``seed + r`` made the rounds overlap; 100 episodes on 16 ManiSkill workers then covered only 22
    distinct initial states (seeds ``seed`` .. ``seed + 21``).
    """
    sampler = sampler or SamplerConfig()
    n = env.num_envs
    gen = torch.Generator(device=actor.model.device)
    results: dict[str, list[float]] = {"success_once": [], "success_at_end": [], "return": [], "length": []}
    for r in range(math.ceil(num_episodes / n)):
        obs = env.reset(seed=seed + r * n)
        gen.manual_seed(seed + r * n)
        pending = torch.arange(n) < min(n, num_episodes - r * n)
        while pending.any():
            chunk = actor.act(obs, sampler, generator=gen).actions
            out = env.step(chunk[:, :execute] if execute else chunk)
            obs = out.obs
            if out.episodes:
                for j, i in enumerate(out.episodes["env_index"].tolist()):
                    if pending[i]:
                        pending[i] = False
                        for k in results:
                            results[k].append(float(out.episodes[k][j]))
    metrics = {f"{prefix}/{k}": sum(v) / num_episodes for k, v in results.items()}
    metrics[f"{prefix}/episodes"] = float(num_episodes)
    return metrics


@dataclass(frozen=True)
class EvalConfig:
    """``vla-rl eval`` settings; the env comes from the checkpoint unless ``env`` overrides fields."""

    episodes: int = 100
    seed: int = 10_000
    num_steps: int = 4
    execute: int = 8
    num_envs: int = 100
    device: str = "cpu"
    env: dict[str, Any] = field(default_factory=dict)  # fields of the checkpoint's env config to override


def checkpoint_env(path: str | Path, config: dict) -> dict:
    """The env a checkpoint folder was made for, as an ``EnvConfig`` dict: a training checkpoint's
    ``train_config.yaml``, else the one an SFT policy was trained for (``config``: its ``load_policy`` config)."""
    from vla_rl.checkpoint import read_yaml_file

    path = Path(path)
    if (path / "train_config.yaml").is_file():
        return dict(read_yaml_file(path / "train_config.yaml").get("env", {}))
    return dict(config.get("env_config") or {})


def evaluate_checkpoint(path: str | Path, overrides: dict | None = None) -> dict[str, float]:
    """Evaluate a policy or training checkpoint folder with the deterministic ODE sampler."""
    from vla_rl.checkpoint import load_policy
    from vla_rl.config import from_dict, merge
    from vla_rl.trainer import EnvConfig, make_env

    overrides = dict(overrides or {})
    path = Path(path)
    model, norm, config = load_policy(path)
    env_dict = checkpoint_env(path, config)
    cfg = from_dict(EvalConfig, overrides)
    env_cfg = from_dict(EnvConfig, merge(env_dict, cfg.env), prefix="env")
    device = torch.device(cfg.device)
    env = make_env(env_cfg, num_envs=min(cfg.num_envs, cfg.episodes), device=device, seed=cfg.seed)
    spec = env.spec
    actor = Actor(model.to(device), norm, env_state_dim=spec.state_dim, env_action_dim=spec.action_dim,
                  action_low=spec.action_low, action_high=spec.action_high)
    return evaluate(actor, env, num_episodes=cfg.episodes, sampler=SamplerConfig(cfg.num_steps, "ode"),
                    execute=cfg.execute, seed=cfg.seed)
