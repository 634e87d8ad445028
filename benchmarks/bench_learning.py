"""SFT -> RL learning benchmark, one command for a list of tasks: for each task and seed, collect expert
demos (built-in: the scripted expert; ManiSkill3: ManiSkill's motion planner, converted to
``pd_ee_delta_pose`` with state observations), train the ``tiny`` policy (or ``--model``'s preset, e.g.
``tiny_smolvla``) on the first ``--demos`` of them (few-shot SFT), then run Flow-SDE PPO and Flow-Noise PPO
(the task's experiment presets) from that SFT policy, evaluating with the deterministic ODE sampler on fixed
seeds along the way (the evaluation at iteration 0 is the SFT policy's).

    python benchmarks/bench_learning.py [--tasks builtin,PushCube-v1,PickCube-v1] [--seeds 0,1,2] [--methods sde,noise]
                                        [--iterations N] [--demos N] [--sft-steps N] [--eval-every 10]
                                        [--eval-episodes 200] [--model tiny] [--out runs/bench_learning]
                                        [--sft-only | --report]

``--iterations``, ``--demos``, ``--sft-steps`` default to each task's entry in :data:`TASKS` (iterations: else
each method's preset's, as for PickCube, whose Flow-Noise lr schedule is planned for its length); ``--sft-only``
makes the demos and SFT policies and stops (so that methods started as separate processes do not both
train the same seed's SFT policy); ``--report``
runs nothing and tabulates the runs as they are (unfinished ones marked "(of N)"). Writes into
``--out``: per task a folder with the demos, one SFT policy per seed and one run folder per (seed, method)
(the trainer's normal output: metrics.jsonl, checkpoints), ``table.md`` (all tasks; printed too) and
``<task>_curves.png`` (success vs env-steps per method; needs matplotlib). Finished runs are not run
again and an unfinished one resumes from its newest checkpoint, so the command can be stopped and
restarted (ManiSkill runs take about an hour each on 2 cores).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vla_rl.checkpoint.policy import save_policy
from vla_rl.core.errors import CheckpointError
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.data.maniskill_demos import collect_maniskill
from vla_rl.policies.actor import Actor
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import load_preset, policy_preset
from vla_rl.train.sft import SFTConfig, SFTRunConfig, run_sft, train_sft
from vla_rl.train.trainer import TrainConfig, Trainer, resume_trainer

LABELS = {"sde": "Flow-SDE PPO", "noise": "Flow-Noise PPO", "grpo": "GRPO (Flow-SDE)", "rloo": "RLOO (Flow-SDE)",
          "fpo": "FPO++ (ODE)"}


@dataclass(frozen=True)
class TaskSetup:
    presets: dict[str, str]   # method -> experiment preset (configs/experiment)
    demos: int                # few-shot: SFT on this many demos ...
    sft_steps: int
    iterations: int | None    # None: each method's preset's own (its lr schedule is planned for that length)
    demo_pool: int = 0        # ... of this many collected (ManiSkill: collected once, shared by the seeds)
    eval_every: int = 10
    eval_episodes: int = 200
    sft: dict[str, object] = field(default_factory=dict)   # further SFTRunConfig fields, e.g. lr


TASKS = {
    # 200 iterations: with the presets' cosine lr decay, every run of both methods first reached 90 % between
    # iterations 70 and 160 (RESULTS.md).
    "builtin": TaskSetup({"sde": "builtin_flow_sde", "noise": "builtin_flow_noise"}, demos=10, sft_steps=500,
                         iterations=200),
    "PushCube-v1": TaskSetup({"sde": "maniskill_pushcube_flow_sde", "noise": "maniskill_pushcube_flow_noise",
                              "grpo": "maniskill_pushcube_grpo", "rloo": "maniskill_pushcube_rloo",
                              "fpo": "maniskill_pushcube_fpo"},
                             demos=20, sft_steps=2000, iterations=150, demo_pool=100, eval_every=10,
                             eval_episodes=100),
    # PickCube: the planner pauses ~7 steps after the grasp; cloned as is, the policy stalls there (grasped,
    # never lifted: 0.02-0.03 from 40 demos), so idle frames are dropped. And a policy that sees the joint
    # velocities (state dims 9-17) copies the planner's slow start of each carry and crawls (0.27 from 100
    # demos); hidden, 50 demos give 0.60-0.67 (docs/notes.md).
    "PickCube-v1": TaskSetup({"sde": "maniskill_pickcube_flow_sde", "noise": "maniskill_pickcube_flow_noise"},
                             demos=50, sft_steps=6000, iterations=None, demo_pool=100, eval_every=10,
                             eval_episodes=100, sft={"lr": 1e-3, "idle_threshold": 0.02, "hidden_state_dims": "9-17",
                                                     # Flow-Noise's std bounds (SFT does not use them): the
                                                     # tiny preset's [0.2, 0.4] explored too coarsely here
                                                     "policy": {"noise_std_min": 0.1, "noise_std_max": 0.2}}),
}


def sft_policy(out: Path, task: str, seed: int, demos: int, steps: int, model: str = "tiny") -> Path:
    path = out / f"seed{seed}" / "sft"
    if (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(seed)
    if task == "builtin":
        data = collect_builtin_demos(demos, seed=seed)
        norm = NormStats(Stats.of(data.state), Stats.of(data.action))
        actor = Actor(make_policy(policy_preset(model)), norm)
        train_sft(actor, data, SFTConfig(steps=steps, seed=seed), progress=False)
        return save_policy(path, actor.model, actor.norm, meta={"demos": demos, "sft_steps": steps, "seed": seed})
    # ManiSkill: one pool of motion-planner demos per task; each seed trains on the first `demos` of it.
    pool = out / "demos"
    if not (pool / "meta" / "info.json").is_file():
        collect_maniskill(pool, task=task, episodes=max(demos, TASKS[task].demo_pool), log=lambda *_: None)
    run_sft(pool, SFTRunConfig(steps=steps, seed=seed, out=str(path), max_episodes=demos, eval_episodes=0,
                               model=model, **TASKS[task].sft), progress=False)
    return path


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rl_run(sft: Path, run: Path, preset: str, method: str, seed: int, iterations: int, setup: TaskSetup,
           args) -> list[dict]:
    history = read_metrics(run)
    if history and history[-1]["iteration"] >= iterations:
        return history
    overrides = {"iterations": iterations}
    try:
        trainer = resume_trainer(run, overrides=overrides, log=lambda *_: None)
    except CheckpointError:  # nothing to resume from: start afresh (dropping any partial metrics)
        shutil.rmtree(run, ignore_errors=True)
        cfg = load_preset(TrainConfig, "experiment", preset, {
            "init": str(sft), "out": str(run), "seed": seed, "iterations": iterations,
            "eval_every": args.eval_every or setup.eval_every,
            "eval_episodes": args.eval_episodes or setup.eval_episodes,
            "save_every": args.eval_every or setup.eval_every,
            "tensorboard": False, "progress": False})
        trainer = Trainer(cfg, log=lambda *_: None)
    t0 = time.time()
    with trainer:   # one process runs every (seed, method): release each run's workers when it ends
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


def planned_iterations(setup: TaskSetup, method: str, override: int | None = None) -> int:
    """RL iterations of one method's runs: ``--iterations``, else the task entry's, else the preset's."""
    return override or setup.iterations or load_preset(TrainConfig, "experiment", setup.presets[method]).iterations


def table(curves: dict[str, dict[str, list]], reached: dict[str, dict[str, list[int]]],
          planned: dict[str, dict[str, int]]) -> str:
    """One row per (task, method); "RL iterations" is each seed's last iteration, "(of N)" when a run is
    unfinished (``--report`` on runs still going or stopped)."""
    lines = ["| task | method | seeds | SFT success | after RL | RL iterations | best | env-steps to best | "
             "s to best | env-steps to 90 % | s to 90 % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, method, runs in [(t, m, r) for t, by_method in curves.items() for m, r in by_method.items() if r]:
        its = reached[task][method]
        total = planned[task][method]
        its_text = " / ".join(map(str, its)) + (f" (of {total})" if min(its) < total else "")
        sft = [c[0][2] for c in runs]
        final = [c[-1][2] for c in runs]
        best = [max(s for _, _, s in c) for c in runs]
        to_best = [next((st, w) for st, w, s in c if s == b) for c, b in zip(runs, best)]
        to_90 = [first_reach(c, 0.9) for c in runs]
        lines.append(
            f"| {task} | {LABELS[method]} | {len(runs)} | {fmt(sft)} | {fmt(final)} | {its_text} | "
            f"{fmt(best)} | "
            f"{' / '.join(f'{st:,}' for st, _ in to_best)} | {' / '.join(f'{w:.0f}' for _, w in to_best)} | "
            f"{' / '.join(a for a, _ in to_90)} | {' / '.join(b for _, b in to_90)} |")
    per_seed = [f"- {task} {LABELS[method]}, SFT -> after RL per seed: "
                + ", ".join(f"{c[0][2]:.2f} -> {c[-1][2]:.2f} ({c[-1][2] - c[0][2]:+.2f})" for c in runs)
                for task, by_method in curves.items() for method, runs in by_method.items() if runs]
    return "\n".join(lines + [""] + per_seed)


def plot(curves: dict[str, list], path: Path, title: str) -> bool:
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
    ax.set_title(f"{title}: few-shot SFT, then RL (one line per seed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="builtin", help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default="sde,noise")
    p.add_argument("--iterations", type=int, help="RL iterations (default: the task's)")
    p.add_argument("--demos", type=int, help="SFT demos (default: the task's)")
    p.add_argument("--sft-steps", type=int, help="SFT steps (default: the task's)")
    p.add_argument("--eval-every", type=int, help="default: the task's")
    p.add_argument("--eval-episodes", type=int, help="default: the task's")
    p.add_argument("--model", default="tiny",
                   help="the policy preset the SFT policies are made with (configs/model), e.g. tiny_smolvla; RL "
                        "continues the SFT policy, whatever its architecture; give each model its own --out")
    p.add_argument("--out", default="runs/bench_learning")
    p.add_argument("--sft-only", action="store_true",
                   help="make the demos and SFT policies, run no RL (then start the methods as separate processes)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: tabulate and plot the runs' metrics as they are now (unfinished runs too)")
    args = p.parse_args()
    out = Path(args.out)
    methods = args.methods.split(",")
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown task(s) {unknown}; known: {list(TASKS)}")
    curves: dict[str, dict[str, list]] = {}
    reached: dict[str, dict[str, list[int]]] = {}
    planned: dict[str, dict[str, int]] = {}
    for task in tasks:
        setup = TASKS[task]
        demos, sft_steps = args.demos or setup.demos, args.sft_steps or setup.sft_steps
        planned[task] = {m: planned_iterations(setup, m, args.iterations) for m in methods}
        curves[task], reached[task] = {m: [] for m in methods}, {m: [] for m in methods}
        task_out = out if task == "builtin" else out / task   # builtin: the layout of earlier results
        for seed in [int(s) for s in args.seeds.split(",")]:
            if not args.report:
                t0 = time.time()
                sft = sft_policy(task_out, task, seed, demos, sft_steps, args.model)
                print(f"{task} seed {seed}: SFT policy ({demos} demos, {sft_steps} steps) at {sft} "
                      f"({time.time() - t0:.0f} s)", flush=True)
                if args.sft_only:
                    continue
            for method in methods:
                run = task_out / f"seed{seed}" / method
                history = (read_metrics(run) if args.report else
                           rl_run(sft, run, setup.presets[method], method, seed, planned[task][method], setup,
                                  args))
                if curve(history):
                    curves[task][method].append(curve(history))
                    reached[task][method].append(int(history[-1]["iteration"]))
        if args.sft_only:  # no run was read: keep the saved table.md and curves as they are
            continue
        title = "Built-in ColorReach" if task == "builtin" else f"ManiSkill3 {task}"
        if plot(curves[task], out / f"{task}_curves.png", title):
            print(f"learning curves: {out / f'{task}_curves.png'}")
        text = table(curves, reached, planned)   # rewritten after every task: results are kept as they come
        (out / "table.md").write_text(text + "\n")
    if not args.sft_only:
        print("\n" + text)


if __name__ == "__main__":
    main()
