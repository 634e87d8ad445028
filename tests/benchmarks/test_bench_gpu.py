"""benchmarks/bench_gpu.py: without CUDA it refuses with exit status 2; ``--smoke`` runs every code path (sampling
with each weight dtype and denoising loop, the PPO update with activation checkpointing) on the CPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_gpu)


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--smoke" in err


def test_smoke_runs_every_section_on_the_cpu(capsys):
    assert bench_gpu.main(["--smoke", "--checkpointing", "all", "--train", "full,freeze_prefix,lora"]) == 0
    out = capsys.readouterr().out
    for row in ("| fp32, bf16 autocast | none | 1 |", "| bf16 | none | 1 |", "| bf16 | cudagraph | 1 |",
                "| bf16 | none | 2 |", "| mixed Flow-SDE, K=2 | everything | all | 2 |",
                "| Flow-Noise, K=2 | everything | all | 2 |", "| Flow-Noise, K=2 | expert + heads | all | 2 |",
                "| Flow-Noise, K=2 | LoRA r=16 + expert + heads | all | 2 |"):
        assert row in out, row
    assert "out of memory" not in out


@pytest.mark.slow   # the memory plan of every row: a minute on 2 shared cores
def test_smoke_sets_the_memory_plan_beside_each_ppo_row(capsys):
    assert bench_gpu.main(["--smoke", "--skip", "sampling,batch", "--checkpointing", "all", "--methods", "noise",
                           "--train", "lora", "--plan"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| Flow-Noise"))
    assert float(row.strip(" |").split("|")[-1]) > 0
