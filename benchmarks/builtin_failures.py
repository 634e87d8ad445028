"""Where do a built-in ColorReach policy's failed episodes end? For each policy folder (SFT policy or
training checkpoint), run ``--episodes`` fixed-seed episodes (one per env, seeds as the trainer's
evaluation: 10_000...) with each sampler and sort the failures: ended nearest a wrong-colour square, or
on the right colour's side but off the square (with the max-axis distance to the goal's centre; success
needs < ``target_half_size`` = 0.16). Says whether RL has a grounding problem (which colour) or a
precision problem (exactly where) left to fix.

    python benchmarks/builtin_failures.py runs/bench_learning/seed0/sft runs/.../checkpoints/iter_000200 \
        [--samplers ode,noise] [--episodes 200]
"""

from __future__ import annotations

import argparse

import torch

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.checkpoint import load_policy
from vla_rl.envs.builtin import ColorReachEnv


@torch.inference_mode()
def failures(actor: Actor, env: ColorReachEnv, method: str, *, seed: int = 10_000, execute: int = 8) -> dict:
    n = env.num_envs
    obs = env.reset(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    pending = torch.ones(n, dtype=torch.bool)
    successes, wrong, off = 0, 0, []
    while pending.any():
        goal, targets, colour = env.goal_position().clone(), env.targets.clone(), env.goal.clone()
        out = env.step(actor.act(obs, SamplerConfig(4, method), generator=gen).actions[:, :execute])
        obs = out.obs
        if not out.episodes:
            continue
        for j, i in enumerate(out.episodes["env_index"].tolist()):
            if not pending[i]:
                continue
            pending[i] = False
            if out.episodes["success_once"][j]:
                successes += 1
                continue
            end = out.final_obs["state"][i, :2]   # the agent's position when the episode ended
            if (end[None] - targets[i]).norm(dim=1).argmin().item() != colour[i].item():
                wrong += 1
            else:
                off.append((end - goal[i]).abs().max().item())
    q = torch.tensor(off).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist() if off else []
    return {"success": successes / n, "failures": n - successes, "wrong_colour": wrong, "off_square": len(off),
            "off_distance_quartiles": [round(x, 3) for x in q]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policies", nargs="+")
    p.add_argument("--samplers", default="ode")
    p.add_argument("--episodes", type=int, default=200)
    args = p.parse_args()
    env = ColorReachEnv(args.episodes, seed=0)
    for path in args.policies:
        model, norm, _ = load_policy(path)
        actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
        for method in args.samplers.split(","):
            r = failures(actor, env, method)
            print(f"{path} [{method}]: success {r['success']:.3f}; {r['failures']} failures: "
                  f"{r['wrong_colour']} nearest a wrong colour, {r['off_square']} by the right colour but off "
                  f"the square (max-axis distance quartiles {r['off_distance_quartiles']})", flush=True)


if __name__ == "__main__":
    main()
