"""The memory plan against a measured update: one PPO update of a real-size preset on the CPU, the process's
peak memory during it beside what `vla-rl train --plan` predicts for the same config, and its time.

    python benchmarks/bench_plan_cpu.py [--model pi0] [--envs 2] [--method sde] [--num-steps 10] [--lora 16]
                                        [--param-dtype bf16] [--checkpointing none] [--threads 2] [--json FILE]

The policy is built on the meta device and materialised in ``--param-dtype`` directly (random weights: their values
change neither the memory nor the time), so building it never holds an fp32 copy of a bf16 model. A rollout of one
chunk per env (``--envs`` chunks, the minibatch) is sampled by the policy itself; then the peak resident set
(``VmHWM``) is reset (``/proc/self/clear_refs``) and one update runs: LoRA adapters of rank ``--lora`` on the
default parts, bf16 weights with fp32 masters of what is trained (``learner.param_dtype``), one epoch, one minibatch.
Measured = the peak during the update less the process's size before the policy was built (Python, torch, this
script); planned = the plan's rows (weights, gradients, optimizer state, rollout buffers, the update's
activations), the CPU activation simulation (``cuda=False``). ``--model tiny`` runs the same code in seconds (the
test of the script).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vla_rl.core.schema import from_dict
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.rl.algorithms import make_algorithm
from vla_rl.rl.learner import Learner
from vla_rl.rl.rollout import Rollout
from vla_rl.train.memory_plan import GIB, plan_memory
from vla_rl.train.trainer import TrainConfig

MIB = 2**20


def rss(field: str = "VmRSS") -> int:
    """Bytes of ``field`` (``VmRSS``: now, ``VmHWM``: the peak since the last reset) of /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Make ``VmHWM`` start again from the current resident set (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def train_config(args) -> TrainConfig:
    return from_dict(TrainConfig, {
        "model": args.model, "device": "cpu", "env": {"num_envs": args.envs}, "rollout_chunks": 1,
        "sampler": {"num_steps": args.num_steps, "method": args.method},
        "learner": {"update_epochs": 1, "minibatches": 1, "grad_checkpointing": args.checkpointing,
                    "lora": {"rank": args.lora}, "param_dtype": args.param_dtype}})


def materialised_policy(cfg, dtype: torch.dtype):
    """The policy's modules in ``dtype``, weights random normal (std 0.02), built without an fp32 copy."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = make_policy(cfg)
    finally:
        torch.set_default_dtype(before)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
    return model.eval()


def rollout(model, actor: Actor, n: int, method: str, k: int) -> Rollout:
    """One chunk step of ``n`` envs sampled by the policy itself (PPO's ratios start at 1)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    size = cfg.vision.image_size
    obs = model.prepare({"images": torch.randint(0, 256, (n, cfg.num_cameras, size, size, 3), dtype=torch.uint8,
                                                 generator=g),
                         "state": torch.randn(n, cfg.state_dim, generator=g) * 0.5,
                         "instruction": ["pick up the red cube and put it in the bowl"] * n})
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=g)
        s = flow.sample(model.field(prefix), noise, num_steps=k, method=method, generator=g)
        values = model.value(prefix).float()
    row = lambda x: x[None]  # noqa: E731   [N, ...] -> [T=1, N, ...]
    zeros = torch.zeros(1, n)
    return Rollout(obs={key: row(obs[key]) for key in ("images", "image_mask", "state", "tokens", "token_mask")},
                   chain=row(s.chain), stochastic=row(s.stochastic), log_probs=row(s.log_probs), entropy=zeros,
                   values=row(values), rewards=torch.rand(1, n, generator=g), terminated=zeros.bool(),
                   truncated=zeros.bool(), success=zeros.bool(), final_values=zeros, last_values=values,
                   sampler=SamplerConfig(k, method), execute=cfg.action_horizon)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pi0")
    p.add_argument("--envs", type=int, default=2, help="chunks in the update's minibatch")
    p.add_argument("--method", default="sde", choices=["sde", "noise"])
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank (0: train every weight)")
    p.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--checkpointing", default="none", choices=["none", "prefix", "expert", "all"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = train_config(args)
    plan = plan_memory(cfg, cuda=False)
    planned = sum(b for what, b, _ in plan.rows if not what.startswith("sampling"))
    base = rss()
    t0 = time.perf_counter()
    model = materialised_policy(cfg_policy := _policy(cfg), getattr(torch, {"bf16": "bfloat16",
                                                                            "fp32": "float32"}[args.param_dtype]))
    built_s = time.perf_counter() - t0
    actor = Actor(model, NormStats(Stats.identity(cfg_policy.state_dim), Stats.identity(cfg_policy.action_dim)))
    learner = Learner(actor, cfg.learner, make_algorithm(cfg.algorithm))
    ro = rollout(model, actor, args.envs, args.method, args.num_steps)
    reset_peak()
    t0 = time.perf_counter()
    metrics = learner.update(ro, iteration=0)
    update_s = time.perf_counter() - t0
    peak = rss("VmHWM") - base
    result = {"model": args.model, "parameters": sum(q.numel() for q in model.parameters()), "envs": args.envs,
              "method": args.method, "num_steps": args.num_steps, "lora": args.lora, "param_dtype": args.param_dtype,
              "checkpointing": args.checkpointing, "threads": args.threads, "torch": torch.__version__,
              "planned_gib": planned / GIB, "measured_gib": peak / GIB, "ratio": peak / planned,
              "update_s": update_s, "build_s": built_s, "baseline_gib": base / GIB,
              "plan": [(what, b / GIB, how) for what, b, how in plan.rows], "loss_finite": bool(
                  all(v == v for v in metrics.values() if isinstance(v, float)))}
    print(plan.table())
    print(f"\n{args.model}: one update of {args.envs} chunks (LoRA r={args.lora}, {args.param_dtype} weights, "
          f"{args.method} K={args.num_steps}, checkpointing {args.checkpointing}, {args.threads} threads): "
          f"peak {peak / GIB:.2f} GiB above the {base / GIB:.2f} GiB baseline, planned {planned / GIB:.2f} GiB "
          f"(measured / planned {peak / planned:.2f}); update {update_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _policy(cfg: TrainConfig):
    from vla_rl.presets import policy_preset

    return policy_preset(cfg.model)


if __name__ == "__main__":
    main()
