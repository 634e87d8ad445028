"""benchmarks/bench_learning.py: every task entry names real presets and valid SFT settings (a typo there
would only surface an hour into a benchmark run), and the table reads curves as documented."""

import importlib.util
import sys
from pathlib import Path

import pytest

from vla_rl.core.schema import from_dict
from vla_rl.policies.normalize import parse_dims
from vla_rl.presets import load_preset
from vla_rl.train.sft import SFTRunConfig
from vla_rl.train.trainer import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_learning", ROOT / "benchmarks" / "bench_learning.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules["bench_learning"] = bench
SPEC.loader.exec_module(bench)


@pytest.mark.parametrize("task", sorted(bench.TASKS))
def test_task_entries_parse(task):
    setup = bench.TASKS[task]
    assert {"sde", "noise"} <= set(setup.presets)
    for method, preset in setup.presets.items():
        cfg = load_preset(TrainConfig, "experiment", preset)
        # the two PPO rows are named by their sampler, the other methods by their algorithm
        assert cfg.sampler.method == method if method in ("sde", "noise") else cfg.algorithm.name == method
    sft = from_dict(SFTRunConfig, dict(setup.sft))
    parse_dims(sft.hidden_state_dims, 42)   # the ManiSkill state size; raises on a bad spec
    assert setup.demos >= 1
    assert setup.demo_pool == 0 or setup.demos <= setup.demo_pool   # 0: demos collected per seed (built-in)


def test_table_reports_best_and_first_reach_of_90():
    # (env-steps, seconds, success) per evaluation; one seed per method
    curves = {"T": {"sde": [[(0, 0.0, 0.5), (100, 10.0, 0.92), (200, 20.0, 0.85)]], "noise": []}}
    text = bench.table(curves, {"T": {"sde": [20]}}, {"T": {"sde": 20, "noise": 30}})
    row = text.splitlines()[2]
    assert row == "| T | Flow-SDE PPO | 1 | 0.50 | 0.85 | 20 | 0.92 | 100 | 10 | 100 | 10 |", row
    text = bench.table(curves, {"T": {"sde": [15]}}, {"T": {"sde": 20, "noise": 30}})
    assert "| 15 (of 20) |" in text.splitlines()[2]


def test_iterations_come_from_the_flag_the_entry_or_the_preset():
    pick, push = bench.TASKS["PickCube-v1"], bench.TASKS["PushCube-v1"]
    assert pick.iterations is None   # each method's preset plans its own length (Flow-Noise's lr drop)
    for method, preset in pick.presets.items():
        assert bench.planned_iterations(pick, method) == load_preset(TrainConfig, "experiment", preset).iterations
    assert bench.planned_iterations(push, "noise") == push.iterations == 150
    assert bench.planned_iterations(pick, "noise", 7) == 7
