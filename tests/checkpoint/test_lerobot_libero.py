"""LeRobot's LIBERO conventions, against what ``lerobot-eval --env.type=libero`` does (LeRobot 0.6.1, recorded by
scripts/fixtures/lerobot_libero_fixtures.py into tests/fixtures/lerobot_libero): from the same robosuite-LIBERO
observations, our LIBERO env's frames and state are what LeRobot's ``LiberoEnv`` + ``LiberoProcessorStep`` make of
them, and an imported LeRobot π0.5 LIBERO checkpoint turns them into LeRobot's tokens, normalised state and
actions. The conventions travel in the imported folder: 256 px frames turned 180 degrees, agentview then wrist,
LeRobot's denoising steps and ``n_action_steps``."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

from vla_rl.checkpoint.lerobot import import_lerobot, load_lerobot
from vla_rl.checkpoint.policy import load_policy
from vla_rl.envs.libero.robosuite_env import CAMERAS, orient, robot_state
from vla_rl.envs.libero.settings import libero_env_config
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_libero"
META = json.loads((ROOT / "reference_meta.json").read_text())
RAW_META = json.loads((ROOT / "raw_meta.json").read_text())
TINY = {"vision": {"num_heads": 2}}   # what the weights cannot tell (lerobot_pi_fixtures.TINY)


def raw_observations() -> list[dict]:
    """robosuite's observation dicts as recorded; frames blown up from every 4th pixel to 256 px, as on
    LeRobot's side."""
    a, k = load_numpy(str(ROOT / "raw.safetensors")), RAW_META["stride"]
    keys = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")
    cams = ("agentview_image", "robot0_eye_in_hand_image")
    return [{**{key: a[key][i] for key in keys},
             **{c: np.repeat(np.repeat(a[c][i], k, axis=0), k, axis=1) for c in cams}}
            for i in range(a["robot0_eef_pos"].shape[0])]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("lerobot_libero") / "pol"
    import_lerobot(ROOT / "pi05", out, overrides=TINY)
    return load_policy(out)


def our_observation(env, raws: list[dict]) -> dict:
    """What our LIBERO env (robosuite_env._obs) hands the policy for these robosuite observations."""
    frames = np.stack([np.stack([orient(r[CAMERAS[c][1]], env.image_orientation) for c in env.cameras])
                       for r in raws])
    return {"images": torch.from_numpy(frames.copy()), "instruction": [RAW_META["task"]] * len(raws),
            "state": torch.from_numpy(np.stack([robot_state(r) for r in raws]).astype(np.float32))}


def test_the_imported_policy_asks_lerobots_libero_observations(imported):
    model, _, config = imported
    env = libero_env_config(config, model.cfg, {}, None)
    assert (env.image_orientation, env.image_size, tuple(env.cameras)) == ("rot180", 256, ("agentview", "wrist"))
    assert META["env_preprocessor"] == ["LiberoProcessorStep"]
    assert META["camera_name_mapping"] == {"agentview_image": "image", "robot0_eye_in_hand_image": "image2"}
    # LeRobot runs 5 denoising steps and 3 actions of each 6-action chunk (select_action's queue)
    assert config["deploy"] == {"sampler": {"num_steps": 5}, "execute": 3, "image_size": 256}


def test_frames_and_state_are_lerobots(imported):
    """Camera slots, 180-degree turn (LeRobot flips H and W of the raw frames) and the 8-d state (quaternion ->
    axis-angle without canonicalising the sign: observation 2 has w < 0)."""
    model, _, config = imported
    ref = load_file(str(ROOT / "reference.safetensors"))
    raws = raw_observations()
    assert raws[2]["robot0_eef_quat"][3] < 0
    obs = our_observation(libero_env_config(config, model.cfg, {}, None), raws)
    k = RAW_META["stride"]
    ours = obs["images"][:, :, ::k, ::k].permute(0, 1, 4, 2, 3)   # [B, cam, 3, 64, 64]
    assert torch.equal(ours, ref["env_frames"])
    torch.testing.assert_close(obs["state"], ref["env_state"], atol=2e-6, rtol=0)   # LeRobot: float32 acos


def test_model_inputs_and_actions_are_lerobots(imported):
    """Our actor on our env's observation: LeRobot's tokens (π0.5's prompt with the quantile-normalised,
    discretised state), normalised state and, from the same noise, the postprocessed actions."""
    model, norm, config = imported
    ref = load_file(str(ROOT / "reference.safetensors"))
    obs = our_observation(libero_env_config(config, model.cfg, {}, None), raw_observations())
    actor = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))   # LeRobot does not clip
    prepared = model.prepare(actor.model_obs(obs))
    assert torch.equal(prepared["tokens"], ref["tokens"])
    assert torch.equal(prepared["token_mask"].bool(), ref["token_mask"].bool())
    torch.testing.assert_close(prepared["state"], ref["state"], atol=2e-6, rtol=0)
    noise, steps = ref["noise"], META["num_steps"]
    draws = flow.SampleNoise(noise, torch.zeros(len(noise), steps, dtype=torch.bool),
                             torch.zeros(steps, *noise.shape))
    got = actor.chunk(obs, SamplerConfig(num_steps=steps, method="ode"), draws=draws)
    err = (got - ref["actions"]).abs().max().item()
    assert got.shape == ref["actions"].shape and err <= 1e-4, err


def test_loading_in_place_gives_the_same_settings():
    """``init=`` / ``bench`` of the LeRobot folder itself (no import step) see the same deploy settings."""
    _, _, config = load_lerobot(ROOT / "pi05", overrides=TINY)
    assert config["deploy"] == {"sampler": {"num_steps": 5}, "execute": 3, "image_size": 256}
