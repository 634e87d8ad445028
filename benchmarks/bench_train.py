"""Throughput of one RL iteration on the built-in task: rollout (policy sampling + env stepping, both on
``--device``) and the PPO update, for several numbers of envs.

    python benchmarks/bench_train.py [--device cpu] [--envs 64,320] [--method noise] [--bf16]
                                     [--chunks 4] [--epochs 4] [--minibatches 4] [--model tiny]

Prints a markdown table: rollout env-steps/s (an env-step is one executed action of one env), rollout
seconds, update seconds, and peak memory (CUDA: allocated by torch; CPU: the process's max RSS). Each row
is the median of ``--repeats`` iterations after one warm-up iteration. Wall-clock times with CUDA
synchronisation; on a shared CPU machine prefer ``bench_sampling.py``'s CPU times.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from vla_rl.envs.builtin import ColorReachEnv
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import collect_rollout


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_setting(args, n: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    env = ColorReachEnv(n, device=device, seed=0)
    with torch.device(device):  # initialise the weights where they will live
        model = make_policy(policy_preset(args.model))
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    actor = Actor(model, norm)
    sampler = SamplerConfig(args.num_steps, args.method)
    learner = Learner(actor, LearnerConfig(update_epochs=args.epochs, minibatches=args.minibatches), PPO(PPOConfig()),
                      bf16=args.bf16)
    gen = torch.Generator(device=device).manual_seed(0)
    roll, upd, steps = [], [], 0
    for it in range(args.repeats + 1):
        obs = env.reset(seed=it)
        sync(device)
        t0 = time.perf_counter()
        ro, _ = collect_rollout(actor, env, obs, num_chunks=args.chunks, sampler=sampler, execute=args.execute,
                                generator=gen)
        sync(device)
        t1 = time.perf_counter()
        learner.update(ro, iteration=it)
        sync(device)
        t2 = time.perf_counter()
        if it > 0:  # the first iteration warms up kernels and allocators
            roll.append(t1 - t0)
            upd.append(t2 - t1)
            steps = ro.env_steps
    r, u = statistics.median(roll), statistics.median(upd)
    return {"envs": n, "env_steps": steps, "rollout_s": r, "update_s": u, "sps": steps / r, "mb": peak_mb(device)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--envs", default="64,320")
    p.add_argument("--model", default="tiny")
    p.add_argument("--method", default="noise", choices=["noise", "sde"])
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--execute", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"model={args.model} method={args.method} K={args.num_steps} chunks={args.chunks} execute={args.execute} "
          f"epochs={args.epochs} minibatches={args.minibatches} bf16={args.bf16} device={name} "
          f"torch={torch.__version__}\n")
    print("| envs | env-steps / iteration | rollout env-steps/s | rollout s | PPO update s | peak MB |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in args.envs.split(",")]:
        r = one_setting(args, n, device)
        print(f"| {r['envs']} | {r['env_steps']} | {r['sps']:,.0f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} "
              f"| {r['mb']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
