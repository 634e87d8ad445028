"""FPO with FPO++'s changes: policy gradients for flow policies without any likelihood.

FPO (McAllister et al. 2025, "Flow Matching Policy Gradients") replaces PPO's likelihood ratio by the
exponentiated drop of the conditional flow-matching (CFM) loss of the taken action: for each chunk, ``M`` draws of
a flow time ``t_i`` and a noise ``eps_i`` are stored at rollout time together with the loss under the sampling
parameters, ``l_old,i``; the update recomputes ``l_theta,i`` on the same draws. The loss of draw ``i`` is the
squared error of the velocity at ``x_t = t eps + (1 - t) a`` against ``eps - a``, averaged over the real action
dims and summed over the executed actions of the chunk (the chunk-level loss of FPO++'s manipulation runs).

FPO++ (Yi, Choi et al. 2026, "Flow Policy Gradients for Robot Control") changes two things, both on by default:

- per-sample ratios: one ratio per draw, ``rho_i = exp(l_old,i - l_theta,i)``, each in its own clipped term
  (``per_sample: false`` is FPO's single ratio ``exp(mean_i l_old,i - mean_i l_theta,i)``);
- the trust region ``aspo``: PPO's clipped objective where the advantage is >= 0 and SPO's
  ``rho A - |A| / (2 clip) (rho - 1)^2`` where it is < 0, which pulls a ratio back smoothly instead of leaving
  it unbounded once clipped (``ppo`` / ``spo``: either alone).

The log-ratio is clamped, as FPO++'s code does (straight-through: the clamp bounds the value, not the gradient), so
one unlucky draw cannot blow a ratio up. Advantages are GAE from the critic, normalised.
It needs no noise head and no stochastic sampler: rollouts run the deterministic ODE sampler, and the policy
explores through the initial noise of each chunk, as a flow policy does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vla_rl.core.ranges import check_ranges, positive, ranged, setting
from vla_rl.core.shapes import Float
from vla_rl.rl.algorithms.seam import Advantages, Algorithm, Batch, CriticConfig, Step, critic_loss, gae_advantages
from vla_rl.rl.losses import scalar


@dataclass(frozen=True)
class FPOConfig(CriticConfig):
    """FPO / FPO++: CFM-loss ratios on stored (t, eps) draws, no likelihood; a critic for GAE advantages."""

    num_draws: int = ranged(8, 1, doc="M: (t, eps) draws per chunk whose CFM losses make the ratio")
    per_sample: bool = setting(True, doc="FPO++: one ratio per draw; false: FPO's ratio of the mean losses")
    trust_region: Literal["aspo", "ppo", "spo"] = setting(
        "aspo", doc="aspo (FPO++): PPO's clip for advantages >= 0, SPO's quadratic penalty for < 0; ppo; spo")
    clip: float = positive(0.05, doc="ratio clip epsilon (PPO: [1 - clip, 1 + clip]; SPO's penalty scale)")
    clamp_log_ratio: float | None = positive(5.0, doc="bound on |l_old - l_theta| before exp (straight-through); "
                                                      "None: none")
    clamp_old_loss: float | None = positive(None, doc="cap on the stored loss l_old of a draw (FPO++'s code caps it "
                                                      "at 4 on its loss scale; a cap below the losses makes the ratio "
                                                      "differ from 1 at the sampling parameters); None: none")
    normalize_advantages: bool = setting(True, doc="zero-mean, unit-std advantages over the rollout's samples")

    def __post_init__(self):
        check_ranges(self)


def draw_times(n: int, m: int, *, generator: torch.Generator | None, device) -> Float[Tensor, "n m"]:
    """Flow times of the draws, uniform in [0.005, 0.995] (away from the ends, where the target is all noise or
    all action)."""
    return 0.005 + 0.99 * torch.rand(n, m, generator=generator, device=device)


def chunk_losses(errors: Float[Tensor, "n h a"], *, execute: int, dim_mask: Tensor) -> Float[Tensor, " n"]:
    """A draw's CFM loss: squared errors averaged over the real action dims, summed over the executed actions."""
    per_action = (errors[:, :execute] * dim_mask.to(errors)).sum(-1) / dim_mask.sum().clamp_min(1)
    return per_action.sum(-1)


def clamp_straight_through(x: Tensor, bound: float | None) -> Tensor:
    """``x`` clamped to [-bound, bound] in value, with the gradient of ``x`` itself."""
    return x if bound is None else x + (x.clamp(-bound, bound) - x).detach()


def fpo_ratio(old: Float[Tensor, "b m"], new: Float[Tensor, "b m"], *, per_sample: bool,
              clamp_log_ratio: float | None = None) -> Float[Tensor, "b m"]:
    """The CFM-loss ratio: ``exp(l_old,i - l_new,i)`` per draw, or (FPO) the one ``exp(mean_i l_old - mean_i l_new)``
    repeated over the draws; the log-ratio clamped straight-through."""
    log_ratio = old - new if per_sample else (old.mean(1, keepdim=True) - new.mean(1, keepdim=True)).expand_as(old)
    return torch.exp(clamp_straight_through(log_ratio, clamp_log_ratio))


def trust_region_objective(ratio: Float[Tensor, "b m"], adv: Float[Tensor, " b"], *, clip: float,
                           kind: str) -> Float[Tensor, "b m"]:
    """The per-draw objective to maximise: PPO's ``min(rho A, clip(rho) A)``, SPO's
    ``rho A - |A| / (2 clip) (rho - 1)^2``, or ASPO (PPO where ``A >= 0``, SPO where ``A < 0``)."""
    a = adv[:, None].expand_as(ratio)
    ppo = torch.minimum(ratio * a, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * a)
    spo = ratio * a - a.abs() / (2.0 * clip) * (ratio - 1.0).pow(2)
    if kind == "ppo":
        return ppo
    if kind == "spo":
        return spo
    return torch.where(a >= 0, ppo, spo)


class FPO(Algorithm):
    name = "fpo"
    needs_likelihood = False

    def draw(self, batch, model_cfg, *, generator, device):
        """The draws of one chunk per env: times ``t`` ``[N, M]`` and noises ``eps`` ``[N, M, H, A]``."""
        m, h, a = self.cfg.num_draws, model_cfg.action_horizon, model_cfg.action_dim
        return {"fpo_t": draw_times(batch, m, generator=generator, device=device),
                "fpo_eps": torch.randn(batch, m, h, a, generator=generator, device=device)}

    def record(self, actor, seen, chain, draws, *, execute):
        """The draws and their losses ``fpo_old_loss`` ``[N, M]`` under the sampling parameters, of the chain's last
        element: the model's actions (before any clipping to the env's bounds)."""
        old = self._losses(actor, seen.prefix, chain[:, -1], draws["fpo_t"], draws["fpo_eps"], execute=execute)
        return {**draws, "fpo_old_loss": old}

    def extras_spec(self, model_cfg, sampler):
        m, h, a = self.cfg.num_draws, model_cfg.action_horizon, model_cfg.action_dim
        return {"fpo_t": ((m,), torch.float32), "fpo_eps": ((m, h, a), torch.float32),
                "fpo_old_loss": ((m,), torch.float32)}

    def _losses(self, actor, prefix, actions: Tensor, t: Tensor, eps: Tensor, *, execute: int) -> Tensor:
        """``[N, M]`` CFM losses of the chunks ``actions`` ``[N, H, A]`` at the draws, all M in one expert pass."""
        n, m = t.shape
        errors = actor.flow_matching_errors(prefix.repeat(m), actions.repeat_interleave(m, dim=0),
                                            t.reshape(n * m), eps.reshape(n * m, *eps.shape[2:]))
        return chunk_losses(errors, execute=execute, dim_mask=actor.dim_mask).reshape(n, m)

    def advantages(self, ro) -> Advantages:
        return gae_advantages(ro, self.cfg, normalize=self.cfg.normalize_advantages)

    def loss(self, actor, batch: Batch, step: Step):
        cfg = self.cfg
        prefix = actor.prefix(batch.obs, hidden=actor.value_from_prefix)
        loss, metrics = critic_loss(actor, prefix, batch, cfg)
        if not step.train_policy:
            return loss, metrics
        old = batch.extras["fpo_old_loss"]
        if cfg.clamp_old_loss is not None:
            old = old.clamp(max=cfg.clamp_old_loss)
        new = self._losses(actor, prefix, batch.chain[:, -1], batch.extras["fpo_t"], batch.extras["fpo_eps"],
                           execute=step.execute)
        ratio = fpo_ratio(old, new, per_sample=cfg.per_sample, clamp_log_ratio=cfg.clamp_log_ratio)
        pg = -trust_region_objective(ratio, batch.advantages, clip=cfg.clip, kind=cfg.trust_region).mean()
        with torch.no_grad():
            log_ratio = torch.log(ratio)
            metrics.update({"losses/policy": scalar(pg.detach()),
                            "losses/approx_kl": scalar(((ratio - 1.0) - log_ratio).mean()),
                            "losses/clipfrac": scalar(((ratio - 1.0).abs() > cfg.clip).float().mean()),
                            "losses/ratio_max": scalar(ratio.max()), "losses/cfm": scalar(new.mean())})
        return loss + pg, metrics
