"""benchmarks/bench_robustness.py: the table reads the lift's distribution as documented, a finished run is
not run again, and --report tabulates what is on disk without training."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_robustness", ROOT / "benchmarks" / "bench_robustness.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules["bench_robustness"] = bench
SPEC.loader.exec_module(bench)


def result(threads, seed, sft, after, method="sde"):
    return {"method": method, "threads": threads, "seed": seed, "iterations": 80, "env_steps": 160_000 + seed,
            "sft": sft, "after": after,
            "lift": after - sft, "seconds": 10.0, "cpu_seconds": 100.0 + seed, "overrides": {},
            "evals": [(0, sft), (80, after)]}


def test_table_gives_min_median_max_of_the_lift_and_the_runs_on_target():
    rs = [result(1, 0, 0.48, 0.70), result(1, 1, 0.48, 0.60), result(2, 0, 0.50, 0.80)]
    lines = bench.table(rs, ["sde"]).splitlines()
    assert lines[2:5] == [
        "| Flow-SDE PPO | 1 | 2 | 0.480 | 0.600 / 0.650 / 0.700 | +0.120 / +0.170 / +0.220 | 1 / 2 | 160,000 | 100 |",
        "| Flow-SDE PPO | 2 | 1 | 0.500 | 0.800 / 0.800 / 0.800 | +0.300 / +0.300 / +0.300 | 1 / 1 | 160,000 | 100 |",
        "| Flow-SDE PPO | all | 3 | 0.480 / 0.500 | 0.600 / 0.700 / 0.800 | +0.120 / +0.220 / +0.300 | 2 / 3 | 160,000 "
        "| 100 |",
    ], lines[2:5]
    per_run = [line for line in lines if line.startswith("| Flow-SDE PPO | ")][3:]
    assert [line.split(" | ")[1:3] for line in per_run] == [["1", "0"], ["1", "1"], ["2", "0"]]
    assert "0: 0.48, 80: 0.70" in per_run[0]


def test_a_finished_run_is_read_not_rerun(tmp_path):
    run = tmp_path / "sde" / "t1_s3"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps(result(1, 3, 0.5, 0.75)))
    # an SFT path that does not exist: any attempt to train would fail
    r = bench.rl_run(tmp_path, "sde", 1, 3, tmp_path / "missing", 0.5, bench.DemoConfig(), 80, {})
    assert r["after"] == 0.75


def test_report_tabulates_the_runs_on_disk(tmp_path, monkeypatch, capsys):
    for threads, seed, after in [(1, 0, 0.7), (2, 1, 0.9)]:
        run = tmp_path / "sde" / f"t{threads}_s{seed}"
        run.mkdir(parents=True)
        (run / "result.json").write_text(json.dumps(result(threads, seed, 0.5, after)))
    monkeypatch.setattr(sys, "argv", ["bench_robustness.py", "--methods", "sde", "--seeds", "0,1",
                                      "--out", str(tmp_path), "--report"])
    bench.main()
    text = (tmp_path / "table.md").read_text()
    assert "| Flow-SDE PPO | all | 2 | 0.500 | 0.700 / 0.800 / 0.900 | +0.200 / +0.300 / +0.400 | 2 / 2 |" in text
    assert text.strip() in capsys.readouterr().out


def test_cpu_time_median_skips_unknown_values():
    rs = [result(1, 0, 0.5, 0.7), result(1, 1, 0.5, 0.6)]
    rs[1]["cpu_seconds"] = float("nan")   # a run finished from a checkpoint: its whole CPU time is unknown
    assert bench.table(rs, ["sde"]).splitlines()[2].endswith("| 1 / 2 | 160,000 | 100 |")   # the median of one value
    for r in rs:   # runs recorded before the env-steps column: "-"
        del r["env_steps"]
    assert bench.table(rs, ["sde"]).splitlines()[2].endswith("| 1 / 2 | - | 100 |")
