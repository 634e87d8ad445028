"""benchmarks/bench_libero_expert.py: the expert table's layout and the reasons it lists (known reports in, text out),
and the resumable per-task loop (a saved task is not run again)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_libero_expert", ROOT / "benchmarks" / "bench_libero_expert.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def report(task, succeeded, tried, length=100.0, failed=None, unsupported=None):
    return {"task_id": task, "instruction": f"task {task}", "tried": tried, "succeeded": succeeded,
            "success_rate": succeeded / max(1, tried), "failed": failed or {},
            "mean_length": length if succeeded else None, "unsupported": unsupported}


def test_table_counts_tasks_at_90_percent_and_names_the_rest():
    reports = {"libero_goal": [report(0, 20, 20), report(1, 17, 20, failed={
                   "3": "step limit (300 steps) in primitive 1/1, phase lower",
                   "5": "step limit (300 steps) in primitive 1/1, phase lower",
                   "9": "the expert gave up (grasps did not hold)"})],
               "libero_10": [report(0, 0, 1, unsupported="unsupported goal: no primitive for ['close', 'microwave_1']"),
                             report(1, 18, 20)]}
    text = bench.table(reports)
    lines = text.splitlines()
    assert lines[0] == "| task | Goal | LIBERO-10 |"
    assert lines[2] == "| 0 | 20 / 20 (100) | no plan |" and lines[3] == "| 1 | 17 / 20 (100) | 18 / 20 (100) |"
    assert "| tasks at ≥ 90 % | **1 / 2** | **1 / 2** |" in text
    assert "- Goal 1 (task 1): step limit in primitive 1/1, phase lower (2 of 3)" in text
    reports["libero_goal"][1]["failed"] = {"1": "the expert gave up (grasps did not hold)"}
    assert "- Goal 1 (task 1): the expert gave up (grasps did not hold) (1 of 1)" in bench.table(reports)
    assert "- LIBERO-10 0 (task 0): unsupported goal" in text


def test_a_saved_task_is_not_run_again(tmp_path, monkeypatch, capsys):
    saved = {"init_states": 2, "report": [report(t, 2, 2) for t in range(9)], "cpu_s": 1.0}
    (tmp_path / "libero_goal.json").write_text(json.dumps(saved))
    ran = []
    monkeypatch.setattr(bench, "run_task", lambda suite, task, n: ran.append(task) or report(task, 1, 2))
    monkeypatch.setattr(sys, "argv", ["x", "--suites", "libero_goal", "--init-states", "2", "--out", str(tmp_path)])
    bench.main()
    assert ran == [9]
    assert len(json.loads((tmp_path / "libero_goal.json").read_text())["report"]) == 10
    assert "**9 / 10**" in (tmp_path / "table.md").read_text()
