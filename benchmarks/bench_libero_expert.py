"""The scripted LIBERO expert's success per task, over the four suites LIBERO is reported on: one command for the
expert table of RESULTS.md.

    python benchmarks/bench_libero_expert.py [--suites libero_spatial,libero_object,libero_goal,libero_10]
                                             [--init-states 50] [--out runs/libero_expert] [--report]

Each task runs the expert (``vla-rl collect libero ... policy=expert``'s episode, state only) from its fixed init
states 0 .. N-1 at the suite's official step limit; a goal the expert has no primitive for is tried once and
reported with its reason. Every suite's report is saved as ``<out>/<suite>.json`` after each task and a finished
task is not run again, so the command can be stopped and restarted (``--report``: tabulate what is done).
``table.md`` (printed too) holds one row per task id and a column per suite: successes / init states tried (mean
length of the successful episodes), then every task below 90 % with the most common reason of its failures.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
NAMES = {"libero_spatial": "Spatial", "libero_object": "Object", "libero_goal": "Goal", "libero_10": "LIBERO-10"}


def run_task(suite: str, task: int, init_states: int) -> dict:
    from vla_rl.data.libero_demos import LiberoRecordConfig, record_libero_episodes

    cfg = LiberoRecordConfig(suite=suite, task_ids=[task], episodes_per_task=init_states, max_tries=init_states,
                             policy="expert", cameras=[], state_mode="robot+objects", threads=1)
    report: list[dict] = []
    try:
        record_libero_episodes(cfg, progress=False, log=lambda *_: None, report=report)
    except RuntimeError:   # no episode succeeded: the report still says why
        pass
    return report[0]


def reason(r: dict) -> str:
    if r.get("unsupported"):
        return r["unsupported"]
    if not r["failed"]:
        return ""
    # "step limit (300 steps) in primitive 1/2, phase lower" -> counted without the step count
    kinds = Counter(re.sub(r" \(\d+ steps\)", "", why) for why in r["failed"].values())
    text, n = kinds.most_common(1)[0]
    return f"{text} ({n} of {len(r['failed'])})"


def table(reports: dict[str, list[dict]]) -> str:
    """One row per task id, one column per suite: successes / init states tried (mean length of the successful
    episodes); then each suite's tasks at >= 90 %, and the reason of every task below it."""
    suites = list(reports)
    by_id = {s: {r["task_id"]: r for r in reports[s]} for s in suites}
    lines = ["| task | " + " | ".join(NAMES[s] for s in suites) + " |", "|---" * (len(suites) + 1) + "|"]

    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        if r.get("unsupported"):
            return "no plan"
        length = f" ({r['mean_length']:.0f})" if r["mean_length"] is not None else ""
        return f"{r['succeeded']} / {r['tried']}{length}"

    for task in range(10):
        lines.append(f"| {task} | " + " | ".join(cell(by_id[s].get(task)) for s in suites) + " |")
    good = [sum(1 for r in reports[s] if not r.get("unsupported") and r["tried"]
                and r["succeeded"] / r["tried"] >= 0.9) for s in suites]
    lines.append("| tasks at ≥ 90 % | " + " | ".join(f"**{g} / {len(reports[s])}**" for g, s in zip(good, suites))
                 + " |")
    notes = [f"- {NAMES[s]} {r['task_id']} ({r['instruction']}): {reason(r)}" for s in suites for r in reports[s]
             if r.get("unsupported") or (r["tried"] and r["succeeded"] / r["tried"] < 0.9)]
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default=",".join(SUITES))
    p.add_argument("--init-states", type=int, default=50, help="fixed init states per task (LIBERO ships 50)")
    p.add_argument("--out", default="runs/libero_expert")
    p.add_argument("--report", action="store_true", help="run nothing: tabulate the tasks done so far")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for suite in args.suites.split(","):
        if suite not in SUITES:
            p.error(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
        path = out / f"{suite}.json"
        saved = json.loads(path.read_text()) if path.is_file() else None
        if saved is None or saved["init_states"] != args.init_states:
            saved = {"init_states": args.init_states, "report": [], "cpu_s": 0.0}
        done = {r["task_id"] for r in saved["report"]}
        for task in range(10):
            if task in done or args.report:
                continue
            t0 = time.process_time()
            saved["report"].append(run_task(suite, task, args.init_states))
            saved["cpu_s"] = round(saved["cpu_s"] + time.process_time() - t0, 1)
            path.write_text(json.dumps(saved, indent=1))   # after every task: a stopped run resumes there
        saved["report"].sort(key=lambda r: r["task_id"])
        print(f"{suite}: {len(saved['report'])} tasks, {sum(r['succeeded'] for r in saved['report'])} / "
              f"{sum(r['tried'] for r in saved['report'])} episodes succeeded ({saved['cpu_s']} CPU s)", flush=True)
        reports[suite] = saved["report"]
    text = table(reports)
    (out / "table.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
