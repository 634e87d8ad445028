"""Demonstration collection with scripted experts."""

from __future__ import annotations

import torch

from vla_rl.data import DemoDataset
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv


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
