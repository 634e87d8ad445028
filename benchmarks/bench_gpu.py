"""The GPU targets of the `pi0` preset (3.24 B parameters, 3 cameras at 224 px, H = 50, A = 32), on one CUDA GPU:

1. one action chunk at batch 1, K = 10: fp32 weights under bf16 autocast, then bf16 weights with the denoising
   loop eager, torch.compile'd and captured as a CUDA graph (target: <= 50 ms per chunk);
2. the same at batch 64, against the prefix alone (target: chunk <= 1.3 x prefix-only time);
3. one PPO update (one epoch, one minibatch of --ppo-batch >= 64 chunk samples) under bf16 autocast with
   activation checkpointing: time and peak memory (target: fits one 80 GB GPU), mixed Flow-SDE and Flow-Noise,
   training everything, the expert only (freeze_prefix) or LoRA r=16 (--train), beside the memory plan (--plan).

    python benchmarks/bench_gpu.py [--model pi0] [--num-steps 10] [--batch 64] [--ppo-batch 64] [--repeats 10]
                                   [--checkpointing all,none] [--train full,freeze_prefix,lora] [--plan]
                                   [--skip sampling,batch,ppo]

Wall-clock milliseconds with CUDA synchronisation, median of --repeats after warm-up (torch.compile and the
graph capture happen in the warm-up). TF32 matmuls are allowed (the fp32 rows are what a user would get).
Without a CUDA device the script refuses (exit status 2); ``--smoke`` runs every code path on the CPU with the
tiny preset and tiny batches, for a test that the script works, not for numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings

import torch

from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.inference import Denoiser, cast_weights
from vla_rl.policies.lora import LoRAConfig, merge_lora
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.seam import FlowVLA
from vla_rl.presets import policy_preset
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import Rollout


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --smoke: the tiny preset narrowed further (the code paths, not the sizes, are what it checks)
SMOKE_MODEL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
               "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
WARMUP = {"default": 2, "compiled": 3, "update": 1}   # --smoke: none


def timed_ms(fn, repeats: int, device: torch.device, warmup: int = WARMUP["default"]) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def observations(cfg, n: int, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    size = cfg.vision.image_size
    return {"images": torch.randint(0, 256, (n, cfg.num_cameras, size, size, 3), dtype=torch.uint8,
                                    generator=g).to(device),
            "state": (torch.randn(n, cfg.state_dim, generator=g) * 0.5).to(device),
            "instruction": ["pick up the red cube and put it in the bowl"] * n}


def chunk_fn(model: FlowVLA, denoiser: Denoiser, obs: dict, noise: torch.Tensor, k: int):
    def run():
        with torch.inference_mode():
            denoiser(model.encode_prefix(obs, hidden=False), noise, num_steps=k)
    return run


def prefix_fn(model: FlowVLA, obs: dict):
    def run():
        with torch.inference_mode():
            model.encode_prefix(obs, hidden=False)
    return run


def sampling_rows(model: FlowVLA, n: int, args, device: torch.device, modes: list[str]) -> list[tuple]:
    """(weights, loop, batch, prefix ms, chunk ms) rows: fp32 weights under autocast first, then bf16 weights."""
    cfg, k = model.cfg, args.num_steps
    obs = observations(cfg, n, device)
    noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    if n == 1:
        on_gpu = device.type == "cuda"
        with torch.autocast(device.type, dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext():
            den = Denoiser(model)
            rows.append(("fp32, bf16 autocast", "none", n, timed_ms(prefix_fn(model, obs), args.repeats, device),
                         timed_ms(chunk_fn(model, den, obs, noise, k), args.repeats, device)))
    cast_weights(model, "bf16")
    prefix_ms = timed_ms(prefix_fn(model, obs), args.repeats, device)
    for mode in modes:
        den = Denoiser(model, mode)
        ms = timed_ms(chunk_fn(model, den, obs, noise, k), args.repeats, device, warmup=WARMUP["compiled"])
        rows.append(("bf16", mode, n, prefix_ms, ms))
    cast_weights(model, "fp32")
    return rows


def synthetic_rollout(model: FlowVLA, actor: Actor, n: int, method: str, k: int, device: torch.device) -> Rollout:
    """One chunk step of ``n`` envs (T = 1), its chain sampled by the policy itself, so PPO's ratios start at 1."""
    cfg = model.cfg
    obs = model.prepare(observations(cfg, n, device))
    sampler = SamplerConfig(k, method)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        prefix = model.encode_prefix(obs)
        noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=gen, device=device)
        s = flow.sample(model.field(prefix), noise, num_steps=k, method=method, generator=gen)
        values = model.value(prefix).float()
    row = lambda x: x[None]  # noqa: E731   [N, ...] -> [T=1, N, ...]
    zeros = torch.zeros(1, n, device=device)
    return Rollout(obs={key: row(obs[key]) for key in ("images", "image_mask", "state", "tokens", "token_mask")},
                   chain=row(s.chain), stochastic=row(s.stochastic), log_probs=row(s.log_probs), entropy=zeros,
                   values=row(values), rewards=torch.rand(1, n, generator=torch.Generator().manual_seed(2)).to(device),
                   terminated=zeros.bool(), truncated=zeros.bool(), success=zeros.bool(), final_values=zeros,
                   last_values=values, sampler=sampler, execute=cfg.action_horizon)


TRAIN = {"full": {}, "freeze_prefix": {"freeze_prefix": True}, "lora": {"lora": LoRAConfig(rank=16)}}


def restore(model: FlowVLA) -> None:
    """Undo what a learner did to the model: LoRA adapters merged away, every parameter trainable again."""
    merge_lora(model)
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None


def planned_gib(args, method: str, parts: str, train: str, cuda: bool) -> str:
    """The memory plan's total for this row's update (vla_rl/train/memory_plan.py), to set beside the measured peak."""
    from vla_rl.core.schema import from_dict
    from vla_rl.train.memory_plan import GIB, plan_memory
    from vla_rl.train.trainer import TrainConfig

    learner = {"minibatches": 1, "update_epochs": 1, "grad_checkpointing": parts,
           **({"freeze_prefix": True} if train == "freeze_prefix" else {}),
           **({"lora": {"rank": 16}} if train == "lora" else {})}
    cfg = from_dict(TrainConfig, {"model": args.model, "bf16": True, "env": {"num_envs": args.ppo_batch},
                                  "rollout_chunks": 1, "sampler": {"num_steps": args.num_steps, "method": method},
                                  "learner": learner})
    plan = plan_memory(cfg, cuda=cuda)
    # the bench's update holds no sampling activations beside it: the update's rows alone
    total = sum(b for what, b, _ in plan.rows if not what.startswith("sampling"))
    return f"{total / GIB:.3g}"


def one_update(model: FlowVLA, actor: Actor, method: str, parts: str, args, device: torch.device,
               train: str = "full") -> tuple[str, str]:
    """Update time (ms) and peak memory (GiB) of one PPO update; "out of memory" if it does not fit."""
    ro = synthetic_rollout(model, actor, args.ppo_batch, method, args.num_steps, device)
    learner = Learner(actor, LearnerConfig(update_epochs=1, minibatches=1, grad_checkpointing=parts, **TRAIN[train]),
                      PPO(PPOConfig()), bf16=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        ms = timed_ms(lambda: learner.update(ro, iteration=0), max(1, args.repeats // 5), device,
                      warmup=WARMUP["update"])
    except torch.cuda.OutOfMemoryError:
        return "out of memory", "-"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return f"{ms:.0f}", f"{peak:.1f}"


def ppo_rows(model: FlowVLA, args, device: torch.device) -> list[tuple]:
    """(training, method, checkpointing, samples, update ms, peak GiB, planned GiB) rows."""
    cfg = model.cfg
    actor = Actor(model, NormStats(Stats.identity(cfg.state_dim), Stats.identity(cfg.action_dim)))
    rows = []
    for train in args.train.split(","):
        for method in args.methods.split(","):
            for parts in args.checkpointing.split(","):
                plan = planned_gib(args, method, parts, train, device.type == "cuda") if args.plan else "-"
                try:
                    rows.append((train, method, parts, args.ppo_batch,
                                 *one_update(model, actor, method, parts, args, device, train), plan))
                except torch.cuda.OutOfMemoryError:   # already the rollout's sampling
                    rows.append((train, method, parts, args.ppo_batch, "out of memory", "-", plan))
                finally:   # the optimizer's state went with the learner; free the cached blocks for the next row
                    restore(model)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pi0")
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="the large sampling batch (section 2)")
    p.add_argument("--ppo-batch", type=int, default=64, help="chunk samples in the PPO minibatch (section 3)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modes", default="none,compile,cudagraph", help="denoising loops to time with bf16 weights")
    p.add_argument("--checkpointing", default="all,none", help="activation checkpointing parts for the PPO rows")
    p.add_argument("--train", default="full", help="what the PPO rows train: full, freeze_prefix, lora (rank 16)")
    p.add_argument("--methods", default="sde,noise", help="sampler methods of the PPO rows")
    p.add_argument("--plan", action="store_true", help="set the memory plan's total beside each PPO row's peak")
    p.add_argument("--skip", default="", help="sections to leave out: sampling, batch, ppo")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny batches: a test of the code paths")
    args = p.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        args.model, args.num_steps, args.batch, args.ppo_batch, args.repeats = "tiny", 2, 2, 2, 1
        # torch.compile's C++ build takes minutes on a small CPU; cudagraph falls back to the eager loop here
        args.modes = ",".join(m for m in args.modes.split(",") if m != "compile")
        WARMUP.update(default=0, compiled=0, update=0)
        warnings.simplefilter("ignore", RuntimeWarning)
    elif not torch.cuda.is_available():
        print("bench_gpu.py measures the GPU targets and needs a CUDA device, but torch.cuda.is_available() is "
              f"False (torch {torch.__version__}); --smoke runs its code paths on the CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    skip = {s for s in args.skip.split(",") if s}
    modes = [m for m in args.modes.split(",") if m]
    torch.manual_seed(0)
    with torch.device(device):   # initialise the weights where they live (seconds for pi0 on a GPU)
        model = make_policy(policy_preset(args.model, SMOKE_MODEL if args.smoke else None)).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test: no meaningful numbers)"
    print(f"model={args.model} params={sum(q.numel() for q in model.parameters()) / 1e9:.2f}B K={args.num_steps} "
          f"cameras={model.cfg.num_cameras} H={model.cfg.action_horizon} A={model.cfg.action_dim} device={name} "
          f"torch={torch.__version__}\n", flush=True)
    if not skip >= {"sampling", "batch"}:
        print("| weights | denoising loop | batch | prefix ms | chunk ms (prefix + K steps) | chunk / prefix |")
        print("|---|---|---|---|---|---|")
        for n in [b for b, section in ((1, "sampling"), (args.batch, "batch")) if section not in skip]:
            for weights, mode, batch, pre, chunk in sampling_rows(model, n, args, device, modes):
                print(f"| {weights} | {mode} | {batch} | {pre:.1f} | {chunk:.1f} | {chunk / pre:.2f} |", flush=True)
        print()
    if "ppo" not in skip:
        print("| PPO update (bf16 autocast, 1 epoch, 1 minibatch) | trains | activation checkpointing | samples | "
              "ms | peak GiB | planned GiB |")
        print("|---|---|---|---|---|---|---|")
        for train, method, parts, n, ms, peak, plan in ppo_rows(model.train(), args, device):
            label = {"sde": "mixed Flow-SDE", "noise": "Flow-Noise"}[method]
            what = {"full": "everything", "freeze_prefix": "expert + heads", "lora": "LoRA r=16 + expert + heads"}
            print(f"| {label}, K={args.num_steps} | {what[train]} | {parts} | {n} | {ms} | {peak} | {plan} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
