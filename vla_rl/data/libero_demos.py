"""Record LIBERO episodes as a LeRobot v3.0 dataset in the LIBERO feature layout of openpi's datasets.

openpi's community LIBERO dataset (``physical-intelligence/libero``) names its features ``image``
(agentview) and ``wrist_image`` (uint8 ``[256, 256, 3]``, rotated 180 degrees: ``image_orientation
"rot180"``), ``state`` (8 floats: end-effector position, axis-angle orientation, two gripper finger
positions) and ``actions`` (7 floats in [-1, 1], gripper -1 opens), at 10 fps, robot ``panda``.
:func:`record_libero_dataset` writes the same layout from episodes of a simple policy, so that reading
and SFT on that layout can be tested without downloading the real data (``vla-rl collect libero OUT``).

Policies: ``random``: smoothed random actions (an AR(1) process, so the arm actually moves), the gripper
switching at random. It never solves a task; the data is for format and pipeline checks.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch

from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.config import check_ranges, nonneg, positive, ranged, to_dict
from vla_rl.data.dataset import DemoDataset
from vla_rl.data.lerobot import write_lerobot_dataset
from vla_rl.envs.libero import LiberoConfig, LiberoSingleEnv
from vla_rl.outputs import DATASET, check_output
from vla_rl.progress import progress as progress_bar

# Our LeRobot writer's names -> the LIBERO layout's.
LIBERO_FEATURES = {"observation.images.image": "image", "observation.images.wrist_image": "wrist_image",
                   "observation.state": "state", "action": "actions"}


@dataclass(frozen=True)
class LiberoRecordConfig:
    """``vla-rl collect libero OUT`` settings."""

    suite: str = "libero_spatial"
    task_ids: list[int] = field(default_factory=lambda: [0])
    episodes_per_task: int = ranged(2, 1, 50)  # init states 0, 1, ... of each task (LIBERO ships 50)
    policy: Literal["random"] = "random"
    max_episode_steps: int = ranged(50, 1)  # the random policy never succeeds: every episode has this length
    image_size: int = ranged(256, 1)       # openpi's datasets: 256
    image_orientation: Literal["upright", "rot180"] = "rot180"   # openpi's datasets: rot180
    action_scale: float = positive(0.5)
    seed: int = nonneg(0)
    fps: int = ranged(10, 1)

    def __post_init__(self):
        check_ranges(self)


def random_policy(rng: np.random.Generator, scale: float):
    """Smoothed random 7-d actions in [-1, 1]; the gripper flips with probability 0.05 per step."""
    state = {"a": np.zeros(6), "grip": -1.0}

    def act(_obs: dict) -> np.ndarray:
        state["a"] = 0.8 * state["a"] + 0.6 * rng.standard_normal(6)
        if rng.random() < 0.05:
            state["grip"] = -state["grip"]
        return np.r_[np.clip(scale * state["a"], -1, 1), state["grip"]]

    return act


def record_libero_episodes(cfg: LiberoRecordConfig, *, progress: bool = True) -> DemoDataset:
    """Run ``cfg.episodes_per_task`` episodes (init states 0, 1, ...) of each task; every frame is the
    observation before an action and that action."""
    env = LiberoSingleEnv(LiberoConfig(suite=cfg.suite, task_ids=list(cfg.task_ids), image_size=cfg.image_size,
                                       max_episode_steps=cfg.max_episode_steps,
                                       image_orientation=cfg.image_orientation))
    rng = np.random.default_rng(cfg.seed)
    cols: dict[str, list] = {k: [] for k in ("images", "state", "action", "episode_index", "frame_index",
                                             "task_index")}
    tasks: list[str] = []
    episode = 0
    try:
        bar = progress_bar(total=len(cfg.task_ids) * cfg.episodes_per_task, desc="LIBERO episodes", unit="episodes",
                           enabled=progress)
        for task_id in cfg.task_ids:
            for init_id in range(cfg.episodes_per_task):
                obs = env.reset_to(task_id, init_id)
                if obs["instruction"] not in tasks:
                    tasks.append(obs["instruction"])
                policy = random_policy(rng, cfg.action_scale)
                done, t = False, 0
                while not done:
                    action = policy(obs)
                    cols["images"].append(obs["images"])
                    cols["state"].append(obs["state"])
                    cols["action"].append(action.astype(np.float32))
                    cols["episode_index"].append(episode)
                    cols["frame_index"].append(t)
                    cols["task_index"].append(tasks.index(obs["instruction"]))
                    obs, _, terminated, truncated, _ = env.step(action)
                    done, t = terminated or truncated, t + 1
                episode += 1
                bar.update(1)
        bar.close()
    finally:
        env.close()
    return DemoDataset(
        images=torch.from_numpy(np.stack(cols["images"])), state=torch.from_numpy(np.stack(cols["state"])),
        action=torch.from_numpy(np.stack(cols["action"])), episode_index=torch.tensor(cols["episode_index"]),
        frame_index=torch.tensor(cols["frame_index"]), task_index=torch.tensor(cols["task_index"]), tasks=tasks)


def write_libero_layout(path: str | Path, data: DemoDataset, *, fps: int = 10, extra_info: dict | None = None) -> Path:
    """Write ``data`` (cameras agentview, wrist) as a LeRobot v3.0 dataset with the LIBERO feature names
    (``image``, ``wrist_image``, ``state``, ``actions``), atomically."""
    if data.images.shape[1] != 2:
        raise ValueError(f"the LIBERO layout has 2 cameras (image, wrist_image), the data has {data.images.shape[1]}")
    with atomic_folder(path) as tmp:
        src = write_lerobot_dataset(tmp / "_lerobot_names", data, fps=fps, camera_names=["image", "wrist_image"],
                                    robot_type="panda", extra_info=extra_info)
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            rel = f.relative_to(src)
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel.parts[0] == "data":
                table = pq.read_table(f)
                pq.write_table(table.rename_columns([LIBERO_FEATURES.get(c, c) for c in table.column_names]), dst)
            elif rel.name in ("info.json", "stats.json"):
                doc = json.loads(f.read_text())
                if rel.name == "info.json":
                    doc["features"] = {LIBERO_FEATURES.get(k, k): v for k, v in doc["features"].items()}
                else:
                    doc = {LIBERO_FEATURES.get(k, k): v for k, v in doc.items()}
                dst.write_text(json.dumps(doc, indent=2))
            else:
                shutil.copyfile(f, dst)
        shutil.rmtree(src)
    return Path(path)


def recording_info(cfg: LiberoRecordConfig) -> dict:
    """info.json's ``vla_rl`` entry of a recording."""
    # Same shape as the other envs' recordings: env name + the adapter config (LiberoConfig fields).
    env_config = {"suite": cfg.suite, "task_ids": list(cfg.task_ids), "image_size": cfg.image_size,
                  "cameras": ["agentview", "wrist"], "max_episode_steps": cfg.max_episode_steps,
                  "image_orientation": cfg.image_orientation}
    # "collect": the recorder's own settings, as the built-in and ManiSkill collectors record theirs.
    return {"vla_rl": {"env": "libero", "env_config": env_config, "policy": cfg.policy, "seed": cfg.seed,
                       "collect": {"kind": "libero", **to_dict(cfg)}}}


def record_libero_dataset(path: str | Path, cfg: LiberoRecordConfig | None = None, *, progress: bool = True,
                          overwrite: bool = False) -> Path:
    """Record episodes with :func:`record_libero_episodes` and write them in the LIBERO layout (a ``path``
    that holds anything is refused before any work unless ``overwrite``)."""
    check_output(path, overwrite=overwrite, kind=DATASET, elsewhere="another OUT folder")
    cfg = cfg or LiberoRecordConfig()
    data = record_libero_episodes(cfg, progress=progress)
    return write_libero_layout(path, data, fps=cfg.fps, extra_info=recording_info(cfg))
