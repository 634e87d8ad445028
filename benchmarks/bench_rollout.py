"""Env-steps/s of the rollout loop with the policy in it, against the simulator alone, on ManiSkill3 CPU workers.

    python benchmarks/bench_rollout.py [--tasks PushCube-v1,PickCube-v1] [--envs 16] [--workers 2]
                                       [--rounds 5] [--seconds 10] [--chunks 8] [--execute 8]

For each task, side by side (state observations, ``pd_ee_delta_pose``, sparse reward, the task's episode limit):

- ``sim``: the simulator alone, free-running: ``--workers`` processes, each stepping its share of the envs
  (``--envs / --workers`` raw ``gym.make(..., sim_backend="physx_cpu")`` envs, one after another, random
  actions, resetting an env when its episode ends); nobody waits for anybody. The upper bound.
- ``env``: our ``WorkerVectorEnv`` (``--workers`` processes) stepping random chunks of ``--execute`` actions,
  no policy: what waiting for every worker once per chunk costs.
- ``lockstep``: ``collect_rollout`` with the tiny policy (``rollout_groups=1``): the policy samples all envs'
  chunks, then every worker simulates, then the policy samples again.
- ``overlap``: the same with ``rollout_groups=2``: two groups of workers stepped in alternation, the policy
  sampling one group's chunks while the other group simulates.
- ``policy``: the policy alone sampling one group's chunks (half the envs) back to back on one thread: the
  env-steps/s it could feed with a core to itself.

The policy is the ``tiny`` preset without cameras (state in, as the ManiSkill state-observation experiments),
Flow-Noise with ``--steps`` denoising steps, identity normalisation, ``--threads`` torch threads in this process
(the workers use one each). The loop sides run whole rollouts of ``--chunks`` chunks (each continuing from the
last one's observation) until their segment's time is up. The sides share one pool of workers (the
``env`` and loop sides) and one pool of raw processes (``sim``), all started once; they are timed in
alternating segments (a b c d e, e d c b a, ...; ``--rounds`` rounds of ``--seconds`` per side), so that the
load of the shared machine hits them alike.

Reported: the median over rounds of each side's env-steps/s and of its gap to ``sim`` in the same round
((sim - side) / sim; negative: faster), with the 1-minute load average; and the CPU-bound floor of the gap:
with ``--workers`` cores all busy, sampling costs cores that the simulator alone had to itself, so no loop
can beat ``workers / (workers / sim + 1 / policy)`` env-steps/s (see ``_floor_gap``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
from bench_envs import RAW_BANK, RawPool, _make_raw_maniskill, _raw_loop, loadavg, log, random_chunks, raw_actions


def _raw_group_worker(conn, cfg, count: int, seed: int) -> None:
    """``count`` raw ManiSkill envs in this process, stepped one after another (as a worker steps its envs)."""
    try:
        envs = [_make_raw_maniskill(cfg) for _ in range(count)]
        banks = []
        for j, env in enumerate(envs):
            env.reset(seed=seed * 100 + j)
            banks.append(raw_actions(env.action_space.low, env.action_space.high, seed * 100 + j))

        def step(k: int) -> None:
            for env, bank in zip(envs, banks):
                _, _, terminated, truncated, _ = env.step(bank[k % RAW_BANK])
                if bool(terminated.any()) or bool(truncated.any()):
                    env.reset()

        # _raw_loop counts calls of step; each steps `count` envs
        _raw_loop(conn, step)
        for env in envs:
            env.close()
    except Exception as e:
        conn.send(("error", repr(e)))


def sim_segment(pool: RawPool, per_worker: int):
    def run(seconds: float) -> tuple[int, float]:
        steps, elapsed = pool.segment(seconds)
        return steps * per_worker, elapsed
    return run


def env_segment(env, bank: torch.Tensor):
    state = {"k": 0}

    def run(seconds: float) -> tuple[int, float]:
        steps = 0
        t0 = time.perf_counter()
        while True:
            steps += int(env.step(bank[state["k"] % len(bank)]).steps.sum())
            state["k"] += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return steps, elapsed
    return run


def loop_segment(actor, env, start_obs: dict, groups: int, args):
    from vla_rl.policies.actor import SamplerConfig
    from vla_rl.rl.rollout import collect_rollout

    sampler = SamplerConfig(num_steps=args.steps, method="noise")
    gen = torch.Generator().manual_seed(0)
    state = {"obs": start_obs}

    def run(seconds: float) -> tuple[int, float]:
        steps = 0
        t0 = time.perf_counter()
        while True:
            ro, state["obs"] = collect_rollout(actor, env, state["obs"], num_chunks=args.chunks, sampler=sampler,
                                               execute=args.execute, generator=gen, groups=groups)
            steps += ro.env_steps
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return steps, elapsed
    return run


def policy_segment(actor, obs: dict, args):
    """The policy alone sampling one group's chunks (``--envs / 2`` envs) over and over: the env-steps/s it
    could feed if it had a core to itself (each chunk feeds ``envs / 2 * execute`` env-steps)."""
    from vla_rl.policies.actor import SamplerConfig

    sampler = SamplerConfig(num_steps=args.steps, method="noise")
    half = {k: v[:args.envs // 2] for k, v in obs.items()}
    gen = torch.Generator().manual_seed(0)

    def run(seconds: float) -> tuple[int, float]:
        steps = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            while True:
                actor.act(actor.observe(half), sampler, generator=gen)   # the value too, as a rollout does
                steps += len(half["state"]) * args.execute
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    return steps, elapsed
    return run


def tiny_actor(spec):
    from vla_rl.policies.actor import Actor
    from vla_rl.policies.architectures import make_policy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    base = policy_preset("tiny")
    cfg = policy_preset("tiny", {"num_cameras": 0, "state_dim": max(base.state_dim, spec.state_dim),
                                 "action_dim": max(base.action_dim, spec.action_dim)})
    torch.manual_seed(0)
    model = make_policy(cfg).eval()
    return Actor.for_env(model, NormStats(Stats.identity(spec.state_dim), Stats.identity(spec.action_dim)), spec)


def bench_task(task: str, args) -> dict:
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    if args.envs % args.workers:
        raise SystemExit(f"--envs {args.envs} must be a multiple of --workers {args.workers}")
    per_worker = args.envs // args.workers
    cfg = ManiSkillConfig(task=task, obs_mode="state", control_mode="pd_ee_delta_pose", reward="sparse",
                          sim_backend="cpu")
    raw = env = None
    try:
        t0 = time.perf_counter()
        raw = RawPool(_raw_group_worker, (cfg, per_worker), args.workers)
        env = WorkerVectorEnv(functools.partial(ManiSkillSingleEnv, cfg), args.envs, envs_per_worker=per_worker,
                              name="bench-rollout")
        obs = env.reset(seed=0)
        log(f"    {args.workers} raw + {args.workers} worker processes ready in {time.perf_counter() - t0:.0f} s")
        actor = tiny_actor(env.spec)
        sides = {"sim": sim_segment(raw, per_worker),
                 "env": env_segment(env, random_chunks(env.spec, args.envs, args.execute)),
                 "lockstep": loop_segment(actor, env, obs, 1, args),
                 "overlap": loop_segment(actor, env, obs, 2, args),
                 "policy": policy_segment(actor, obs, args)}
        for fn in sides.values():
            fn(1.0)                                  # warm-up
        rates: dict[str, list[float]] = {k: [] for k in sides}
        order = list(sides)
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                steps, elapsed = sides[name](args.seconds)
                rates[name].append(steps / elapsed)
            log(f"    round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items())
                + f" env-steps/s (load {loadavg().split()[0]})")
        return rates
    finally:
        for pool in (env, raw):
            if pool is not None:
                pool.close()


def _gap(side: list[float], sim: list[float]) -> float:
    return 100.0 * statistics.median((s - x) / s for x, s in zip(side, sim))


def _floor_gap(sim: float, policy: float, cores: int) -> float:
    """The smallest gap to ``sim`` that a loop can reach when the ``cores`` cores are all busy: each env-step
    costs ``cores / sim`` core-seconds of simulation (``sim`` saturates them) plus ``1 / policy`` of sampling,
    and the best a loop can do is overlap them perfectly: ``cores / (cores / sim + 1 / policy)`` env-steps/s."""
    best = cores / (cores / sim + 1 / policy)
    return 100.0 * (sim - best) / sim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="PushCube-v1,PickCube-v1")
    p.add_argument("--envs", type=int, default=16, help="envs in all (a multiple of --workers)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per side per round")
    p.add_argument("--chunks", type=int, default=8, help="chunks per rollout (loop sides)")
    p.add_argument("--execute", type=int, default=8, help="actions executed per chunk")
    p.add_argument("--steps", type=int, default=4, help="denoising steps K")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (the policy)")
    args = p.parse_args()
    if min(args.envs, args.workers, args.rounds, args.chunks, args.execute, args.steps, args.threads) < 1 \
            or args.seconds <= 0:
        p.error("every count and --seconds must be positive")
    if args.workers < 2:
        p.error("--workers must be at least 2 (two groups of workers)")
    torch.set_num_threads(args.threads)
    # Simulators print to stdout: send everything but the table to stderr (worker processes inherit fd 1).
    sys.stdout.flush()
    table = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    start_load = loadavg()
    rows = []
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        before = loadavg().split()[0]
        log(f"[{task}] {args.rounds} rounds of {args.seconds:g} s per side (load {before}) ...")
        rates = bench_task(task, args)
        rows.append((task, rates, f"{before} → {loadavg().split()[0]}"))

    out = functools.partial(print, file=table)
    out(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.envs} envs in "
        f"{args.workers} workers, chunks of {args.execute} actions, {args.chunks} chunks per rollout, tiny policy "
        f"(K={args.steps}, {args.threads} thread), {args.rounds} rounds of {args.seconds:g} s per side")
    out(f"load average (1, 5, 15 min): before {start_load}, after {loadavg()}\n")
    out("| task | sim alone, steps/s | env, no policy | loop, lockstep | loop, overlap (2 groups) | policy alone "
        "| gap to sim: env % | lockstep % | overlap % | CPU-bound floor % | load 1-min |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    for task, r, load in rows:
        med = {k: statistics.median(v) for k, v in r.items()}
        floor = [_floor_gap(sim, pol, args.workers) for sim, pol in zip(r["sim"], r["policy"])]
        out(f"| {task} | {med['sim']:,.0f} | {med['env']:,.0f} | {med['lockstep']:,.0f} | {med['overlap']:,.0f} | "
            f"{med['policy']:,.0f} | {_gap(r['env'], r['sim']):+.1f} | {_gap(r['lockstep'], r['sim']):+.1f} | "
            f"{_gap(r['overlap'], r['sim']):+.1f} | {statistics.median(floor):+.1f} | {load} |")
    out("\nper round (sim / env / lockstep / overlap / policy, env-steps/s):")
    for task, r, _ in rows:
        out(f"- {task}: " + "; ".join(" / ".join(f"{r[k][i]:.0f}" for k in r) for i in range(len(r["sim"]))))
    table.flush()


if __name__ == "__main__":
    main()
