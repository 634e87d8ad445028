"""openpi's LIBERO input / output conventions, against what openpi's own serving path did on the tiny twins
(tests/fixtures/openpi_tiny/libero: ``create_trained_policy`` with the ``pi0_libero`` / ``pi05_libero`` configs,
then ``policy.infer`` on observations as openpi's LIBERO client sends them, every transform's output recorded).

From the observation the client sends (224 px camera frames, the 8-d state, the task), our actor must hand the
model what openpi's transforms hand it (camera slots and masks, normalised and padded state, prompt tokens) and
return the actions openpi's output transforms return (unnormalised, pi0_libero's arm dims made absolute again,
7 of 32 dims)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vla_rl.checkpoint.openpi import load_openpi
from vla_rl.envs.libero.robosuite_env import quat_to_axis_angle
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.tokenizer import SentencePieceTokenizer

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "openpi_tiny"
LIB = ROOT / "libero"
META = json.loads((LIB / "libero_meta.json").read_text())
CONFIGS = {"pi0_libero": "pi0", "pi05_libero": "pi05"}
NUM_STEPS = 10   # openpi's sample_actions default, what policy.infer used


def inputs() -> dict:
    arrays = load_file(str(LIB / "inputs.safetensors"))
    for copy, original in META["same_as"].items():
        arrays[copy] = arrays[original]
    return arrays


def sent(i: int) -> dict:
    """Observation i as openpi's LIBERO client sent it, in our observation's form (cameras agentview, wrist)."""
    a = inputs()
    cams = [a[f"obs{i}/sent/observation/image"], a[f"obs{i}/sent/observation/wrist_image"]]
    images = [c[None] for c in cams] if cams[0].shape != cams[1].shape else torch.stack(cams)[None]
    return {"images": images, "state": a[f"obs{i}/sent/observation/state"].float()[None],
            "instruction": [META["prompts"][i]]}


def policy(config: str):
    model, norm, cfg = load_openpi(ROOT / CONFIGS[config] / "jax")   # the settings recognised by asset id
    model.set_tokenizer(SentencePieceTokenizer.from_file(ROOT / "tokenizer.model"))
    return model, norm, cfg


def step(ref: dict, i: int, name: str, key: str) -> torch.Tensor:
    hits = [k for k in ref if k.startswith(f"obs{i}/in") and k.endswith(f"_{name}/{key}")]
    assert len(hits) == 1, (name, key, hits)
    return ref[hits[0]]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("i", [0, 1])
def test_model_inputs_are_openpis(config, i):
    model, norm, cfg = policy(config)
    assert cfg["source"]["settings"].startswith(f"openpi config {config}")
    ref = load_file(str(LIB / f"{config}.safetensors"))
    actor = Actor(model, norm)
    prepared = model.prepare(actor.model_obs(sent(i)))
    # LiberoInputs: agentview -> base_0_rgb, wrist -> left_wrist_0_rgb, right wrist zeros and masked
    masks = [bool(step(ref, i, "LiberoInputs", f"image_mask/{c}")) for c in
             ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")]
    assert prepared["image_mask"][0].tolist() == masks == [True, True, False]
    # Normalize (z-score / quantiles, openpi's epsilon) then PadStatesAndActions to 32
    torch.testing.assert_close(prepared["state"][0].double(), step(ref, i, "PadStatesAndActions", "state"),
                               atol=1e-6, rtol=0)
    # TokenizePrompt: pi0_libero and pi05_libero (discrete_state_input false) both write "task\n"
    assert torch.equal(prepared["tokens"][0], step(ref, i, "TokenizePrompt", "tokenized_prompt").long())
    assert torch.equal(prepared["token_mask"][0].bool(), step(ref, i, "TokenizePrompt", "tokenized_prompt_mask"))
    # the camera frames as the model gets them (224 px already: nothing resized; uint8 -> [-1, 1] in the encoder)
    assert torch.equal(prepared["images"][0, 0], inputs()[f"obs{i}/sent/observation/image"])


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("i", [0, 1, 2])
def test_actions_are_openpis(config, i):
    """Same model inputs and noise: our actor's env actions equal openpi's ``policy.infer`` output transforms
    applied to the float32 model's chunk (pi0_libero: Unnormalize, AbsoluteActions on dims 0-5, LiberoOutputs;
    pi05_libero: Unnormalize, LiberoOutputs)."""
    model, norm, _ = policy(config)
    ref = load_file(str(LIB / f"{config}.safetensors"))
    assert norm.relative_actions == ((0, 1, 2, 3, 4, 5) if config == "pi0_libero" else ())
    actor = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))   # openpi does not clip
    obs = sent(i)
    if i == 2:   # a 96x128 frame: compare from openpi's resized model input (resize-with-pad is checked apart)
        obs["images"] = torch.stack([inputs()["obs2/model_input/base_0_rgb"],
                                     inputs()["obs0/sent/observation/wrist_image"]])[None]
    noise = ref[f"obs{i}/noise"][None]
    draws = flow.SampleNoise(noise, torch.zeros(1, NUM_STEPS, dtype=torch.bool), torch.zeros(NUM_STEPS, *noise.shape))
    got = actor.chunk(obs, SamplerConfig(num_steps=NUM_STEPS, method="ode"), draws=draws)[0]
    want = ref[f"obs{i}/policy_actions"].float()
    assert got.shape == want.shape == (model.cfg.action_horizon, 7)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, err   # measured <= 7.3e-5 (pi0_libero), 1e-5 (pi05_libero)


def test_resize_with_pad_of_another_size_matches_openpis_server():
    """obs2's 96x128 main camera: openpi's ResizeImages (JAX resize_with_pad: bilinear, rounded to uint8, zero
    padding) against ours (policy image_resize pad)."""
    model, norm, _ = policy("pi05_libero")
    obs = sent(2)
    prepared = model.prepare(Actor(model, norm).model_obs(obs))
    ours = (prepared["images"][0, 0] + 1) / 2 * 255
    theirs = inputs()["obs2/model_input/base_0_rgb"].float()
    pad = theirs.sum(dim=(1, 2)) == 0
    assert bool(((ours.sum(dim=(1, 2)) < 1e-3) == pad).all())   # the same rows are padding
    assert (ours - theirs).abs().max().item() <= 1.01   # measured 1.0: openpi rounds to uint8, we stay in float


def test_state_axis_angle_is_openpis():
    """Our LIBERO env's state orientation (quat_to_axis_angle of robot0_eef_quat) is openpi's
    ``_quat2axisangle`` (examples/libero/main.py), run on the same quaternions."""
    q = META["quat2axisangle"]
    for quat, want in zip(q["quat_xyzw"], q["axisangle"]):
        np.testing.assert_allclose(quat_to_axis_angle(np.array(quat)), want, atol=1e-6)


def test_client_constants_are_recorded():
    """What the client does beyond the transforms, as read from openpi's example (and applied by a LIBERO
    evaluation of an imported openpi policy: docs/pretrained.md)."""
    c = META["client"]["module_constants"] | META["client"]["Args_defaults"]
    assert c["LIBERO_ENV_RESOLUTION"] == 256 and c["resize_size"] == 224 and c["replan_steps"] == 5


def test_relative_action_dims_travel_with_the_policy_and_its_export(tmp_path):
    """pi0_libero's arm dims are offsets from the state: the imported folder, the policy loaded from it and its
    export all add the state back (the same chunk from the same noise), and SFT targets subtract it."""
    from vla_rl.checkpoint.openpi import import_openpi
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.interop.export import export_policy
    from vla_rl.policies import load_exported

    import_openpi(ROOT / "pi0" / "jax", tmp_path / "pol", tokenizer=ROOT / "tokenizer.model")
    model, norm, config = load_policy(tmp_path / "pol")
    assert config["normalization"]["relative_action_dims"] == [0, 1, 2, 3, 4, 5]
    export_policy(tmp_path / "pol", tmp_path / "exp", dtype="fp32")
    exported = load_exported(tmp_path / "exp")
    obs = sent(0)
    actor = Actor(model, norm)   # LIBERO's bounds [-1, 1], as the export's spec
    with torch.no_grad():
        want = actor.chunk(obs, SamplerConfig(num_steps=exported.spec.num_steps),
                           generator=torch.Generator().manual_seed(5))[0]
    cams = {c.name: obs["images"][0, k].numpy() for k, c in enumerate(exported.spec.cameras)}   # agentview, wrist
    got = exported.infer({**cams, "state": obs["state"][0].numpy(), "prompt": obs["instruction"][0]}, seed=5)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    free = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))
    chunk = torch.randn(1, model.cfg.action_horizon, 7)
    back = free.model_actions(chunk, obs["state"])           # SFT's targets: the state subtracted
    torch.testing.assert_close(free.env_actions(back, obs["state"]), chunk, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="offsets from the state"):
        free.env_actions(back)


def test_an_imported_libero_policy_carries_openpis_client_settings(tmp_path):
    """The conventions travel in the policy folder: LIBERO frames rotated 180° at 256 px (resized with padding by
    the policy), 5 actions run per chunk, 10 denoising steps; bench / eval / export read them from there."""
    from vla_rl.checkpoint.openpi import import_openpi
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.envs.libero.settings import libero_env_config
    from vla_rl.interop.export import export_policy
    from vla_rl.policies import load_exported

    import_openpi(ROOT / "pi05" / "jax", tmp_path / "pol", tokenizer=ROOT / "tokenizer.model")
    model, _, config = load_policy(tmp_path / "pol")
    assert config["deploy"] == {"sampler": {"num_steps": 10}, "execute": 5}
    env = libero_env_config(config, model.cfg, {}, None)
    assert (env.image_orientation, env.image_size, env.cameras) == ("rot180", 256, ("agentview", "wrist"))
    export_policy(tmp_path / "pol", tmp_path / "exp", dtype="fp32")
    spec = load_exported(tmp_path / "exp").spec
    assert (spec.execute, spec.num_steps, spec.action_horizon) == (5, 10, 10)


def test_frames_rendered_at_256_are_resized_as_openpis_client_does():
    """openpi's LIBERO client turns a 256 px render 180° and resizes it with padding to 224 (PIL bilinear,
    antialiased, uint8); our env renders rot180 frames and the imported policy (image_antialias: true) resizes them:
    within one uint8 level (measured: without antialiasing up to 24 levels)."""
    model, norm, _ = policy("pi05_libero")
    assert model.cfg.image_antialias
    a = inputs()
    renders = [a[f"obs0/render_tile/{c}"].repeat_interleave(4, 0).repeat_interleave(4, 1)
               for c in ("agentview_image", "robot0_eye_in_hand_image")]
    frames = [r.flip(0).flip(1)[None] for r in renders]          # env.image_orientation: rot180; one per camera
    prepared = model.prepare(Actor(model, norm).model_obs({**sent(0), "images": frames}))   # resized as encoded
    ours = (prepared["images"][0, :2] + 1) / 2 * 255
    theirs = torch.stack([a["obs0/sent/observation/image"], a["obs0/sent/observation/wrist_image"]]).float()
    assert (ours - theirs).abs().max().item() <= 1.01
