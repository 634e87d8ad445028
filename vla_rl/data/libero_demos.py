"""Record LIBERO episodes as a LeRobot v3.0 dataset in the LIBERO feature layout of openpi's datasets.

openpi's community LIBERO dataset (``physical-intelligence/libero``) names its features ``image``
(agentview) and ``wrist_image`` (uint8 ``[256, 256, 3]``, rotated 180 degrees: ``image_orientation
"rot180"``), ``state`` (8 floats: end-effector position, axis-angle orientation, two gripper finger
positions) and ``actions`` (7 floats in [-1, 1], gripper -1 opens), at 10 fps, robot ``panda``.
:func:`record_libero_dataset` writes the same layout (``vla-rl collect libero OUT``).

Policies:

- ``expert``: the scripted expert of :mod:`vla_rl.envs.libero.expert` (privileged state -> OSC_POSE action),
  from the task's fixed init states 0, 1, ... (``init_states="fixed"``, LIBERO's official ones) or from sampled
  placements 0, 1, ... (``"sampled"``), until ``episodes_per_task`` episodes succeeded or ``max_tries`` init
  states were tried. Only successful episodes become demonstrations; every failure is counted and reported
  (printed, and in info.json's ``vla_rl.collect_report``).
- ``random``: smoothed random actions (an AR(1) process, so the arm actually moves), the gripper switching at
  random. It never solves a task; the data is for format and pipeline checks.

With ``cameras=[]`` the dataset has no image features (a state-only dataset, e.g. with ``state_mode=
"robot+objects"``: the objects' poses after the robot's 8 numbers).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch

from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.core.outputs import DATASET, check_output
from vla_rl.core.progress import progress as progress_bar
from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged
from vla_rl.core.schema import to_dict
from vla_rl.core.threads import policy_threads, threads_setting, torch_threads
from vla_rl.data.dataset import DemoDataset
from vla_rl.data.lerobot import write_lerobot_dataset
from vla_rl.envs.libero.expert import ExpertConfig, LiberoExpert, Push, UnsupportedGoal, plan_goal, read_scene
from vla_rl.envs.libero.robosuite_env import (
    NUM_FIXED_INIT_STATES,
    SUITE_NUM_TASKS,
    LiberoConfig,
    LiberoSingleEnv,
    NoStablePlacement,
)
from vla_rl.envs.registry import LIBERO

# Our LeRobot writer's names -> the LIBERO layout's.
LIBERO_FEATURES = {"observation.images.image": "image", "observation.images.wrist_image": "wrist_image",
                   "observation.state": "state", "action": "actions"}
CAMERA_FEATURES = {"agentview": "image", "wrist": "wrist_image"}   # the adapter's cameras -> the layout's


@dataclass(frozen=True)
class LiberoRecordConfig:
    """``vla-rl collect libero OUT`` settings."""

    suite: str = "libero_spatial"
    task_ids: list[int] | None = None       # None: every task of the suite
    # random: episodes per task (init states 0, 1, ...); expert: successful episodes wanted per task
    episodes_per_task: int = ranged(2, 1)
    policy: Literal["random", "expert"] = "random"
    init_states: Literal["fixed", "sampled"] = "fixed"   # LIBERO's shipped init states, or sampled placements
    max_tries: int | None = ranged(None, 1)  # expert: init states tried per task at most (None: fixed 50,
                                             # sampled 2 x episodes_per_task + 10)
    max_episode_steps: int | None = ranged(None, 1)  # None: random 50 (it never succeeds), expert the suite's limit
    image_size: int = ranged(256, 1)       # openpi's datasets: 256
    cameras: list[Literal["agentview", "wrist"]] = field(default_factory=lambda: ["agentview", "wrist"])
    image_orientation: Literal["upright", "rot180"] = "rot180"   # openpi's datasets: rot180
    state_mode: Literal["robot", "robot+objects"] = "robot"
    state_objects: int = ranged(2, 1, 8)
    reflections: bool = True               # LiberoConfig.reflections: False about halves a camera step's CPU
    action_scale: float = positive(0.5)    # random policy
    jitter: float = nonneg(0.0)            # expert: std (m) of its seeded waypoint offsets, for varied demos
    seed: int = nonneg(0)
    fps: int = ranged(10, 1)
    threads: int | Literal["auto"] = threads_setting()   # how fast, not what: not recorded in info.json

    def __post_init__(self):
        check_ranges(self)
        if self.init_states == "fixed":
            n = NUM_FIXED_INIT_STATES
            if self.episodes_per_task > n or (self.max_tries or 0) > n:
                raise ValueError(f"LIBERO ships {n} fixed init states per task: episodes_per_task and max_tries "
                                 f"must be <= {n} (init_states=sampled draws any number of placements)")
        if self.policy == "random" and self.init_states != "fixed":
            raise ValueError("the random policy records the fixed init states (init_states=fixed)")
        # the recording's env takes its suite and task ids: a name or id that does not exist is refused here, before
        # any simulator starts (not as a crashed worker)
        LiberoConfig(suite=self.suite, task_ids=self.task_ids, cameras=tuple(self.cameras))

    @property
    def ids(self) -> list[int]:
        """The task ids recorded: ``task_ids``, or every task of the suite."""
        return list(range(SUITE_NUM_TASKS.get(self.suite, 0))) if self.task_ids is None else list(self.task_ids)

    @property
    def tries(self) -> int:
        if self.policy == "random":
            return self.episodes_per_task
        if self.max_tries is not None:
            return max(self.max_tries, self.episodes_per_task)
        return 50 if self.init_states == "fixed" else 2 * self.episodes_per_task + 10

    @property
    def episode_steps(self) -> int | None:
        return self.max_episode_steps or (50 if self.policy == "random" else None)

    def env_config(self) -> dict:
        """The LiberoConfig fields of the recording's env (info.json's ``env_config``)."""
        return {"suite": self.suite, "task_ids": self.ids, "image_size": self.image_size,
                "cameras": list(self.cameras), "max_episode_steps": self.episode_steps,
                "image_orientation": self.image_orientation, "init_states": self.init_states,
                "state_mode": self.state_mode, "state_objects": self.state_objects, "reflections": self.reflections}


def random_policy(rng: np.random.Generator, scale: float):
    """Smoothed random 7-d actions in [-1, 1]; the gripper flips with probability 0.05 per step."""
    state = {"a": np.zeros(6), "grip": -1.0}

    def act(_obs: dict) -> np.ndarray:
        state["a"] = 0.8 * state["a"] + 0.6 * rng.standard_normal(6)
        if rng.random() < 0.05:
            state["grip"] = -state["grip"]
        return np.r_[np.clip(scale * state["a"], -1, 1), state["grip"]]

    return act


@dataclass
class TaskReport:
    """How the recording of one task went: what was tried, what succeeded, why the rest failed."""

    task_id: int
    instruction: str
    tried: list[int] = field(default_factory=list)      # init state (or placement) ids, in order
    succeeded: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)  # id -> reason
    lengths: list[int] = field(default_factory=list)     # of the successful episodes
    unsupported: str | None = None   # the expert has no plan for the task's goal (tried once, not per init state)

    def to_dict(self) -> dict:
        return {"task_id": self.task_id, "instruction": self.instruction, "tried": len(self.tried),
                "succeeded": len(self.succeeded), "success_rate": len(self.succeeded) / max(1, len(self.tried)),
                "failed": {str(k): v for k, v in self.failed.items()},
                "mean_length": float(np.mean(self.lengths)) if self.lengths else None,
                "unsupported": self.unsupported}


UNSUPPORTED = "unsupported goal"


def run_expert_episode(env, task_id: int, init_id: int, *, seed: int, jitter: float = 0.0):
    """One episode of the scripted expert on ``env`` (a :class:`~vla_rl.envs.libero.robosuite_env.LiberoSingleEnv`)
    from init state ``init_id``: ``(frames [(obs, action)], success, reason)``; ``reason`` says why a failure
    failed."""
    obs = env.reset_to(task_id, init_id)
    sim = env.sim_env
    scene = read_scene(sim)
    try:
        expert = LiberoExpert(plan_goal(sim.parsed_problem["goal_state"], scene), ExpertConfig(jitter=jitter),
                              seed=seed)
    except UnsupportedGoal as e:
        return [], False, f"{UNSUPPORTED}: {e}"
    frames, done, success = [], False, False
    while not done:
        action = expert.act(scene).astype(np.float32)
        frames.append((obs, action))
        obs, _, terminated, truncated, success = env.step(action)
        done = terminated or truncated
        if not done:
            scene = read_scene(sim)
    if success:
        return frames, True, ""
    where = f"primitive {expert.index + 1}/{len(expert.primitives)}, phase {expert.phase}"
    gave_up = "the pushed object kept sliding off the fingers" if isinstance(
        expert.primitives[min(expert.index, len(expert.primitives) - 1)], Push) else "grasps did not hold"
    why = f"the expert gave up ({gave_up})" if expert.status == "failed" else \
        f"the plan finished but the goal does not hold ({len(frames)} steps)" if expert.status == "done" else \
        f"step limit ({len(frames)} steps) in {where}"
    return frames, False, why


def record_libero_episodes(cfg: LiberoRecordConfig, *, progress: bool = True, log=print,
                           report: list | None = None) -> DemoDataset:
    """Run the policy on init states 0, 1, ... of each task (random: ``episodes_per_task`` of them; expert: until
    ``episodes_per_task`` succeeded or ``cfg.tries`` were tried); every frame is the observation before an
    action and that action. ``report`` (a list) receives one :meth:`TaskReport.to_dict` per task."""
    env = LiberoSingleEnv(LiberoConfig(suite=cfg.suite, task_ids=cfg.ids, image_size=cfg.image_size,
                                       cameras=tuple(cfg.cameras), max_episode_steps=cfg.episode_steps,
                                       image_orientation=cfg.image_orientation, init_states=cfg.init_states,
                                       state_mode=cfg.state_mode, state_objects=cfg.state_objects,
                                       reflections=cfg.reflections, max_cached_envs=1))
    rng = np.random.default_rng(cfg.seed)
    cols: dict[str, list] = {k: [] for k in ("images", "state", "action", "episode_index", "frame_index",
                                             "task_index")}
    tasks: list[str] = []
    reports: list[TaskReport] = []
    episode = 0
    start = time.perf_counter()
    try:
        bar = progress_bar(total=len(cfg.ids) * cfg.episodes_per_task, desc=f"LIBERO {cfg.policy} episodes",
                           unit="episodes", enabled=progress)
        for task_id in cfg.ids:
            rep = TaskReport(task_id, env.instruction_of(task_id))
            reports.append(rep)
            for init_id in range(cfg.tries):
                if len(rep.succeeded) >= cfg.episodes_per_task:
                    break
                rep.tried.append(init_id)
                if cfg.policy == "expert":
                    try:
                        frames, success, why = run_expert_episode(env, task_id, init_id, seed=cfg.seed + init_id,
                                                                  jitter=cfg.jitter)
                    except NoStablePlacement as e:
                        # LIBERO's sampler fails the task's placements, not this one: once a task, like a goal.
                        rep.failed[init_id] = rep.unsupported = f"no sampled placements ({e})"
                        log(f"task {task_id}: {e}; its other placements are not tried")
                        break
                    if not success and why.startswith(UNSUPPORTED):
                        # The goal is the task's, the same from every init state: say so once and move on.
                        rep.failed[init_id] = rep.unsupported = why
                        log(f"task {task_id}: {why}; its other init states are not tried")
                        break
                    if not success:
                        rep.failed[init_id] = why
                        log(f"task {task_id} init state {init_id}: failed ({why}); not recorded")
                        continue
                else:
                    frames = random_episode(env, task_id, init_id, random_policy(rng, cfg.action_scale))
                rep.succeeded.append(init_id)
                rep.lengths.append(len(frames))
                instruction = frames[0][0]["instruction"]
                if instruction not in tasks:
                    tasks.append(instruction)
                for t, (obs, action) in enumerate(frames):
                    cols["images"].append(obs["images"])
                    cols["state"].append(obs["state"])
                    cols["action"].append(action.astype(np.float32))
                    cols["episode_index"].append(episode)
                    cols["frame_index"].append(t)
                    cols["task_index"].append(tasks.index(instruction))
                episode += 1
                bar.update(1)
        bar.close()
    finally:
        env.close()
    if report is not None and reports:
        report.extend({**r.to_dict(), "seconds": None} for r in reports)
        report[-1]["seconds"] = round(time.perf_counter() - start, 1)   # the whole recording's wall time
    if not cols["state"]:
        why = "; ".join(f"task {r.task_id}: {r.unsupported}" for r in reports if r.unsupported)
        raise RuntimeError(f"no successful {cfg.policy} episode in {sum(len(r.tried) for r in reports)} tries: "
                           "nothing to write" + (f" ({why})" if why else ""))
    return DemoDataset(
        images=torch.from_numpy(np.stack(cols["images"])), state=torch.from_numpy(np.stack(cols["state"])),
        action=torch.from_numpy(np.stack(cols["action"])), episode_index=torch.tensor(cols["episode_index"]),
        frame_index=torch.tensor(cols["frame_index"]), task_index=torch.tensor(cols["task_index"]), tasks=tasks)


def random_episode(env, task_id: int, init_id: int, policy) -> list[tuple[dict, np.ndarray]]:
    """One episode of ``policy`` (obs -> action) from init state ``init_id``, to the step limit."""
    obs = env.reset_to(task_id, init_id)
    frames, done = [], False
    while not done:
        action = policy(obs)
        frames.append((obs, action))
        obs, _, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
    return frames


def report_table(report: list[dict]) -> str:
    """The expert's per-task success as a markdown table."""
    lines = ["| task | instruction | tried | succeeded | success | mean length |", "|---|---|---|---|---|---|"]
    for r in report:
        length = f"{r['mean_length']:.0f}" if r["mean_length"] is not None else "-"
        rate = f"{r['success_rate']:.2f}" + (f" ({r['unsupported']})" if r.get("unsupported") else "")
        lines.append(f"| {r['task_id']} | {r['instruction']} | {r['tried']} | {r['succeeded']} | {rate} | {length} |")
    tried, ok = sum(r["tried"] for r in report), sum(r["succeeded"] for r in report)
    lines.append(f"| all | | {tried} | {ok} | {ok / max(1, tried):.2f} | |")
    return "\n".join(lines)


def write_libero_layout(path: str | Path, data: DemoDataset, *, fps: int = 10, extra_info: dict | None = None,
                        cameras: tuple[str, ...] | list[str] = ("agentview", "wrist")) -> Path:
    """Write ``data`` (its cameras: ``cameras``, any of agentview and wrist, or none) as a LeRobot v3.0 dataset
    with the LIBERO feature names (``image``, ``wrist_image``, ``state``, ``actions``), atomically."""
    names = [CAMERA_FEATURES[c] for c in cameras]
    if data.images.shape[1] != len(names):
        raise ValueError(f"{len(names)} camera(s) named ({list(cameras)}), the data has {data.images.shape[1]}")
    with atomic_folder(path) as tmp:
        src = write_lerobot_dataset(tmp / "_lerobot_names", data, fps=fps, camera_names=names,
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


def recording_info(cfg: LiberoRecordConfig, report: list[dict] | None = None) -> dict:
    """info.json's ``vla_rl`` entry of a recording (with the expert's per-task ``collect_report``)."""
    # Same shape as the other envs' recordings: env name + the adapter config (LiberoConfig fields);
    # "collect": the recorder's own settings, as the built-in and ManiSkill collectors record theirs.
    out = {"env": LIBERO, "env_config": cfg.env_config(), "policy": cfg.policy, "seed": cfg.seed,
           "collect": {"kind": LIBERO, **{k: v for k, v in to_dict(cfg).items() if k != "threads"}}}
    if report is not None:
        out["collect_report"] = report
    return {"vla_rl": out}


def record_libero_dataset(path: str | Path, cfg: LiberoRecordConfig | None = None, *, progress: bool = True,
                          overwrite: bool = False, log=print) -> tuple[Path, list[dict]]:
    """Record episodes with :func:`record_libero_episodes` and write them in the LIBERO layout (a ``path``
    that holds anything is refused before any work unless ``overwrite``); returns the folder and the per-task
    report."""
    check_output(path, overwrite=overwrite, kind=DATASET, elsewhere="another OUT folder")
    cfg = cfg or LiberoRecordConfig()
    report: list[dict] = []
    with torch_threads(policy_threads(cfg.threads)):
        data = record_libero_episodes(cfg, progress=progress, log=log, report=report)
    return write_libero_layout(path, data, fps=cfg.fps, extra_info=recording_info(cfg, report),
                               cameras=cfg.cameras), report
