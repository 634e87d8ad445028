"""Policy evaluation on a batched env: each env's first episode counts, on fixed seeds."""

from __future__ import annotations

import math

import torch

from vla_rl.actor import Actor, SamplerConfig


@torch.inference_mode()
def evaluate(actor: Actor, env, *, num_episodes: int, sampler: SamplerConfig | None = None,
             execute: int | None = None, seed: int = 1000, prefix: str = "eval") -> dict[str, float]:
    """Success rate and returns over ``num_episodes`` episodes.

    Counting only each env's first episode (rather than whatever ends first) keeps short, successful
    episodes from being over-represented. Rounds of ``env.num_envs`` episodes use seeds ``seed``,
    ``seed + 1``, ... so a result is reproducible. ``execute`` actions of each chunk are run (default:
    the whole chunk).
    """
    sampler = sampler or SamplerConfig()
    n = env.num_envs
    gen = torch.Generator(device=actor.model.device)
    results: dict[str, list[float]] = {"success_once": [], "success_at_end": [], "return": [], "length": []}
    for r in range(math.ceil(num_episodes / n)):
        obs = env.reset(seed=seed + r)
        gen.manual_seed(seed + r)
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
