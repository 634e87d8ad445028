"""CPU cost of one LIBERO env-step with and without cameras: the number a LIBERO training run's compute is
projected from (an RL run is env-steps × this, plus the policy's share).

    python benchmarks/bench_libero_cost.py [--cases none,64,64-flat,128] [--steps 64] [--suite libero_spatial]
                                           [--task 0]

For each case (``none``: state only; ``S``: agentview + wrist cameras at S×S; ``S-flat``: the same without MuJoCo's
mirror reflections, ``env.libero.reflections=false``; a further ``-plain`` suffix, e.g. ``none-plain``: robosuite's
own physics substeps, ``env.libero.fast_substeps=false``, three MuJoCo forward passes a substep instead of one,
the same trajectory) one ``LiberoSingleEnv`` in this
process resets to fixed init state 0 and takes ``--steps`` random actions after 8 warm-up steps. Prints a
markdown table: CPU seconds per env-step (this process and its threads, e.g. llvmpipe's rendering threads:
``time.process_time``), the env-steps/s one fully used core gives (its inverse), the wall-clock rate seen
here, and the process's resident memory. CPU seconds hold on a shared machine; the wall-clock rate does not.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def measure(case: str, steps: int, suite: str, task: int) -> dict:
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    plain = case.endswith("-plain")
    base = case.removesuffix("-plain")
    flat = base.endswith("-flat")
    cams = () if base == "none" else ("agentview", "wrist")
    size = 128 if base == "none" else int(base.removesuffix("-flat"))
    env = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=[task], cameras=cams, image_size=size,
                                       max_episode_steps=steps + 16, reflections=not flat, fast_substeps=not plain))
    try:
        rng = np.random.default_rng(0)
        actions = np.clip(rng.normal(0, 0.3, (steps + 8, 7)), -1, 1)
        env.reset_to(task, 0)
        for a in actions[:8]:
            env.step(a)
        c0, w0 = time.process_time(), time.perf_counter()
        for a in actions[8:]:
            env.step(a)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        name = "state only" if base == "none" else f"agentview + wrist, {size} px" + (", no reflections" * flat)
        name += ", robosuite's substeps" * plain
        return {"case": name,
                "cpu_per_step": cpu / steps, "wall_per_s": steps / wall, "rss_mb": rss_mb()}
    finally:
        env.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="none,none-plain,64,64-flat,128",
                   help="comma-separated: none (state only), image sizes S, or S-flat (no reflections); each may end "
                        "in -plain (robosuite's own substep loop)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--task", type=int, default=0)
    args = p.parse_args()
    rows = [measure(c, args.steps, args.suite, args.task) for c in args.cases.split(",")]
    print("| observation | CPU s per env-step | env-steps/s per core | wall env-steps/s here | RSS MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['cpu_per_step']:.4f} | {1 / r['cpu_per_step']:.1f} | {r['wall_per_s']:.1f} | "
              f"{r['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
