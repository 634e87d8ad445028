"""``vla-rl export --format lerobot``: a π0 / π0.5 policy written as a LeRobot 0.6.1 policy folder and read back (by
our LeRobot import and, where scripts/fixtures/lerobot_side_env.sh 0.6.1 has built it, by LeRobot's own
``from_pretrained`` and processor pipelines) gives the same actions."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from vla_rl.checkpoint.lerobot import import_lerobot, load_lerobot
from vla_rl.checkpoint.policy import load_policy
from vla_rl.core.ranges import ConfigError
from vla_rl.interop.export_lerobot import export_lerobot, size_notes
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "tests" / "fixtures" / "lerobot_pi_tiny" / "lerobot-0.6.1"
SIDE = REPO / ".cache" / "side" / "lerobot-0.6.1" / "bin" / "python"
TINY = {"vision": {"num_heads": 2}}
RL_HEADS = ("noise_head.", "value_head.")   # ours only: left out of the export, fresh on import


def changed(folder: Path) -> None:
    """Move every weight a little, as RL fine-tuning does (so the export cannot pass by copying the import)."""
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
               for k, v in state.items()}, str(folder / "model.safetensors"))


def edit_config(folder: Path, edit) -> None:
    config = yaml.safe_load((folder / "config.yaml").read_text())
    edit(config)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def policy(kind: str, folder: Path, hidden: list[int] | None = None) -> Path:
    import_lerobot(ROOT / kind, folder, overrides=TINY)
    changed(folder)
    if hidden:
        edit_config(folder, lambda c: c["normalization"].update(hidden_state_dims=hidden))
    return folder


def model_obs(ref: dict) -> dict:
    images = torch.stack([ref["img0"], ref["img1"]], dim=1).permute(0, 1, 3, 4, 2)
    return {"images": images, "image_mask": ref["img_masks"], "state": ref["state"], "tokens": ref["lang_tokens"],
            "token_mask": ref["lang_masks"]}


def raw_actions(model, norm, ref: dict, tasks: list[str]) -> torch.Tensor:
    """Robot-unit actions of our actor for the fixture's raw inputs (uint8 frames, robot-unit state, task strings)
    and noise, unclipped as LeRobot's are."""
    obs = {"images": torch.stack([ref["raw_img0"], ref["raw_img1"]], dim=1).permute(0, 1, 3, 4, 2),
           "state": ref["raw_state"], "instruction": tasks}
    actor = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))
    noise = ref["noise"]
    draws = flow.SampleNoise(noise, torch.zeros(2, 5, dtype=torch.bool), torch.zeros(5, *noise.shape))
    with torch.no_grad():
        return actor.chunk(obs, SamplerConfig(num_steps=5, method="ode"), draws=draws)


def reference(kind: str) -> tuple[dict, list[str]]:
    return (load_file(str(ROOT / kind / "reference.safetensors")),
            json.loads((ROOT / kind / "reference_meta.json").read_text())["tasks"])


@pytest.mark.parametrize("kind, hidden", [("pi0", None), ("pi05", None), ("pi0", [1, 4]), ("pi05", [1, 4])])
def test_lerobot_export_reads_back_to_the_same_weights_and_actions(kind, hidden, tmp_path):
    pol, exp = policy(kind, tmp_path / "policy", hidden), tmp_path / "lerobot"
    assert export_lerobot(pol, exp) == exp
    written, original = load_file(str(exp / "model.safetensors")), load_file(str(ROOT / kind / "model.safetensors"))
    assert written.keys() == original.keys()                       # LeRobot 0.6.1's names, nothing more or less
    assert all(written[k].shape == original[k].shape and written[k].dtype == original[k].dtype for k in written)
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        mine, theirs = json.loads((exp / name).read_text()), json.loads((ROOT / kind / name).read_text())
        if name == "config.json":
            assert mine.keys() == theirs.keys()
            # the import recorded LeRobot's K (deploy.sampler.num_steps); the export writes it back
            assert mine["num_inference_steps"] == theirs["num_inference_steps"] == 5
        if hidden:   # hidden state dims: the state is written in MEAN_STD (hidden dims: std inf)
            assert json.dumps(mine).count('"STATE": "MEAN_STD"') >= 1
        else:
            assert mine == theirs, name
    ours, norm, _ = load_policy(pol)
    back, norm_back, _ = load_lerobot(exp, overrides=TINY)
    assert back.cfg == ours.cfg
    mine_state, back_state = ours.state_dict(), back.state_dict()
    for name, t in mine_state.items():
        if not name.startswith(RL_HEADS):
            assert (back_state[name] - t).abs().max() <= 1e-6, name
    ref, tasks = reference(kind)
    with torch.no_grad():
        a = flow.sample(ours.field(ours.encode_prefix(model_obs(ref))), ref["noise"], num_steps=5, method="ode")
        b = flow.sample(back.field(back.encode_prefix(model_obs(ref))), ref["noise"], num_steps=5, method="ode")
    assert (a.actions - b.actions).abs().max() <= 1e-6
    err = (raw_actions(ours, norm, ref, tasks) - raw_actions(back, norm_back, ref, tasks)).abs().max().item()
    assert err <= 1e-6, err   # measured 0 (hidden dims: std inf normalises them to exactly 0 on both sides)
    if hidden:
        x = ref["raw_state"]
        assert torch.equal(norm.normalize_state(x), norm_back.normalize_state(x))
    assert size_notes(ours.cfg)   # the tiny twin's sizes are not stock LeRobot's: said, not refused
    assert (exp / "tokenizer.model").read_bytes() == (ROOT / kind / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["policy"].update(time_embedding_precision="float32"), "time_embedding_precision 'float32'"),
    (lambda c: c["policy"].update(clean_prompt=True), "clean_prompt True"),
    (lambda c: c["policy"].update(image_resize="stretch"), "image_resize 'stretch'"),
    (lambda c: c["normalization"].update(relative_action_dims=[0, 1]), r"relative action dims \[0, 1\]"),
])
def test_settings_lerobot_cannot_express_are_refused(edit, message, tmp_path):
    pol = policy("pi0", tmp_path / "policy")
    edit_config(pol, edit)
    with pytest.raises(ConfigError, match=f"cannot be written as a LeRobot π0 / π0.5 folder: .*{message}"):
        export_lerobot(pol, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pi05_prompt_state_dims_and_other_architectures_are_refused(tmp_path):
    pol = policy("pi05", tmp_path / "pi05")
    edit_config(pol, lambda c: c["policy"].update(state_prompt_dims=4))
    with pytest.raises(ConfigError, match="the prompt writes 4 state dims.*robot's 8"):
        export_lerobot(pol, tmp_path / "out")
    from helpers import sft_policy  # tests/helpers.py: a tiny policy trained on the built-in task

    tiny = sft_policy(tmp_path / "tiny", {}, 1)
    with pytest.raises(ConfigError, match="tokenizer 'words'"):
        export_lerobot(tiny, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not SIDE.is_file(), reason="LeRobot 0.6.1's side environment "
                                               "(scripts/fixtures/lerobot_side_env.sh 0.6.1) is not built")
@pytest.mark.parametrize("kind, hidden", [("pi0", None), ("pi05", None), ("pi05", [1, 4])])
def test_lerobots_own_policy_and_processors_reproduce_our_actions(kind, hidden, tmp_path):
    """LeRobot's PI0Policy / PI05Policy.from_pretrained and its processor pipelines, loaded from the export, give
    our actor's robot-unit actions for the same raw inputs and noise."""
    pol, exp = policy(kind, tmp_path / "policy", hidden), tmp_path / f"{kind}_lerobot"
    export_lerobot(pol, exp)
    out = tmp_path / "lerobot_actions.safetensors"
    env = {**os.environ, "PYTHONPATH": ""}
    subprocess.run([str(SIDE), str(REPO / "scripts/fixtures/lerobot_check_export.py"), str(exp), kind,
                    str(ROOT / kind), str(out)], check=True, env=env, cwd=REPO, timeout=600)
    theirs = load_file(str(out))
    ours, norm, _ = load_policy(pol)
    ref, tasks = reference(kind)
    prepared_obs = {"images": torch.stack([ref["raw_img0"], ref["raw_img1"]], dim=1).permute(0, 1, 3, 4, 2),
                    "state": ref["raw_state"], "instruction": tasks}
    actor = Actor(ours, norm, action_low=-float("inf"), action_high=float("inf"))
    prepared = ours.prepare(actor.model_obs(prepared_obs))
    assert torch.equal(prepared["tokens"], theirs["tokens"])
    assert torch.equal(prepared["token_mask"].bool(), theirs["token_mask"].bool())
    err = (raw_actions(ours, norm, ref, tasks) - theirs["actions"]).abs().max().item()
    assert err <= 1e-4, err


def test_cli_writes_it_and_overwrites_only_an_export(tmp_path, capsys):
    from vla_rl.cli import main as cli_main

    src = policy("pi0", tmp_path / "policy")
    out = tmp_path / "lerobot"
    assert cli_main(["export", str(src), str(out), "--format", "lerobot"]) == 0
    assert "LeRobot 0.6 policy folder" in capsys.readouterr().out
    assert cli_main(["export", str(src), str(out), "--format", "lerobot"]) == 2        # occupied
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["export", str(src), str(out), "--format", "lerobot", "--overwrite"]) == 0   # an export: replaced
    assert cli_main(["export", str(src), str(src), "--format", "lerobot", "--overwrite"]) == 2    # the source: never
