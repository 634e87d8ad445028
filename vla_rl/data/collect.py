"""Demonstration collection with scripted experts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from vla_rl.core.outputs import DATASET, TRAJECTORIES, check_output
from vla_rl.core.progress import progress as progress_bar
from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, ranged, setting
from vla_rl.core.schema import to_dict
from vla_rl.core.threads import policy_threads, threads_setting, torch_threads
from vla_rl.data.dataset import DemoDataset
from vla_rl.data.lerobot import write_lerobot_dataset
from vla_rl.data.maniskill_demos import PLANNED_TASKS, collect_maniskill
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.envs.registry import BUILTIN, MANISKILL

# Kinds of scripted experts ``vla-rl collect`` knows: the built-in task's expert, ManiSkill's motion planners.
COLLECT_KINDS = (BUILTIN, MANISKILL)
# The settings each collector reads (the others belong to the other collector). info.json records these
# only, resolved, and setting another collector's field is refused: it would do nothing.
COMMON_FIELDS = ("episodes", "seed", "fps", "video")
KIND_FIELDS = {BUILTIN: ("noise", "num_envs", "env"),
               MANISKILL: ("task", "control_mode", "obs_mode", "image_size", "max_episode_steps", "max_tries")}
DEFAULT_FPS = {BUILTIN: 10, MANISKILL: 20}   # built-in: no clock; ManiSkill: its 20 Hz control rate


@dataclass(frozen=True)
class CollectConfig:
    """``vla-rl collect builtin OUT`` settings."""

    episodes: int = ranged(50, 1, doc="episodes to record")
    seed: int = nonneg(0, doc="seed of the first episode (episode k: seed + k)")
    noise: float = nonneg(0.1, doc="Gaussian action noise of the expert (demos then show some recoveries)")
    num_envs: int = ranged(16, 1, doc="built-in: envs the expert runs in parallel")
    fps: int | None = ranged(None, 1, doc="LeRobot timestamps; None: DEFAULT_FPS of the kind")
    env: ColorReachConfig = setting(default_factory=ColorReachConfig, doc="built-in: the task's level")
    video: bool = setting(
        False, doc="camera images as MP4 files (AV1, lossy, LeRobot's default for recorded data) instead of PNG in "
                   "the parquet")
    task: str = setting("PushCube-v1", doc="ManiSkill: the task (vla_rl.data.maniskill_demos)")
    control_mode: str = setting("pd_ee_delta_pose", doc="ManiSkill: the control mode the demos are converted to")
    obs_mode: Literal["state", "rgb"] = setting(
        "state", doc="ManiSkill: rgb = camera images (image_size px) + proprioception")
    image_size: int = ranged(64, 1, doc="ManiSkill: camera images are S x S")
    max_episode_steps: int | None = ranged(
        None, 1, doc="ManiSkill: the episode limit recorded for evaluation / RL (None: the task's, raised to 1.5 x the "
                     "longest demo)")
    max_tries: int | None = ranged(
        None, 1, doc="ManiSkill: motion plans tried at most (seeds seed, seed + 1, ...) to get `episodes` good demos; "
                     "a plan that fails, or whose conversion to control_mode fails or is corrupt, is dropped and "
                     "reported. None: 3 x episodes + 10.")
    threads: int | Literal["auto"] = threads_setting()   # how fast, not what: not recorded in info.json

    def __post_init__(self):
        check_ranges(self)


def collector_settings(kind: str, cfg: CollectConfig) -> dict:
    """The settings of ``cfg`` that the ``kind`` collector reads, with ``fps`` and ``max_tries`` resolved (what
    info.json's ``vla_rl.collect`` records). A field of the other collector set away from its default is a
    :class:`ConfigError` naming it."""
    if kind not in COLLECT_KINDS:
        raise ConfigError(f"unknown collect kind {kind!r}; supported: {list(COLLECT_KINDS)}")
    defaults = CollectConfig()
    foreign = [f"{name} ({other})" for other, names in KIND_FIELDS.items() if other != kind for name in names
               if getattr(cfg, name) != getattr(defaults, name)]
    if foreign:
        raise ConfigError(f"collect {kind} does not read {', '.join(foreign)}: those settings are for the "
                          "collector named in brackets")
    full = to_dict(cfg)
    out = {name: full[name] for name in COMMON_FIELDS + KIND_FIELDS[kind]}
    out["fps"] = cfg.fps or DEFAULT_FPS[kind]
    if kind == MANISKILL:
        out["max_tries"] = cfg.max_tries or 3 * cfg.episodes + 10
    return {"kind": kind, **out}


def collect_builtin_demos(num_episodes: int, *, seed: int = 0, noise: float = 0.1, num_envs: int = 16,
                          config: ColorReachConfig | None = None, progress: bool = False) -> DemoDataset:
    """Successful ColorReach episodes of the scripted expert (with Gaussian action noise ``noise``, so
    the demos cover some recovery states), recorded frame by frame."""
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    env = ColorReachEnv(num_envs, config=config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    obs = env.reset(seed=seed)
    buffers = [[] for _ in range(num_envs)]
    episodes: list[list[tuple]] = []
    bar = progress_bar(total=num_episodes, desc="expert episodes", unit="episodes", enabled=progress)
    while len(episodes) < num_episodes:
        action = env.expert_action(noise=noise, generator=gen)
        for i in range(num_envs):
            buffers[i].append((obs["images"][i], obs["state"][i], action[i], obs["instruction"][i]))
        out = env.step(action[:, None, :])
        obs = out.obs
        for i in out.done.nonzero(as_tuple=True)[0].tolist():
            if bool(out.terminated[i]) and len(episodes) < num_episodes:  # keep successes only
                episodes.append(buffers[i])
                bar.update(1)
            buffers[i] = []
    bar.close()
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


def collect_dataset(kind: str, out: str | Path, cfg: CollectConfig, *, overwrite: bool = False,
                    progress: bool = True) -> Path:
    """Collect ``cfg.episodes`` expert demos of ``kind`` and write them as a LeRobot v3.0 dataset at ``out``
    (``builtin``: the scripted expert; ``maniskill``: ManiSkill's motion planner for ``cfg.task``, converted
    to ``cfg.control_mode`` with state observations, see :mod:`vla_rl.data.maniskill_demos`).

    info.json records the env (``"vla_rl": {"env": ..., "env_config": ...}``) so ``vla-rl sft`` can
    evaluate on the task the demos came from, and the collector's settings (``"collect"``:
    :func:`collector_settings`). An ``out`` that holds anything is refused before any work
    unless ``overwrite`` (then replaced atomically once the new dataset is complete)."""
    settings = collector_settings(kind, cfg)
    check_output(out, overwrite=overwrite, kind=DATASET, elsewhere="another OUT folder")
    if kind == MANISKILL:   # ManiSkill's own files of an earlier collection into OUT live beside it
        raw = Path(out).with_name(Path(out).name + ".maniskill")
        check_output(raw, overwrite=overwrite, kind=TRAJECTORIES, elsewhere="another OUT folder")
    if kind == MANISKILL and cfg.task not in PLANNED_TASKS:
        raise ConfigError(f"ManiSkill has no motion-planning solution for task={cfg.task!r}; it has one for: "
                          f"{', '.join(PLANNED_TASKS)}")
    with torch_threads(policy_threads(cfg.threads)):
        return _collect(kind, out, cfg, settings, progress)


def _collect(kind: str, out: str | Path, cfg: CollectConfig, settings: dict, progress: bool) -> Path:
    if kind == MANISKILL:
        return collect_maniskill(out, task=cfg.task, episodes=cfg.episodes, seed=cfg.seed,
                                 control_mode=cfg.control_mode, obs_mode=cfg.obs_mode, image_size=cfg.image_size,
                                 max_episode_steps=cfg.max_episode_steps, max_tries=settings["max_tries"],
                                 fps=settings["fps"], video=cfg.video, extra_info={"collect": settings},
                                 progress=progress)
    data = collect_builtin_demos(cfg.episodes, seed=cfg.seed, noise=cfg.noise, num_envs=cfg.num_envs,
                                 config=cfg.env, progress=progress)
    return write_lerobot_dataset(out, data, fps=settings["fps"], camera_names=["top"],
                                 robot_type="color_reach_point", video=cfg.video,
                                 extra_info={"vla_rl": {"env": BUILTIN, "env_config": to_dict(cfg.env),
                                                        "collect": settings}})
