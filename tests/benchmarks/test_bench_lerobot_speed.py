"""benchmarks/bench_lerobot_speed.py without LeRobot: the FLOP count of its ``--split`` table against products
counted by hand, and our side's worker (deployment path, split into ViT / denoising steps / rest) on a small
case. The comparison itself needs LeRobot's virtual environment (see the script's docstring)."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_lerobot_speed", ROOT / "benchmarks" / "bench_lerobot_speed.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_flop_count_of_matrix_products():
    x, w, b = torch.randn(2, 5, 16), torch.randn(32, 16), torch.randn(32)
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 9, 8)
    images, kernel = torch.randn(1, 3, 28, 28), torch.randn(8, 3, 14, 14)
    with torch.inference_mode(), bench._flop_mode() as count:
        F.linear(x, w, b)
        torch.mm(x[0], w.t())
        F.scaled_dot_product_attention(q, k, k)
        F.conv2d(images, kernel, stride=14)
        torch.relu(x)                                                        # not a product: not counted
    assert count.total == 2 * 10 * 16 * 32 + 2 * 5 * 16 * 32 + 4 * (4 * 6 * 8) * 9 + 2 * (8 * 2 * 2) * (3 * 14 * 14)


def test_our_split_adds_up(monkeypatch):
    from vla_rl.policies.model import FlowPolicy

    for name in ("_embed_images", "sampling_velocity"):   # the split wraps them: put them back afterwards
        monkeypatch.setattr(FlowPolicy, name, getattr(FlowPolicy, name))
    dims = bench.bench_dims("pi0_cpu")
    split = bench._split_parts("ours-fast")
    prepare, run = bench._ours_runner(dims, horizon=4, action_dim=3, steps=2, path="fast")
    inputs = prepare(bench._inputs(dims, batch=1, horizon=4, action_dim=3))
    split.counter, split.on = bench._flop_mode(), True
    with split.counter:
        actions = run(inputs)
    split.on = False
    assert actions.shape == (1, 4, 3)
    assert set(split.wall) == {"vit", "steps"}
    assert 0 < split.flops["steps"] < split.flops["vit"] < split.counter.total
