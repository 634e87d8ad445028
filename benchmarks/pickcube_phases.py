"""Where a PickCube policy fails: per episode, was the cube reached, grasped, lifted, brought to the goal?

    python benchmarks/pickcube_phases.py CKPT [--episodes 30] [--seed 10000] [--execute 8] [--num-steps 4]
                                              [--method ode|sde|noise] [--trace]

One ManiSkill env in this process (state observations, ``pd_ee_delta_pose``, episode limit 150), seeds
``--seed``, ``--seed + 1``, ... (10,000+: the held-out evaluation seeds; 0+: the demo collection's). Reads
PickCube's flat state vector: is_grasped [18], cube pose [29:36] (z at 31), tcp->cube [36:39],
cube->goal [39:42]. Used to find the SFT stall described in benchmarks/RESULTS.md (PickCube).

``--trace`` also prints one line per chunk: grasped, cube height, cube->goal distance, joint speed |qvel|
[9:18] and the chunk's summed arm command (xyz, env units). That showed the "copycat" crawl of a policy
that sees the joint velocities (RESULTS.md, PickCube, seventh attempt).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.checkpoint import load_policy
from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--episodes", type=int, default=30)
    p.add_argument("--seed", type=int, default=10_000)
    p.add_argument("--execute", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--method", default="ode", choices=("ode", "sde", "noise"))
    p.add_argument("--trace", action="store_true", help="print every chunk of every episode")
    args = p.parse_args()
    model, norm, _ = load_policy(args.checkpoint)
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PickCube-v1", obs_mode="state", max_episode_steps=150))
    actor = Actor(model, norm, env_state_dim=env.spec.state_dim, env_action_dim=env.spec.action_dim)
    sampler = SamplerConfig(num_steps=args.num_steps, method=args.method, sde_mode="mixed", noise_level=0.5)
    gen = torch.Generator().manual_seed(args.seed)
    wins = lifted = 0
    for ep in range(args.episodes):
        obs = env.reset(seed=args.seed + ep)
        reach, to_goal, grasped, top, success, t, done = 9.0, 9.0, 0.0, 0.0, False, 0, False
        while not done:
            batch = {"images": torch.as_tensor(obs["images"])[None], "state": torch.as_tensor(obs["state"])[None],
                     "instruction": [obs["instruction"]]}
            with torch.inference_mode():
                chunk = actor.act(batch, sampler, generator=gen).actions[0]
            if args.trace:
                s, part = obs["state"], chunk[: args.execute]
                arm, grip = np.round(part[:, :3].sum(0).numpy(), 2), float(part[:, 6].mean())
                print(f"  t={t:3d} grasped {s[18]:.0f} cube z {s[31]:.3f} cube-goal {np.linalg.norm(s[39:42]):.3f} "
                      f"|qvel| {np.linalg.norm(s[9:18]):.2f} arm xyz {arm} gripper {grip:+.2f}")
            for a in chunk[: args.execute]:
                obs, _, terminated, truncated, succ = env.step(a.numpy())
                s, t = obs["state"], t + 1
                reach = min(reach, float(np.linalg.norm(s[36:39])))
                to_goal = min(to_goal, float(np.linalg.norm(s[39:42])))
                grasped, top, success = max(grasped, float(s[18])), max(top, float(s[31])), success or succ
                if terminated or truncated:
                    done = True
                    break
        wins += success
        lifted += top > 0.04
        print(f"seed {args.seed + ep}: success={success} steps={t} closest tcp-cube={reach:.3f} grasped={grasped:.0f} "
              f"highest cube z={top:.3f} closest cube-goal={to_goal:.3f} final cube-goal="
              f"{float(np.linalg.norm(s[39:42])):.3f}", flush=True)
    print(f"success {wins}/{args.episodes}, cube lifted above 4 cm {lifted}/{args.episodes}")
    env.close()


if __name__ == "__main__":
    main()
