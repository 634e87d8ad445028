"""How reliably the quickstart recipe lifts: `vla-rl demo`'s SFT policy, then its RL stage, over RL seeds and
torch thread counts, for each method (PPO with Flow-Noise / Flow-SDE, GRPO, RLOO, DAPO, FPO++: the presets of
PRESETS, which differ from the demo's Flow-SDE preset in the method alone, at equal env-steps). The lift is the
after-RL minus SFT success of the demo's own evaluation (ODE sampler, ``eval_episodes`` fixed-seed episodes from
10,000).

    python benchmarks/bench_robustness.py [--methods noise,sde,grpo,rloo,dapo,fpo] [--seeds 0,1,2,3,4] [--threads 1,2]
                                          [--iterations N] [--set key=value ...] [--model tiny | tiny_smolvla]
                                          [--out runs/bench_robustness] [--report | --divergence N]

Why threads: a run on 1 and on 2 torch threads rounds differently (~1e-7 in the first update), and PPO
amplifies such differences until the two runs are as different as two RL seeds; a user's machine rounds in its
own way. So each thread count gets its own SFT policy (the demo's, seed 0) and its own RL runs, and the table
reads the lift over all of them: every (method, threads, seed) is one run. ``--divergence N`` measures that
amplification instead: for each method, ``N`` iterations of RL seed 0 on 1 and on 2 threads from the same SFT
policy (the 1-thread one), checkpointed every iteration, and per iteration the distance between the two runs'
weights and between their rollout successes (``divergence.md``). ``--set`` adds overrides of the RL
stage (e.g. ``--set learner.critic_warmup_iters=0``) for probing one setting; give such a probe its own ``--out``.

Writes into ``--out``: ``t<threads>/sft`` (the SFT policy and ``sft.json``, its success), one run folder per
``<method>/t<threads>_s<seed>`` (the trainer's output plus ``result.json``) and ``table.md`` (printed too: the
lift's min / median / max per method and thread count, and over all thread counts, then one row per run). A run
with a ``result.json`` is not run again, so the command can be stopped and restarted; ``--report`` runs
nothing and tabulates what is there. Run one process at a time with the thread counts it is told: the numbers
are deterministic given (seed, threads), so a busy machine only makes it slower.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch

from vla_rl.checkpoint.policy import load_policy
from vla_rl.checkpoint.training import list_checkpoints
from vla_rl.policies.actor import Actor
from vla_rl.presets import parse_overrides
from vla_rl.train.demo import DemoConfig, demo_success, demo_train_config, train_demo_sft
from vla_rl.train.trainer import Trainer

PRESETS = {"noise": "builtin_flow_noise", "sde": "builtin_flow_sde", "grpo": "builtin_grpo", "rloo": "builtin_rloo",
           "dapo": "builtin_dapo", "fpo": "builtin_fpo"}
LABELS = {"noise": "Flow-Noise PPO", "sde": "Flow-SDE PPO", "grpo": "GRPO (Flow-SDE)", "rloo": "RLOO (Flow-SDE)",
          "dapo": "DAPO (Flow-SDE)", "fpo": "FPO++ (ODE)"}
TARGET = 0.20


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sft_for(out: Path, threads: int, demo: DemoConfig) -> tuple[Path, float]:
    """The demo's SFT policy trained on ``threads`` torch threads, and its success (cached in ``sft.json``)."""
    folder = out / f"t{threads}"
    record = folder / "sft.json"
    if record.is_file():
        doc = json.loads(record.read_text())
        return Path(doc["path"]), doc["success"]
    shutil.rmtree(folder, ignore_errors=True)
    torch.set_num_threads(threads)
    actor, path, _ = train_demo_sft(DemoConfig(**{**vars(demo), "out": str(folder)}), progress=False)
    success = demo_success(actor, demo)
    record.write_text(json.dumps({"path": str(path), "success": success, "threads": threads}))
    return path, success


def rl_run(out: Path, method: str, threads: int, seed: int, sft: Path, sft_success: float, demo: DemoConfig,
           iterations: int, extra: dict) -> dict:
    """One RL stage of the demo (cached in ``result.json``)."""
    run = out / method / f"t{threads}_s{seed}"
    record = run / "result.json"
    if record.is_file():
        return json.loads(record.read_text())
    dcfg = DemoConfig(**{**vars(demo), "rl": PRESETS[method], "rl_iterations": iterations})
    # Every method gets the env-steps the demo's iterations give at most (a method that collects more an iteration,
    # DAPO's top-ups, ends earlier), so the methods compare at equal env-steps.
    budget = env_step_budget(dcfg, sft, out=run)
    cfg = demo_train_config(dcfg, sft, out=run, progress=False,
                            overrides={"seed": seed, "threads": threads, "tensorboard": False,
                                       "max_env_steps": budget, **extra})
    torch.set_num_threads(threads)
    t0, c0 = time.time(), cpu_seconds()
    with Trainer(cfg, log=lambda *_: None, overwrite=True) as trainer:
        history = trainer.run()
    seconds, cpu = time.time() - t0, cpu_seconds() - c0
    model, norm, _ = load_policy(list_checkpoints(run)[-1])
    after = demo_success(Actor(model, norm), dcfg)
    result = {"method": method, "threads": threads, "seed": seed, "iterations": history[-1]["iteration"],
              "env_steps": history[-1]["time/env_steps"], "sft": sft_success,
              "after": after, "lift": after - sft_success, "seconds": seconds, "cpu_seconds": cpu,
              "overrides": extra,
              "evals": [(h["iteration"], h["eval/success_once"]) for h in history if "eval/success_once" in h]}
    record.write_text(json.dumps(result, indent=1))
    return result


def env_step_budget(dcfg: DemoConfig, sft: Path, out: Path) -> int:
    """The env-steps of the demo's RL stage if no episode ended inside a chunk: iterations x envs x chunks x actions
    executed per chunk."""
    cfg = demo_train_config(dcfg, sft, out=out, progress=False)
    return dcfg.rl_iterations * cfg.env.num_envs * cfg.rollout_chunks * cfg.execute


def divergence(out: Path, method: str, iterations: int, sft: Path, demo: DemoConfig, extra: dict) -> list[dict]:
    """Per iteration: the L2 distance between the weights of RL runs on 1 and on 2 threads from the same SFT
    policy (relative to the weights' norm and to the distance the first update moved them), and the two runs'
    rollout success."""
    from safetensors.torch import load_file

    histories = {}
    for threads in (1, 2):
        run = out / "divergence" / method / f"t{threads}"
        if not (run / "checkpoints" / f"iter_{iterations:06d}").is_dir():
            dcfg = DemoConfig(**{**vars(demo), "rl": PRESETS[method], "rl_iterations": iterations})
            cfg = demo_train_config(dcfg, sft, out=run, progress=False, overrides={
                "seed": 0, "threads": threads, "tensorboard": False, "save_every": 1, "keep_last": iterations,
                "keep_best": False, **extra})
            torch.set_num_threads(threads)
            with Trainer(cfg, log=lambda *_: None, overwrite=True) as trainer:
                trainer.run()
        histories[threads] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    base = load_file(str(sft / "model.safetensors"))
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in base.values())).item()
    rows, first_step = [], None
    for it in range(1, iterations + 1):
        w = [load_file(str(out / "divergence" / method / f"t{t}" / "checkpoints" / f"iter_{it:06d}" /
                           "model.safetensors")) for t in (1, 2)]
        dist = torch.sqrt(sum(((w[0][k].double() - w[1][k].double()) ** 2).sum() for k in w[0])).item()
        moved = torch.sqrt(sum(((w[0][k].double() - base[k].double()) ** 2).sum() for k in base)).item()
        first_step = first_step or moved
        h1, h2 = histories[1][it], histories[2][it]
        rows.append({"iteration": it, "distance": dist, "relative": dist / norm, "per_first_update": dist / first_step,
                     "moved": moved, "success_t1": h1.get("rollout/success_once"),
                     "success_t2": h2.get("rollout/success_once"),
                     "value_loss_t1": h1.get("losses/value"), "value_loss_t2": h2.get("losses/value")})
    return rows


def divergence_table(rows: list[dict], method: str) -> str:
    lines = [f"### {LABELS[method]}", "", "| iteration | weight distance (1 vs 2 threads) | / weight norm | "
             "/ first update's step | distance moved from SFT | rollout success 1 / 2 threads |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['iteration']} | {r['distance']:.3g} | {r['relative']:.2g} | {r['per_first_update']:.2g} | "
                     f"{r['moved']:.3g} | {r['success_t1']:.3f} / {r['success_t2']:.3f} |")
    return "\n".join(lines)


def table(results: list[dict], methods: list[str]) -> str:
    """One summary row per method and thread count (and over all thread counts, when there are several),
    then one row per run."""
    lines = ["| method | threads | runs | SFT | after RL: min / median / max | lift: min / median / max | "
             f"runs with lift ≥ +{TARGET:.2f} | env-steps per run (median) | CPU s per run (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        threads = sorted({r["threads"] for r in rs})
        groups = [(str(t), [r for r in rs if r["threads"] == t]) for t in threads]
        if len(threads) > 1:
            groups.append(("all", rs))
        for label, group in groups:
            sft = " / ".join(f"{s:.3f}" for s in sorted({r["sft"] for r in group}))
            after, lift = [r["after"] for r in group], [r["lift"] for r in group]
            ok = sum(x >= TARGET - 1e-9 for x in lift)
            cpu = [r["cpu_seconds"] for r in group if math.isfinite(r["cpu_seconds"])]  # NaN: a resumed run's
            cpu_text = f"{statistics.median(cpu):.0f}" if cpu else "-"
            steps = [r["env_steps"] for r in group if "env_steps" in r]   # runs recorded before the column: -
            steps_text = f"{statistics.median(steps):,.0f}" if steps else "-"
            lines.append(f"| {LABELS[m]} | {label} | {len(group)} | {sft} | {min(after):.3f} / "
                         f"{statistics.median(after):.3f} / {max(after):.3f} | {min(lift):+.3f} / "
                         f"{statistics.median(lift):+.3f} / {max(lift):+.3f} | {ok} / {len(group)} | {steps_text} | "
                         f"{cpu_text} |")
    lines += ["", "| method | threads | seed | SFT | after RL | lift | evaluations during RL (iteration: success) |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (methods.index(r["method"]), r["threads"], r["seed"])):
        evals = ", ".join(f"{i}: {s:.2f}" for i, s in r["evals"])
        lines.append(f"| {LABELS[r['method']]} | {r['threads']} | {r['seed']} | {r['sft']:.3f} | {r['after']:.3f} | "
                     f"{r['lift']:+.3f} | {evals} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="noise,sde")
    p.add_argument("--seeds", default="0,1,2,3,4", help="RL seeds")
    p.add_argument("--threads", default="1,2", help="torch thread counts")
    p.add_argument("--iterations", type=int, help="RL iterations (default: the demo's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the RL stage")
    p.add_argument("--out", default="runs/bench_robustness")
    p.add_argument("--model", default="tiny", help="the policy preset (configs/model), e.g. tiny_smolvla; give each "
                                                    "its own --out")
    p.add_argument("--report", action="store_true", help="run nothing: tabulate the finished runs")
    p.add_argument("--divergence", type=int, metavar="N",
                   help="instead: N iterations on 1 and 2 threads from one SFT policy, their weights' distance")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in PRESETS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {list(PRESETS)}")
    demo = DemoConfig(model=args.model)
    iterations = args.iterations or demo.rl_iterations
    extra = parse_overrides(args.set)
    if args.divergence:
        sft, _ = sft_for(out, 1, demo)
        text = "\n\n".join(divergence_table(divergence(out, m, args.divergence, sft, demo, extra), m) for m in methods)
        (out / "divergence.md").write_text(text + "\n")
        print(text)
        return
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for method in methods:
            for seed in [int(s) for s in args.seeds.split(",")]:
                record = out / method / f"t{threads}_s{seed}" / "result.json"
                if args.report:
                    if record.is_file():
                        results.append(json.loads(record.read_text()))
                    continue
                sft, sft_success = sft_for(out, threads, demo)
                r = rl_run(out, method, threads, seed, sft, sft_success, demo, iterations, extra)
                results.append(r)
                print(f"{method} threads={threads} seed={seed}: SFT {r['sft']:.3f} -> {r['after']:.3f} "
                      f"(lift {r['lift']:+.3f}; {r['seconds']:.0f} s, {r['cpu_seconds']:.0f} CPU s)", flush=True)
    text = table(results, methods)
    (out / "table.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
