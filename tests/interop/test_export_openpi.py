"""``vla-rl export --format openpi``: a policy written in openpi's PyTorch layout and read back (by our openpi import
and, where scripts/fixtures/openpi_side_env.sh has built it, by openpi's own model) gives the same actions."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_rl.checkpoint.openpi import import_openpi, load_openpi
from vla_rl.checkpoint.policy import load_policy
from vla_rl.cli import main as cli_main
from vla_rl.policies import flow

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "tests" / "fixtures" / "openpi_tiny"
SIDE = REPO / ".cache" / "side" / "openpi" / "bin" / "python"
TINY = {"vision": {"num_heads": 2}}


def reference(kind: str) -> tuple[dict, dict]:
    ref = load_file(str(ROOT / kind / "reference.safetensors"))
    cams = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    up = 224 // ref["image_tile/base_0_rgb"].shape[1]
    images = torch.stack([ref[f"image_tile/{c}"].repeat_interleave(up, 1).repeat_interleave(up, 2) for c in cams], 1)
    masks = torch.stack([ref[f"image_mask/{c}"] for c in cams], 1)
    return {"images": images.float() / 255 * 2 - 1, "image_mask": masks, "state": ref["state"],
            "tokens": ref["tokenized_prompt"].long(), "token_mask": ref["tokenized_prompt_mask"]}, ref


def actions(model, obs, noise, steps=5):
    with torch.no_grad():
        return flow.sample(model.field(model.encode_prefix(obs)), noise, num_steps=steps, method="ode").actions


def changed(folder: Path) -> None:
    """Move every weight a little, as RL fine-tuning does (so the export cannot pass by copying the import)."""
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
               for k, v in state.items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_openpi_export_reads_back_to_the_same_actions(kind, tmp_path, capsys):
    pol, exp = tmp_path / "policy", tmp_path / "openpi"
    import_openpi(ROOT / kind / "pytorch", pol, tokenizer=ROOT / "tokenizer.model", overrides=TINY)
    changed(pol)
    assert cli_main(["export", str(pol), str(exp), "--format", "openpi", "--dtype", "fp32"]) == 0
    assert "openpi's PyTorch layout" in capsys.readouterr().out
    written = load_file(str(exp / "model.safetensors"))
    original = load_file(str(ROOT / kind / "pytorch" / "model.safetensors"))
    assert written.keys() == original.keys()                       # openpi's names, nothing more or less
    assert all(written[k].shape == original[k].shape for k in written)
    ours, norm, _ = load_policy(pol)
    back, norm_back, config = load_openpi(exp, overrides=TINY)
    assert config["source"]["settings"].startswith("the settings vla-rl's export recorded")
    assert back.cfg.action_horizon == ours.cfg.action_horizon and back.cfg.state_input == ours.cfg.state_input
    obs, ref = reference(kind)
    torch.testing.assert_close(actions(back, obs, ref["noise"]), actions(ours, obs, ref["noise"]), atol=1e-6, rtol=0)
    for a, b in ((norm.state, norm_back.state), (norm.action, norm_back.action)):
        for f in ("mean", "std", "q01", "q99"):
            torch.testing.assert_close(getattr(a, f), getattr(b, f), atol=1e-6, rtol=0)


def test_relative_dims_and_incompatible_policies(tmp_path, capsys):
    pol = tmp_path / "policy"
    import_openpi(ROOT / "pi0" / "jax", pol, tokenizer=ROOT / "tokenizer.model")   # pi0_libero: dims 0-5 relative
    assert cli_main(["export", str(pol), str(tmp_path / "o"), "--format", "openpi"]) == 0
    meta = json.loads((tmp_path / "o" / "config.json").read_text())
    assert meta["vla_rl"]["delta_action_dims"] == [0, 1, 2, 3, 4, 5] and meta["precision"] == "bfloat16"
    assert (tmp_path / "o/assets/physical-intelligence/libero/norm_stats.json").is_file()
    _, norm, _ = load_openpi(tmp_path / "o", overrides=TINY)
    assert norm.relative_actions == (0, 1, 2, 3, 4, 5)
    assert cli_main(["export", str(pol), str(tmp_path / "p"), "--format", "openpi", "execute=3"]) == 2
    assert "robot spec overrides" in capsys.readouterr().err


def test_a_policy_openpi_cannot_express_is_refused(tmp_path, capsys):
    from helpers import sft_policy  # tests/helpers.py: a tiny policy trained on the built-in task

    pol = sft_policy(tmp_path / "tiny", {}, 1)
    assert cli_main(["export", str(pol), str(tmp_path / "o"), "--format", "openpi"]) == 2
    assert "cannot be written in openpi's layout" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not SIDE.is_file(), reason="openpi's side environment (scripts/fixtures/openpi_side_env.sh) "
                                               "is not built")
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_openpis_own_model_loads_the_export_and_reproduces_our_actions(kind, tmp_path):
    pol, exp = tmp_path / "policy", tmp_path / f"{kind}_export"
    import_openpi(ROOT / kind / "pytorch", pol, tokenizer=ROOT / "tokenizer.model", overrides=TINY)
    changed(pol)
    assert cli_main(["export", str(pol), str(exp), "--format", "openpi", "--dtype", "fp32"]) == 0
    out = tmp_path / "openpi_actions.safetensors"
    env = {**os.environ, "PYTHONPATH": ""}
    subprocess.run([str(SIDE), str(REPO / "scripts/fixtures/openpi_check_export.py"), str(exp), kind, str(out)],
                   check=True, env=env, cwd=REPO, timeout=600)
    theirs = load_file(str(out))["actions"]
    ours, _, _ = load_policy(pol)
    obs, ref = reference(kind)
    err = (actions(ours, obs, ref["noise"]) - theirs).abs().max().item()
    assert err <= 1e-4, err
