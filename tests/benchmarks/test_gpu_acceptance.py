"""benchmarks/gpu_acceptance.py: without CUDA it refuses (exit status 2); ``--smoke`` runs each step's CPU variant as
its own process and writes the markdown report the GPU run writes (a missing optional benchmark is a skip)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "benchmarks" / "gpu_acceptance.py")
acceptance = importlib.util.module_from_spec(SPEC)
sys.modules["gpu_acceptance"] = acceptance   # its dataclasses look their module up
SPEC.loader.exec_module(acceptance)


def test_refuses_without_cuda_and_unknown_steps(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert acceptance.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert acceptance.main(["--smoke", "--only", "tests,bench_nothing", "--out", str(tmp_path)]) == 2
    assert "bench_nothing" in capsys.readouterr().err


def test_gpu_steps_cover_the_results_tables():
    steps = {s.name: s for s in acceptance.gpu_steps("python")}
    assert set(steps) == {"tests", "bench_gpu", "bench_train", "bench_libero_warp"}
    assert sum(s.limit_s for s in steps.values()) <= 8 * 60
    gpu = " ".join(steps["bench_gpu"].argv)
    assert "--train full,freeze_prefix,lora" in gpu and "cudagraph" in gpu and "--plan" in gpu
    assert "320" in steps["bench_train"].argv


def test_smoke_runs_the_steps_and_writes_the_report(tmp_path):
    # bench_gpu.py's and bench_libero_warp.py's smoke runs have their own tests (test_bench_gpu.py,
    # test_libero_warp.py); `-m slow` runs all four steps here
    assert acceptance.main(["--smoke", "--only", "tests,bench_train", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    status = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in text.splitlines()
              if line.startswith("| ") and line.count("|") == 5 and not line.startswith("| step")}
    assert status["tests"] == status["bench_train"] == "ok"
    assert "skipped" in text and "rollout env-steps/s" in text         # pytest's and bench_train's output came through


@pytest.mark.slow
def test_smoke_runs_every_step(tmp_path):
    assert acceptance.main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert "| LoRA r=16 + expert + heads | all | 2 |" in text          # bench_gpu's PPO row came through
