"""Episode and rollout lengths taken from the task (vla_rl/train/lengths.py): ``episode_limit: demos`` sizes
episodes by the init policy's longest SFT demo, ``rollout_chunks: auto`` makes a rollout one episode long."""

import pytest
import yaml

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.train.lengths import demo_episode_limit, resolve_lengths
from vla_rl.train.trainer import TrainConfig


def policy_folder(tmp_path, longest: int | None):
    folder = tmp_path / "sft"
    folder.mkdir(parents=True)
    sft = {"steps": 10} | ({"longest_episode": longest} if longest is not None else {})
    (folder / "config.yaml").write_text(yaml.safe_dump({"format_version": 1, "sft": sft}))
    return str(folder)


def libero_cfg(**over) -> TrainConfig:
    return from_dict(TrainConfig, {"env": {"kind": "libero", "libero": {"suite": "libero_goal", "task_ids": [0],
                                                                       "cameras": []}}, "execute": 8, **over})


def test_demo_limit_known_answers():
    assert demo_episode_limit(125, 8, 220) == 160    # 156.25 -> 157 -> 20 chunks of 8
    assert demo_episode_limit(270, 8, 300) == 300    # 338 -> 344 steps, capped at LIBERO-Goal's official 300
    assert demo_episode_limit(10, 8, None) == 16     # 12.5 -> 13 -> two chunks of 8
    assert demo_episode_limit(16, 4, 100) == 20


def test_a_libero_goal_task_takes_its_own_length(tmp_path):
    cfg, notes = resolve_lengths(libero_cfg(init=policy_folder(tmp_path, 200), episode_limit="demos",
                                            rollout_chunks="auto"))
    assert cfg.env.libero.max_episode_steps == 256 and cfg.rollout_chunks == 32 and cfg.episode_limit == "env"
    assert "longest demo, 200 steps" in notes[0] and "rollout_chunks 32" in notes[1]
    cfg, notes = resolve_lengths(libero_cfg(init=policy_folder(tmp_path / "b", 290), episode_limit="demos"))
    assert cfg.env.libero.max_episode_steps == 300 and "official 300" in notes[0]
    # auto alone: the env's own limit, else the suite's official one
    assert resolve_lengths(libero_cfg(rollout_chunks="auto"))[0].rollout_chunks == 38    # ceil(300 / 8)
    unchanged = libero_cfg(rollout_chunks=5)
    assert resolve_lengths(unchanged) == (unchanged, [])


@pytest.mark.parametrize("over, says", [
    ({"episode_limit": "demos"}, "no init policy is given"),
    ({"episode_limit": "demos", "init": "MISSING"}, "records none"),
    ({"episode_limit": "sometimes"}, "episode_limit: 'sometimes'"),
])
def test_length_errors_name_the_setting(over, says, tmp_path):
    if over.get("init") == "MISSING":
        over = {**over, "init": policy_folder(tmp_path, None)}
    with pytest.raises(ConfigError, match=says):
        resolve_lengths(libero_cfg(**over))


def test_auto_needs_a_known_limit():
    cfg = from_dict(TrainConfig, {"env": {"kind": "maniskill", "maniskill": {"task": "PushCube-v1"}},
                                  "rollout_chunks": "auto"})
    if cfg.env.maniskill.max_episode_steps is not None:
        pytest.skip("ManiSkill's section sets a limit by default")
    with pytest.raises(ConfigError, match="env.maniskill.max_episode_steps"):
        resolve_lengths(cfg)


def test_sft_records_the_longest_demo_and_a_run_uses_it(tmp_path):
    """End to end on the built-in task: SFT writes sft.longest_episode; a run with episode_limit=demos and
    rollout_chunks=auto records the numbers in its config.yaml (what a resume reads)."""
    from vla_rl.data.collect import CollectConfig, collect_dataset
    from vla_rl.train.sft import SFTRunConfig, run_sft
    from vla_rl.train.trainer import Trainer

    demos = collect_dataset("builtin", tmp_path / "demos", CollectConfig(episodes=3, seed=0))
    run_sft(demos, SFTRunConfig(model="tiny", steps=2, batch_size=8, warmup_steps=1, eval_episodes=0, threads=1,
                                out=str(tmp_path / "sft")), progress=False)
    longest = yaml.safe_load((tmp_path / "sft" / "config.yaml").read_text())["sft"]["longest_episode"]
    import pyarrow.parquet as pq
    frames = pq.read_table(next((tmp_path / "demos" / "data").rglob("*.parquet"))).column("episode_index").to_pylist()
    assert longest == max(frames.count(e) for e in set(frames))
    cfg = from_dict(TrainConfig, {"init": str(tmp_path / "sft"), "out": str(tmp_path / "run"), "episode_limit": "demos",
                                  "rollout_chunks": "auto", "execute": 4, "iterations": 1, "eval_every": 1,
                                  "eval_episodes": 2, "env": {"num_envs": 2}, "threads": 1, "tensorboard": False,
                                  "progress": False})
    logged = []
    with Trainer(cfg, log=logged.append) as trainer:
        trainer.run()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    limit = demo_episode_limit(longest, 4, None)
    assert saved["env"]["builtin"]["max_episode_steps"] == limit and saved["rollout_chunks"] == -(-limit // 4)
    assert saved["episode_limit"] == "env" and any("episode_limit=demos" in line for line in logged)
