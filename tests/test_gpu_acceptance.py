"""benchmarks/gpu_acceptance.py: without CUDA it refuses (exit status 2); ``--smoke`` runs each step's CPU variant as
its own process and writes the markdown report the GPU run writes (a missing optional benchmark is a skip)."""

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
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


def test_smoke_runs_every_step_and_writes_the_report(tmp_path):
    assert acceptance.main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    for row in ("| tests |", "| bench_gpu |", "| bench_train |", "| bench_libero_warp |"):
        assert row in text, row
    assert text.count("| ok |") >= 3
    assert "| LoRA r=16 + expert + heads | all | 2 |" in text          # bench_gpu's PPO row came through
    assert "env-steps" in text or "envs" in text                        # bench_train's table
