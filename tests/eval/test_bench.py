"""`vla-rl bench`: suites, the per-task results and their summary (known answers), resume, the ManiSkill bench
of a state policy at toy size, and `--compare` (episode-paired, per task)."""

import json
import math
import os

import numpy as np
import pytest
from helpers import SKIP_SIMULATORS as SKIP

from vla_rl.checkpoint.policy import save_policy
from vla_rl.cli import main
from vla_rl.core.ranges import ConfigError
from vla_rl.eval.bench import (
    RESULT_FORMAT,
    BenchError,
    binomial_se,
    compare_benches,
    suite_names,
    summarize_bench,
)
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset


def test_suite_names():
    assert suite_names("libero_4") == ("libero", ["libero_spatial", "libero_object", "libero_goal", "libero_10"])
    assert suite_names("libero_90") == ("libero", ["libero_90"])
    assert suite_names("maniskill:PickCube-v1, PushCube-v1") == ("maniskill", ["PickCube-v1", "PushCube-v1"])
    sim, tasks = suite_names("maniskill:mp")
    assert sim == "maniskill" and "PickCube-v1" in tasks and "StackCube-v1" in tasks
    for bad in ("libero_100", "maniskill:", "pickcube"):
        with pytest.raises(ConfigError):
            suite_names(bad)


def test_summary_known_answer():
    assert binomial_se(3, 4) == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert binomial_se(0, 10) == 0.0
    tasks = [{"suite": "libero_goal", "task": "0", "instruction": "a", "episodes": 4, "successes": 3},
             {"suite": "libero_goal", "task": "1", "instruction": "b", "episodes": 4, "successes": 1},
             {"suite": "libero_10", "task": "0", "instruction": "c", "episodes": 4, "successes": 4}]
    for t in tasks:
        t["success_rate"], t["se"] = t["successes"] / 4, binomial_se(t["successes"], 4)
    s = summarize_bench(tasks)
    assert s["suites"]["libero_goal"] == {"tasks": 2, "episodes": 8, "successes": 4, "success_rate": 0.5,
                                          "se": pytest.approx(math.sqrt(0.25 / 8))}
    assert s["suites"]["libero_10"]["success_rate"] == 1.0
    assert s["average"] == 0.75          # mean over suites, as LIBERO papers report


def _task_file(root, suite, task, outcomes):
    path = root / "tasks" / suite / f"{task}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [{"episode_seed": i, "success_once": float(o)} for i, o in enumerate(outcomes)]
    path.write_text(json.dumps({"format": RESULT_FORMAT, "suite": suite, "task": task, "records": recs}))


def test_compare_pairs_episodes_per_task(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _task_file(a, "libero_goal", "0", [0, 0, 1, 1])
    _task_file(b, "libero_goal", "0", [1, 1, 1, 0])   # two wins, one loss
    _task_file(a, "libero_goal", "1", [0, 0])
    _task_file(b, "libero_goal", "1", [1, 1])         # two wins
    _task_file(a, "libero_goal", "2", [1])            # only in a
    cmp = compare_benches(a, b)
    rows = {r["task"]: r for r in cmp["tasks"]}
    assert rows["libero_goal/0"]["diff"] == pytest.approx(0.25)
    assert (rows["libero_goal/0"]["new_better"], rows["libero_goal/0"]["base_better"]) == (2, 1)
    assert rows["libero_goal/1"]["diff"] == 1.0 and rows["libero_goal/1"]["sign_test_p"] == 0.5
    assert cmp["pooled"]["n"] == 6 and cmp["pooled"]["diff"] == pytest.approx(3 / 6)
    assert (cmp["pooled"]["new_better"], cmp["pooled"]["base_better"]) == (4, 1)
    assert cmp["only_base"] == ["libero_goal/2"]
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| libero_goal/1 | 0.000 | 1.000 | +100.0 ±" in out and "**pooled**" in out and "libero_goal/2" in out
    with pytest.raises(BenchError, match="no bench results"):
        compare_benches(a, tmp_path / "nothing")


def test_compare_says_when_benches_are_not_like_for_like(tmp_path, capsys):
    """Different episode counts, step limits or settings are named, with the number of episodes paired."""
    a, b = tmp_path / "a", tmp_path / "b"
    _task_file(a, "maniskill", "PickCube-v1", [0, 1, 0, 1])
    _task_file(b, "maniskill", "PickCube-v1", [1, 1])
    _task_file(a, "maniskill", "PushCube-v1", [0, 0, 1])
    _task_file(b, "maniskill", "PushCube-v1", [1, 1, 1])
    for root, limit, execute in ((a, 150, None), (b, 50, 4)):
        for p in (root / "tasks" / "maniskill").glob("*.json"):
            doc = json.loads(p.read_text())
            doc.update(max_episode_steps=limit, identity={"num_steps": 4, "execute": execute, "seed": 10_000,
                                                          "episodes": len(doc["records"]), "env": {}})
            p.write_text(json.dumps(doc))
    cmp = compare_benches(a, b)
    assert [r["n"] for r in cmp["tasks"]] == [2, 3] and cmp["pooled"]["n"] == 5
    notes = " | ".join(cmp["notes"])
    assert "maniskill/PickCube-v1: 4 episodes in the base bench, 2 in the new; 2 paired (same episode seed)" in notes
    assert "PushCube-v1: 3 episodes" not in notes
    assert "maniskill/PushCube-v1: different episode step limits (base 150, new 50)" in notes
    assert "maniskill/PickCube-v1: other settings differ: execute (base None, new 4)" in notes
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| episodes paired |" in out and "| **pooled** |" in out
    assert "Not like for like:" in out and "2 paired" in out
    same = compare_benches(a, a)
    assert same["notes"] == []


def test_a_bench_run_from_python_records_the_command_that_repeats_it():
    from vla_rl.core.schema import from_dict
    from vla_rl.eval.bench import BenchConfig, bench_markdown, equivalent_command
    from vla_rl.presets import parse_overrides

    cfg = BenchConfig(suite="maniskill:PickCube-v1", tasks=["PickCube-v1"], episodes=2, progress=False,
                      env={"max_episode_steps": 8}, out="runs/my bench")
    line = equivalent_command("runs/p", cfg)
    assert line == ("vla-rl bench runs/p --suite maniskill:PickCube-v1 'tasks=[\"PickCube-v1\"]' episodes=2 "
                    "'out=runs/my bench' env.max_episode_steps=8 progress=false")
    import shlex

    words = shlex.split(line)
    assert from_dict(BenchConfig, {**parse_overrides(words[5:]), "suite": words[4]}) == cfg
    assert equivalent_command("p", BenchConfig(suite="libero_10")) == "vla-rl bench p --suite libero_10"
    summary = {"checkpoint": "runs/p", "weights_sha256": "ab", "command": line, "tasks": [], "suites": {},
               "average": float("nan")}
    assert "`None`" not in bench_markdown(summary) and f"command: `{line}`" in bench_markdown(summary)


@pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
def test_maniskill_bench_of_a_state_policy(tmp_path, capsys):
    """A PickCube state policy (42 state dims) on PickCube and PushCube (35 dims: skipped, with the reason), two
    episodes, a truncated episode limit; a second run resumes and keeps the finished task. DrawSVG-v1, whose
    scene needs svgpathtools, is skipped with its reason where that is not installed."""
    cfg = policy_preset("tiny", {"num_cameras": 0, "state_dim": 48, "action_dim": 7, "depth": 1})
    norm = NormStats(Stats.identity(42), Stats.identity(7))
    ckpt = save_policy(tmp_path / "policy", FlowPolicy(cfg), norm, meta={
        "env_config": {"kind": "maniskill", "maniskill": {"task": "PickCube-v1", "max_episode_steps": 8}}})
    out = tmp_path / "bench"
    common = ["episodes=2", "workers=1", "execute=4", "videos=1", f"out={out}", "progress=false"]
    assert main(["bench", str(ckpt), "--suite", "maniskill:PickCube-v1", *common]) == 0
    assert main(["bench", str(ckpt), "--suite", "maniskill:PickCube-v1,PushCube-v1,DrawSVG-v1", *common]) == 0
    printed = capsys.readouterr().out
    assert "maniskill/PickCube-v1: done earlier, kept" in printed
    res = json.loads((out / "results.json").read_text())
    assert [(t["task"], t["episodes"]) for t in res["tasks"]] == [("PickCube-v1", 2)]
    skip, svg = res["skipped"]
    assert skip["task"] == "maniskill/PushCube-v1" and "state/action dims 42/7, the env has 35/7" in skip["reason"]
    assert svg["task"] == "maniskill/DrawSVG-v1"
    try:
        import svgpathtools  # noqa: F401
    except ImportError:
        assert svg["reason"].startswith("its env did not start: ManiSkillUnavailable: ManiSkill task DrawSVG-v1 "
                                        "needs a package that is not installed (svgpathtools")
    assert f"Skipped maniskill/DrawSVG-v1: {svg['reason']}" in (out / "results.md").read_text()
    doc = json.loads((out / "tasks" / "maniskill" / "PickCube-v1.json").read_text())
    assert [r["episode_seed"] for r in doc["records"]] == [10_000, 10_001] and doc["max_episode_steps"] == 8
    assert all(1 <= r["length"] <= 8 for r in doc["records"])
    assert (out / doc["records"][0]["video"]).stat().st_size > 0
    header = "suite,task,instruction,episodes,successes,success_rate,se"
    assert (out / "results.csv").read_text().splitlines()[0] == header
    assert "pick up the red cube" in (out / "results.md").read_text()
    # Same policy, same settings, another folder: the episodes pair one to one and nothing differs.
    assert main(["bench", str(ckpt), "--suite", "maniskill:PickCube-v1",
                 *[c if not c.startswith("out=") else f"out={tmp_path / 'again'}" for c in common]]) == 0
    cmp = compare_benches(out, tmp_path / "again")
    assert [r["task"] for r in cmp["tasks"]] == ["maniskill/PickCube-v1"]
    assert cmp["tasks"][0]["diff"] == 0.0 and cmp["tasks"][0]["n"] == 2


@pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
def test_a_smolvla_benches_like_any_policy(tmp_path):
    """bench knows no architecture: a state-only SmolVLA runs the ManiSkill protocol and writes its results."""
    from vla_rl.policies.architectures import make_policy

    cfg = policy_preset("tiny_smolvla", {"num_cameras": 0, "state_dim": 40, "action_dim": 7, "depth": 2})
    ckpt = save_policy(tmp_path / "policy", make_policy(cfg), NormStats(Stats.identity(35), Stats.identity(7)),
                       meta={"env_config": {"kind": "maniskill",
                                            "maniskill": {"task": "PushCube-v1", "max_episode_steps": 8}}})
    out = tmp_path / "bench"
    assert main(["bench", str(ckpt), "--suite", "maniskill:PushCube-v1", "episodes=2", "workers=1", "execute=4",
                 f"out={out}", "progress=false"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(t["task"], t["episodes"]) for t in res["tasks"]] == [("PushCube-v1", 2)]


@pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
@pytest.mark.slow   # two ManiSkill workers and their first renderings; the bench test above covers videos=1 fast
def test_eval_records_maniskill_videos_of_a_state_policy(tmp_path):
    """`vla-rl eval videos=N` on ManiSkill with state observations: the frames are renderings of ManiSkill's
    human-view camera (render_size), one per chunk, named by episode seed and outcome."""
    import imageio.v2 as imageio

    cfg = policy_preset("tiny", {"num_cameras": 0, "state_dim": 48, "action_dim": 7, "depth": 1})
    ckpt = save_policy(tmp_path / "policy", FlowPolicy(cfg), NormStats(Stats.identity(42), Stats.identity(7)),
                       meta={"env_config": {"kind": "maniskill", "maniskill": {"task": "PickCube-v1"}}})
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "episodes=2", "num_envs=2", "execute=4", "videos=1", f"out={out}",
                 "env.maniskill.max_episode_steps=12", "env.maniskill.render_size=64", "progress=false"]) == 0
    first, second = json.loads(out.read_text())["episodes"]
    assert "video" not in second and first["length"] == 12
    assert first["video"] == str(tmp_path / "eval" / f"ep10000_{'success' if first['success_once'] else 'failure'}.mp4")
    frames = imageio.mimread(first["video"])
    # the reset and the three chunks, each held twice (2 s at 4 fps), enlarged from 64 to 256 px for viewing; the
    # last frame is the episode's final state, rendered before its reset
    assert len(frames) == 8 and frames[0].shape == (256, 256, 3) and frames[0].std() > 10   # a scene, not a blank
    assert all(f.std() > 10 for f in frames) and not np.array_equal(frames[-1], frames[0])


def test_eval_records_videos_of_the_first_episodes(tmp_path, capsys):
    cfg = policy_preset("tiny")
    ckpt = save_policy(tmp_path / "policy", FlowPolicy(cfg), NormStats(Stats.identity(4), Stats.identity(2)),
                       meta={"env_config": {"kind": "builtin"}})
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "episodes=6", "num_envs=3", "videos=2", f"out={out}", "video_format=gif"]) == 0
    eps = json.loads(out.read_text())["episodes"]
    videos = [e.get("video") for e in eps]
    assert all(v is not None for v in videos[:2]) and not any(videos[2:])
    for e in eps[:2]:
        tag = "success" if e["success_once"] else "failure"
        assert e["video"].endswith(f"eval/ep{e['episode_seed']}_{tag}.gif") and os.path.getsize(e["video"]) > 0
    import imageio.v2 as imageio

    assert imageio.mimread(eps[0]["video"])[0].shape[:2] == (256, 256)   # the 32 px camera, enlarged for viewing
