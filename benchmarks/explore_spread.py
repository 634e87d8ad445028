"""How much does a policy's own sampling noise change the outcome from one initial state?

    python benchmarks/explore_spread.py CKPT [--states 16] [--samples 8] [--seed 20000]
                                             [--method sde|noise|ode] [--sde-mode all|mixed]
                                             [--noise-level 0.5] [--execute 8] [--num-envs 16]
                                             [--binary-gripper] [--env.options.max_episode_steps=150 ...]

Resets ``--samples`` envs to each of ``--states`` initial states (seeds ``--seed`` .. ``--seed + states - 1``:
held-out, away from demo seeds 0+, evaluation seeds 10,000+ and rollout seeds 1,000,000+), runs each env's
first episode with the stochastic sampler RL explores with, and prints per state the successes out of
``--samples``. A policy-gradient method learns from the states where the samples disagree ("mixed"); a
state every sample fails gives no success to reinforce, and one every sample wins has nothing left to gain.
The env is the checkpoint's (a training checkpoint's ``train_config.yaml``, else the SFT policy's).
Used in RESULTS.md to compare PushCube (where RL lifts the SFT policy) with PickCube (where it does not).
"""

from __future__ import annotations

import argparse

import torch

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.config import parse_overrides
from vla_rl.evaluate import checkpoint_env_config, first_episodes, open_checkpoint


def outcomes(actor: Actor, env, *, states: int, samples: int, seed: int, sampler: SamplerConfig,
             execute: int) -> torch.Tensor:
    """Success of each env's first episode, ``[states, samples]``. A round resets ``env.num_envs //
    samples`` states with seed ``seed + first state`` and ``group_size=samples``, so env ``i`` of the round
    runs sample ``i % samples`` of its ``i // samples``-th state."""
    n = env.num_envs
    if n % samples:
        raise ValueError(f"num_envs ({n}) must be a multiple of samples ({samples})")
    per_round = n // samples
    result = torch.zeros(states, samples)
    gen = torch.Generator(device=actor.model.device)
    for start in range(0, states, per_round):
        count = min(per_round, states - start) * samples
        ep = first_episodes(actor, env, seed=seed + start, count=count, sampler=sampler, execute=execute,
                            generator=gen, group_size=samples)
        result[start:start + count // samples] = ep["success_once"].reshape(-1, samples).float()
    return result


def binary_gripper(actor: Actor) -> Actor:
    """Make ``actor`` send the gripper command (the last action dim) as exactly -1 or +1, thresholded at 0,
    like the planner's demos. A diagnostic (``--binary-gripper``): with it, a sampler's exploration noise
    reaches only the arm, so comparing success with and without it says how much of the noise's cost is
    the gripper loosening its grasp."""
    act = actor.act

    def act_binary(*args, **kwargs):
        out = act(*args, **kwargs)
        out.actions[..., -1] = torch.where(out.actions[..., -1] >= 0, 1.0, -1.0)
        return out

    actor.act = act_binary
    return actor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--states", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=20_000)
    p.add_argument("--method", default="sde", choices=("ode", "sde", "noise"))
    p.add_argument("--sde-mode", default="all", choices=("all", "mixed"))
    p.add_argument("--noise-level", type=float, default=0.5)
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--execute", type=int, default=8)
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--binary-gripper", action="store_true",
                   help="send the last action dim as -1 / +1 (thresholded at 0): noise then reaches only the arm")
    args, rest = p.parse_known_args()
    overrides = parse_overrides([a.removeprefix("--") for a in rest])
    if set(overrides) - {"env"}:
        p.error(f"unknown arguments {sorted(set(overrides) - {'env'})}: only --env.FIELD=VALUE overrides are passed on")
    env_cfg = checkpoint_env_config(args.checkpoint, overrides.get("env", {}))
    actor, env = open_checkpoint(args.checkpoint, env_config=env_cfg, num_envs=args.num_envs,
                                 device=torch.device("cpu"), seed=args.seed)
    if args.binary_gripper:
        binary_gripper(actor)
    try:
        sampler = SamplerConfig(args.num_steps, args.method, args.noise_level, args.sde_mode)
        res = outcomes(actor, env, states=args.states, samples=args.samples, seed=args.seed, sampler=sampler,
                       execute=args.execute)
    finally:
        env.close()
    wins = res.sum(1)
    for s in range(args.states):
        print(f"seed {args.seed + s}: {int(wins[s])}/{args.samples}")
    never, always = int((wins == 0).sum()), int((wins == args.samples).sum())
    print(f"{args.method} ({args.sde_mode if args.method == 'sde' else ''}): success {res.mean():.3f} over "
          f"{res.numel()} episodes; states never won {never}/{args.states}, always won {always}/{args.states}, "
          f"mixed {args.states - never - always}/{args.states}")


if __name__ == "__main__":
    main()
