"""Envs per worker process: memory and throughput of a ManiSkill CPU pool of N envs grouped G per worker.

For each G in ``--per-worker`` it builds ``WorkerVectorEnv`` (N envs, ceil(N / G) workers), resets it,
steps random chunks of ``--horizon`` actions for ``--seconds`` (after one warm-up chunk), and reports
env-steps per second and the workers' memory: the sum of their PSS (proportional set size, from
``/proc/PID/smaps_rollup``: shared pages split between the processes that map them, so the sum does not
count a shared library once per worker) and of their RSS.

    python benchmarks/bench_env_grouping.py --envs 16 --per-worker 1,4,8 --seconds 30
    python benchmarks/bench_env_grouping.py --envs 64 --per-worker 16,32 --seconds 30

Only the simulator is timed (no policy), so the figures are an upper bound for a training loop.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch


def _kib(pid: int, path: str, key: str) -> int:
    with open(f"/proc/{pid}/{path}") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/{pid}/{path}")


def measure(n: int, per_worker: int, seconds: float, horizon: int, task: str) -> dict:
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    cfg = ManiSkillConfig(task=task, obs_mode="state", control_mode="pd_ee_delta_pose", reward="sparse",
                          sim_backend="cpu")
    t0 = time.perf_counter()
    env = WorkerVectorEnv(functools.partial(ManiSkillSingleEnv, cfg), n, envs_per_worker=per_worker,
                          name="bench-grouping")
    try:
        env.reset(seed=0)
        build_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(0)
        low, high = env.spec.action_low, env.spec.action_high

        def chunk():
            u = torch.rand(n, horizon, env.spec.action_dim, generator=gen)
            return low + (high - low) * u

        env.step(chunk())                                   # warm-up
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            steps += int(env.step(chunk()).steps.sum())
        rate = steps / (time.perf_counter() - t0)
        pids = [p.pid for p in env._procs]
        pss = sum(_kib(p, "smaps_rollup", "Pss") for p in pids) / 1024
        rss = sum(_kib(p, "status", "VmRSS") for p in pids) / 1024
        return {"envs": n, "per_worker": per_worker, "workers": len(pids), "build_s": build_s,
                "steps_per_s": rate, "pss_mb": pss, "rss_mb": rss}
    finally:
        env.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--per-worker", default="1,4,8", help="comma-separated envs-per-worker values")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--task", default="PickCube-v1")
    args = p.parse_args()
    rows = [measure(args.envs, int(g), args.seconds, args.horizon, args.task) for g in args.per_worker.split(",")]
    print(f"| {args.task} envs | envs per worker | workers | build + reset, s | env-steps/s | workers' PSS, MB "
          f"| workers' RSS, MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['envs']} | {r['per_worker']} | {r['workers']} | {r['build_s']:.0f} | {r['steps_per_s']:.0f} "
              f"| {r['pss_mb']:.0f} | {r['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
