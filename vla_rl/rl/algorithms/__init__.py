"""RL methods behind one seam (:mod:`.seam`): each is one file here and one entry of :data:`ALGORITHMS`; the
config picks one by name (``algorithm.name``) and reads only its section (``algorithm.<name>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vla_rl.core.ranges import ConfigError, setting
from vla_rl.core.schema import check_one_section
from vla_rl.rl.algorithms.dapo import DAPO, DAPOConfig
from vla_rl.rl.algorithms.fpo import FPO, FPOConfig
from vla_rl.rl.algorithms.grpo import GRPO, GRPOConfig
from vla_rl.rl.algorithms.ppo import PPO, PPOConfig
from vla_rl.rl.algorithms.rloo import RLOO, RLOOConfig
from vla_rl.rl.algorithms.seam import Algorithm

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (PPO, GRPO, RLOO, DAPO, FPO)}


@dataclass(frozen=True)
class AlgorithmConfig:
    """Which RL method (``name``) and its settings. Only the section named by ``name`` is read; setting another
    section is an error (it would silently do nothing)."""

    name: Literal["ppo", "grpo", "rloo", "dapo", "fpo"] = setting(
        "ppo", doc="ppo: GAE + critic on the chunk likelihood (Flow-Noise / Flow-SDE); grpo / rloo / dapo: "
                   "critic-free group baselines; fpo: likelihood-free (CFM-loss ratios, FPO++)")
    ppo: PPOConfig = setting(default_factory=PPOConfig, doc="name ppo")
    grpo: GRPOConfig = setting(default_factory=GRPOConfig, doc="name grpo")
    rloo: RLOOConfig = setting(default_factory=RLOOConfig, doc="name rloo")
    dapo: DAPOConfig = setting(default_factory=DAPOConfig, doc="name dapo")
    fpo: FPOConfig = setting(default_factory=FPOConfig, doc="name fpo")

    def __post_init__(self):
        check_one_section(self, self.name, tuple(ALGORITHMS), "name")

    @property
    def section(self):
        """The typed settings of the chosen method."""
        return getattr(self, self.name)


def make_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    return ALGORITHMS[cfg.name](cfg.section)


# Where the keys of a config's old ``ppo`` section went (:func:`upgrade_ppo_section`).
LEARNER_KEYS = frozenset(("update_epochs", "minibatches", "grad_accum", "lr_actor", "lr_critic", "weight_decay",
                          "max_grad_norm", "target_kl", "critic_warmup_iters", "actor_lr_warmup_iters",
                          "actor_lr_decay", "actor_lr_final", "actor_lr_decay_start", "freeze_prefix",
                          "grad_checkpointing", "lora", "param_dtype", "optimizer_state_dtype"))
CRITIC_KEYS = frozenset(("gamma", "lam", "reward_scale", "value_clip", "huber_delta", "value_coef"))
GRPO_KEYS = frozenset(("group_size", "clip", "dual_clip", "entropy_coef", "log_prob"))


def upgrade_ppo_section(data: dict) -> dict:
    """A training config written before the algorithm sections, in today's layout: its ``ppo`` section held both
    the learner's settings and the method's (``ppo.algorithm: ppo | grpo``); they become ``learner`` and
    ``algorithm.<name>``. An old key beside its new spelling is refused, naming its new place."""
    if not isinstance(data, dict) or "ppo" not in data:
        return data
    data = dict(data)
    old = dict(data.pop("ppo") or {})
    name = old.pop("algorithm", "ppo")
    learner = {k: old.pop(k) for k in list(old) if k in LEARNER_KEYS}
    if name == "grpo":
        section = {k: old.pop(k) for k in list(old) if k in GRPO_KEYS}
        for old_key, new_key in (("grpo_filter", "filter"),):
            if old_key in old:
                section[new_key] = old.pop(old_key)
        # GRPO runs of that format trained the value head too (on GAE returns): keep doing so on resume.
        critic = {k: old.pop(k) for k in list(old) if k in CRITIC_KEYS}
        old.pop("normalize_advantages", None)   # unread by GRPO
        section["critic"] = critic
    else:
        old.pop("group_size", None)
        old.pop("grpo_filter", None)
        section = old
        old = {}
    if old:
        raise ConfigError(f"ppo.{sorted(old)[0]} has no place in algorithm.{name}")
    new_alg = dict(data.get("algorithm") or {})
    if new_alg.get("name", name) != name:
        raise ConfigError(f"ppo.algorithm={name} is now algorithm.name, which says {new_alg['name']}: "
                          "keep one")
    for where, moved, new in ((f"algorithm.{name}", section, new_alg.get(name) or {}),
                              ("learner", learner, data.get("learner") or {})):
        both = sorted(set(moved) & set(new))
        if both:   # an old key beside its new spelling (e.g. an override of a preset that uses the new one)
            raise ConfigError(f"ppo.{both[0]} is now {where}.{both[0]}: write {where}.{both[0]}="
                              f"{moved[both[0]]} instead")
    data["learner"] = {**learner, **(data.get("learner") or {})}
    data["algorithm"] = {**new_alg, "name": name, name: {**section, **(new_alg.get(name) or {})}}
    return data
