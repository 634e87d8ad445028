"""The learner: epochs of minibatch updates over a rollout's chunk samples, for any RL method of
:mod:`vla_rl.rl.algorithms` (which gives the advantages and the loss). What every method shares lives here:
separate actor / critic learning rates and their schedule, gradient accumulation, clipping, optional prefix
freezing and LoRA, bf16 autocast on GPU, skipped (never applied) non-finite steps, the KL early stop, and the
data-parallel gradient sync.

Glossary: T chunk steps, N envs, B samples (chunks) in a minibatch, K denoising steps, H actions per chunk,
A action dims.
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
from vla_rl.policies.actor import Actor
from vla_rl.policies.inference import cast_weights
from vla_rl.policies.lora import LoRAConfig, apply_lora, frozen_by_lora
from vla_rl.policies.recompute import activation_checkpointing
from vla_rl.rl import losses
from vla_rl.rl.algorithms.seam import Algorithm, Batch, Step
from vla_rl.rl.optim import make_optimizer
from vla_rl.rl.rollout import Rollout


@dataclass(frozen=True)
class LearnerConfig:
    """How the learner updates, whatever the method: epochs, minibatches, learning rates and their schedule,
    clipping, what trains (prefix, LoRA) and in which precision."""

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

    def __post_init__(self):
        check_ranges(self)
        if self.actor_lr_decay not in ("constant", "linear", "cosine", "step"):
            raise ConfigError("actor_lr_decay must be constant, linear, cosine or step, "
                              f"got {self.actor_lr_decay!r}")
        for key in ("param_dtype", "optimizer_state_dtype"):
            if getattr(self, key) not in ("fp32", "bf16"):
                raise ConfigError(f"{key} must be fp32 or bf16, got {getattr(self, key)!r}")
        if self.freeze_prefix and self.lora.enabled and "prefix" in self.lora.parts:
            raise ConfigError("freeze_prefix freezes the prefix, lora.parts adapts it: set "
                              "learner.lora.parts=[expert] or drop freeze_prefix")
        if self.actor_lr_decay == "step" and self.actor_lr_decay_start == 0:
            raise ConfigError("actor_lr_decay=step needs actor_lr_decay_start: the update (0-based) "
                              "from which the actor lr is actor_lr_final x lr_actor")


class Learner:
    """``algorithm`` (:class:`~vla_rl.rl.algorithms.seam.Algorithm`) on ``actor``'s model with ``cfg``. Each
    rollout says how it was sampled (``Rollout.sampler``, ``.execute``); the algorithm reads that from the
    :class:`~vla_rl.rl.algorithms.seam.Step` it is given.

    Data-parallel (``shard = (rank, world)``, ``world`` > 1): every learner holds the whole rollout, computes
    the same advantages and minibatch order, and runs the loss on its share of each minibatch (samples
    ``rank, rank + world, ...``) weighted by ``share / minibatch``; ``sync(params, metrics)`` then sums the
    gradients and metrics (maxima, ``*_max``, are maximised) over the learners
    (:func:`vla_rl.distributed.gradsync.sum_over_learners`), so every learner takes the step one learner would
    take on the whole minibatch and the replicas stay equal."""

    def __init__(self, actor: Actor, cfg: LearnerConfig, algorithm: Algorithm, *, bf16: bool = False,
                 total_iterations: int | None = None, shard: tuple[int, int] = (0, 1),
                 sync: Callable[[list[Tensor], dict[str, float]], dict[str, float]] | None = None):
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard {shard}: need 0 <= rank < world")
        if world > 1 and sync is None:
            raise ValueError("data-parallel learners (world > 1) need a sync function")
        if cfg.critic_warmup_iters and not algorithm.uses_critic:
            raise ConfigError(f"learner.critic_warmup_iters = {cfg.critic_warmup_iters}: algorithm "
                              f"{algorithm.name} trains no critic")
        self.actor, self.cfg, self.algorithm = actor, cfg, algorithm
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

    def update(self, ro: Rollout, *, iteration: int) -> dict[str, float]:
        """Epochs of minibatch steps over ``ro``; returns averaged metrics (the fixed names of docs/training.md)."""
        cfg, model, algo = self.cfg, self.actor.model, self.algorithm
        adv = algo.advantages(ro)
        mask = adv.mask if ro.valid is None else adv.mask & ro.valid   # chunks of episodes lost to a dead worker
        valid = mask.reshape(-1).nonzero(as_tuple=True)[0]
        total = valid.numel()
        self.applied_steps = 0
        if total == 0:  # e.g. GRPO with every group all-success or all-failure: nothing to learn from
            return {"train/samples": 0.0, "train/skipped_steps": float(self.skipped_steps)}
        algo.check_sampler(ro.sampler)
        critic_only = iteration < cfg.critic_warmup_iters
        step = Step(ro.sampler, ro.execute, self.actor.dim_mask, train_policy=not critic_only)
        batch = algo.prepare(Batch.of(ro, adv), step)
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
                            loss, m = algo.loss(self.actor, batch.rows(idx), step)
                        m["losses/total"] = float(loss.detach())
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
        if adv.returns is not None:
            out["losses/explained_variance"] = losses.explained_variance(batch.values, batch.returns)
        out["train/skipped_steps"] = float(self.skipped_steps)
        out["train/epochs"] = float(epochs_run)
        out["train/samples"] = float(total)
        out["train/lr_actor"] = lr_actor
        out["train/advantage_mean"] = float(batch.advantages.mean())
        # Before normalisation (PPO: the GAE advantages, returns - values): ~0 everywhere means no signal.
        raw = adv.raw.reshape(-1)
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


def actor_lr_scale(iteration: int, cfg: LearnerConfig, total_iterations: int | None = None) -> float:
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
