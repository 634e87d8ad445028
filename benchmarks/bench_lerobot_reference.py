"""Our model against LeRobot's own ``sample_actions`` on the tiny π0 / π0.5 checkpoints LeRobot 0.4.4, 0.5.1 and
0.6.1 wrote (tests/fixtures/lerobot_pi_tiny): the largest absolute error of the action chunk (5 Euler steps, the
reference's inputs and noise) in float32 for each; then, on the newest, with the weights rounded to bfloat16, in
bfloat16 compute, and with the time embedding's angles in float32 (what the default ``time_embedding_precision`` of
our own presets does).

    python benchmarks/bench_lerobot_reference.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from vla_rl.checkpoint.lerobot import load_lerobot
from vla_rl.policies import flow

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "lerobot_pi_tiny"
GENERATIONS = ("lerobot-0.4.4", "lerobot-0.5.1", "lerobot-0.6.1")
TINY = {"vision": {"num_heads": 2}}   # the tiny SigLIP's head count (its weights cannot tell it)


def max_error(folder: Path, *, weights: torch.dtype = torch.float32, compute: torch.dtype = torch.float32,
              angles: str = "float64") -> float:
    model, _, _ = load_lerobot(folder, overrides={**TINY, "time_embedding_precision": angles})
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(weights).float())
    model = model.to(compute)
    ref = load_file(str(folder / "reference.safetensors"))
    images = torch.stack([ref["img0"], ref["img1"]], dim=1).permute(0, 1, 3, 4, 2).to(compute)
    obs = {"images": images, "image_mask": ref["img_masks"], "state": ref["state"].to(compute),
           "tokens": ref["lang_tokens"], "token_mask": ref["lang_masks"]}
    with torch.no_grad():
        x = flow.denoise(model.velocity_field(model.encode_prefix(obs, hidden=False)), ref["noise"], num_steps=5)
    return (x.float() - ref["actions"]).abs().max().item()


def main() -> None:
    newest = ROOT / GENERATIONS[-1]
    rows = [(f"{g.replace('-', ' ')}, float32", ROOT / g, {}) for g in GENERATIONS]
    rows += [(f"{GENERATIONS[-1].replace('-', ' ')}, {name}", newest, kw) for name, kw in (
        ("time-embedding angles in float32", {"angles": "float32"}),
        ("bf16 weights, float32 compute", {"weights": torch.bfloat16}),
        ("bf16 weights and compute", {"weights": torch.bfloat16, "compute": torch.bfloat16}))]
    print("| checkpoint, numerics | π0 max abs error | π0.5 max abs error |")
    print("|---|---|---|")
    for name, root, kw in rows:
        print(f"| {name} | {max_error(root / 'pi0', **kw):.1e} | {max_error(root / 'pi05', **kw):.1e} |")
    scale = {k: load_file(str(newest / k / "reference.safetensors"))["actions"].abs().mean().item()
             for k in ("pi0", "pi05")}
    print(f"(mean |action| of the newest references: π0 {scale['pi0']:.2f}, π0.5 {scale['pi05']:.2f})")


if __name__ == "__main__":
    main()
