"""Every GPU check in one script, for one CUDA GPU and ~8 minutes: the `gpu` tests, the `pi0` preset's targets
(bench_gpu.py: a chunk at batch 1 <= 50 ms with bf16 weights and the graphed denoising loop; batch 64 within
1.3 x the prefix alone; one PPO update of 64 samples fitting 80 GB, training everything, the expert only and LoRA,
beside the memory plan), the colocated 320-env rollout and update (bench_train.py, `small` policy, bf16), and the
LIBERO worlds on MuJoCo Warp (benchmarks/bench_libero_warp.py). It writes what each step printed, its command, exit
status and time into one markdown file (default runs/gpu_acceptance/results.md) whose tables go into
benchmarks/RESULTS.md.

    python benchmarks/gpu_acceptance.py [--out runs/gpu_acceptance] [--only tests,bench_gpu,...] [--budget-s 480]
    python benchmarks/gpu_acceptance.py --smoke      # CPU, tiny sizes, seconds: checks the script, no numbers

Each step runs as its own process with a time limit (a step over it is stopped and marked so; the next starts); the
limits add up to the budget. Without CUDA (and without --smoke) it refuses with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    name: str
    what: str                  # the RESULTS.md row or table it fills
    argv: list[str]            # run from the repository root, with this checkout on PYTHONPATH
    limit_s: int
    optional_file: str = ""    # a script another issue adds: the step is skipped (and said so) while it is absent


def gpu_steps(py: str) -> list[Step]:
    return [
        Step("tests", "`pytest -m gpu` (policy, envs, rollouts, trainer, CUDA-graph loop on the device)",
             [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"], 130),
        Step("bench_gpu", "bench_gpu.py: pi0 chunk latency (batch 1, batch 64 vs prefix), PPO update memory "
             "(full, freeze_prefix, LoRA r=16) against the memory plan",
             [py, "benchmarks/bench_gpu.py", "--modes", "none,cudagraph", "--repeats", "5", "--checkpointing", "all",
              "--methods", "noise", "--train", "full,freeze_prefix,lora", "--plan"], 210),
        Step("bench_train", "bench_train.py: the colocated 320-env rollout and update on one GPU (small policy, bf16)",
             [py, "benchmarks/bench_train.py", "--device", "cuda", "--envs", "320", "--model", "small", "--bf16",
              "--repeats", "2"], 60),
        Step("bench_libero_warp", "bench_libero_warp.py: LIBERO scenes on MuJoCo Warp on the GPU",
             [py, "benchmarks/bench_libero_warp.py", "--device", "cuda"], 80,
             optional_file="benchmarks/bench_libero_warp.py"),
    ]


def smoke_steps(py: str) -> list[Step]:
    return [
        Step("tests", "`pytest -m gpu` (collected and skipped without CUDA)",
             [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"], 120),
        Step("bench_gpu", "bench_gpu.py --smoke", [py, "benchmarks/bench_gpu.py", "--smoke", "--skip", "batch",
                                                   "--checkpointing", "all", "--methods", "noise", "--train", "lora"],
             120),
        Step("bench_train", "bench_train.py on the CPU, tiny sizes",
             [py, "benchmarks/bench_train.py", "--device", "cpu", "--envs", "4", "--chunks", "1", "--epochs", "1",
              "--minibatches", "1", "--repeats", "1", "--num-steps", "2", "--threads", "1"], 120),
        Step("bench_libero_warp", "bench_libero_warp.py --smoke (one world on the CPU)",
             [py, "benchmarks/bench_libero_warp.py", "--smoke"], 120, optional_file="benchmarks/bench_libero_warp.py"),
    ]


def run_step(step: Step, env: dict) -> dict:
    if step.optional_file and not (ROOT / step.optional_file).is_file():
        return {"status": f"skipped: {step.optional_file} is not in this checkout", "rc": None, "seconds": 0.0,
                "output": ""}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.limit_s)
        rc, output = proc.returncode, proc.stdout + (("\n" + proc.stderr) if proc.returncode else "")
        status = "ok" if rc == 0 else f"failed (exit status {rc})"
    except subprocess.TimeoutExpired as e:
        rc, status = None, f"stopped at its {step.limit_s} s limit"
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return {"status": status, "rc": rc, "seconds": time.perf_counter() - t0, "output": output}


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        return (f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    return f"CPU (smoke test: no GPU figures), torch {torch.__version__}"


def report(steps: list[Step], results: list[dict], header: str) -> str:
    lines = [f"# GPU acceptance: {header}", "", "| step | what | status | seconds |", "|---|---|---|---|"]
    for step, r in zip(steps, results):
        lines.append(f"| {step.name} | {step.what} | {r['status']} | {r['seconds']:.0f} |")
    for step, r in zip(steps, results):
        lines += ["", f"## {step.name}", "", "```bash", " ".join(shlex.quote(a) for a in step.argv), "```", ""]
        tail = r["output"].strip().splitlines()[-60:]
        lines += tail if tail else ["(no output)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_acceptance", help="folder for results.md")
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--budget-s", type=int, default=480, help="stop starting steps once this much time has passed")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script, no GPU figures")
    args = p.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_acceptance.py runs the GPU checks and needs a CUDA device, but torch.cuda.is_available() is False; "
              "--smoke checks the script on the CPU", file=sys.stderr)
        return 2
    py = sys.executable
    steps = smoke_steps(py) if args.smoke else gpu_steps(py)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            print(f"unknown step(s) {sorted(unknown)}; steps: {[s.name for s in steps]}", file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in wanted]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.smoke:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    started, results = time.perf_counter(), []
    for step in steps:
        left = args.budget_s - (time.perf_counter() - started)
        if left <= 0:
            results.append({"status": "not run: the time budget was spent", "rc": None, "seconds": 0.0, "output": ""})
            continue
        step.limit_s = int(min(step.limit_s, max(left, 1)))
        print(f"[{step.name}] {' '.join(step.argv[1:])}", flush=True)
        results.append(run_step(step, env))
        print(f"[{step.name}] {results[-1]['status']} ({results[-1]['seconds']:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(steps, results, device_line())
    (out / "results.md").write_text(text)
    print(f"wrote {out / 'results.md'}")
    return 0 if all(r["rc"] == 0 or r["rc"] is None and r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
