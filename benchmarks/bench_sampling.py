"""Time one action-chunk sample with and without the prefix cache, and the cost of recomputing chain
log-probs (what every PPO minibatch does) for mixed Flow-SDE vs Flow-Noise.

    python benchmarks/bench_sampling.py [--model tiny] [--batch 64] [--device cpu] [--repeats 5] [--bf16]

Prints a markdown table (median of ``--repeats`` timings after one warm-up). On CPU the timings are
this process's CPU time with ``--threads`` torch threads (default 1), which stays meaningful on a shared,
loaded machine; on CUDA they are wall-clock times with synchronisation. ``--bf16`` runs everything under
bf16 autocast (CUDA; fp32 weights, as the learner does).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from vla_rl.policies import flow
from vla_rl.policies.architectures import make_policy
from vla_rl.presets import policy_preset


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):  # initialise the weights where they live (seconds for pi0 on a GPU)
        model = make_policy(policy_preset(args.model)).eval()
    scope = contextlib.ExitStack()  # held until the process ends: every timing below runs inside it
    if args.bf16:
        scope.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    cfg, n = model.cfg, args.batch
    obs = {
        "images": torch.randint(0, 256, (n, cfg.num_cameras, cfg.vision.image_size, cfg.vision.image_size, 3),
                                dtype=torch.uint8, device=device),
        "state": torch.randn(n, cfg.state_dim, device=device),
        "instruction": ["move to the red square"] * n,
    }
    noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, device=device)
    print(f"model={args.model} batch={n} device={device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} bf16={args.bf16} "
          f"params={sum(p.numel() for p in model.parameters()) / 1e6:.0f}M\n")
    unit = "wall ms" if device.type == "cuda" else "CPU ms"
    print(f"| what | K | time per chunk ({unit}) |")
    print("|---|---|---|")
    for k in (4, 10):
        def cached(k=k):
            with torch.inference_mode():
                prefix = model.encode_prefix(obs)
                flow.sample(model.field(prefix), noise, num_steps=k, method="ode")

        def uncached(k=k):
            with torch.inference_mode():
                def field(x, t):
                    out = model.forward_joint(obs, x, t)[1]
                    return out.velocity, out.noise_std
                flow.sample(field, noise, num_steps=k, method="ode")

        print(f"| sample, prefix cache | {k} | {1e3 * timed(cached, args.repeats, device):.1f} |")
        print(f"| sample, no cache (full pass per step) | {k} | {1e3 * timed(uncached, args.repeats, device):.1f} |")
    for k in (4, 10):
        with torch.no_grad():  # not inference mode: these chains feed a differentiable recomputation
            prefix = model.encode_prefix(obs)
            chains = {m: flow.sample(model.field(prefix), noise, num_steps=k, method=m, sde_mode="mixed")
                      for m in ("sde", "noise")}

        for method, label in (("sde", "mixed Flow-SDE"), ("noise", "Flow-Noise")):
            s = chains[method]

            def recompute(method=method, s=s):
                model.zero_grad(set_to_none=True)
                pre = model.encode_prefix(obs)
                lp = flow.chain_log_prob(model.field(pre), s.chain, s.stochastic, method=method)
                flow.aggregate(lp.log_probs, s.stochastic).mean().backward()

            print(f"| log-prob recompute + backward, {label} | {k} | "
                  f"{1e3 * timed(recompute, args.repeats, device):.1f} |")


if __name__ == "__main__":
    main()
