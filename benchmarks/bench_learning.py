"""SFT -> RL learning benchmark on the built-in task: for each seed, collect expert demos, train the
``tiny`` policy on them (few-shot SFT), then run Flow-SDE PPO and Flow-Noise PPO (the experiment presets)
from that SFT policy, evaluating with the deterministic ODE sampler on fixed seeds along the way.

    python benchmarks/bench_learning.py [--seeds 0,1,2] [--iterations 80] [--methods sde,noise]
                                        [--demos 10] [--sft-steps 500] [--eval-every 10]
                                        [--eval-episodes 200] [--out runs/bench_learning]

Writes into ``--out``: one run folder per (seed, method) (the trainer's normal output: metrics.jsonl,
checkpoints), ``table.md`` (printed too) and ``curves.png`` (success vs env-steps per method; needs
matplotlib). A run whose metrics already reach ``--iterations`` is not run again, and an unfinished one
resumes from its newest checkpoint, so the command can be stopped and restarted.

Table columns: SFT success and the success after RL (mean ± standard deviation over seeds, each
evaluated on ``--eval-episodes`` fixed-seed episodes), the best evaluation reached, and the env-steps and
wall-clock seconds (of training, evaluation included) each method needed to reach its best and to reach
90 % ("-" where it never did).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from vla_rl.actor import Actor
from vla_rl.checkpoint import CheckpointError, save_policy
from vla_rl.collect import collect_builtin_demos
from vla_rl.config import load_preset
from vla_rl.policies.config import policy_preset
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.sft import SFTConfig, train_sft
from vla_rl.trainer import TrainConfig, Trainer, resume_trainer

PRESETS = {"sde": "builtin_flow_sde", "noise": "builtin_flow_noise"}
LABELS = {"sde": "Flow-SDE PPO", "noise": "Flow-Noise PPO"}


def sft_policy(out: Path, seed: int, demos: int, steps: int) -> Path:
    path = out / f"seed{seed}" / "sft"
    if (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(seed)
    data = collect_builtin_demos(demos, seed=seed)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(FlowPolicy(policy_preset("tiny")), norm, env_state_dim=4, env_action_dim=2)
    train_sft(actor, data, SFTConfig(steps=steps, seed=seed), progress=False)
    return save_policy(path, actor.model, actor.norm, meta={"demos": demos, "sft_steps": steps, "seed": seed})


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rl_run(sft: Path, run: Path, method: str, seed: int, args) -> list[dict]:
    history = read_metrics(run)
    if history and history[-1]["iteration"] >= args.iterations:
        return history
    overrides = {"iterations": args.iterations}
    try:
        trainer = resume_trainer(run, overrides=overrides, log=lambda *_: None)
    except CheckpointError:  # nothing to resume from: start afresh (dropping any partial metrics)
        shutil.rmtree(run, ignore_errors=True)
        cfg = load_preset(TrainConfig, "experiment", PRESETS[method], {
            "init": str(sft), "out": str(run), "seed": seed, "iterations": args.iterations,
            "eval_every": args.eval_every, "eval_episodes": args.eval_episodes, "save_every": args.eval_every,
            "tensorboard": False, "progress": False})
        trainer = Trainer(cfg, log=lambda *_: None)
    t0 = time.time()
    history = trainer.run()
    print(f"  seed {seed} {LABELS[method]}: {len(history) - 1} iterations in {time.time() - t0:.0f} s, eval "
          + " ".join(f"{h['eval/success_once']:.2f}" for h in history if "eval/success_once" in h), flush=True)
    return history


def curve(history: list[dict]) -> list[tuple[int, float, float]]:
    """(env-steps, training seconds so far, eval success) at every evaluation."""
    out, wall = [], 0.0
    for h in history:
        wall += h.get("time/iteration_s", 0.0)
        if "eval/success_once" in h:
            out.append((int(h["time/env_steps"]), wall, float(h["eval/success_once"])))
    return out


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def first_reach(points, level: float) -> tuple[str, str]:
    for steps, wall, s in points:
        if s >= level - 1e-9:
            return f"{steps:,}", f"{wall:.0f}"
    return "-", "-"


def table(curves: dict[str, list], args) -> str:
    lines = [f"| method | seeds | SFT success | after RL ({args.iterations} it.) | best | env-steps to best | "
             f"s to best | env-steps to 90 % | s to 90 % |", "|---|---|---|---|---|---|---|---|---|"]
    for method, runs in curves.items():
        sft = [c[0][2] for c in runs]
        final = [c[-1][2] for c in runs]
        best = [max(s for _, _, s in c) for c in runs]
        to_best = [next((st, w) for st, w, s in c if s == b) for c, b in zip(runs, best)]
        to_90 = [first_reach(c, 0.9) for c in runs]
        lines.append(
            f"| {LABELS[method]} | {len(runs)} | {fmt(sft)} | {fmt(final)} | {fmt(best)} | "
            f"{' / '.join(f'{st:,}' for st, _ in to_best)} | {' / '.join(f'{w:.0f}' for _, w in to_best)} | "
            f"{' / '.join(a for a, _ in to_90)} | {' / '.join(b for _, b in to_90)} |")
    return "\n".join(lines)


def plot(curves: dict[str, list], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for (method, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        for k, c in enumerate(runs):
            ax.plot([p[0] for p in c], [p[2] for p in c], color=color, alpha=0.8 if len(runs) == 1 else 0.5,
                    label=LABELS[method] if k == 0 else None)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("success (ODE sampler)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Built-in ColorReach: few-shot SFT, then RL (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default="sde,noise")
    p.add_argument("--iterations", type=int, default=80)
    p.add_argument("--demos", type=int, default=10)
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--out", default="runs/bench_learning")
    args = p.parse_args()
    out = Path(args.out)
    methods = args.methods.split(",")
    curves: dict[str, list] = {m: [] for m in methods}
    for seed in [int(s) for s in args.seeds.split(",")]:
        t0 = time.time()
        sft = sft_policy(out, seed, args.demos, args.sft_steps)
        print(f"seed {seed}: SFT policy at {sft} ({time.time() - t0:.0f} s)", flush=True)
        for method in methods:
            curves[method].append(curve(rl_run(sft, out / f"seed{seed}" / method, method, seed, args)))
    text = table(curves, args)
    print("\n" + text)
    (out / "table.md").write_text(text + "\n")
    if plot(curves, out / "curves.png"):
        print(f"\nlearning curves: {out / 'curves.png'}")


if __name__ == "__main__":
    main()
