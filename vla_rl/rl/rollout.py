"""Rollout collection: the policy samples action chunks, the env executes them, and everything PPO
needs is stored on the policy's device, with how it was sampled (the sampler, the executed actions per chunk,
the GRPO group size) so the learner reads that from the rollout. The per-element log-densities are stored as
sampled; how they become a chunk's log-prob is the loss's choice (:func:`vla_rl.rl.losses.aggregate_log_prob`).
The policy is reached through its :class:`~vla_rl.policies.actor.Actor` alone.

Glossary: T chunk steps, N envs, K denoising steps, H actions per chunk, A model action dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vla_rl.policies.actor import Actor, SamplerConfig


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

    obs: dict[str, Tensor]       # prepared model inputs: images, image_mask, state (normalised, padded), tokens, ...
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
    group_size: int = 1          # envs per group sharing an initial state (GRPO), as the env was reset
    episodes: dict[str, list] = field(default_factory=dict)
    env_steps: int = 0
    # [T, N] bool, False on the chunks of episodes lost to a dead env worker (dropped from the update);
    # None: every chunk counts.
    valid: Tensor | None = None
    lost_episodes: int = 0
    # [T, N, ...] what the algorithm stored at rollout time beside the common fields (Algorithm.record)
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return self.values.numel()

    def take_envs(self, keep: Tensor) -> Rollout:
        """The rollout of the envs where ``keep`` ``[N]`` (bool) is True (episodes stay as they are: they describe
        what was played, see :meth:`join`)."""
        idx = keep.nonzero(as_tuple=True)[0]
        cols = lambda x: None if x is None else x[:, idx]  # noqa: E731
        return Rollout(obs={k: v[:, idx] for k, v in self.obs.items()}, chain=cols(self.chain),
                       stochastic=cols(self.stochastic), log_probs=cols(self.log_probs), entropy=cols(self.entropy),
                       values=cols(self.values), rewards=cols(self.rewards), terminated=cols(self.terminated),
                       truncated=cols(self.truncated), success=cols(self.success),
                       final_values=cols(self.final_values), last_values=self.last_values[idx], sampler=self.sampler,
                       execute=self.execute, group_size=self.group_size, episodes=self.episodes,
                       env_steps=self.env_steps, valid=cols(self.valid), lost_episodes=self.lost_episodes,
                       extras={k: v[:, idx] for k, v in self.extras.items()})

    @staticmethod
    def join(parts: list[Rollout], *, limit: int, env_steps: int, episodes_of: list[Rollout]) -> Rollout:
        """The env columns of ``parts`` side by side, cut to the first ``limit`` envs: one batch of several
        rollouts' kept envs (dynamic sampling). ``env_steps`` and the ended episodes (``rollout/*`` metrics) are
        those of every rollout played, ``episodes_of``, whose env indices are numbered on from rollout to rollout."""
        def cat(get):
            xs = [get(p) for p in parts]
            return None if xs[0] is None else torch.cat(xs, dim=1)[:, :limit]
        episodes: dict[str, list] = {}
        offset = 0
        for ro in episodes_of:
            for k, v in ro.episodes.items():
                episodes.setdefault(k, []).extend([i + offset for i in v] if k == "env_index" else v)
            offset += ro.values.shape[1]
        valid = None
        if any(p.valid is not None for p in parts):
            valid = torch.cat([p.valid if p.valid is not None else torch.ones_like(p.values, dtype=torch.bool)
                               for p in parts], dim=1)[:, :limit]
        first = parts[0]
        return Rollout(obs={k: cat(lambda p, k=k: p.obs[k]) for k in first.obs},
                       chain=cat(lambda p: p.chain), stochastic=cat(lambda p: p.stochastic),
                       log_probs=cat(lambda p: p.log_probs), entropy=cat(lambda p: p.entropy),
                       values=cat(lambda p: p.values), rewards=cat(lambda p: p.rewards),
                       terminated=cat(lambda p: p.terminated), truncated=cat(lambda p: p.truncated),
                       success=cat(lambda p: p.success), final_values=cat(lambda p: p.final_values),
                       last_values=torch.cat([p.last_values for p in parts])[:limit], sampler=first.sampler,
                       execute=first.execute, group_size=first.group_size, episodes=episodes, env_steps=env_steps,
                       valid=valid, lost_episodes=sum(r.lost_episodes for r in episodes_of),
                       extras={k: cat(lambda p, k=k: p.extras[k]) for k in first.extras})

    def metrics(self) -> dict[str, float]:
        """The ``rollout/*`` metrics: over the episodes that ended (success, return, length; and over each env's
        first episode, :func:`first_episode_mask`), the mean chunk reward, the sampler's mean step entropy (how much
        the stochastic policy still explores), and the episodes lost to dead env workers."""
        m: dict[str, float] = {}
        eps = self.episodes
        if eps.get("success_once"):
            k = len(eps["success_once"])
            m["rollout/success_once"] = sum(eps["success_once"]) / k
            m["rollout/return"] = sum(eps["return"]) / k
            m["rollout/episode_length"] = sum(eps["length"]) / k
            m["rollout/episodes"] = k
            first = [s for s, f in zip(eps["success_once"], first_episode_mask(eps["env_index"])) if f]
            m["rollout/success_first"] = sum(first) / len(first)
            m["rollout/first_episodes"] = len(first)
        m["rollout/chunk_reward"] = float(self.rewards.mean())
        m["rollout/entropy"] = float(self.entropy.mean())
        if self.lost_episodes:
            m["rollout/lost_episodes"] = self.lost_episodes
        return m


def collect_rollout(actor: Actor, env, obs: dict, *, num_chunks: int, sampler: SamplerConfig, execute: int,
                    generator: torch.Generator | None = None, groups: int = 1,
                    group_size: int = 1, algorithm=None) -> tuple[Rollout, dict]:
    """Run ``num_chunks`` chunk steps from ``obs``; returns the rollout and the next observation. ``group_size``:
    the envs per group sharing an initial state, as ``env`` was reset (GRPO), recorded in the rollout.
    ``algorithm`` (an :class:`~vla_rl.rl.algorithms.seam.Algorithm`): stores its extras of every chunk
    (``Rollout.extras``), its random draws made with the sampler's, chunk by chunk, from ``generator``.

    ``groups`` > 1 (an env with ``step_groups``: worker processes or Ray env actors) overlaps sampling with
    simulation: the envs are split into that many groups of whole workers, stepped in alternation, and the
    policy samples one group's next chunk while the other groups' workers simulate theirs. Each env gets the
    random draws it gets with ``groups=1`` (drawn for the whole batch, chunk by chunk), and its simulator,
    seed and episodes are its own, so the rollout is the one of ``groups=1`` up to the float rounding of the
    model evaluated on smaller batches; its layout (``[T, N]``, env order, episodes in the order they ended)
    is the same.

    Sampling runs in inference mode (no graphs); the stored tensors are cloned out of it at the end so
    that the learner may use them as inputs of differentiable computations.
    """
    with torch.inference_mode():
        rollout, obs = _collect(actor, env, obs, num_chunks=num_chunks, sampler=sampler, execute=execute,
                                generator=generator, groups=groups, group_size=group_size, algorithm=algorithm)
    plain = lambda x: x.clone() if torch.is_tensor(x) else x  # noqa: E731
    rollout = Rollout(**{k: ({kk: plain(vv) for kk, vv in v.items()} if k in ("obs", "extras") else plain(v))
                         for k, v in vars(rollout).items()})
    return rollout, obs


def step_groups(env, groups: int) -> list[range]:
    """The env rows of each of ``groups`` groups stepped in alternation (one group: all envs)."""
    if groups == 1:
        return [range(env.num_envs)]
    if not hasattr(env, "step_groups"):
        raise ValueError(f"{groups} rollout groups need an env that steps its envs in groups (worker processes or "
                         f"Ray env actors); {type(env).__name__} steps all its envs as one batch")
    return env.step_groups(groups)


def _take_rows(obs: dict, rows: range) -> dict:
    return {k: v[rows.start:rows.stop] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in obs.items()}


def _join_rows(parts: list[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    return {k: torch.cat([p[k] for p in parts]) if torch.is_tensor(v) else
            [x for p in parts for x in p[k]] if isinstance(v, list) else v for k, v in parts[0].items()}


_STORED = ("chain", "stochastic", "log_probs", "entropy", "values", "rewards", "terminated", "truncated", "success",
           "final_values")


def _collect(actor: Actor, env, obs: dict, *, num_chunks: int, sampler: SamplerConfig, execute: int,
             generator: torch.Generator | None, groups: int, group_size: int, algorithm) -> tuple[Rollout, dict]:
    n, device = env.num_envs, actor.device
    rows = step_groups(env, groups)
    parts: list[list[dict]] = [[{} for _ in rows] for _ in range(num_chunks)]   # [t][g]: group g's chunk t
    group_obs = [obs] if len(rows) == 1 else [_take_rows(obs, r) for r in rows]
    stepped: dict[int, object] = {}    # one group: the ChunkStep of its chunk in flight (the env steps at once)
    episodes: dict[str, list] = {}
    env_steps = 0
    valid = [torch.ones(n, dtype=torch.bool, device=device) for _ in range(num_chunks)]
    episode_start = torch.zeros(n, dtype=torch.long)   # chunk at which each env's episode began
    lost_episodes = 0

    def start(t: int, g: int, draws, extra_draws: dict) -> None:
        """Sample group g's chunk t and start it on the env."""
        seen = actor.observe(group_obs[g])
        act = actor.act(seen, sampler, draws=draws.rows(rows[g]), execute=execute)
        parts[t][g].update(inputs=seen.inputs, chain=act.chain, stochastic=act.stochastic, log_probs=act.log_probs,
                           entropy=act.entropy, values=act.value)
        if algorithm is not None:
            mine = {k: v[rows[g].start:rows[g].stop] for k, v in extra_draws.items()}
            parts[t][g]["extras"] = algorithm.record(actor, seen, act.chain, mine, execute=execute)
        if len(rows) == 1:
            stepped[g] = env.step(act.actions[:, :execute])
        else:
            env.step_async(rows[g], act.actions[:, :execute])

    def finish(t: int, g: int) -> None:
        """Take group g's chunk t from the env and record what it did."""
        nonlocal env_steps, lost_episodes
        out = stepped.pop(g) if len(rows) == 1 else env.step_wait(rows[g])
        rec, lo = parts[t][g], rows[g].start
        env_steps += int(out.steps.sum())
        final_values = torch.zeros_like(rec["values"])
        if out.final_obs is not None and bool(out.truncated.any()):
            trunc = out.truncated.to(device)
            v_final = actor.value(actor.observe(out.final_obs))
            final_values = torch.where(trunc, v_final, final_values)
        rec.update(rewards=out.rewards.sum(dim=1).to(device), terminated=out.terminated.to(device),
                   truncated=out.truncated.to(device), success=out.success.to(device), final_values=final_values)
        for k, v in out.episodes.items():
            episodes.setdefault(k, []).extend(v.tolist())
        ended = out.done.cpu()
        if out.lost is not None:   # worker envs that were restarted: their episode so far is dropped
            lost = out.lost.cpu()
            for i in (lost.nonzero(as_tuple=True)[0] + lo).tolist():
                lost_episodes += 1
                for s in range(int(episode_start[i]), t + 1):
                    valid[s][i] = False
            rec["terminated"] = rec["terminated"] | lost.to(device)   # no bootstrap across
            ended = ended | lost
        span = slice(lo, rows[g].stop)
        episode_start[span] = torch.where(ended, t + 1, episode_start[span])
        group_obs[g] = out.obs

    # Group g's chunk t is sampled once its chunk t - 1 is back, while the other groups' chunks run. The draws
    # of chunk t are made for the whole batch before any group samples it: the order of a single batch.
    for t in range(num_chunks):
        draws = actor.draw(n, sampler, generator=generator)
        extra_draws = {} if algorithm is None else algorithm.draw(n, actor.model_config, generator=generator,
                                                                   device=device)
        for g in range(len(rows)):
            if t > 0:
                finish(t - 1, g)
            start(t, g, draws, extra_draws)
    last_values = []
    for g in range(len(rows)):
        finish(num_chunks - 1, g)
        last_values.append(actor.value(actor.observe(group_obs[g])))

    def stack(key: str) -> Tensor:
        return torch.stack([torch.cat([p[key] for p in chunk]) for chunk in parts])

    rollout = Rollout(obs={k: torch.stack([torch.cat([p["inputs"][k] for p in chunk]) for chunk in parts])
                           for k in parts[0][0]["inputs"]},
                      **{k: stack(k) for k in _STORED}, last_values=torch.cat(last_values),
                      sampler=sampler, execute=execute, group_size=group_size, episodes=episodes, env_steps=env_steps,
                      valid=torch.stack(valid) if lost_episodes else None, lost_episodes=lost_episodes,
                      extras={k: torch.stack([torch.cat([p["extras"][k] for p in chunk]) for chunk in parts])
                              for k in (parts[0][0].get("extras") or {})})
    return rollout, _join_rows(group_obs)
