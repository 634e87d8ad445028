"""Warnings at the start of a run whose rollouts are shorter than its episodes, or whose episode limit is not the
one the init policy's dataset recorded (docs/new_task.md, section 2)."""

from vla_rl.checkpoint.policy import save_policy
from vla_rl.core.schema import from_dict
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.train.preflight import image_warnings, recorded_limit, rollout_warnings
from vla_rl.train.trainer import TrainConfig, Trainer


def test_rollout_warnings_known_answers():
    assert rollout_warnings(rollout_chunks=19, execute=8, episode_limit=150, dataset_limit=150) == []
    assert rollout_warnings(rollout_chunks=4, execute=8, episode_limit=32) == []
    (short,) = rollout_warnings(rollout_chunks=4, execute=8, episode_limit=120)
    assert short.startswith("rollout_chunks x execute = 4 x 8 = 32 actions per rollout, below the episode limit 120")
    assert "set rollout_chunks=15" in short
    (other,) = rollout_warnings(rollout_chunks=19, execute=8, episode_limit=50, dataset_limit=150,
                                limit_key="env.maniskill.max_episode_steps")
    assert other.startswith("the episode limit 50 differs from the 150 the init policy's dataset recorded (demos "
                            "longer than 50 steps time out); set env.maniskill.max_episode_steps=150")
    assert len(rollout_warnings(rollout_chunks=2, execute=8, episode_limit=40, dataset_limit=32)) == 2


def test_recorded_limit_only_for_the_same_env():
    ms = {"kind": "maniskill", "maniskill": {"task": "StackCube-v1", "max_episode_steps": 150}}
    assert recorded_limit(ms, "maniskill", "StackCube-v1") == 150
    assert recorded_limit(ms, "maniskill", "PickCube-v1") is None      # another task's dataset
    assert recorded_limit(ms, "libero") is None
    assert recorded_limit({"kind": "maniskill", "maniskill": {"task": "PickCube-v1"}}, "maniskill") is None
    assert recorded_limit(None, "builtin") is None


def test_image_warnings_name_the_setting_the_demos_were_recorded_with():
    cams = {"cameras": ["agentview", "wrist"], "image_orientation": "rot180", "reflections": False}
    rec = {"kind": "libero", "libero": cams}
    same = {"image_orientation": "rot180", "reflections": False, "cameras": ["agentview", "wrist"]}
    assert image_warnings(rec, "libero", same) == []
    (w,) = image_warnings(rec, "libero", {**same, "reflections": True})
    assert w.startswith("the init policy's demos were recorded with reflections=False, this run's env renders with "
                        "reflections=True") and w.endswith("set env.libero.reflections=False unless that is meant")
    assert len(image_warnings(rec, "libero", {"image_orientation": "upright", "reflections": True})) == 2
    # A dataset recorded before `reflections` existed rendered them; a state-only one shows no images.
    old = {"kind": "libero", "libero": {"cameras": ["agentview"], "image_orientation": "rot180"}}
    assert image_warnings(old, "libero", same)[0].startswith("the init policy's demos were recorded with "
                                                             "reflections=True")
    assert image_warnings({"kind": "libero", "libero": {"cameras": []}}, "libero", {"reflections": True}) == []
    unknown = {"kind": "libero", "libero": {"cameras": ["agentview"], "reflections": False}}   # no orientation kept
    assert image_warnings(unknown, "libero", same) == []
    assert image_warnings(rec, "maniskill", same) == [] and image_warnings(None, "libero", same) == []
    assert image_warnings(rec, "libero_warp", {"image_orientation": "rot180"}) == []   # no such key there


def test_a_run_says_so_before_any_work(tmp_path):
    meta = {"env_config": {"kind": "builtin", "builtin": {"max_episode_steps": 32}}}
    init = save_policy(tmp_path / "sft", FlowPolicy(policy_preset("tiny")), NormStats(Stats.identity(4),
                                                                                     Stats.identity(2)), meta=meta)
    lines = []
    cfg = from_dict(TrainConfig, {"init": str(init), "env": {"num_envs": 2, "builtin": {"max_episode_steps": 40}},
                                  "rollout_chunks": 2, "execute": 8, "iterations": 0, "tensorboard": False,
                                  "progress": False, "threads": 1, "out": str(tmp_path / "run")})
    with Trainer(cfg, log=lines.append):
        pass
    warnings = [x for x in lines if x.startswith("warning: ")]
    assert len(warnings) == 2 and "2 x 8 = 16 actions per rollout, below the episode limit 40" in warnings[0]
    assert "differs from the 32 the init policy's dataset recorded" in warnings[1]
    assert "env.builtin.max_episode_steps=32" in warnings[1]
