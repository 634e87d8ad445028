"""Rollout collection: the policy samples action chunks, the env executes them, and everything PPO
needs is stored on the policy's device, with how it was sampled (the sampler, the executed actions per chunk)
so the learner reads that from the rollout. The per-element log-densities are stored as sampled; how they
become a chunk's log-prob is the loss's choice (:func:`vla_rl.rl.losses.aggregate_log_prob`).

Glossary: T chunk steps, N envs, K denoising steps, H actions per chunk, A model action dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vla_rl.policies import flow
from vla_rl.rl.actor import Actor, SamplerConfig


def first_episode_mask(env_index: list[int]) -> list[bool]:
    """Which of a rollout's ended episodes (in the order they ended) is its env's first: the episode the
    iteration's seeded reset started.

    Why: the success rate over *all* ended episodes is biased towards success whenever an env can finish
    a second episode inside the rollout, since only short episodes fit and short ones are successes. On
    PickCube (150-step limit, 152-step rollouts; an episode ends only by success or at the limit, so every
    second episode that ends in the rollout is a success), 64 envs ended 73 episodes in one iteration and
    ``rollout/success_once`` read 26 / 73 = 0.36, where the 64 first episodes hold 26 - 9 = 17, i.e. 0.27.
    Over first episodes only (the rule :func:`vla_rl.eval.evaluate.first_episodes` applies), and with a rollout
    as long as the episode limit, every env counts once and the rate is unbiased."""
    seen: set[int] = set()
    out = []
    for i in env_index:
        out.append(i not in seen)
        seen.add(i)
    return out


@dataclass
class Rollout:
    """``[T, N, ...]`` tensors of one rollout, plus the episodes that ended during it."""

    obs: dict[str, Tensor]       # model inputs: images, state (normalised, padded), tokens, token_mask
    chain: Tensor                # [T, N, K+1, H, A]
    stochastic: Tensor           # [T, N, K]
    log_probs: Tensor            # [T, N, K, H, A] per-element log-densities of the chain's steps, as sampled
    entropy: Tensor              # [T, N] mean step entropy over the stochastic steps, executed actions, real dims
    values: Tensor               # [T, N]
    rewards: Tensor              # [T, N]  sum of the executed sub-step rewards
    terminated: Tensor           # [T, N]
    truncated: Tensor            # [T, N]
    success: Tensor              # [T, N]  task solved at the chunk's last executed sub-step
    final_values: Tensor         # [T, N]  V(final obs) where truncated, else 0
    last_values: Tensor          # [N]     V(obs after the last chunk)
    sampler: SamplerConfig       # how the chunks were drawn (method, noise level, K)
    execute: int                 # actions executed of each chunk (the rest never reached the env)
    episodes: dict[str, list] = field(default_factory=dict)
    env_steps: int = 0
    # [T, N] bool, False on the chunks of episodes lost to a dead env worker (dropped from the update);
    # None: every chunk counts.
    valid: Tensor | None = None
    lost_episodes: int = 0

    @property
    def num_samples(self) -> int:
        return self.values.numel()


def _model_inputs(actor: Actor, obs: dict) -> dict[str, Tensor]:
    prepared = actor.model.prepare(actor.model_obs(obs))
    return {k: prepared[k] for k in ("images", "state", "tokens", "token_mask")}


def collect_rollout(actor: Actor, env, obs: dict, *, num_chunks: int, sampler: SamplerConfig, execute: int,
                    generator: torch.Generator | None = None) -> tuple[Rollout, dict]:
    """Run ``num_chunks`` chunk steps from ``obs``; returns the rollout and the next observation.

    Sampling runs in inference mode (no graphs); the stored tensors are cloned out of it at the end so
    that the learner may use them as inputs of differentiable computations.
    """
    with torch.inference_mode():
        rollout, obs = _collect(actor, env, obs, num_chunks=num_chunks, sampler=sampler, execute=execute,
                                generator=generator)
    plain = lambda x: x.clone() if torch.is_tensor(x) else x  # noqa: E731
    rollout = Rollout(**{k: ({kk: plain(vv) for kk, vv in v.items()} if k == "obs" else plain(v))
                         for k, v in vars(rollout).items()})
    return rollout, obs


def _collect(actor: Actor, env, obs: dict, *, num_chunks: int, sampler: SamplerConfig, execute: int,
             generator: torch.Generator | None) -> tuple[Rollout, dict]:
    model, dim_mask = actor.model, actor.dim_mask
    store: dict[str, list] = {k: [] for k in ("chain", "stochastic", "log_probs", "entropy", "values",
                                              "rewards", "terminated", "truncated", "success", "final_values")}
    obs_store: dict[str, list] = {k: [] for k in ("images", "state", "tokens", "token_mask")}
    episodes: dict[str, list] = {}
    env_steps = 0
    valid: list[Tensor] = []                       # per chunk [N]
    episode_start = torch.zeros(env.num_envs, dtype=torch.long)   # chunk at which each env's episode began
    lost_episodes = 0
    for t in range(num_chunks):
        inputs = _model_inputs(actor, obs)
        prefix = model.encode_prefix(inputs)
        act = actor.act(obs, sampler, generator=generator, prefix=prefix)
        value = model.value(prefix)
        out = env.step(act.actions[:, :execute])
        env_steps += int(out.steps.sum())
        final_values = torch.zeros_like(value)
        if out.final_obs is not None and bool(out.truncated.any()):
            trunc = out.truncated.to(value.device)
            v_final = model.value(model.encode_prefix(_model_inputs(actor, out.final_obs)))
            final_values = torch.where(trunc, v_final, final_values)
        for k, v in inputs.items():
            obs_store[k].append(v)
        s = act.sample
        store["chain"].append(s.chain)
        store["stochastic"].append(s.stochastic)
        store["log_probs"].append(s.log_probs)
        store["entropy"].append(flow.aggregate(s.entropy, s.stochastic, steps="mean", actions="mean",
                                               dims="mean", executed=execute, dim_mask=dim_mask))
        store["values"].append(value)
        store["rewards"].append(out.rewards.sum(dim=1).to(value.device))
        store["terminated"].append(out.terminated.to(value.device))
        store["truncated"].append(out.truncated.to(value.device))
        store["success"].append(out.success.to(value.device))
        store["final_values"].append(final_values)
        for k, v in out.episodes.items():
            episodes.setdefault(k, []).extend(v.tolist())
        valid.append(torch.ones(env.num_envs, dtype=torch.bool, device=value.device))
        ended = out.done.cpu()
        if out.lost is not None:   # worker envs that were restarted: their episode so far is dropped
            lost = out.lost.cpu()
            for i in lost.nonzero(as_tuple=True)[0].tolist():
                lost_episodes += 1
                for s in range(int(episode_start[i]), t + 1):
                    valid[s][i] = False
            store["terminated"][-1] = store["terminated"][-1] | lost.to(value.device)  # no bootstrap across
            ended = ended | lost
        episode_start = torch.where(ended, t + 1, episode_start)
        obs = out.obs
    last_values = model.value(model.encode_prefix(_model_inputs(actor, obs)))
    rollout = Rollout(obs={k: torch.stack(v) for k, v in obs_store.items()},
                      **{k: torch.stack(v) for k, v in store.items()}, last_values=last_values,
                      sampler=sampler, execute=execute,
                      episodes=episodes, env_steps=env_steps,
                      valid=torch.stack(valid) if lost_episodes else None, lost_episodes=lost_episodes)
    return rollout, obs
