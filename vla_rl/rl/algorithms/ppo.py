"""PPO over action chunks with a critic (πRL's recipe): GAE advantages, the clipped surrogate on the chunk
likelihood ratio, a clipped value loss. The likelihood is the rollout sampler's: Flow-Noise (every denoising step
Gaussian with the learned std) or Flow-SDE (the ODE's SDE twin, usually one random stochastic step a chunk)."""

from __future__ import annotations

from dataclasses import dataclass

from vla_rl.core.ranges import check_ranges, setting
from vla_rl.rl.algorithms.seam import (
    Advantages,
    Algorithm,
    Batch,
    CriticConfig,
    Step,
    SurrogateConfig,
    gae_advantages,
    surrogate_loss,
    with_old_log_prob,
)


@dataclass(frozen=True)
class PPOConfig(CriticConfig, SurrogateConfig):
    """PPO: GAE advantages from the critic, normalised; the clipped chunk-ratio surrogate; the value loss."""

    normalize_advantages: bool = setting(True, doc="zero-mean, unit-std advantages over the rollout's samples")

    def __post_init__(self):
        check_ranges(self)


class PPO(Algorithm):
    name = "ppo"

    def advantages(self, ro) -> Advantages:
        return gae_advantages(ro, self.cfg, normalize=self.cfg.normalize_advantages)

    def prepare(self, batch: Batch, step: Step) -> Batch:
        return with_old_log_prob(batch, step, self.cfg)

    def loss(self, actor, batch: Batch, step: Step):
        return surrogate_loss(actor, batch, step, self.cfg, self.cfg)
