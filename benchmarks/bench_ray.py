"""What Ray costs and buys: env-steps/s of env actors vs local worker processes, and training iterations with the
update in Ray learner actors.

Envs (default): for each worker count W in ``--workers`` it builds a pool of ``--envs`` single envs in W local
processes (:class:`~vla_rl.envs.workers.WorkerVectorEnv`) and one in W Ray actors
(:class:`~vla_rl.envs.ray_workers.RayVectorEnv`, on a private Ray instance), resets both, and then times
``--repeats`` windows of ``--seconds`` stepping random chunks of ``--horizon`` actions, alternating the two pools
(the machine is shared: interleaved windows and medians). Both pools run the same per-worker code
(``EnvGroup``); the difference is the transport: shared memory and pipes vs Ray's object store and actor calls.
Only the simulators are timed (no policy).

    python benchmarks/bench_ray.py --env builtin --envs 16 --workers 1,2,4 --seconds 5 --repeats 5
    python benchmarks/bench_ray.py --env maniskill --envs 16 --workers 1,2,4 --seconds 5 --repeats 5

``--train``: time training iterations of the ``builtin_flow_noise`` preset (a fresh ``tiny`` policy, ``--envs`` envs),
the medians of ``time/iteration_s`` and of the rollout's part of it over iterations 2 to N-1 (the last one also
evaluates), for each placement below;
``--repeats`` runs of every mode, interleaved. On the CPU (``--device cpu``): the update in this process (local),
in one Ray learner, and in two data-parallel Ray learners (gloo). On a GPU (``--device cuda``, needs one GPU):
local; colocated (the batched built-in task on the policy's GPU, one learner actor sharing that GPU); and
disaggregated (the envs as single envs in 4 CPU env actors, one learner actor holding a whole GPU).

    python benchmarks/bench_ray.py --train --envs 16 --iterations 6 --repeats 3
    python benchmarks/bench_ray.py --train --device cuda --envs 256 --iterations 12 --repeats 3

Ray is started as a run starts a private instance (:func:`vla_rl.distributed.runtime.connect`: the actors at this
process's priority, not Ray's default of 15 nice levels lower; ``RAY_worker_niceness=15`` in the environment
measures that default), with ``max(workers)`` logical CPUs (envs; 2 for CPU training), so that every actor holds a
whole CPU slot whatever the machine has; what the actors can use is the machine's cores.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch


def factory(env: str):
    if env == "builtin":
        from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv

        return functools.partial(ColorReachSingleEnv, ColorReachConfig())
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv

    cfg = ManiSkillConfig(task="PickCube-v1", obs_mode="state", control_mode="pd_ee_delta_pose", reward="sparse",
                          sim_backend="cpu")
    return functools.partial(ManiSkillSingleEnv, cfg)


def worker_pids(pool) -> list[int]:
    if hasattr(pool, "where"):                       # env actors
        return [pid for _, pid in pool.where()]
    return [proc.pid for proc in pool._procs]        # worker processes


def cpu_seconds(pids: list[int]) -> float:
    import psutil  # a dependency of ray[default]

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def window(pool, pids: list[int], seconds: float, horizon: int, gen: torch.Generator) -> tuple[float, float, float]:
    """(env-steps/s, CPU ms of the workers per env-step, CPU ms of this process per env-step) of ``pool`` stepping
    random chunks for ``seconds``. CPU time does not depend on what else runs on the machine, wall time does."""
    n, spec = pool.num_envs, pool.spec

    def chunk():
        u = torch.rand(n, horizon, spec.action_dim, generator=gen)
        return spec.action_low + (spec.action_high - spec.action_low) * u

    steps = 0
    workers0, driver0, t0 = cpu_seconds(pids), time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        steps += int(pool.step(chunk()).steps.sum())
    dt = time.perf_counter() - t0
    return (steps / dt, 1e3 * (cpu_seconds(pids) - workers0) / steps, 1e3 * (time.process_time() - driver0) / steps)


def build(kind: str, env: str, n: int, workers: int):
    """(pool, seconds to build and reset it)."""
    from vla_rl.envs.ray_workers import RayVectorEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    t0 = time.perf_counter()
    if kind == "local":
        pool = WorkerVectorEnv(factory(env), n, envs_per_worker=-(-n // workers), name="bench-ray")
    else:
        pool = RayVectorEnv(factory(env), n, num_actors=workers, actor_options=lambda w: {"num_cpus": 1},
                            name="bench-ray")
    pool.reset(seed=0)
    return pool, time.perf_counter() - t0


def env_rows(args, counts: list[int]) -> list[dict]:
    rows = []
    for w in counts:
        pools, built = {}, {}
        try:
            for kind in ("local", "ray"):
                pools[kind], built[kind] = build(kind, args.env, args.envs, w)
            gen = torch.Generator().manual_seed(0)
            pids = {kind: worker_pids(pool) for kind, pool in pools.items()}
            runs: dict[str, list[tuple]] = {"local": [], "ray": []}
            for kind in ("local", "ray"):
                window(pools[kind], pids[kind], min(1.0, args.seconds), args.horizon, gen)   # warm-up
            for r in range(args.repeats):
                for kind in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
                    runs[kind].append(window(pools[kind], pids[kind], args.seconds, args.horizon, gen))
        finally:
            for pool in pools.values():
                pool.close()
        for kind in ("local", "ray"):
            rate, worker_ms, driver_ms = (statistics.median(x) for x in zip(*runs[kind]))
            rows.append({"kind": kind, "workers": w, "build_s": built[kind], "steps_per_s": rate,
                         "worker_ms": worker_ms, "driver_ms": driver_ms,
                         "range": (min(r[0] for r in runs[kind]), max(r[0] for r in runs[kind]))})
            print(rows[-1], flush=True)
    return rows


def train_modes(device: str) -> dict[str, dict]:
    if device == "cpu":
        return {"local": {},
                "ray, 1 learner": {"runtime": "ray", "ray": {"learners": 1, "num_cpus": 2}},
                "ray, 2 learners (gloo)": {"runtime": "ray", "ray": {"learners": 2, "num_cpus": 2}}}
    return {"local": {},
            "ray colocated: envs on the policy's GPU, learner on the same GPU": {
                "runtime": "ray", "ray": {"placement": "colocated", "num_gpus": 1, "num_cpus": 4, "learners": 1,
                                          "learner_gpus": 0.5}},
            "ray disaggregated: 4 CPU env actors, learner on a whole GPU": {
                "runtime": "ray", "ray": {"placement": "disaggregated", "num_gpus": 1, "num_cpus": 6,
                                          "env_actors": 4, "learners": 1, "learner_gpus": 1.0}}}


def train_rows(iterations: int, device: str, repeats: int, envs: int) -> list[dict]:
    import tempfile

    from vla_rl.core.schema import from_dict
    from vla_rl.presets import merge, preset_path, read_yaml
    from vla_rl.train.trainer import TrainConfig, Trainer

    if iterations < 4:
        raise SystemExit("--iterations must be at least 4 (iterations 2 to N-1 are timed)")
    modes = train_modes(device)
    if device == "cpu":
        # One torch thread here, as in each learner actor (learner_cpus 1): the same compute per process in every
        # mode. On shared cores two OpenMP threads spin-wait for each other: an iteration took 4x as long.
        torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in modes}
    rollouts: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, over in modes.items():
            with tempfile.TemporaryDirectory() as out:
                base = read_yaml(preset_path("experiment", "builtin_flow_noise"))
                cfg = from_dict(TrainConfig, merge(base, {"init": None, "iterations": iterations, "device": device,
                                                          "env": {"num_envs": envs},
                                                          "eval_every": 1000, "eval_episodes": envs, "out": out,
                                                          "progress": False, "tensorboard": False, **over}))
                with Trainer(cfg, log=lambda *_: None) as trainer:   # a ray mode starts and stops its own Ray
                    history = trainer.run()
            timed = [h for h in history if 2 <= h["iteration"] < iterations]
            times[name].append(statistics.median(h["time/iteration_s"] for h in timed))
            rollouts[name].append(statistics.median(h["time/env_steps_iter"] / h["time/env_steps_per_s"]
                                                    for h in timed))
            print({"mode": name, "iteration_s": times[name][-1], "rollout_s": rollouts[name][-1]}, flush=True)
    return [{"mode": name, "iteration_s": statistics.median(times[name]),
             "rollout_s": statistics.median(rollouts[name])} for name in modes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=("builtin", "maniskill"), default="builtin")
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker / env actor counts")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one timed window")
    p.add_argument("--repeats", type=int, default=5, help="timed windows (envs) or runs (--train) per case")
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--train", action="store_true", help="time training iterations instead (see above)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--train only")
    p.add_argument("--iterations", type=int, default=6)
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    if args.train:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device")
        rows = train_rows(args.iterations, args.device, args.repeats, args.envs)
        local = rows[0]["iteration_s"]
        print(f"\nbuiltin_flow_noise, fresh tiny policy, {args.envs} envs, {args.device}, {cores} CPU cores, "
              f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; medians of {args.repeats} run(s)")
        print("| placement | s / iteration | rollout s | rest (update, weight sync) s | vs local |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['iteration_s']:.2f} | {r['rollout_s']:.2f} | "
                  f"{r['iteration_s'] - r['rollout_s']:.2f} | {r['iteration_s'] / local:.2f} |")
        return

    import ray

    from vla_rl.distributed.ray_config import RayConfig
    from vla_rl.distributed.runtime import connect

    counts = [int(w) for w in args.workers.split(",")]
    connect(RayConfig(num_cpus=max(counts)))   # a private instance, as a run starts it
    try:
        rows = env_rows(args, counts)
    finally:
        ray.shutdown()
    print(f"\n{args.env}, {args.envs} envs, chunks of {args.horizon} actions, {cores} CPU cores, load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}; medians of {args.repeats} windows of {args.seconds:g} s")
    print("| workers | env-steps/s local / Ray | Ray / local | worker CPU ms per env-step local / Ray "
          "| driver CPU ms per env-step local / Ray | build + reset s local / Ray |")
    print("|---|---|---|---|---|---|")
    for w in counts:
        loc, rem = [next(r for r in rows if r["kind"] == k and r["workers"] == w) for k in ("local", "ray")]
        ratio = rem["steps_per_s"] / loc["steps_per_s"]
        print(f"| {w} | {loc['steps_per_s']:.0f} / {rem['steps_per_s']:.0f} | {ratio:.2f} "
              f"| {loc['worker_ms']:.2f} / {rem['worker_ms']:.2f} | {loc['driver_ms']:.3f} / {rem['driver_ms']:.3f} "
              f"| {loc['build_s']:.1f} / {rem['build_s']:.1f} |")


if __name__ == "__main__":
    main()
