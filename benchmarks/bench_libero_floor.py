"""Where a state-only LIBERO env-step's CPU time goes, for each way the adapter can step it, side by side in one
process: robosuite's own loop (``direct_step=false fast_substeps=false``), its substeps split (``direct_step=false``)
and the direct step (the default, ``envs/libero/direct.py``). MuJoCo's own physics (``mj_step1`` + ``mj_step2``, 25
substeps) is the floor any backend with robosuite-LIBERO's exact trajectories stays above.

    python benchmarks/bench_libero_floor.py [--steps 200] [--suite libero_spatial] [--task 0] [--repeats 3]

For each way, one ``LiberoSingleEnv`` (state only) takes the same ``--steps`` random actions from init state 0,
timed plain (CPU seconds; the ways take turns, the best of ``--repeats`` runs counts), then once more under
``cProfile``, whose functions' own
time is summed into: MuJoCo's physics, robosuite's arm and gripper controllers (``robosuite/controllers``,
``robots``, ``control_utils``), its observables (``utils/observables.py`` and ``_update_observables``), and the rest
(our adapter, robosuite's env loop, numpy glue). Prints a markdown table (profiled ms per part, plain ms per step,
the speed-up over robosuite's loop) and the floor: plain time / profiled physics, the most a backend that keeps
the physics could save. Profiling inflates the Python parts, not MuJoCo's, so the shares are approximate.
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


WAYS = {"robosuite's loop": dict(direct_step=False, fast_substeps=False),
        "split substeps": dict(direct_step=False, fast_substeps=True),
        "direct step (default)": dict(direct_step=True)}
REST = "the rest (adapter, env loop, numpy)"


def play(env, task: int, actions: np.ndarray) -> float:
    """CPU seconds per step of one episode of ``actions`` from init state 0."""
    env.reset_to(task, 0)
    t0 = time.process_time()
    for a in actions:
        env.step(a)
    return (time.process_time() - t0) / len(actions)


def measure(args, actions: np.ndarray) -> dict[str, tuple[float, dict[str, float], np.ndarray]]:
    """Per way: (plain CPU s per step, profiled CPU s per part per step, the final MuJoCo state). The ways take
    turns, repeat by repeat, so a change in the machine's load reaches all of them; the best repeat counts."""
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    envs = {way: LiberoSingleEnv(LiberoConfig(suite=args.suite, task_ids=[args.task], cameras=(),
                                              max_episode_steps=len(actions) + 1, **options))
            for way, options in WAYS.items()}
    plain: dict[str, list[float]] = {way: [] for way in WAYS}
    out = {}
    try:
        for _ in range(args.repeats):
            for way, env in envs.items():
                plain[way].append(play(env, args.task, actions))
        for way, env in envs.items():
            data = env.sim_env.sim.data
            final = np.concatenate([data.qpos, data.qvel])
            env.reset_to(args.task, 0)
            prof = cProfile.Profile()
            prof.enable()
            for a in actions:
                env.step(a)
            prof.disable()
            parts: dict[str, float] = {}
            for key, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
                parts[part_of(key)] = parts.get(part_of(key), 0.0) + tottime / len(actions)
            out[way] = (min(plain[way]), parts, final)
    finally:
        for env in envs.values():
            env.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--task", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    actions = np.random.default_rng(0).uniform(-0.3, 0.3, (args.steps, 7)).astype(np.float32)
    results = measure(args, actions)
    names = [*PARTS, REST]
    print("| way | " + " | ".join(names) + " | CPU ms per env-step (plain) | speed-up | same final state |")
    print("|---" * (len(names) + 4) + "|")
    base_ms, _, base_final = results["robosuite's loop"]
    for way, (plain, parts, final) in results.items():
        cells = " | ".join(f"{1000 * parts.get(n, 0.0):.2f}" for n in names)
        same = np.array_equal(final, base_final)
        print(f"| {way} | {cells} | {1000 * plain:.2f} | {base_ms / plain:.2f}x | {same} |")
    physics = results["robosuite's loop"][1][next(iter(PARTS))]
    print(f"\nphysics floor {1000 * physics:.2f} ms a step: a backend with the same physics is at most "
          f"{base_ms / physics:.2f}x cheaper than robosuite's loop")


if __name__ == "__main__":
    main()
