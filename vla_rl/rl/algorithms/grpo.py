"""GRPO: critic-free; the envs are reset in groups that share an initial state, each env's first episode of the
rollout is scored by its return normalised within its group, and every chunk of that episode takes the episode's
advantage in the clipped chunk-ratio surrogate. Groups whose episodes all succeeded or all failed carry no signal
and are dropped (πRL). Chunks are weighted alike in the loss (a longer episode counts more)."""

from __future__ import annotations

from dataclasses import dataclass

from vla_rl.core.ranges import check_ranges, ranged, setting
from vla_rl.rl import advantages as adv_lib
from vla_rl.rl.algorithms.seam import (
    Advantages,
    Algorithm,
    Batch,
    CriticConfig,
    Step,
    SurrogateConfig,
    env_groups,
    episode_advantages,
    first_episodes,
    gae_advantages,
    surrogate_loss,
    with_old_log_prob,
)


@dataclass(frozen=True)
class GRPOConfig(SurrogateConfig):
    """GRPO: group-normalised episode returns, no critic."""

    group_size: int = ranged(8, 2, doc="envs per group sharing an initial state (num_envs must be a multiple)")
    filter: bool = setting(True, doc="drop groups whose episodes all succeeded or all failed (no signal)")
    critic: CriticConfig | None = setting(
        None, doc="None: no critic. A section: also train the value head on GAE returns with these settings (how "
                  "GRPO runs written before the algorithm sections trained; their configs load into it).")

    def __post_init__(self):
        check_ranges(self)


class GRPO(Algorithm):
    name = "grpo"

    @property
    def uses_critic(self) -> bool:
        return self.cfg.critic is not None

    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    def advantages(self, ro) -> Advantages:
        returns, success, in_first, _ = first_episodes(ro)
        groups = env_groups(returns.shape[0], self.cfg.group_size).to(returns.device)
        ep_adv, keep = adv_lib.grpo(returns=returns, groups=groups, success=success,
                                    filter_degenerate=self.cfg.filter)
        adv, mask = episode_advantages(ep_adv, keep, in_first)
        targets = None if self.cfg.critic is None else gae_advantages(ro, self.cfg.critic, normalize=False).returns
        return Advantages(adv, targets, mask, adv)

    def prepare(self, batch: Batch, step: Step) -> Batch:
        return with_old_log_prob(batch, step, self.cfg)

    def loss(self, actor, batch: Batch, step: Step):
        return surrogate_loss(actor, batch, step, self.cfg, self.cfg.critic)
