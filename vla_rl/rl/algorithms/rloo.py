"""RLOO (REINFORCE leave-one-out): critic-free; the envs are reset in groups that share an initial state, and each
env's first episode of the rollout has the advantage of its return over the mean return of the *other* episodes
of its group, ``A_i = R_i - 1/(k-1) sum_{j != i} R_j = k/(k-1) (R_i - mean_group R)`` (Kool et al. 2019; Ahmadian
et al. 2024). Every chunk of the episode takes it in the clipped chunk-ratio surrogate (TRL's RLOO clips too), so
several epochs over a rollout stay near the sampling policy. Unlike GRPO there is no division by the group's
spread: a group whose returns are all equal gives 0 everywhere, and no group is dropped."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vla_rl.core.ranges import check_ranges, ranged, setting
from vla_rl.core.shapes import Float, Int
from vla_rl.rl import advantages as adv_lib
from vla_rl.rl.algorithms.seam import (
    Advantages,
    Algorithm,
    Batch,
    Step,
    SurrogateConfig,
    env_groups,
    episode_advantages,
    first_episodes,
    surrogate_loss,
    with_old_log_prob,
)


def leave_one_out(returns: Float[Tensor, " e"], groups: Int[Tensor, " e"]) -> Float[Tensor, " e"]:
    """``R_i`` minus the mean of the other returns of its group (a group of one has no baseline: 0 is used)."""
    uniq, inv = torch.unique(groups, return_inverse=True)
    count = torch.zeros(uniq.numel(), device=returns.device).index_add_(0, inv, torch.ones_like(returns))
    total = torch.zeros(uniq.numel(), device=returns.device).index_add_(0, inv, returns)
    others = count[inv] - 1
    baseline = torch.where(others > 0, (total[inv] - returns) / others.clamp_min(1), returns)
    return returns - baseline


@dataclass(frozen=True)
class RLOOConfig(SurrogateConfig):
    """RLOO: leave-one-out baselines over groups of episodes from one initial state, no critic."""

    group_size: int = ranged(8, 2, doc="envs per group sharing an initial state (num_envs must be a multiple)")
    normalize_advantages: bool = setting(False, doc="also scale the advantages to zero mean, unit std over the "
                                                    "rollout (TRL's option; off in the papers)")

    def __post_init__(self):
        check_ranges(self)


class RLOO(Algorithm):
    name = "rloo"
    uses_critic = False

    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    def advantages(self, ro) -> Advantages:
        returns, _, in_first, _ = first_episodes(ro)
        groups = env_groups(returns.shape[0], self.cfg.group_size).to(returns.device)
        ep_adv = leave_one_out(returns, groups)
        raw, mask = episode_advantages(ep_adv, torch.ones_like(ep_adv, dtype=torch.bool), in_first)
        adv = adv_lib.normalize(raw, mask) * mask if self.cfg.normalize_advantages else raw
        return Advantages(adv, None, mask, raw)

    def prepare(self, batch: Batch, step: Step) -> Batch:
        return with_old_log_prob(batch, step, self.cfg)

    def loss(self, actor, batch: Batch, step: Step):
        return surrogate_loss(actor, batch, step, self.cfg)
