"""Does an evaluation repeat? The same policy, the same env, the same seeds, several times in one process.

    python benchmarks/reset_repeatability.py POLICY [--episodes 32] [--repeats 3] [--seed 10000] [--stale-reset]

Builds POLICY's ManiSkill env on CPU workers (``--episodes`` envs, ``reward=dense_cost``) and runs
:func:`vla_rl.evaluate.evaluate` ``--repeats`` times on that one env. Every round resets all envs with the
same seeds, so the readings should agree; only the first starts from fresh simulators. Prints success and
mean return per repeat. ``--stale-reset`` uses ManiSkill's reset observation as it is (what the adapter did
before ``envs.maniskill.observe_after_reset``): the contacts of the previous episode's last step.
"""

from __future__ import annotations

import argparse
import functools

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.checkpoint import load_policy
from vla_rl.config import from_dict
from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv
from vla_rl.envs.workers import WorkerVectorEnv
from vla_rl.evaluate import evaluate


class StaleResetEnv(ManiSkillSingleEnv):
    """The adapter before stop 20: the reset's observation straight from ManiSkill."""

    def reset(self, seed: int | None = None) -> dict:
        raw, _ = self.env.reset(seed=seed)
        self._t = 0
        return self._obs(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=10_000)
    ap.add_argument("--stale-reset", action="store_true")
    args = ap.parse_args()
    model, norm, config = load_policy(args.policy)
    env_cfg = config.get("env_config") or {}
    if env_cfg.get("kind") != "maniskill":
        raise SystemExit(f"{args.policy} is not a ManiSkill policy (env_config kind {env_cfg.get('kind')!r})")
    ms = from_dict(ManiSkillConfig, {**env_cfg.get("options", {}), "reward": "dense_cost"})
    cls = StaleResetEnv if args.stale_reset else ManiSkillSingleEnv
    env = WorkerVectorEnv(functools.partial(cls, ms), args.episodes, seed=args.seed, name="maniskill")
    try:
        spec = env.spec
        actor = Actor(model, norm, env_state_dim=spec.state_dim, env_action_dim=spec.action_dim,
                      action_low=spec.action_low, action_high=spec.action_high)
        for r in range(args.repeats):
            m = evaluate(actor, env, num_episodes=args.episodes, sampler=SamplerConfig(4, "ode"), execute=8,
                         seed=args.seed)
            print(f"repeat {r}: success {m['eval/success_once']:.3f}  mean return {m['eval/return']:.4f}",
                  flush=True)
    finally:
        env.close()


if __name__ == "__main__":
    main()
