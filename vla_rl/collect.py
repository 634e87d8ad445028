"""Demonstration collection with scripted experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from vla_rl.config import ConfigError, to_dict
from vla_rl.data import DemoDataset
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv

# Kinds of scripted experts ``vla-rl collect`` knows; ManiSkill's motion planners are meant to join here.
COLLECT_KINDS = ("builtin",)


@dataclass(frozen=True)
class CollectConfig:
    """``vla-rl collect builtin OUT`` settings."""

    episodes: int = 50
    seed: int = 0
    noise: float = 0.1      # Gaussian action noise of the expert (demos then show some recoveries)
    num_envs: int = 16
    fps: int = 10           # only recorded in the dataset (LeRobot timestamps); the task has no real clock
    env: ColorReachConfig = field(default_factory=ColorReachConfig)


def collect_builtin_demos(num_episodes: int, *, seed: int = 0, noise: float = 0.1, num_envs: int = 16,
                          config: ColorReachConfig | None = None) -> DemoDataset:
    """Successful ColorReach episodes of the scripted expert (with Gaussian action noise ``noise``, so
    the demos cover some recovery states), recorded frame by frame."""
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    env = ColorReachEnv(num_envs, config=config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    obs = env.reset(seed=seed)
    buffers = [[] for _ in range(num_envs)]
    episodes: list[list[tuple]] = []
    while len(episodes) < num_episodes:
        action = env.expert_action(noise=noise, generator=gen)
        for i in range(num_envs):
            buffers[i].append((obs["images"][i], obs["state"][i], action[i], obs["instruction"][i]))
        out = env.step(action[:, None, :])
        obs = out.obs
        for i in out.done.nonzero(as_tuple=True)[0].tolist():
            if bool(out.terminated[i]) and len(episodes) < num_episodes:  # keep successes only
                episodes.append(buffers[i])
            buffers[i] = []
    tasks = sorted({frame[3] for ep in episodes for frame in ep})
    task_id = {t: k for k, t in enumerate(tasks)}
    frames = [(e, f, *frame) for e, ep in enumerate(episodes) for f, frame in enumerate(ep)]
    return DemoDataset(
        images=torch.stack([fr[2] for fr in frames]),
        state=torch.stack([fr[3] for fr in frames]),
        action=torch.stack([fr[4] for fr in frames]),
        episode_index=torch.tensor([fr[0] for fr in frames]),
        frame_index=torch.tensor([fr[1] for fr in frames]),
        task_index=torch.tensor([task_id[fr[5]] for fr in frames]),
        tasks=tasks,
    )


def collect_dataset(kind: str, out: str | Path, cfg: CollectConfig) -> Path:
    """Collect ``cfg.episodes`` expert demos of ``kind`` and write them as a LeRobot v3.0 dataset at ``out``.

    info.json records the env (``"vla_rl": {"env": ..., "env_config": ...}``) so ``vla-rl sft`` can
    evaluate on the task the demos came from."""
    from vla_rl.lerobot import write_lerobot_dataset

    if kind not in COLLECT_KINDS:
        raise ConfigError(f"unknown collect kind {kind!r}; supported: {list(COLLECT_KINDS)} "
                          "(ManiSkill demos are not supported yet)")
    if cfg.episodes < 1 or cfg.num_envs < 1 or cfg.fps < 1:
        raise ConfigError("episodes, num_envs and fps must be >= 1")
    data = collect_builtin_demos(cfg.episodes, seed=cfg.seed, noise=cfg.noise, num_envs=cfg.num_envs,
                                 config=cfg.env)
    return write_lerobot_dataset(out, data, fps=cfg.fps, camera_names=["top"], robot_type="color_reach_point",
                                 extra_info={"vla_rl": {"env": "builtin", "env_config": to_dict(cfg.env),
                                                        "collect": to_dict(cfg)}})
