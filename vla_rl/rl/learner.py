"""The learner: PPO epochs over a rollout's chunk samples, with separate actor / critic learning rates,
gradient accumulation, clipping, optional prefix freezing, bf16 autocast on GPU, and skipped
(never applied) non-finite steps.

Glossary: B samples (chunks) in a minibatch, K denoising steps, H actions per chunk, A action dims.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vla_rl.core.ranges import ConfigError, check_ranges, fraction, nonneg, positive, ranged
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor
from vla_rl.policies.inference import cast_weights
from vla_rl.policies.lora import LoRAConfig, apply_lora, frozen_by_lora
from vla_rl.policies.recompute import activation_checkpointing
from vla_rl.rl import advantages as adv_lib
from vla_rl.rl import losses
from vla_rl.rl.losses import LogProbConfig, aggregate_log_prob
from vla_rl.rl.optim import make_optimizer
from vla_rl.rl.rollout import Rollout


@dataclass(frozen=True)
class PPOConfig:
    # "ppo": GAE advantages from the critic; "grpo": group-normalised returns of each env's first episode,
    # groups of `group_size` envs sharing an initial state (the run resets the env with group_size and the rollout
    # records it).
    algorithm: Literal["ppo", "grpo"] = "ppo"
    group_size: int = ranged(8, 2)
    grpo_filter: bool = True
    gamma: float = fraction(0.99)
    lam: float = fraction(0.95)
    # Rewards are multiplied by this before GAE. Keeps the value targets O(1) under a per-step cost
    # (ManiSkill's dense_cost: PickCube episodes sum to -60..-110, iteration means of rollout/return): the
    # value head's Adam steps (~lr_critic each) and the value clip (0.2 per update) could not follow
    # targets that far from the start.
    reward_scale: float = positive(1.0)
    clip: float = positive(0.2)
    dual_clip: float | None = ranged(3.0, 1, None, lo_open=True)   # a ratio bound on negative advantages: > 1
    value_clip: float | None = positive(0.2)
    huber_delta: float = positive(1.0)
    value_coef: float = nonneg(1.0)
    entropy_coef: float = nonneg(0.0)
    normalize_advantages: bool = True
    update_epochs: int = ranged(4, 1)
    minibatches: int = ranged(4, 1)
    grad_accum: int = ranged(1, 1)
    # Learning rates above 1 only make Adam steps that throw the weights far from any trained solution.
    lr_actor: float = ranged(2e-5, 0, 1)  # small: Flow-Noise log-densities (std ~0.1) react strongly to the mean
    lr_critic: float = ranged(1e-3, 0, 1)
    weight_decay: float = nonneg(0.0)
    max_grad_norm: float = positive(1.0)
    target_kl: float | None = positive(None)
    critic_warmup_iters: int = nonneg(0)
    # The actor's learning rate ramps up linearly over this many policy-update iterations (after the
    # critic warm-up): the first full-size Adam steps from an SFT policy move the chunk log-likelihood
    # far (approx-KL ~2 on the built-in task at lr 1e-4) before the ratio clip can hold them.
    actor_lr_warmup_iters: int = nonneg(0)
    # After the warm-up the actor's learning rate may decay to `actor_lr_final` x lr_actor at the run's last
    # iteration: constant steps kept moving a policy that had already reached its best (built-in Flow-SDE
    # slipped from 0.91 to 0.80-0.86 over its last 100 of 200 iterations, docs/notes.md).
    # `actor_lr_decay_start` delays the decay to that update (0-based): on PickCube a linear decay from the
    # warm-up slowed the rise (+12/+14), while full lr through the rise and then 1e-5 held the gain (the
    # PickCube Flow-Noise preset, benchmarks/RESULTS.md). `step` holds full lr until then and
    # `actor_lr_final` x lr_actor after.
    actor_lr_decay: Literal["constant", "linear", "cosine", "step"] = "constant"
    actor_lr_final: float = fraction(0.1)
    actor_lr_decay_start: int = nonneg(0)
    freeze_prefix: bool = False
    # Activation checkpointing during the update (policies/recompute.py): "prefix" (vision + prefix backbone),
    # "expert", "all" or "none". Costs about one more forward pass of those layers; what it saves is what lets
    # the pi0 preset's minibatches of 64 fit one GPU (docs/training.md).
    grad_checkpointing: Literal["none", "prefix", "expert", "all"] = "none"
    # LoRA adapters on the prefix (and/or the expert); `lora.rank` 0: none (policies/lora.py, docs/training.md).
    lora: LoRAConfig = LoRAConfig()
    # Memory-lean training (vla_rl/rl/optim.py): "bf16" weights (the optimizer keeps fp32 masters of the trained
    # ones; the rollouts sample with the bf16 weights) and Adam moments stored in bf16.
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    optimizer_state_dtype: Literal["fp32", "bf16"] = "fp32"
    log_prob: LogProbConfig = LogProbConfig()

    def __post_init__(self):
        check_ranges(self)
        if self.actor_lr_decay not in ("constant", "linear", "cosine", "step"):
            raise ConfigError("ppo.actor_lr_decay must be constant, linear, cosine or step, "
                              f"got {self.actor_lr_decay!r}")
        for key in ("param_dtype", "optimizer_state_dtype"):
            if getattr(self, key) not in ("fp32", "bf16"):
                raise ConfigError(f"ppo.{key} must be fp32 or bf16, got {getattr(self, key)!r}")
        if self.freeze_prefix and self.lora.enabled and "prefix" in self.lora.parts:
            raise ConfigError("ppo.freeze_prefix freezes the prefix, ppo.lora.parts adapts it: set "
                              "ppo.lora.parts=[expert] or drop freeze_prefix")
        if self.actor_lr_decay == "step" and self.actor_lr_decay_start == 0:
            raise ConfigError("ppo.actor_lr_decay=step needs ppo.actor_lr_decay_start: the update (0-based) "
                              "from which the actor lr is actor_lr_final x lr_actor")


class Learner:
    """PPO on ``actor``'s model. Each rollout says how it was sampled (``Rollout.sampler``, ``.execute``); the
    learner recomputes the chain's log-densities the same way and aggregates both old and new ones with
    ``cfg.log_prob``.

    Data-parallel (``shard = (rank, world)``, ``world`` > 1): every learner holds the whole rollout, computes
    the same advantages and minibatch order, and runs the loss on its share of each minibatch (samples
    ``rank, rank + world, ...``) weighted by ``share / minibatch``; ``sync(params, metrics)`` then sums the
    gradients and metrics (maxima, ``*_max``, are maximised) over the learners
    (:func:`vla_rl.distributed.gradsync.sum_over_learners`), so every learner takes the step one learner would
    take on the whole minibatch and the replicas stay equal."""

    def __init__(self, actor: Actor, cfg: PPOConfig, *, bf16: bool = False, total_iterations: int | None = None,
                 shard: tuple[int, int] = (0, 1),
                 sync: Callable[[list[Tensor], dict[str, float]], dict[str, float]] | None = None):
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard {shard}: need 0 <= rank < world")
        if world > 1 and sync is None:
            raise ValueError("data-parallel learners (world > 1) need a sync function")
        self.actor, self.cfg = actor, cfg
        self.bf16, self.shard, self.sync = bf16, shard, sync
        self.total_iterations = total_iterations  # the decay's end; None: no decay (constant after warm-up)
        model = actor.model
        apply_lora(model, cfg.lora)   # in place: the rollouts sample with the adapters too
        groups = model.parameter_groups()
        frozen = set(frozen_by_lora(model, cfg.lora))
        if cfg.freeze_prefix:   # "train the expert only"
            frozen |= set(groups["prefix"])
        for name, p in model.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        if cfg.param_dtype == "bf16":
            cast_weights(model, "bf16")
        critic = [p for p in groups["value"].values() if p.requires_grad]
        actor_params = [p for n, p in model.named_parameters() if n not in groups["value"] and p.requires_grad]
        self.optimizer = make_optimizer([
            {"params": actor_params, "lr": cfg.lr_actor, "name": "actor"},
            {"params": critic, "lr": cfg.lr_critic, "name": "critic"},
        ], weight_decay=cfg.weight_decay, param_dtype=cfg.param_dtype, state_dtype=cfg.optimizer_state_dtype)
        # Activation checkpointing parts applied per update (a sharded learner builds them into its model).
        self.recompute = cfg.grad_checkpointing
        self.autocast = bf16 and model.device.type == "cuda"
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.skipped_steps = 0   # over the run (saved in checkpoints)
        self.applied_steps = 0   # in the last update() (0 with samples: every step was skipped)

    def compute_advantages(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advantages, value targets and a mask of the samples that take part, all ``[T, N]``."""
        cfg = self.cfg
        adv, ret = adv_lib.gae(rewards=ro.rewards * cfg.reward_scale, values=ro.values, terminated=ro.terminated,
                               truncated=ro.truncated, final_values=ro.final_values, last_values=ro.last_values,
                               gamma=cfg.gamma, lam=cfg.lam)
        mask = torch.ones_like(adv, dtype=torch.bool)
        if cfg.algorithm == "grpo":
            adv, mask = grpo_chunk_advantages(ro, group_size=ro.group_size, filter_degenerate=cfg.grpo_filter)
        elif cfg.normalize_advantages:
            adv = adv_lib.normalize(adv, ro.valid)
        if ro.valid is not None:   # chunks of episodes lost to a dead env worker take no part
            mask = mask & ro.valid
        return adv, ret, mask

    def update(self, ro: Rollout, *, iteration: int) -> dict[str, float]:
        """PPO epochs over ``ro``; returns averaged metrics (the fixed names of docs/training.md)."""
        cfg, model = self.cfg, self.actor.model
        adv, ret, mask = self.compute_advantages(ro)
        t_len, n = ro.values.shape
        flat = lambda x: x.reshape(t_len * n, *x.shape[2:])  # noqa: E731
        valid = flat(mask).nonzero(as_tuple=True)[0]
        total = valid.numel()
        self.applied_steps = 0
        if total == 0:  # e.g. GRPO with every group all-success or all-failure: nothing to learn from
            return {"train/samples": 0.0, "train/skipped_steps": float(self.skipped_steps)}
        if ro.sampler.method == "ode":
            raise ValueError("the rollout was sampled with the ODE sampler, which has no likelihood: PPO needs "
                             "method sde or noise")
        obs = {k: flat(v) for k, v in ro.obs.items()}
        chain, stoch = flat(ro.chain), flat(ro.stochastic)
        old_lp = aggregate_log_prob(flat(ro.log_probs), stoch, cfg.log_prob, executed=ro.execute,
                                    dim_mask=self.actor.dim_mask)
        old_v, adv, ret = flat(ro.values), flat(adv), flat(ret)
        critic_only = iteration < cfg.critic_warmup_iters
        lr_actor = cfg.lr_actor * actor_lr_scale(iteration, cfg, self.total_iterations)
        for group in self.optimizer.param_groups:  # the schedule is a function of the iteration alone
            if group.get("name") == "actor":
                group["lr"] = lr_actor
        mb_size = math.ceil(total / cfg.minibatches)
        gen = torch.Generator().manual_seed(iteration)
        sums: dict[str, float] = {}
        count = 0
        model.train()
        # the model is restored when the block ends (nothing checkpointed is saved or copied)
        with activation_checkpointing(model, self.recompute), dropout_rng(model.device, iteration, cfg.lora.dropout):
            epochs_run = 0
            for _ in range(cfg.update_epochs):
                epochs_run += 1
                perm = valid[torch.randperm(total, generator=gen).to(valid.device)]
                epoch_kl = []
                for start in range(0, total, mb_size):
                    mb = perm[start:start + mb_size]
                    self.optimizer.zero_grad(set_to_none=True)
                    share, counts = self._share(mb)
                    mb_metrics: dict[str, float] = {}
                    for idx in share.chunk(cfg.grad_accum):
                        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                            loss, m = self._loss({k: v[idx] for k, v in obs.items()}, chain[idx], stoch[idx],
                                                 old_lp[idx], old_v[idx], adv[idx], ret[idx], critic_only, ro)
                        used = idx.numel() if counts else 0
                        (loss * used / mb.numel()).backward()
                        for k, v in m.items():
                            if k.endswith("_max"):   # a maximum over the minibatch's samples, not a mean
                                mb_metrics[k] = max(mb_metrics.get(k, -math.inf), v if used else -math.inf)
                            else:
                                mb_metrics[k] = mb_metrics.get(k, 0.0) + v * used / mb.numel()
                    if self.sync is not None:
                        mb_metrics = self.sync(self.params, mb_metrics)
                    # A norm is non-finite iff some gradient in it is: two checks cover every parameter.
                    grad_norm, critic_grad_norm = clip_grad_norms(self.optimizer, cfg.max_grad_norm)
                    if not (math.isfinite(mb_metrics["losses/total"]) and math.isfinite(float(grad_norm))
                            and math.isfinite(float(critic_grad_norm))):
                        self.skipped_steps += 1  # never apply (nor later save) a non-finite update
                        self.optimizer.zero_grad(set_to_none=True)
                        continue
                    if critic_only:  # warm-up trains the value head alone; dropping the actor's gradients (not
                        # just its zero lr) also keeps value-loss gradients out of the actor's Adam moments
                        for group in self.optimizer.param_groups:
                            if group.get("name") == "actor":
                                for p in group["params"]:
                                    p.grad = None
                    self.optimizer.step()
                    mb_metrics["losses/grad_norm"] = float(grad_norm)
                    mb_metrics["losses/critic_grad_norm"] = float(critic_grad_norm)
                    for k, v in mb_metrics.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
                    epoch_kl.append(mb_metrics.get("losses/approx_kl", 0.0))
                if cfg.target_kl is not None and epoch_kl and sum(epoch_kl) / len(epoch_kl) > cfg.target_kl:
                    break  # KL early stop: the policy already moved far enough for this rollout
        model.eval()
        self.applied_steps = count
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["losses/explained_variance"] = losses.explained_variance(flat(ro.values), ret)
        out["train/skipped_steps"] = float(self.skipped_steps)
        out["train/epochs"] = float(epochs_run)
        out["train/samples"] = float(total)
        out["train/lr_actor"] = lr_actor
        out["train/advantage_mean"] = float(adv.mean())
        # Before normalisation (PPO: the GAE advantages, returns - values): ~0 everywhere means no signal.
        raw = adv if cfg.algorithm == "grpo" else ret - old_v
        out["train/advantage_std_raw"] = float(raw[valid].std()) if total > 1 else 0.0
        out["train/applied_steps"] = float(count)
        return out

    def _share(self, mb: Tensor) -> tuple[Tensor, bool]:
        """This learner's samples of minibatch ``mb`` and whether they count. A learner whose share is empty (a
        minibatch smaller than the number of learners) runs the minibatch's first sample with weight 0, so that
        every learner reports the same metrics and reaches the same parameters."""
        rank, world = self.shard
        if world == 1:
            return mb, True
        share = mb[rank::world]
        return (share, True) if share.numel() else (mb[:1], False)

    def _loss(self, obs, chain, stoch, old_lp, old_v, adv, ret, critic_only, ro: Rollout):
        cfg, model = self.cfg, self.actor.model
        # The prefix's final hidden states feed only a prefix-sourced value head: without one, the last prefix
        # layer computes its keys and values alone (its attention output and MLP would reach no loss).
        prefix = self.actor.prefix(obs, hidden=model.cfg.value_source == "prefix")
        value = model.value(prefix)
        v_loss, metrics = losses.value_loss(values=value, old_values=old_v, returns=ret, clip=cfg.value_clip,
                                            huber_delta=cfg.huber_delta)
        loss = cfg.value_coef * v_loss
        if not critic_only:
            re = flow.chain_log_prob(model.field(prefix), chain, stoch, method=ro.sampler.method,
                                     noise_level=ro.sampler.noise_level)
            new_lp = aggregate_log_prob(re.log_probs, stoch, cfg.log_prob, executed=ro.execute,
                                        dim_mask=self.actor.dim_mask)
            pg, pm = losses.ppo_policy_loss(new_log_prob=new_lp, old_log_prob=old_lp, advantages=adv,
                                            clip=cfg.clip, dual_clip=cfg.dual_clip)
            metrics.update(pm)
            loss = loss + pg
            if cfg.entropy_coef:
                ent = flow.mean_entropy(re.entropy, stoch, executed=ro.execute, dim_mask=self.actor.dim_mask).mean()
                loss = loss - cfg.entropy_coef * ent
                metrics["losses/entropy"] = float(ent)
        metrics["losses/total"] = float(loss.detach())
        return loss, metrics


def dropout_rng(device: torch.device, iteration: int, dropout: float):
    """With LoRA dropout, the update's dropout masks come from the global RNG seeded with the iteration (restored
    afterwards), so they are a function of the iteration like every other draw of a run, and a resumed run
    repeats them."""
    if not dropout:
        return contextlib.nullcontext()
    return _seeded(device, iteration)


@contextlib.contextmanager
def _seeded(device: torch.device, iteration: int):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(7_919 * iteration + 1)
        yield


def clip_grad_norms(optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[Tensor, Tensor]:
    """Clip the actor's and the critic's gradients each to ``max_norm``; returns their norms before.

    Why separately: the chunk log-prob sums many Gaussian terms, so the policy gradient's norm runs at
    17-27 (PickCube, ``losses/grad_norm``) while the value head's is 3-6 (``losses/critic_grad_norm``). One
    joint clip to 1 left the critic a gradient of norm ~0.2 (5/27) once the actor trained, against 1 when
    it is clipped alone (and during the critic warm-up), and Adam's second moment (memory ~1000 steps)
    still held the warm-up's larger gradients, so the value head's steps shrank about 5x."""
    norms = {}
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        # a sharded learner's norm is a distributed tensor: its value is the whole gradient's norm
        norms[group.get("name")] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norms.get("actor", torch.zeros(())), norms.get("critic", torch.zeros(()))


def actor_lr_scale(iteration: int, cfg: PPOConfig, total_iterations: int | None = None) -> float:
    """Factor on ``lr_actor`` at ``iteration`` (0-based; a function of the iteration alone, so a resumed run
    continues the same schedule): 0 during the critic warm-up, then a linear ramp over
    ``actor_lr_warmup_iters`` iterations (1/n, 2/n, ..., 1), then 1, or, with ``actor_lr_decay`` linear or
    cosine and ``total_iterations`` given, a decay from 1 after the ramp (or from ``actor_lr_decay_start``,
    if later) to ``actor_lr_final`` at the last iteration (``total_iterations - 1``); with ``step``, 1 until
    ``actor_lr_decay_start`` and ``actor_lr_final`` from it on (no run length needed)."""
    k = iteration - cfg.critic_warmup_iters
    if k < 0:
        return 0.0
    if cfg.actor_lr_warmup_iters > 0 and k + 1 < cfg.actor_lr_warmup_iters:
        return (k + 1) / cfg.actor_lr_warmup_iters
    if cfg.actor_lr_decay == "step":
        return 1.0 if iteration < cfg.actor_lr_decay_start else cfg.actor_lr_final
    if cfg.actor_lr_decay == "constant" or total_iterations is None:
        return 1.0
    start = max(cfg.critic_warmup_iters + max(cfg.actor_lr_warmup_iters - 1, 0),  # first iteration at full lr
                cfg.actor_lr_decay_start)
    span = total_iterations - 1 - start
    frac = 1.0 if span <= 0 else min(1.0, max(0.0, (iteration - start) / span))
    if cfg.actor_lr_decay == "linear":
        return 1.0 - (1.0 - cfg.actor_lr_final) * frac
    return cfg.actor_lr_final + (1.0 - cfg.actor_lr_final) * 0.5 * (1.0 + math.cos(math.pi * frac))


def grpo_chunk_advantages(ro: Rollout, *, group_size: int,
                          filter_degenerate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO over each env's first episode of the rollout: its return (the sum of its chunk rewards up to
    its first end, or to the rollout's end) is normalised within its group of ``group_size`` envs, and
    every chunk of that episode gets the episode's advantage. Returns ``(advantages, mask)`` ``[T, N]``."""
    t_len, n = ro.rewards.shape
    if n % group_size:
        raise ValueError(f"GRPO needs num_envs ({n}) to be a multiple of group_size ({group_size})")
    t_idx = torch.arange(t_len, device=ro.rewards.device)[:, None]
    done = ro.terminated | ro.truncated
    first_end = torch.where(done.any(0), done.float().argmax(0), torch.full((n,), t_len - 1, device=done.device))
    in_first = t_idx <= first_end[None, :]
    returns = (ro.rewards * in_first).sum(0)
    success = ro.success[first_end, torch.arange(n, device=done.device)]
    groups = torch.arange(n, device=done.device) // group_size
    ep_adv, keep = adv_lib.grpo(returns=returns, groups=groups, success=success,
                                filter_degenerate=filter_degenerate)
    return ep_adv[None, :].expand(t_len, n) * in_first, in_first & keep[None, :]
