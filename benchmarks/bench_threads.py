"""Seconds per built-in RL iteration with 1 torch thread, with every core, and with ``threads=auto``, on the
machine as it is (idle or shared): the measurement behind ``threads: auto`` (vla_rl/core/threads.py).

    python benchmarks/bench_threads.py [--settings 1,all,auto] [--rounds 3] [--iterations 3]

Each round runs every setting once, in turn, each in a fresh process (so ``auto`` looks at the machine as a
new command would): a ``vla-rl train builtin_flow_sde`` run from a fresh ``tiny`` policy (the demo's
iteration: 64 envs, 4 chunks of 8 actions, Flow-SDE K=4, 2 epochs x 8 minibatches), ``--iterations`` timed
iterations between a warm-up one and a last one (which also evaluates and saves). ``all`` is every core this
process may use (as torch does by default). Prints a line per run as it ends, then, per setting, the threads it
ran with, the median seconds per iteration (min-max over rounds; each round's value is the median of its
iterations), the process's CPU seconds per iteration, and the load: the 1-minute load average at each run's
start (min-max) and the cores other processes kept busy when ``auto`` looked (min-max). Wall-clock on a shared
machine: compare settings within one run of this script, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(setting: str, iterations: int) -> None:
    """One run: print a JSON line with the threads used and the per-iteration wall and CPU seconds."""
    import torch

    from vla_rl.core.threads import available_cores, measured_busy_cores
    from vla_rl.presets import load_preset
    from vla_rl.train.trainer import TrainConfig, Trainer

    load = os.getloadavg()[0]
    busy = measured_busy_cores()   # what `auto` sees (the trainer reuses this measurement)
    threads = available_cores() if setting == "all" else (setting if setting == "auto" else int(setting))
    times: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as out:
        cfg = load_preset(TrainConfig, "experiment", "builtin_flow_sde", {
            "init": None, "model": "tiny", "iterations": iterations + 2, "eval_every": 10_000, "eval_episodes": 8,
            "threads": threads, "tensorboard": False, "progress": False, "save_every": 10_000, "out": out})

        last = [time.perf_counter(), time.process_time()]

        def log(line: str) -> None:   # one summary line per iteration, and a few others
            if line.startswith("iter"):
                now = (time.perf_counter(), time.process_time())
                times.append((now[0] - last[0], now[1] - last[1]))
                last[:] = now

        with Trainer(cfg, log=log) as trainer:
            used = torch.get_num_threads()
            last[:] = [time.perf_counter(), time.process_time()]
            trainer.run()
    # the first timed iteration warms up; the last one also evaluates and saves
    body = times[1:-1] or times
    print(json.dumps({"setting": setting, "threads": used, "load1": load, "busy": busy,
                      "wall": statistics.median(t for t, _ in body), "cpu": statistics.median(c for _, c in body)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="1,all,auto", help="comma-separated: a number, 'all' or 'auto'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per run (after one warm-up)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.iterations)
    settings = args.settings.split(",")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    rows: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            out = subprocess.run([sys.executable, __file__, "--worker", s, "--iterations", str(args.iterations)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            rows[s].append(json.loads(out.strip().splitlines()[-1]))
            row = rows[s][-1]
            print(f"round {r + 1} {s}: {row['threads']} thread(s), {row['wall']:.2f} s/iteration, "
                  f"load {row['load1']:.2f}, busy {row['busy']:.2f}", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} cores, built-in iteration (builtin_flow_sde, tiny, 64 envs), {args.rounds} rounds x "
          f"{args.iterations} iterations\n")
    print("| threads setting | threads used | s / iteration, median (min-max) | CPU s / iteration | "
          "load average at start | cores busy elsewhere (auto's view) |")
    print("|---|---|---|---|---|---|")
    for s, rs in rows.items():
        w = [x["wall"] for x in rs]
        used = sorted({x["threads"] for x in rs})
        print(f"| {s} | {', '.join(map(str, used))} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) "
              f"| {statistics.median(x['cpu'] for x in rs):.2f} "
              f"| {min(x['load1'] for x in rs):.2f}-{max(x['load1'] for x in rs):.2f} "
              f"| {min(x['busy'] for x in rs):.2f}-{max(x['busy'] for x in rs):.2f} |")


if __name__ == "__main__":
    main()
