"""Where a state-only LIBERO env-step's CPU time goes, and so how much cheaper any backend with robosuite-LIBERO's
exact trajectories could be: MuJoCo's own physics (``mj_step1`` + ``mj_step2``, 25 substeps) is the floor.

    python benchmarks/bench_libero_floor.py [--steps 200] [--suite libero_spatial] [--task 0]

One ``LiberoSingleEnv`` (state only, the adapter's one-forward-pass substeps) takes ``--steps`` random actions
from init state 0 under ``cProfile``; its functions' own time is summed into: MuJoCo's physics, robosuite's
arm and gripper controllers (``robosuite/controllers``, ``robots``, ``control_utils``), its observables
(``utils/observables.py`` and ``_update_observables``), and the rest (our adapter, robosuite's env loop, numpy
glue). Prints a markdown table and the ratio total / physics: the most a backend that keeps the physics could
save. Profiling adds overhead to the Python parts, so the ratio is an upper bound; a plain timing of the same
steps is printed beside it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

PARTS = {
    "MuJoCo physics (mj_step1 + mj_step2)": ("mujoco._functions.mj_step",),
    "robosuite controllers (OSC, gripper, robot)": ("robosuite/controllers", "robosuite/robots", "control_utils",
                                                    "robosuite/models/grippers"),
    "robosuite observables": ("observables.py", "_update_observables"),
}


def part_of(key: tuple) -> str:
    filename, _, name = key
    where = f"{filename}:{name}"
    for part, needles in PARTS.items():
        if any(n in where for n in needles):
            return part
    return "the rest (adapter, env loop, numpy)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--task", type=int, default=0)
    args = p.parse_args()
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite=args.suite, task_ids=[args.task], cameras=(),
                                       max_episode_steps=2 * args.steps + 16))
    rng = np.random.default_rng(0)
    actions = rng.uniform(-0.3, 0.3, (2 * args.steps + 8, 7)).astype(np.float32)
    try:
        env.reset_to(args.task, 0)
        for a in actions[:8]:
            env.step(a)
        t0 = time.process_time()
        for a in actions[8:8 + args.steps]:
            env.step(a)
        plain = (time.process_time() - t0) / args.steps
        prof = cProfile.Profile()
        prof.enable()
        for a in actions[8 + args.steps:]:
            env.step(a)
        prof.disable()
    finally:
        env.close()
    totals: dict[str, float] = {}
    for key, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        totals[part_of(key)] = totals.get(part_of(key), 0.0) + tottime
    total = sum(totals.values())
    physics = totals.get(next(iter(PARTS)), 0.0)
    print("| part | CPU ms per env-step (profiled) | share |\n|---|---|---|")
    for part in [*PARTS, "the rest (adapter, env loop, numpy)"]:
        ms = 1000 * totals.get(part, 0.0) / args.steps
        print(f"| {part} | {ms:.2f} | {100 * totals.get(part, 0.0) / total:.0f} % |")
    print(f"| all (profiled) | {1000 * total / args.steps:.2f} | |")
    print(f"\nunprofiled: {1000 * plain:.2f} CPU ms per env-step; physics floor {1000 * physics / args.steps:.2f} ms: "
          f"a backend with the same physics saves at most {plain / (physics / args.steps):.2f}x")


if __name__ == "__main__":
    main()
