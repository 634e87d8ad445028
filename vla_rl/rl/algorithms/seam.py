"""The Algorithm seam: what an RL method is, and the pieces the methods share.

An algorithm declares three things, and the learner (:mod:`vla_rl.rl.learner`) owns the rest (minibatches,
gradient clipping, the skip-on-non-finite guard, gradient sync, LoRA / bf16 / FSDP, the learning-rate schedule,
exact resume):

- :meth:`Algorithm.record`: what it stores at rollout time beside the common fields (the chain, its
  log-densities, the values, rewards...): its ``extras``, ``[N, ...]`` per chunk (and :meth:`Algorithm.prepare`:
  what it derives once per update from the whole batch, before the minibatches);
- :meth:`Algorithm.advantages`: per-chunk advantages (and value targets, if it trains the critic) of a rollout;
- :meth:`Algorithm.loss`: its loss on a minibatch of chunk samples, ``(loss, metrics)``.

It also says what it needs of the run: a sampler with a likelihood (:attr:`needs_likelihood`), envs reset in
groups that share an initial state (:attr:`group_size`), a critic (:attr:`uses_critic`), and which envs of a
rollout take part (:meth:`keep_envs`: dynamic sampling tops the batch up from further rollouts). An algorithm
reaches the policy through its :class:`~vla_rl.policies.actor.Actor` alone.

Glossary: T chunk steps, N envs, B samples (chunks) in a minibatch, K denoising steps, H actions per chunk,
A model action dims, E episodes, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from vla_rl.core.ranges import ConfigError, check_ranges, fraction, nonneg, positive, ranged, setting
from vla_rl.core.shapes import Bool, Float
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, Observation, SamplerConfig
from vla_rl.rl import advantages as adv_lib
from vla_rl.rl import losses
from vla_rl.rl.losses import LogProbConfig, aggregate_log_prob
from vla_rl.rl.rollout import Rollout


# ----------------------------------------------------------------------------------------------------
# What a loss sees
# ----------------------------------------------------------------------------------------------------
@dataclass
class Advantages:
    """An algorithm's reading of a rollout, ``[T, N]`` each: ``advantages``; ``returns``, the value targets
    (None: the critic is not trained); ``mask``, the samples that take part; ``raw``, the advantages before any
    normalisation (``train/advantage_std_raw``: ~0 everywhere means no learning signal)."""

    advantages: Float[Tensor, "t n"]
    returns: Float[Tensor, "t n"] | None
    mask: Bool[Tensor, "t n"]
    raw: Float[Tensor, "t n"]


@dataclass
class Batch:
    """``B`` chunk samples of a rollout, flattened over (T, N): the prepared model inputs ``obs``, the sampled
    ``chain`` ``[B, K+1, H, A]`` (``chain[:, -1]``: the model's actions), ``stochastic`` ``[B, K]``, the
    per-element ``log_probs`` ``[B, K, H, A]`` as sampled, the critic's ``values`` ``[B]`` at rollout time, the
    ``advantages`` / ``returns`` ``[B]`` and the algorithm's ``extras``."""

    obs: dict[str, Tensor]
    chain: Tensor
    stochastic: Tensor
    log_probs: Tensor
    values: Tensor
    advantages: Tensor
    returns: Tensor | None
    extras: dict[str, Tensor] = field(default_factory=dict)

    def rows(self, idx: Tensor) -> Batch:
        take = lambda x: None if x is None else x[idx]  # noqa: E731
        return Batch({k: v[idx] for k, v in self.obs.items()}, self.chain[idx], self.stochastic[idx],
                     self.log_probs[idx], self.values[idx], self.advantages[idx], take(self.returns),
                     {k: v[idx] for k, v in self.extras.items()})

    @staticmethod
    def of(ro: Rollout, adv: Advantages) -> Batch:
        """The rollout's ``T * N`` samples, in (t, n) order."""
        t_len, n = ro.values.shape
        flat = lambda x: x.reshape(t_len * n, *x.shape[2:])  # noqa: E731
        return Batch({k: flat(v) for k, v in ro.obs.items()}, flat(ro.chain), flat(ro.stochastic),
                     flat(ro.log_probs), flat(ro.values), flat(adv.advantages),
                     None if adv.returns is None else flat(adv.returns), {k: flat(v) for k, v in ro.extras.items()})


@dataclass(frozen=True)
class Step:
    """What the learner tells a loss about the update it is in: how the rollout was sampled (``sampler``, the
    actions of each chunk the env ran, ``execute``), the model's real action dims (``dim_mask`` ``[A]``), and
    whether the policy trains (False during the critic warm-up: the value loss alone)."""

    sampler: SamplerConfig
    execute: int
    dim_mask: Tensor
    train_policy: bool = True


# ----------------------------------------------------------------------------------------------------
# The seam
# ----------------------------------------------------------------------------------------------------
class Algorithm:
    """One RL method. Subclasses set :attr:`name` and the class attributes below, and implement
    :meth:`advantages` and :meth:`loss` (and :meth:`record` / :meth:`extras_spec` if they store more)."""

    name: ClassVar[str] = ""
    needs_likelihood: ClassVar[bool] = True   # the rollout's chain must have log-densities (sde / noise)
    uses_critic: ClassVar[bool] = True        # the value head is trained (value loss, warm-up, explained variance)

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def group_size(self) -> int:
        """Envs per group sharing an initial state at reset (1: every env its own)."""
        return 1

    def check_sampler(self, sampler: SamplerConfig) -> None:
        """Refuse a sampler this method cannot learn from (the one place that says so)."""
        if self.needs_likelihood and sampler.method == "ode":
            raise ConfigError(f"sampler.method=ode has no likelihood, which algorithm {self.name} needs: use sde or "
                              "noise (a likelihood-free method such as fpo learns from ODE rollouts)")

    def draw(self, batch: int, model_cfg, *, generator: torch.Generator | None, device) -> dict[str, Tensor]:
        """The random draws :meth:`record` needs for one chunk of every env, ``[N, ...]``, made once per chunk for
        the whole batch (as the sampler's are), so an env gets the same draws however the envs are grouped."""
        return {}

    def record(self, actor: Actor, seen: Observation, chain: Tensor, draws: dict[str, Tensor], *,
               execute: int) -> dict[str, Tensor]:
        """Extras to store per chunk, ``[N, ...]``: from the chunk's observation ``seen``, its sampled ``chain``
        ``[N, K+1, H, A]`` and this batch's rows of :meth:`draw`."""
        return {}

    def extras_spec(self, model_cfg, sampler: SamplerConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape per sample and dtype of each extra :meth:`record` stores (the memory plan probes with them)."""
        return {}

    def advantages(self, ro: Rollout) -> Advantages:
        raise NotImplementedError

    def prepare(self, batch: Batch, step: Step) -> Batch:
        """The whole update's batch, with what the loss needs computed once (e.g. the old log-probs)."""
        return batch

    @property
    def max_rollouts(self) -> int:
        """Rollouts an iteration may collect to fill its batch with kept envs (:meth:`keep_envs`)."""
        return 1

    def keep_envs(self, ro: Rollout) -> Tensor | None:
        """``[N]`` bool: the envs of ``ro`` whose samples are worth an update, or None (all; no top-up)."""
        return None

    def loss(self, actor: Actor, batch: Batch, step: Step) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------------
# Shared configs and pieces
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CriticConfig:
    """The critic and GAE: discount, GAE lambda, reward scale, the clipped Huber value loss and its weight."""

    gamma: float = fraction(0.99, doc="discount per chunk step")
    lam: float = fraction(0.95, doc="GAE lambda")
    # Keeps the value targets O(1) under a per-step cost (ManiSkill's dense_cost: PickCube episodes sum to
    # -60..-110): the value head's Adam steps (~lr_critic each) and the value clip (0.2 per update) could not
    # follow targets that far from the start.
    reward_scale: float = positive(1.0, doc="rewards are multiplied by this before GAE")
    value_clip: float | None = positive(0.2, doc="bound on the value's change per update (clipped value loss)")
    huber_delta: float = positive(1.0, doc="Huber value loss: quadratic below this error, linear above")
    value_coef: float = nonneg(1.0, doc="weight of the value loss")

    def __post_init__(self):
        check_ranges(self)


@dataclass(frozen=True)
class SurrogateConfig:
    """The clipped likelihood-ratio surrogate over action chunks (PPO's)."""

    clip: float = positive(0.2, doc="ratio clip: [1 - clip, 1 + clip]")
    dual_clip: float | None = ranged(3.0, 1, None, lo_open=True,
                                     doc="a ratio bound on negative advantages (> 1); None: none")
    entropy_coef: float = nonneg(0.0, doc="weight of the sampler's mean step entropy, maximised")
    log_prob: LogProbConfig = setting(default_factory=LogProbConfig,
                                      doc="how per-element log-densities become a chunk's log-prob")

    def __post_init__(self):
        check_ranges(self)


def gae_advantages(ro: Rollout, cfg: CriticConfig, *, normalize: bool) -> Advantages:
    """GAE over chunk steps from the critic's values; normalised over the valid samples if ``normalize``."""
    adv, ret = adv_lib.gae(rewards=ro.rewards * cfg.reward_scale, values=ro.values, terminated=ro.terminated,
                           truncated=ro.truncated, final_values=ro.final_values, last_values=ro.last_values,
                           gamma=cfg.gamma, lam=cfg.lam)
    raw = ret - ro.values
    if normalize:
        adv = adv_lib.normalize(adv, ro.valid)
    return Advantages(adv, ret, torch.ones_like(adv, dtype=torch.bool), raw)


def first_episodes(ro: Rollout) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each env's first episode of the rollout: ``(returns [N], success [N], in_first [T, N], first_end [N])`` --
    its return (the sum of its chunk rewards up to its first end, or to the rollout's end), whether it succeeded,
    which chunks belong to it, and the chunk at which it ended. Critic-free methods score episodes with these."""
    t_len, n = ro.rewards.shape
    t_idx = torch.arange(t_len, device=ro.rewards.device)[:, None]
    done = ro.terminated | ro.truncated
    first_end = torch.where(done.any(0), done.float().argmax(0), torch.full((n,), t_len - 1, device=done.device))
    in_first = t_idx <= first_end[None, :]
    returns = (ro.rewards * in_first).sum(0)
    success = ro.success[first_end, torch.arange(n, device=done.device)]
    return returns, success, in_first, first_end


def env_groups(n: int, group_size: int) -> Tensor:
    """``[N]`` group index of each env (consecutive blocks of ``group_size``)."""
    if n % group_size:
        raise ValueError(f"num_envs ({n}) must be a multiple of the group size ({group_size})")
    return torch.arange(n) // group_size


def episode_advantages(ep_adv: Tensor, keep: Tensor, in_first: Tensor) -> tuple[Tensor, Tensor]:
    """Per-episode advantages ``[N]`` onto every chunk of each env's first episode: ``(advantages, mask)``
    ``[T, N]`` (chunks after the first episode, and dropped episodes, take no part)."""
    t_len, n = in_first.shape
    return ep_adv[None, :].expand(t_len, n) * in_first, in_first & keep[None, :]


def with_old_log_prob(batch: Batch, step: Step, cfg: SurrogateConfig) -> Batch:
    """``batch`` with ``extras["old_log_prob"]``: the stored log-densities aggregated with ``cfg.log_prob``, once
    for the whole update."""
    old = aggregate_log_prob(batch.log_probs, batch.stochastic, cfg.log_prob, executed=step.execute,
                             dim_mask=step.dim_mask)
    return Batch(batch.obs, batch.chain, batch.stochastic, batch.log_probs, batch.values, batch.advantages,
                 batch.returns, {**batch.extras, "old_log_prob": old})


def likelihood_policy_loss(actor: Actor, prefix, batch: Batch, step: Step, cfg: SurrogateConfig, *,
                           clip_high: float | None = None) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """The clipped surrogate on the chunk likelihood ratio: the stored chain's log-densities recomputed under the
    current parameters (the rollout's sampler says which steps are Gaussian), aggregated with ``cfg.log_prob``,
    against ``extras["old_log_prob"]`` (:func:`with_old_log_prob`); ``clip_high``: an upper clip other than
    ``cfg.clip`` (DAPO's clip-higher). Returns ``(surrogate, mean step entropy or None, metrics)``: the entropy
    when ``cfg.entropy_coef`` asks for a bonus (the caller subtracts ``entropy_coef`` times it)."""
    re = actor.chain_log_prob(prefix, batch.chain, batch.stochastic, step.sampler)
    new_lp = aggregate_log_prob(re.log_probs, batch.stochastic, cfg.log_prob, executed=step.execute,
                                dim_mask=step.dim_mask)
    pg, metrics = losses.ppo_policy_loss(new_log_prob=new_lp, old_log_prob=batch.extras["old_log_prob"],
                                         advantages=batch.advantages, clip=cfg.clip, clip_high=clip_high,
                                         dual_clip=cfg.dual_clip)
    ent = None
    if cfg.entropy_coef:
        ent = flow.mean_entropy(re.entropy, batch.stochastic, executed=step.execute, dim_mask=step.dim_mask).mean()
        metrics["losses/entropy"] = losses.scalar(ent)
    return pg, ent, metrics


def surrogate_loss(actor: Actor, batch: Batch, step: Step, cfg: SurrogateConfig, critic: CriticConfig | None = None,
                   *, clip_high: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss of a method on the clipped chunk-likelihood surrogate (PPO, GRPO, RLOO, DAPO): the value loss where
    there is a ``critic``, plus (unless the step trains the critic alone) the surrogate, minus the entropy bonus."""
    # The prefix's final hidden states feed only a prefix-sourced value head: without one, the last prefix layer
    # computes its keys and values alone (its attention output and MLP would reach no loss).
    prefix = actor.prefix(batch.obs, hidden=critic is not None and actor.value_from_prefix)
    loss, metrics = critic_loss(actor, prefix, batch, critic) if critic is not None else (0.0, {})
    if step.train_policy:
        pg, ent, pm = likelihood_policy_loss(actor, prefix, batch, step, cfg, clip_high=clip_high)
        metrics.update(pm)
        loss = loss + pg
        if ent is not None:
            loss = loss - cfg.entropy_coef * ent
    return loss, metrics


def critic_loss(actor: Actor, prefix, batch: Batch, cfg: CriticConfig) -> tuple[Tensor, dict[str, float]]:
    """``value_coef`` times the clipped Huber value loss of the current values against ``batch.returns``."""
    v_loss, metrics = losses.value_loss(values=actor.prefix_value(prefix), old_values=batch.values,
                                        returns=batch.returns, clip=cfg.value_clip, huber_delta=cfg.huber_delta)
    return cfg.value_coef * v_loss, metrics
