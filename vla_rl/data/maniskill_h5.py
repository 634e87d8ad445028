"""ManiSkill3 trajectory files (``.h5`` + the ``.json`` beside it) read as a
:class:`~vla_rl.data.dataset.DemoDataset`: the files :mod:`vla_rl.data.maniskill_demos` collects, or any a user
brings.

ManiSkill's trajectory format: ``traj_<i>/obs`` has one more row than ``traj_<i>/actions`` (the final
observation); frame ``t`` pairs ``obs[t]`` with ``actions[t]``. The ``.json`` beside the file names the
task (``env_info.env_id``), its control / observation mode and each episode's reset seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vla_rl.data.dataset import DemoDataset
from vla_rl.envs.maniskill import default_instruction


class ManiSkillDemoError(RuntimeError):
    """A ManiSkill demonstration file or collection that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class DroppedEpisode:
    """An episode left out of a collection: its reset seed and why."""

    seed: int | None
    reason: str


@dataclass(frozen=True)
class ManiSkillTrajectoryInfo:
    task: str
    control_mode: str
    obs_mode: str
    episodes: list[dict]


def read_trajectory_info(h5: str | Path) -> ManiSkillTrajectoryInfo:
    """The ``.json`` ManiSkill writes beside a trajectory ``.h5``."""
    path = Path(h5).with_suffix(".json")
    if not path.is_file():
        raise ManiSkillDemoError(f"{path} not found: ManiSkill writes it beside every trajectory .h5, and it "
                                 "names the task and the control mode")
    try:
        meta = json.loads(path.read_text())
        env_info = meta["env_info"]
        kwargs = env_info.get("env_kwargs", {})
        return ManiSkillTrajectoryInfo(task=env_info["env_id"], control_mode=kwargs.get("control_mode"),
                                       obs_mode=kwargs.get("obs_mode"), episodes=list(meta["episodes"]))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ManiSkillDemoError(f"{path} is not a ManiSkill trajectory description ({type(e).__name__}: {e})") \
            from e


def _leaves(group, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    """(path, array) of every dataset under ``group``, keys sorted at each level (the adapter's order)."""
    import h5py

    out = []
    for key in sorted(group):
        item = group[key]
        if isinstance(item, h5py.Dataset):
            out.append((prefix + key, np.asarray(item)))
        else:
            out += _leaves(item, f"{prefix}{key}/")
    return out


def _frames(obs, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(images ``[T+1, C, S, S, 3]`` uint8, state ``[T+1, D]`` float32) of one episode's observations,
    laid out as :func:`vla_rl.envs.maniskill._convert_obs` lays out the live env's: ``state`` obs are the
    flat vector; ``rgb`` obs give every camera's rgb, and every non-camera entry flattened in sorted key
    order as the state."""
    import h5py

    if isinstance(obs, h5py.Dataset):
        if obs.ndim != 2:
            raise ManiSkillDemoError(f"{where}/obs is not a flat [T+1, D] state array")
        state = np.asarray(obs, np.float32)
        return np.zeros((len(state), 0, 1, 1, 3), np.uint8), state
    if "sensor_data" not in obs:
        raise ManiSkillDemoError(f"{where}/obs has no sensor_data (keys: {sorted(obs)})")
    cams = [c for c in obs["sensor_data"] if "rgb" in obs["sensor_data"][c]]
    if not cams:
        raise ManiSkillDemoError(f"{where}/obs/sensor_data has no rgb camera")
    images = np.stack([np.asarray(obs["sensor_data"][c]["rgb"], np.uint8) for c in cams], axis=1)
    parts = [a.reshape(len(a), -1).astype(np.float32) for k in sorted(obs) if k not in ("sensor_data", "sensor_param")
             for _, a in _leaves(obs[k])]
    return images, np.concatenate(parts, axis=1)


def kept_episodes(info: ManiSkillTrajectoryInfo, max_episodes: int | None = None) -> list[dict]:
    """The ``.json`` entries of the episodes :func:`read_maniskill_h5` reads, in its order: the successful
    ones, the first ``max_episodes`` of them."""
    return [ep for ep in info.episodes if ep.get("success", True)][:max_episodes]


def episode_seed(ep: dict) -> int | None:
    """The reset seed a ``.json`` episode entry names (``reset_kwargs.seed``, else ``episode_seed``)."""
    seed = (ep.get("reset_kwargs") or {}).get("seed", ep.get("episode_seed"))
    if isinstance(seed, list):   # ManiSkill writes a list for batched resets; ours are single envs
        seed = seed[0] if seed else None
    return None if seed is None else int(seed)


def _episode_frames(f, h5: Path, ep: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, state, actions) of one episode of an open trajectory file; raises :class:`ManiSkillDemoError`
    naming the episode when it is missing, inconsistent or not finite."""
    key = f"traj_{ep['episode_id']}"
    if key not in f:
        raise ManiSkillDemoError(f"{h5}: episode {key} is listed in the .json but missing")
    img, obs = _frames(f[key]["obs"], f"{h5}: {key}")
    act = np.asarray(f[key]["actions"], np.float32)
    if len(obs) != len(act) + 1 or act.ndim != 2:
        raise ManiSkillDemoError(f"{h5}: {key} has {len(obs)} observations for {len(act)} actions "
                                 "(expected one more observation than actions)")
    if not (np.isfinite(obs).all() and np.isfinite(act).all()):
        raise ManiSkillDemoError(f"{h5}: {key} contains NaN or inf")
    return img[:-1], obs[:-1], act


def read_maniskill_episodes(
        h5: str | Path, *, instruction: str | None = None, max_episodes: int | None = None,
        drop_bad: bool = False) -> tuple[DemoDataset | None, list[int | None], list[DroppedEpisode]]:
    """The successful episodes of a ManiSkill trajectory file (see :func:`read_maniskill_h5`), each episode's
    reset seed, and the episodes left out. With ``drop_bad`` an episode whose frames are missing, inconsistent
    or not finite is left out (with its seed and the reason) instead of failing the whole file; None when
    no episode is left."""
    import h5py

    h5 = Path(h5)
    info = read_trajectory_info(h5)
    if info.obs_mode not in ("state", "rgb", None):
        raise ManiSkillDemoError(f"{h5} has {info.obs_mode!r} observations; 'state' and 'rgb' are read "
                                 "(convert with obs_mode='state' or 'rgb')")
    text = instruction or default_instruction(info.task)
    images, states, actions, ep_idx, fr_idx, seeds, dropped = [], [], [], [], [], [], []
    try:
        f = h5py.File(h5, "r")
    except OSError as e:
        raise ManiSkillDemoError(f"{h5} is not a readable HDF5 file ({e})") from e
    with f:
        for ep in kept_episodes(info, max_episodes):
            try:
                img, obs, act = _episode_frames(f, h5, ep)
            except ManiSkillDemoError as e:
                if not drop_bad:
                    raise
                dropped.append(DroppedEpisode(episode_seed(ep), str(e)))
                continue
            e = len(states)
            images.append(img)
            states.append(obs)
            actions.append(act)
            ep_idx.append(np.full(len(act), e))
            fr_idx.append(np.arange(len(act)))
            seeds.append(episode_seed(ep))
    if not states:
        return None, [], dropped
    state = torch.from_numpy(np.concatenate(states))
    m = state.shape[0]
    data = DemoDataset(images=torch.from_numpy(np.concatenate(images)), state=state,
                       action=torch.from_numpy(np.concatenate(actions)),
                       episode_index=torch.from_numpy(np.concatenate(ep_idx)),
                       frame_index=torch.from_numpy(np.concatenate(fr_idx)),
                       task_index=torch.zeros(m, dtype=torch.long), tasks=[text])
    return data, seeds, dropped


def read_maniskill_h5(h5: str | Path, *, instruction: str | None = None,
                      max_episodes: int | None = None) -> DemoDataset:
    """A ManiSkill trajectory file as a :class:`DemoDataset`, instruction from the task id.

    ``state`` observations give a state-only dataset (``images`` ``[M, 0, 1, 1, 3]``); ``rgb`` ones give
    the cameras' images and the proprioception + task extras as the state, in the adapter's layout. Only
    successful episodes are kept (all are, in files written by :func:`convert_demos`); an episode whose frames
    are missing, inconsistent or not finite is an error."""
    data, _, _ = read_maniskill_episodes(h5, instruction=instruction, max_episodes=max_episodes)
    if data is None:
        raise ManiSkillDemoError(f"{h5} holds no successful episodes")
    return data
