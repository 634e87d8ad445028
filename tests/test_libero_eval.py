"""`vla-rl eval --libero` (the official protocol, reduced: one task, two init states) and the LIBERO
dataset layout (record a few random-policy episodes, read them back, SFT on them).

The real-LIBERO tests share one recorded dataset and one SFT policy (module fixtures); they need LIBERO
like tests/test_libero.py and are skipped with ``VLA_RL_SKIP_SIMULATORS=1``. Images are 32 px and
episodes 12 steps, so the module takes well under a minute of simulation on a CPU.
"""

import json
import os

import numpy as np
import pytest
import torch

from vla_rl.checkpoint import CheckpointError, save_policy
from vla_rl.cli import main
from vla_rl.config import ConfigError, from_dict
from vla_rl.data.lerobot import detect_keys, read_lerobot_dataset, read_lerobot_info
from vla_rl.envs.libero import LiberoEpisode, LiberoProtocolResult
from vla_rl.eval.libero import LiberoEvalConfig, libero_env_config, summarize
from vla_rl.policies.config import policy_preset
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats

SKIP = os.environ.get("VLA_RL_SKIP_SIMULATORS") == "1"
needs_libero = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
SMALL = {"depth": 1, "vision": {"depth": 1, "image_size": 32}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}}
STEPS = 12   # max_episode_steps of the recorded and evaluated episodes


def tiny_checkpoint(path, *, meta_dims=(8, 7), **policy):
    cfg = policy_preset("tiny", {**SMALL, **policy})
    norm = NormStats(Stats.of(torch.randn(16, cfg.state_dim)), Stats.of(torch.randn(16, cfg.action_dim)))
    meta = {"env": {"name": "test", "state_dim": meta_dims[0], "action_dim": meta_dims[1]}} if meta_dims else None
    return save_policy(path, FlowPolicy(cfg), norm, meta=meta)


# ---------------------------------------------------------------------------------------------- pure
def test_detect_keys_prefers_lerobot_names_then_libero_layout():
    assert detect_keys({"observation.state": {}, "action": {}}) == ("observation.state", "action")
    assert detect_keys({"state": {}, "actions": {}, "image": {}}) == ("state", "actions")
    assert detect_keys({"observation.state": {}, "state": {}, "actions": {}}) == ("observation.state", "actions")
    assert detect_keys({}) == ("observation.state", "action")           # reported as missing by the reader
    assert detect_keys({"state": {}}, state_key="x", action_key="y") == ("x", "y")


def test_config_rejects_unknown_suites_and_protocol_keys():
    assert from_dict(LiberoEvalConfig, {}).suites == ["libero_spatial", "libero_object", "libero_goal", "libero_10"]
    assert from_dict(LiberoEvalConfig, {}).init_states == 50
    with pytest.raises(ConfigError, match="unknown LIBERO suite.*libero_100.*valid: libero_spatial"):
        from_dict(LiberoEvalConfig, {"suites": ["libero_spatial", "libero_100"]})
    with pytest.raises(ConfigError, match="env.init_state_ids is set by the protocol"):
        from_dict(LiberoEvalConfig, {"env": {"init_state_ids": [3]}})
    with pytest.raises(ConfigError, match="init_states"):
        from_dict(LiberoEvalConfig, {"init_states": 0})


def test_cli_reports_bad_suite_and_wrong_dims(tmp_path, capsys):
    ok = tiny_checkpoint(tmp_path / "ok", num_cameras=2, action_dim=7)
    assert main(["eval", str(ok), "--libero", "libero_spatial,libero_100"]) == 2
    assert "unknown LIBERO suite(s) ['libero_100']" in capsys.readouterr().err
    builtin = tiny_checkpoint(tmp_path / "builtin", meta_dims=(4, 2))
    assert main(["eval", str(builtin), "--libero", "libero_spatial", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "trained for state 4 / action 2 (test); LIBERO needs state 8 / action 7" in err, err
    assert not (tmp_path / "out").exists()   # failed before any simulation or output


def test_env_config_follows_the_model_and_rejects_misfits(tmp_path):
    cfg = LiberoEvalConfig()
    two = policy_preset("tiny", {**SMALL, "num_cameras": 2, "action_dim": 7})
    env = libero_env_config({"env": {"state_dim": 8, "action_dim": 7}}, two, cfg)
    assert env.cameras == ("agentview", "wrist") and env.image_size == 32 and env.image_orientation == "rot180"
    one = policy_preset("tiny", {**SMALL, "action_dim": 7})
    assert libero_env_config({}, one, LiberoEvalConfig(env={"image_orientation": "upright"})).cameras == ("agentview",)
    # A training run on LIBERO: its env options (here the orientation) are the default.
    train_env = {"kind": "libero", "options": {"image_orientation": "upright", "suite": "libero_goal",
                                               "max_episode_steps": 9}}
    env = libero_env_config({}, one, cfg, train_env)
    assert env.image_orientation == "upright" and env.max_episode_steps is None   # official limits
    assert libero_env_config({"env_config": train_env}, one, cfg).image_orientation == "upright"
    with pytest.raises(CheckpointError, match="model has state/action dims 8/4; LIBERO needs at least 8/7"):
        libero_env_config({}, policy_preset("tiny", SMALL), cfg)
    with pytest.raises(CheckpointError, match="takes 3 camera"):
        libero_env_config({}, policy_preset("tiny", {**SMALL, "num_cameras": 3, "action_dim": 7}), cfg)
    with pytest.raises(CheckpointError, match="env.image_size=64, but the model takes 32px"):
        libero_env_config({}, one, LiberoEvalConfig(env={"image_size": 64}))
    with pytest.raises(CheckpointError, match="gives 2 camera"):
        libero_env_config({}, one, LiberoEvalConfig(env={"cameras": ["agentview", "wrist"]}))
    with pytest.raises(ConfigError, match="image_orientation"):
        libero_env_config({}, one, LiberoEvalConfig(env={"image_orientation": "sideways"}))


def test_summary_known_answer():
    eps = [LiberoEpisode("libero_spatial", 0, 0, True, 40), LiberoEpisode("libero_spatial", 0, 1, False, 220),
           LiberoEpisode("libero_spatial", 3, 0, True, 50), LiberoEpisode("libero_spatial", 3, 1, True, 60),
           LiberoEpisode("libero_goal", 1, 0, False, 300)]
    s = summarize(LiberoProtocolResult(eps, {("libero_spatial", 0): "a", ("libero_goal", 1): "b"}, 1.5))
    assert s["per_suite"]["libero_spatial"] == {"success_rate": 0.75, "successes": 3, "episodes": 4, "tasks": 2}
    assert s["per_suite"]["libero_goal"] == {"success_rate": 0.0, "successes": 0, "episodes": 1, "tasks": 1}
    assert s["success_rate"] == 0.375 and (s["successes"], s["episodes"]) == (3, 5)
    assert [(t["suite"], t["task_id"], t["success_rate"], t["episodes"]) for t in s["per_task"]] == [
        ("libero_goal", 1, 0.0, 1), ("libero_spatial", 0, 0.5, 2), ("libero_spatial", 3, 1.0, 2)]
    assert s["per_task"][1]["instruction"] == "a" and len(s["episode_list"]) == 5


# ---------------------------------------------------------------------------------------------- real
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from vla_rl.data.libero_demos import LiberoRecordConfig, record_libero_episodes, recording_info, write_libero_layout

    cfg = LiberoRecordConfig(task_ids=[0], episodes_per_task=2, max_episode_steps=STEPS, image_size=32, seed=0)
    data = record_libero_episodes(cfg, progress=False)
    path = write_libero_layout(tmp_path_factory.mktemp("libero") / "dataset", data, fps=cfg.fps,
                               extra_info=recording_info(cfg))
    return data, path


@needs_libero
def test_recorded_dataset_has_the_libero_layout_and_round_trips(recorded):
    data, path = recorded
    assert data.images.shape == (2 * STEPS, 2, 32, 32, 3) and data.state.shape == (2 * STEPS, 8)
    assert data.action.shape == (2 * STEPS, 7) and data.action.abs().max() <= 1
    info = read_lerobot_info(path)
    assert [k for k in info["features"] if k not in ("timestamp", "frame_index", "episode_index", "index",
                                                     "task_index")] == ["image", "wrist_image", "state", "actions"]
    assert info["features"]["image"]["shape"] == [32, 32, 3] and info["robot_type"] == "panda"
    assert info["vla_rl"]["env"] == "libero" and info["vla_rl"]["env_config"]["image_orientation"] == "rot180"
    assert set(json.loads((path / "meta" / "stats.json").read_text())) >= {"image", "wrist_image", "state", "actions"}
    back = read_lerobot_dataset(path)   # auto-detected: state / actions, cameras image, wrist_image
    for name in ("images", "state", "action", "episode_index", "frame_index", "task_index"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    assert back.tasks == data.tasks == ["pick up the black bowl between the plate and the ramekin and place it "
                                        "on the plate"]
    assert np.unique(back.episode_index.numpy()).tolist() == [0, 1]


@pytest.fixture(scope="module")
def sft_policy(recorded, tmp_path_factory):
    from vla_rl.sft import SFTRunConfig, run_sft

    _, path = recorded
    out = tmp_path_factory.mktemp("sft") / "policy"
    cfg = SFTRunConfig(model="tiny", policy={**SMALL, "num_cameras": 2, "action_dim": 7}, steps=4, batch_size=8,
                       warmup_steps=1, out=str(out), eval_episodes=0)
    return run_sft(path, cfg, progress=False), out


@needs_libero
def test_sft_trains_on_the_libero_layout(sft_policy):
    from vla_rl.checkpoint import load_policy

    res, out = sft_policy
    assert all(np.isfinite(e["losses/flow_matching"]) for e in res["sft_log"]) and res["sft_log"][-1]["step"] == 4
    model, norm, config = load_policy(out)
    assert (config["env"]["state_dim"], config["env"]["action_dim"]) == (8, 7)
    assert (model.cfg.num_cameras, model.cfg.vision.image_size, model.cfg.action_dim) == (2, 32, 7)
    assert norm.state.mean.shape == (8,) and norm.action.mean.shape == (7,)


@needs_libero
def test_cli_eval_runs_the_reduced_protocol(sft_policy, tmp_path, capsys):
    _, ckpt = sft_policy
    out = tmp_path / "eval"
    rc = main(["eval", str(ckpt), "--libero", "libero_spatial", "task_ids=[0]", "init_states=2", "execute=4",
               f"env.max_episode_steps={STEPS}", f"out={out}", "progress=false"])
    assert rc == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["episodes"] == 2 and res["protocol"]["init_states"] == 2
    assert res["protocol"]["suites"] == ["libero_spatial"]
    assert res["protocol"]["env"]["image_size"] == 32 and res["protocol"]["env"]["cameras"] == ["agentview", "wrist"]
    assert [(e["task_id"], e["init_state_id"]) for e in res["episode_list"]] == [(0, 0), (0, 1)]
    for e in res["episode_list"]:   # an untrained policy: success is whatever it is, lengths are bounded
        assert 1 <= e["length"] <= STEPS and (e["success"] or e["length"] == STEPS)
    (task,) = res["per_task"]
    assert task["episodes"] == 2 and task["successes"] == sum(e["success"] for e in res["episode_list"])
    assert task["success_rate"] == task["successes"] / 2 and task["instruction"].startswith("pick up the black bowl")
    suite = res["per_suite"]["libero_spatial"]
    assert suite["success_rate"] == task["success_rate"] == res["success_rate"]   # mean of its (one) task
    assert (suite["episodes"], suite["tasks"]) == (2, 1)
    # Videos of the first init state of each task only (videos_per_task=1), named by outcome.
    videos = sorted(p.name for p in (out / "videos").iterdir())
    first = res["episode_list"][0]
    assert videos == [f"libero_spatial_task00_init00_{'success' if first['success'] else 'failure'}.mp4"]
    assert (out / "videos" / videos[0]).stat().st_size > 0 and first["video"] == videos[0]
    table = (out / "results.md").read_text()
    assert "| libero_spatial | 0 | pick up the black bowl" in table and "| **libero_spatial** | all |" in table
    assert res["table"] in printed and "average success (mean over suites)" in printed
