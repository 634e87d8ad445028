"""ManiSkill motion-planner demos -> pd_ee_delta_pose state demos -> LeRobot dataset -> SFT -> eval.

Needs ManiSkill + mplib (`make sims`); without them these tests fail, unless VLA_RL_SKIP_SIMULATORS=1.
One module-scoped collection of 2 PushCube demos (~20 s) serves every test.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import needs_simulator, simulator_import

from vla_rl.checkpoint.policy import load_policy
from vla_rl.cli import main
from vla_rl.data.lerobot import read_lerobot_dataset, read_lerobot_info
from vla_rl.data.maniskill_demos import (
    demo_env_config,
    episode_limit,
    refresh_dataset_first_frames,
    reobserve_first_frames,
)
from vla_rl.data.maniskill_h5 import ManiSkillDemoError, read_maniskill_h5, read_trajectory_info

h5py = simulator_import("h5py")
pytestmark = needs_simulator("mani_skill", "ManiSkill")


@pytest.fixture(scope="module")
def pushcube(tmp_path_factory):
    out = tmp_path_factory.mktemp("ms") / "push"
    assert main(["collect", "maniskill", str(out), "task=PushCube-v1", "episodes=2", "seed=3"]) == 0
    h5 = out.with_name("push.maniskill") / "PushCube-v1.state.pd_ee_delta_pose.physx_cpu.h5"
    return out, h5


def test_collected_demos_are_ee_delta_pose_state_demos_that_replay_to_success(pushcube):
    """Known answer: the converted actions, replayed open loop in our adapter from the episode's reset
    seed, end in success near the recorded final state; the adapter's state at reset is the
    file's first observation (so SFT sees what RL will see)."""
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv

    out, h5 = pushcube
    meta = read_trajectory_info(h5)
    assert (meta.task, meta.control_mode, meta.obs_mode) == ("PushCube-v1", "pd_ee_delta_pose", "state")
    assert [e["reset_kwargs"]["seed"] for e in meta.episodes][:1] == [3]
    data = read_maniskill_h5(h5)
    assert data.num_episodes == 2 and data.state.shape[1] == 35 and data.action.shape[1] == 7
    assert data.tasks == ["push the cube onto the red and white target"]
    assert tuple(data.images.shape[1:]) == (0, 1, 1, 3)
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PushCube-v1", max_episode_steps=200))
    try:
        with h5py.File(h5) as f:
            obs_file = f["traj_0"]["obs"][:]
        obs = env.reset(seed=meta.episodes[0]["reset_kwargs"]["seed"])
        np.testing.assert_array_equal(obs["state"], obs_file[0])
        actions = data.action[data.episode_index == 0].numpy()
        for t, a in enumerate(actions):  # noqa: B007  (t is the step the episode ended at)
            obs, _, terminated, truncated, success = env.step(a)
            if terminated or truncated:
                break
        assert success   # our adapter ends the episode at success; the planner's recording runs on after it
        # Close, not equal: the adapter's reset runs one physics step to refresh contacts (then restores the
        # state), and that step's solver warm start differs from the converter's; over ~70 open-loop pushing
        # steps the states drift apart by ~1.5 cm (measured 0.015). Wrong actions miss by far more.
        np.testing.assert_allclose(obs["state"], obs_file[t + 1], atol=0.05)
    finally:
        env.close()


def test_first_frames_are_reobserved_at_reset_and_a_wrong_seed_is_an_error(pushcube):
    _, h5 = pushcube
    data = read_maniskill_h5(h5)
    cfg = demo_env_config(data, task="PushCube-v1", control_mode="pd_ee_delta_pose", obs_mode="state")
    first = (data.frame_index == 0).nonzero().flatten()
    stale = data.state.clone()
    stale[first[1], 20] += 1.0          # what a stale contact entry looks like: one value off
    fixed = reobserve_first_frames(replace(data, state=stale), h5, cfg, log=lambda *_: None)
    torch.testing.assert_close(fixed.state, data.state, rtol=0, atol=1e-6)
    swapped = data.state.clone()
    swapped[first[1]] = data.state[first[0]]   # episode 1's first frame is episode 0's: not its seed's state
    with pytest.raises(ManiSkillDemoError, match="differs from a reset with seed 4"):
        reobserve_first_frames(replace(data, state=swapped), h5, cfg)


def test_an_older_dataset_is_refreshed_from_its_source_file(pushcube, tmp_path):
    out, h5 = pushcube
    new = refresh_dataset_first_frames(out, tmp_path / "fresh", log=lambda *_: None)
    a, b = read_lerobot_dataset(out), read_lerobot_dataset(new)
    torch.testing.assert_close(b.state, a.state, rtol=0, atol=1e-6)   # PushCube has no contact entries
    assert torch.equal(b.action, a.action)
    assert read_lerobot_info(new)["vla_rl"]["first_frames"] == "re-observed at reset"
    with pytest.raises(ManiSkillDemoError, match="was not written by"):
        refresh_dataset_first_frames(_plain_copy(out, tmp_path / "plain"), tmp_path / "x")


def _plain_copy(dataset, dest):
    """``dataset`` with the ``vla_rl`` entry taken out of its info.json (a dataset from elsewhere)."""
    import shutil

    shutil.copytree(dataset, dest)
    info_path = dest / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info.pop("vla_rl")
    info_path.write_text(json.dumps(info))
    return dest


@pytest.mark.slow   # plans two PickCube demos: ~40 s
def test_pickcube_demos_begin_with_the_gripper_empty(tmp_path):
    """ManiSkill's converter recorded is_grasped = 1 (state index 18) at the start of every episode after one
    that ended holding the cube; the collected dataset has the reset state's 0."""
    out = tmp_path / "pick"
    assert main(["collect", "maniskill", str(out), "task=PickCube-v1", "episodes=2"]) == 0
    with h5py.File(out.with_name("pick.maniskill") / "PickCube-v1.state.pd_ee_delta_pose.physx_cpu.h5") as f:
        assert f["traj_1"]["obs"][0, 18] == 1     # the premise: the raw conversion is stale
    data = read_lerobot_dataset(out)
    assert data.num_episodes == 2
    assert (data.state[data.frame_index == 0, 18] == 0).all()


def test_lerobot_dataset_holds_the_same_frames_and_names_its_env(pushcube):
    out, h5 = pushcube
    info = read_lerobot_info(out)
    assert info["codebase_version"] == "v3.0" and info["fps"] == 20 and info["robot_type"] == "panda"
    assert not [k for k, f in info["features"].items() if f["dtype"] in ("image", "video")]
    env_cfg = info["vla_rl"]["env_config"]
    assert info["vla_rl"]["env"] == "maniskill" and env_cfg["task"] == "PushCube-v1"
    collect = info["vla_rl"]["collect"]   # the ManiSkill collector's settings, none of the built-in task's
    assert collect["kind"] == "maniskill" and collect["task"] == "PushCube-v1" and collect["seed"] == 3
    assert collect["fps"] == 20 and collect["max_tries"] == 16 and not {"env", "noise", "num_envs"} & set(collect)
    lengths = torch.bincount(read_maniskill_h5(h5).episode_index).tolist()
    assert env_cfg["max_episode_steps"] == episode_limit("PushCube-v1", lengths, None)
    assert env_cfg["max_episode_steps"] >= max(lengths)
    a, b = read_lerobot_dataset(out), read_maniskill_h5(h5)
    assert torch.equal(a.state, b.state) and torch.equal(a.action, b.action)
    assert torch.equal(a.episode_index, b.episode_index) and a.tasks == b.tasks


def test_episode_limit_known_answers():
    assert episode_limit("PushCube-v1", [61, 80], None) == 120      # 1.5 x 80, task limit 50
    assert episode_limit("PushCube-v1", [20, 30], None) == 50       # the task's own limit
    assert episode_limit("PushCube-v1", [61, 80], 77) == 77         # given


def test_sft_on_h5_and_dataset_then_eval_from_the_checkpoint(pushcube, tmp_path, capsys):
    """`vla-rl sft` reads ManiSkill's .h5 directly and the LeRobot dataset, builds a state-only policy
    (no cameras, state 35, action 7), evaluates on the task, and `vla-rl eval` finds the env itself."""
    out, h5 = pushcube
    for src, name in ((h5, "from_h5"), (out, "from_lerobot")):
        assert main(["sft", str(src), "--no-progress", "steps=3", "batch_size=8", "eval_episodes=1",
                     "eval_num_envs=1", f"out={tmp_path / name}", "policy.depth=1"]) == 0
        text = capsys.readouterr().out
        assert "0 camera(s)" in text and "success (ODE sampler, 1 episodes" in text
        model, _, config = load_policy(tmp_path / name)
        assert model.cfg.num_cameras == 0 and (model.cfg.state_dim, model.cfg.action_dim) == (35, 7)
        assert config["env"] == {"name": "maniskill/PushCube-v1", "state_dim": 35, "action_dim": 7}
        assert config["env_config"]["kind"] == "maniskill"
    assert main(["eval", str(tmp_path / "from_h5"), "episodes=1", "num_envs=1"]) == 0
    assert "eval/success_once" in capsys.readouterr().out


def test_bad_trajectory_files_get_clear_errors(pushcube, tmp_path):
    _, h5 = pushcube
    lonely = tmp_path / "lonely.h5"
    lonely.write_bytes(h5.read_bytes())
    with pytest.raises(ManiSkillDemoError, match="lonely.json not found"):
        read_maniskill_h5(lonely)
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(b"not hdf5 at all")
    corrupt.with_suffix(".json").write_text(h5.with_suffix(".json").read_text())
    with pytest.raises(ManiSkillDemoError, match="not a readable HDF5"):
        read_maniskill_h5(corrupt)
    short = tmp_path / "short.h5"
    short.with_suffix(".json").write_text(h5.with_suffix(".json").read_text())
    with h5py.File(h5) as src, h5py.File(short, "w") as dst:
        for key in src:
            dst[f"{key}/obs"] = src[key]["obs"][:-2]
            dst[f"{key}/actions"] = src[key]["actions"][:]
    with pytest.raises(ManiSkillDemoError, match="expected one more observation than actions"):
        read_maniskill_h5(short)
    meta = json.loads(h5.with_suffix(".json").read_text())
    meta["env_info"]["env_kwargs"]["obs_mode"] = "pointcloud"
    cloud = tmp_path / "cloud.h5"
    cloud.write_bytes(h5.read_bytes())
    cloud.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ManiSkillDemoError, match="'pointcloud' observations; 'state' and 'rgb' are read"):
        read_maniskill_h5(cloud)
    assert main(["collect", "maniskill", str(tmp_path / "x"), "task=PushT-v1"]) == 2


@pytest.mark.slow   # renders on lavapipe: ~40 s
def test_rgb_demos_match_the_adapters_camera_observation(tmp_path):
    """Known answer: with obs_mode=rgb the dataset's first frame (camera image + proprioception/extras
    state) equals what ManiSkillSingleEnv(obs_mode="rgb") returns at the same reset seed."""
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv

    out = tmp_path / "push_rgb"
    assert main(["collect", "maniskill", str(out), "task=PushCube-v1", "episodes=1", "seed=5", "obs_mode=rgb",
                 "image_size=32"]) == 0
    data = read_lerobot_dataset(out)
    info = read_lerobot_info(out)
    assert tuple(data.images.shape[1:]) == (1, 32, 32, 3) and "observation.images.base_camera" in info["features"]
    cfg = ManiSkillConfig(**{k: v for k, v in info["vla_rl"]["env_config"].items()})
    assert (cfg.obs_mode, cfg.image_size) == ("rgb", 32)
    env = ManiSkillSingleEnv(cfg)
    try:
        obs = env.reset(seed=5)
        np.testing.assert_array_equal(obs["images"], data.images[0].numpy())
        np.testing.assert_allclose(obs["state"], data.state[0].numpy(), atol=1e-6)
    finally:
        env.close()


def test_a_task_whose_scene_cannot_load_is_a_one_line_env_error(tmp_path, monkeypatch, capsys):
    """DrawSVG-v1 needs svgpathtools, which ManiSkill does not install: `collect` says so in one line (an `env`
    error, not an internal one) and leaves nothing behind."""
    import gymnasium

    def make(task, **kwargs):   # what ManiSkill raises building DrawSVG-v1's scene without svgpathtools
        raise ImportError("svgpathtools not installed. Install with pip install svgpathtools")

    monkeypatch.setattr(gymnasium, "make", make)
    assert main(["collect", "maniskill", str(tmp_path / "svg"), "task=DrawSVG-v1", "episodes=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "vla-rl: env error: ManiSkill task DrawSVG-v1 needs a package that is not installed (svgpathtools not "
        "installed. Install with pip install svgpathtools)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
