"""The memory plan of a `pi0` PPO update per GPU (vla_rl/train/memory_plan.py) for the usual ways of fitting it, at
24, 48 and 80 GB: a markdown table for docs/training.md. Computed, nothing allocated (runs on a CPU in minutes).

    python benchmarks/plan_table.py [--model pi0] [--method noise] [--num-steps 10] [--gpus 24,48,80]

The run: 64 envs x 4 chunks = 256 samples per update, 4 minibatches of 64, bf16 autocast, activation
checkpointing `all`, Flow-Noise with K = 10 (every denoising step is stochastic: the expert runs 10 times per sample
in the update).
"""

from __future__ import annotations

import argparse
import sys

from vla_rl.core.schema import from_dict
from vla_rl.train.memory_plan import GIB, RESERVE, plan_memory
from vla_rl.train.trainer import TrainConfig

VARIANTS = [
    ("full fine-tune", {}, {}),
    ("learner.freeze_prefix=true", {"freeze_prefix": True}, {}),
    ("learner.lora.rank=16 (prefix)", {"lora": {"rank": 16}}, {}),
    ("LoRA r=16 + bf16 weights and Adam states", {"lora": {"rank": 16}, "param_dtype": "bf16",
                                                  "optimizer_state_dtype": "bf16"}, {}),
    ("full, 8 learners sharded (fsdp)", {}, {"runtime": "ray", "ray": {"learners": 8, "learner_gpus": 1,
                                                                       "sharding": "fsdp"}}),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pi0")
    p.add_argument("--method", default="noise")
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--checkpointing", default="all")
    p.add_argument("--gpus", default="24,48,80", help="GPU memory sizes in GB (1e9 bytes)")
    args = p.parse_args(argv)
    gpus = [float(g) for g in args.gpus.split(",")]
    print(f"model={args.model}, {args.envs} envs x {args.chunks} chunks, {args.minibatches} minibatches, "
          f"{args.method} K={args.num_steps}, bf16 autocast, checkpointing {args.checkpointing}; GiB per GPU, "
          f"total includes {RESERVE / GIB:.0f} GiB reserve\n")
    head = "| setting | weights | gradients | optimizer | rollout | autocast copies, fsdp gathers | " \
        "activations (micro-batch, or sampling where larger) | total | " + \
        " | ".join(f"{g:g} GB" for g in gpus) + " |"
    print(head)
    print("|" + "---|" * (8 + len(gpus)))
    for label, learner, extra in VARIANTS:
        cfg = from_dict(TrainConfig, {"model": args.model, "device": "cuda", "bf16": True,
                                      "env": {"num_envs": args.envs}, "rollout_chunks": args.chunks,
                                      "sampler": {"num_steps": args.num_steps, "method": args.method},
                                      "learner": {"minibatches": args.minibatches,
                                                  "grad_checkpointing": args.checkpointing, **learner}, **extra})
        plan = plan_memory(cfg, cuda=True)
        rows = {what: b for what, b, _ in plan.rows}
        act = next((what, b) for what, b in rows.items() if what.startswith(("activations", "sampling")))
        other = rows.get("gathered layers (fsdp)", 0) + rows.get("autocast bf16 weight copies", 0)
        total = (plan.total + RESERVE) / GIB
        cells = ["fits" if plan.total + RESERVE <= g * 1e9 else "no" for g in gpus]
        print(f"| {label} | {rows['weights'] / GIB:.1f} | {rows['gradients'] / GIB:.1f} | "
              f"{rows['optimizer state'] / GIB:.1f} | {rows['rollout buffers'] / GIB:.2f} | {other / GIB:.1f} | "
              f"{act[1] / GIB:.1f} ({'sampling' if act[0].startswith('sampling') else act[0].rsplit(' ', 1)[-1]}) | "
              f"{total:.1f} | "
              + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
