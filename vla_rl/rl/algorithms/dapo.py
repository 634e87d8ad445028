"""DAPO (Yu et al. 2025): GRPO's group-normalised episode returns with three changes --

- clip-higher: the ratio is clipped to ``[1 - clip, 1 + clip_high]`` with ``clip_high`` > ``clip`` (0.2 / 0.28),
  so unlikely actions that paid off can gain probability before the clip stops them;
- dynamic sampling: groups whose episodes all succeeded or all failed carry no signal; they are left out and the
  batch is topped up with the informative groups of further rollouts (:meth:`DAPO.keep_envs`; the trainer resets
  the envs on fresh seeds, at most ``max_rollouts`` rollouts an iteration) until it holds as many groups as one
  rollout has;
- the loss is averaged over samples (every chunk, or every action element with ``log_prob.ratio: dim``, weighs the
  same), not per group or per episode first. (Here GRPO weighs chunks alike too.)

No critic, no KL term."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_rl.core.ranges import ConfigError, check_ranges, positive, ranged
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


@dataclass(frozen=True)
class DAPOConfig(SurrogateConfig):
    """DAPO: clip-higher, dynamic sampling of informative groups, sample-level loss; no critic."""

    group_size: int = ranged(8, 2, doc="envs per group sharing an initial state (num_envs must be a multiple)")
    clip_high: float = positive(0.28, doc="upper ratio clip: [1 - clip, 1 + clip_high] (clip-higher)")
    max_rollouts: int = ranged(4, 1, 64, doc="rollouts an iteration may collect to fill the batch with informative "
                                             "groups (1: no top-up, the uninformative groups are only dropped)")

    def __post_init__(self):
        check_ranges(self)
        if self.clip_high < self.clip:
            raise ConfigError(f"clip_high = {self.clip_high} is below clip = {self.clip}: clip-higher widens the "
                              "upper clip")


class DAPO(Algorithm):
    name = "dapo"
    uses_critic = False

    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    @property
    def max_rollouts(self) -> int:
        return self.cfg.max_rollouts

    def keep_envs(self, ro) -> torch.Tensor:
        """The envs of the groups whose first episodes neither all succeeded nor all failed."""
        _, success, _, _ = first_episodes(ro)
        groups = env_groups(success.shape[0], self.cfg.group_size).to(success.device)
        _, keep = adv_lib.grpo(returns=success.float(), groups=groups, success=success, filter_degenerate=True)
        return keep

    def advantages(self, ro) -> Advantages:
        returns, success, in_first, _ = first_episodes(ro)
        groups = env_groups(returns.shape[0], self.cfg.group_size).to(returns.device)
        ep_adv, keep = adv_lib.grpo(returns=returns, groups=groups, success=success, filter_degenerate=True)
        adv, mask = episode_advantages(ep_adv, keep, in_first)
        return Advantages(adv, None, mask, adv)

    def prepare(self, batch: Batch, step: Step) -> Batch:
        return with_old_log_prob(batch, step, self.cfg)

    def loss(self, actor, batch: Batch, step: Step):
        return surrogate_loss(actor, batch, step, self.cfg, clip_high=self.cfg.clip_high)
