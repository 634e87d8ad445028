"""LeRobot SmolVLA checkpoints through our SmolVLA: tiny twins written by LeRobot 0.6.1 itself
(scripts/fixtures/lerobot_smolvla_fixtures.py; tests/fixtures/lerobot_smolvla_tiny/NOTES.md says what they hold)
reproduce its ``sample_actions``, one denoising step, its flow-matching loss and, from raw robot-unit inputs, its
processors + policy; the import writes a policy folder that loads, exports and serves; what is not reproduced is
refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla_rl.checkpoint.lerobot import import_lerobot, is_lerobot_folder, load_lerobot
from vla_rl.checkpoint.lerobot_format import LeRobotImportError
from vla_rl.checkpoint.policy import load_policy
from vla_rl.cli import main as cli_main
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig

pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_smolvla_tiny" / "lerobot-0.6.1"
VARIANTS = ["smolvla", "smolvla_expert_layers"]


def fixture(variant: str):
    model, norm, config = load_lerobot(ROOT / variant)
    return model, norm, load_file(str(ROOT / variant / "reference.safetensors"))


def reference_obs(ref: dict) -> dict:
    """The reference's model-level inputs as our observation: images [N, C, H, W, 3] already in [-1, 1]."""
    images = torch.stack([ref["img0"], ref["img1"]], dim=1).permute(0, 1, 3, 4, 2)
    return {"images": images, "image_mask": ref["img_masks"], "state": ref["state"], "tokens": ref["lang_tokens"],
            "token_mask": ref["lang_masks"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_twin_reproduces_lerobot_sample_actions_velocity_and_loss(variant):
    model, _, ref = fixture(variant)
    obs = reference_obs(ref)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        acts = flow.sample(model.field(prefix), ref["noise"], num_steps=5, method="ode").actions
        velocity = model.velocity_field(prefix)(ref["noise"], torch.ones(2))
        losses = flow.flow_matching_errors(model.field(model.encode_prefix(obs)), ref["train_actions"],
                                           ref["train_time"], ref["noise"])
    errors = {"actions": (acts - ref["actions"]).abs().max().item(),
              "velocity": (velocity - ref["velocity_t1"]).abs().max().item(),
              "losses": (losses - ref["train_losses"]).abs().max().item()}
    assert max(errors.values()) <= 1e-4, errors   # measured <= 4e-6 (both variants)


@pytest.mark.parametrize("variant", VARIANTS)
def test_raw_inputs_reproduce_lerobot_processors_and_policy(variant):
    """Robot-unit state, uint8 frames of other sizes (60x80 and 80x60: SmolVLA pads on the top and on the left) and
    task strings through our actor (normalisation, resize-with-pad, "task\\n", SmolVLM2's tokenizer,
    unnormalisation) give the actions of LeRobot's pre-processor, ``predict_action_chunk`` and post-processor."""
    model, norm, ref = fixture(variant)   # the tokenizer: the fixture's vlm/ folder
    tasks = json.loads((ROOT / variant / "reference_meta.json").read_text())["tasks"]
    obs = {"images": [ref["raw_img0"].permute(0, 2, 3, 1), ref["raw_img1"].permute(0, 2, 3, 1)],   # per camera
           "state": ref["raw_state"], "instruction": tasks}
    actor = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))   # LeRobot does not clip
    prepared = model.prepare(actor.model_obs(obs))
    width = ref["pipeline_tokens"].shape[1]   # LeRobot pads to the longest prompt, we to max_text_tokens
    assert torch.equal(prepared["tokens"][:, :width][ref["pipeline_token_mask"]],
                       ref["pipeline_tokens"][ref["pipeline_token_mask"]])
    assert torch.equal(prepared["token_mask"][:, :width], ref["pipeline_token_mask"])
    assert not prepared["token_mask"][:, width:].any()
    noise = ref["noise"]
    draws = flow.SampleNoise(noise, torch.zeros(2, 5, dtype=torch.bool), torch.zeros(5, *noise.shape))
    got = actor.chunk(obs, SamplerConfig(num_steps=5, method="ode"), draws=draws)
    err = (got - ref["pipeline_actions"]).abs().max().item()
    assert err <= 1e-4, err   # measured <= 1e-6


def test_a_task_longer_than_the_tokenizer_limit_is_cut_as_lerobot_cuts_it():
    model, norm, ref = fixture("smolvla")
    meta = json.loads((ROOT / "smolvla" / "reference_meta.json").read_text())
    tokens, mask = model.tokenize([meta["long_task"]], torch.zeros(1, model.cfg.state_dim))
    assert torch.equal(tokens[mask], ref["long_tokens"][ref["long_token_mask"]]) and bool(mask.all())


def test_import_writes_a_policy_folder_that_loads_to_the_same_actions(tmp_path, capsys):
    out = tmp_path / "policy"
    assert cli_main(["import", "lerobot", str(ROOT / "smolvla"), str(out)]) == 0
    assert "imported a LeRobot smolvla" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "norm_stats.safetensors",
                                                     "tokenizer.safetensors"]
    model, _, config = load_policy(out)
    assert config["policy"]["arch"] == "smolvla" and config["policy"]["tokenizer"] == "hf"
    ref = load_file(str(ROOT / "smolvla" / "reference.safetensors"))
    with torch.no_grad():
        acts = flow.sample(model.field(model.encode_prefix(reference_obs(ref))), ref["noise"], num_steps=5,
                           method="ode").actions
    assert (acts - ref["actions"]).abs().max().item() <= 1e-4
    tasks = json.loads((ROOT / "smolvla" / "reference_meta.json").read_text())["tasks"]
    tokens, _ = model.tokenize(tasks, torch.zeros(2, model.cfg.state_dim))   # the tokenizer travelled with it
    assert torch.equal(tokens[:, : ref["pipeline_tokens"].shape[1]][ref["pipeline_token_mask"]],
                       ref["pipeline_tokens"][ref["pipeline_token_mask"]])


def test_settings_the_importer_does_not_reproduce_are_refused(tmp_path):
    assert is_lerobot_folder(ROOT / "smolvla")
    for key, value, says in (("adapt_to_pi_aloha", True, "adapt_to_pi_aloha"),
                             ("add_image_special_tokens", True, "add_image_special_tokens"),
                             ("resize_imgs_with_padding", [64, 64], "resize_imgs_with_padding")):
        folder = tmp_path / key
        shutil.copytree(ROOT / "smolvla", folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(LeRobotImportError, match=says):
            load_lerobot(folder)


def test_without_smolvlm2s_files_the_import_says_what_to_give(tmp_path):
    folder = tmp_path / "smolvla"
    shutil.copytree(ROOT / "smolvla", folder)
    shutil.rmtree(folder / "vlm")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vlm_model_name": "HuggingFaceTB/not-downloaded"}))
    with pytest.raises(LeRobotImportError, match=r"give num_heads=N num_kv_heads=N head_dim=N vision.num_heads=N"):
        load_lerobot(folder)
    # with the sizes given, the tokenizer is what is missing
    sizes = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vision": {"num_heads": 2}}
    with pytest.raises(LeRobotImportError, match="no SmolVLM2 tokenizer found.*--tokenizer DIR"):
        import_lerobot(folder, tmp_path / "out", overrides=sizes)
    assert not (tmp_path / "out").exists()
    import_lerobot(folder, tmp_path / "out", overrides=sizes, tokenizer=ROOT / "smolvla" / "vlm")
    assert (tmp_path / "out" / "tokenizer.safetensors").is_file()
