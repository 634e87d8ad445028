"""benchmarks/bench_libero_cost.py: one state-only case, a few steps (a LIBERO env is built: ~5-15 s)."""

import importlib.util
from pathlib import Path

import pytest
from helpers import SKIP_SIMULATORS as SKIP

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_libero_cost", ROOT / "benchmarks" / "bench_libero_cost.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


@pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
def test_state_only_case_reports_a_positive_cost():
    row = bench.measure("none", 3, "libero_spatial", 0)
    assert row["case"] == "state only"
    assert bench.measure("none-plain", 2, "libero_spatial", 0)["case"] == "state only, robosuite's substeps"
    assert 0 < row["cpu_per_step"] < 5 and row["wall_per_s"] > 0 and row["rss_mb"] > 100


def test_case_names():
    # neither "none", a size, nor a size with -flat (each optionally -plain): refused before any env
    for bad in ("64-shiny", "none-flat-plain-plain", "plain"):
        with pytest.raises(ValueError):
            bench.measure(bad, 1, "libero_spatial", 0)
