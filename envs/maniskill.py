"""ManiSkill3 adapter: any ManiSkill task behind the batched chunk-stepping interface of :mod:`envs.base`.

Two ways to run it (``make_maniskill_env`` picks one from the device):

- CPU: ManiSkill's CPU physics builds one env per ``gym.make``, so :class:`ManiSkillSingleEnv` (one env,
  numpy in / numpy out) runs inside the worker processes of :class:`envs.workers.WorkerVectorEnv`, one or
  several per process.
- GPU: :class:`ManiSkillGPUEnv` runs ``num_envs`` envs in one process with ``physx_cuda`` and
  implements the batched interface directly, with ManiSkill's own partial reset.

Observations: ``images`` uint8 ``[C, S, S, 3]`` (``C = 0`` for ``obs_mode="state"``), ``state`` float32
``[D]``, ``instruction`` str. ``state`` is ManiSkill's flat privileged state vector for ``"state"`` and
``"rgb+state"``; for ``"rgb"`` it is proprioception plus task extras (agent qpos, qvel, tcp pose, is_grasped,
goal position ...: every non-camera entry of ManiSkill's rgb observation, flattened in sorted key order).

Actions: ManiSkill's own (``pd_ee_delta_pose``: 3 position deltas, 3 rotation deltas, gripper; all in
[-1, 1]). Gripper sign: +1 opens, -1 closes (LIBERO is the other way round).

Episodes end by ``terminated`` (ManiSkill: success, or failure where a task defines one) or by the time
limit, counted here (``max_episode_steps``, default: the task's registered limit).

Glossary: N envs, H actions per chunk, A action dims, C cameras, S image size, D state dims.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from vla_rl.core.paths import cache_dir, checkout_root
from vla_rl.core.ranges import check_ranges, ranged, setting
from vla_rl.envs.base import (
    DELTA_POSE_ACTIONS,
    ChunkBook,
    ChunkStep,
    EnvSpec,
    EpisodeTracker,
    SimulatorUnavailable,
    check_action_chunk,
    check_env_indices,
)
from vla_rl.envs.workers import WorkerVectorEnv

LAVAPIPE_ICD = cache_dir() / "mesa25" / "lvp_icd.x86_64.json"
SETUP_HINT = ("run `make sims` (or `PY=.venv/bin/python bash scripts/setup_maniskill.sh`) to install "
              "mani-skill 3.0.1 / sapien 3.0.3 and the Mesa 25 lavapipe Vulkan driver"
              + ("" if checkout_root() else f" (an installed package looks for it under {cache_dir()}: run the "
                 "script with VLA_RL_CACHE set to that folder)"))
NVIDIA_ICDS = ("/usr/share/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.json")

INSTRUCTIONS = {
    "PickCube": "pick up the red cube and move it to the goal position",
    "PushCube": "push the cube onto the red and white target",
    "StackCube": "stack the red cube on top of the green cube",
    "PullCube": "pull the cube back onto the red and white target",
    "LiftPegUpright": "lift the peg and stand it upright on the table",
    "PegInsertionSide": "pick up the peg and insert its orange end into the hole in the box",
    "PlaceSphere": "place the sphere into the shallow bin",
    "PokeCube": "use the peg to poke the red cube to the goal",
    "PullCubeTool": "use the L-shaped tool to pull the cube closer",
    "PushT": "push the T-shaped block onto the T-shaped target",
    "RollBall": "push the ball so that it rolls to the red and white target",
    "PlugCharger": "plug the charger into the receptacle",
}

OBS_MODES = ("state", "rgb", "rgb+state")
REWARDS = {"sparse": "sparse", "dense": "normalized_dense", "dense_cost": "normalized_dense"}
# Added to every step's reward. ``dense_cost`` is normalized_dense - 1: ManiSkill normalises each task's
# dense reward so that a success step earns exactly 1, so the shifted reward is <= 0 before success and 0
# at it, and the success (terminated) state is worth 0 after. Plain dense reward with terminate-on-success
# pays an agent to hover near the goal (0.6-0.8 per step on PickCube, forever) rather than finish (1,
# once); with the cost every step short of success loses, so finishing early is the best return.
REWARD_OFFSET = {"sparse": 0.0, "dense": 0.0, "dense_cost": -1.0}
SIM_BACKENDS = ("auto", "cpu", "gpu")


def task_base_name(task: str) -> str:
    return re.sub(r"-v\d+$", "", task)


def default_instruction(task: str) -> str:
    """The instruction of ``task``: from :data:`INSTRUCTIONS`, else the words of the task id
    (``"OpenCabinetDrawer-v1"`` -> ``"open cabinet drawer"``)."""
    base = task_base_name(task)
    if base in INSTRUCTIONS:
        return INSTRUCTIONS[base]
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", base)
    return " ".join(w.lower() for w in words) or task


@dataclass(frozen=True)
class ManiSkillConfig:
    """One ManiSkill task and how to observe / reward it."""

    task: str = setting("PickCube-v1", doc="any ManiSkill env id")
    control_mode: str = setting("pd_ee_delta_pose", doc="ManiSkill's controller (the action space)")
    obs_mode: Literal["state", "rgb", "rgb+state"] = setting(
        "state", doc="state: the flat privileged state vector; rgb: camera images and proprioception; rgb+state: both")
    reward: Literal["sparse", "dense", "dense_cost"] = setting(
        "sparse", doc="sparse: 1 on success; dense: ManiSkill's normalized_dense; dense_cost: normalized_dense - 1 "
                      "(a per-step cost, see REWARD_OFFSET)")
    image_size: int = ranged(64, 1, doc="camera images are S x S")
    max_episode_steps: int | None = ranged(None, 1, doc="None: the task's registered limit")
    instruction: str | None = setting(None, doc="None: default_instruction(task)")
    sim_backend: Literal["auto", "cpu", "gpu"] = setting("auto", doc="auto: gpu on a cuda device, else cpu")
    render_size: int = ranged(256, 1, doc="render_frame() size (videos)")

    def __post_init__(self):
        check_ranges(self)
        if self.obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {self.obs_mode!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {tuple(REWARDS)}, got {self.reward!r}")
        if self.sim_backend not in SIM_BACKENDS:
            raise ValueError(f"sim_backend must be one of {SIM_BACKENDS}, got {self.sim_backend!r}")

    @property
    def task_instruction(self) -> str:
        return self.instruction if self.instruction is not None else default_instruction(self.task)

    @property
    def uses_cameras(self) -> bool:
        return self.obs_mode != "state"


class ManiSkillUnavailable(SimulatorUnavailable):
    """ManiSkill, its Vulkan driver or its GPU physics library cannot be used on this machine."""


# ----------------------------------------------------------------------------------------------------
def ensure_vulkan(lavapipe: bool = True) -> None:
    """Import ManiSkill with a working Vulkan driver selected.

    With ``lavapipe`` (CPU machines) ``VK_ICD_FILENAMES`` defaults to the Mesa 25 lavapipe unpacked by
    ``scripts/setup_maniskill.sh``; Debian's own Mesa 22 is too old. A value already set is kept.
    """
    if lavapipe and LAVAPIPE_ICD.is_file():
        os.environ.setdefault("VK_ICD_FILENAMES", str(LAVAPIPE_ICD))
    try:
        import mani_skill.envs  # noqa: F401  (registers the tasks with gymnasium)
        import sapien  # noqa: F401
    except ImportError as e:
        raise ManiSkillUnavailable(f"ManiSkill3 is not installed ({e}); {SETUP_HINT}") from e


def enable_physx_gpu() -> None:
    """Load SAPIEN's PhysX GPU library, which ``physx_cuda`` needs.

    SAPIEN does not ship it in the wheel: on first use it downloads it from GitHub into
    ``~/.sapien/physx/<version>/``. Where that cannot be reached (a cluster node offline, a sandbox), the
    download fails deep inside SAPIEN; this names the file, the place and the fix instead.
    """
    import sapien.physx as physx

    try:
        physx.enable_gpu()
    except Exception as e:
        version = physx.version()
        where = Path.home() / ".sapien" / "physx" / version
        raise ManiSkillUnavailable(
            f"ManiSkill's GPU simulation needs SAPIEN's PhysX GPU library libPhysXGpu_64.so (PhysX {version}), "
            f"which SAPIEN downloads from GitHub on first use, and that failed ({type(e).__name__}: {e}). "
            f"On a machine with internet access, download https://github.com/sapien-sim/physx-precompiled/"
            f"releases/download/{version}/linux-so.zip and unzip it into {where} on this machine; "
            f"or use the CPU path (sim_backend='cpu', worker processes).") from e


def _vulkan_error(e: Exception) -> bool:
    msg = str(e).lower()
    return any(k in msg for k in ("vulkan", "physical device", "vk_", "icd"))


def check_task(task: str) -> None:
    """Raise ValueError when ``task`` is not a registered ManiSkill env, or needs missing assets."""
    import gymnasium as gym
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        names = sorted(REGISTERED_ENVS) or sorted(gym.registry)
        close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
        close += [n for n in names if task_base_name(n).lower() == task_base_name(task).lower() and n not in close]
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown ManiSkill task {task!r}{hint} ({len(names)} tasks are registered)")
    from mani_skill.utils import assets

    missing = []
    for asset_id in REGISTERED_ENVS[task].asset_download_ids or []:
        ids = (assets.expand_data_group_into_individual_data_source_ids(asset_id)
               if asset_id in assets.DATA_GROUPS else [asset_id])
        missing += [i for i in ids if not assets.is_data_source_downloaded(i)]
    if missing:
        # ManiSkill would prompt on stdin (and exit) here, which hangs a worker process.
        raise ValueError(f"ManiSkill task {task!r} needs assets that are not downloaded: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                         f"(python -m mani_skill.utils.download_asset {task})")


def task_max_episode_steps(task: str) -> int:
    from mani_skill.utils.registration import REGISTERED_ENVS

    steps = REGISTERED_ENVS[task].max_episode_steps
    if steps is None:
        raise ValueError(f"ManiSkill task {task!r} has no registered time limit: set max_episode_steps")
    return int(steps)


def make_task(task: str, **kwargs):
    """``gym.make(task, **kwargs)``, where a task whose scene needs a package that is not installed
    (DrawSVG-v1 needs ``svgpathtools``) or a Vulkan driver that does not start raises
    :class:`ManiSkillUnavailable` saying so."""
    import gymnasium as gym

    try:
        return gym.make(task, **kwargs)
    except ImportError as e:
        raise ManiSkillUnavailable(f"ManiSkill task {task} needs a package that is not installed ({e})") from e
    except Exception as e:
        if _vulkan_error(e):
            raise ManiSkillUnavailable(f"ManiSkill could not start Vulkan ({e}); "
                                       f"VK_ICD_FILENAMES={os.environ.get('VK_ICD_FILENAMES')!r}; {SETUP_HINT}") from e
        raise


def _make(cfg: ManiSkillConfig, num_envs: int, gpu: bool):
    kwargs = dict(obs_mode=cfg.obs_mode, control_mode=cfg.control_mode, reward_mode=REWARDS[cfg.reward],
                  num_envs=num_envs, render_mode="rgb_array",
                  sim_backend="physx_cuda" if gpu else "physx_cpu",
                  render_backend="sapien_cuda" if gpu else "sapien_cpu",
                  human_render_camera_configs=dict(width=cfg.render_size, height=cfg.render_size))
    if cfg.uses_cameras:
        kwargs["sensor_configs"] = dict(width=cfg.image_size, height=cfg.image_size)
    return make_task(cfg.task, **kwargs)


def _flatten(d: dict, out: list[Tensor]) -> None:
    for key in sorted(d):
        v = d[key]
        if isinstance(v, dict):
            _flatten(v, out)
        else:
            out.append(v.reshape(v.shape[0], -1).float())


def _convert_obs(raw, cfg: ManiSkillConfig, cameras: list[str]) -> tuple[Tensor, Tensor]:
    """ManiSkill's batched observation -> (images ``[N, C, S, S, 3]`` uint8, state ``[N, D]`` float32)."""
    if cfg.obs_mode == "state":
        state = raw.float()
        images = torch.zeros(state.shape[0], 0, cfg.image_size, cfg.image_size, 3, dtype=torch.uint8,
                             device=state.device)
        return images, state
    images = torch.stack([raw["sensor_data"][c]["rgb"] for c in cameras], dim=1)
    if cfg.obs_mode == "rgb+state":
        return images, raw["state"].float()
    parts: list[Tensor] = []
    _flatten({k: v for k, v in raw.items() if k not in ("sensor_data", "sensor_param")}, parts)
    return images, torch.cat(parts, dim=1)


def _camera_names(raw, cfg: ManiSkillConfig) -> list[str]:
    if not cfg.uses_cameras:
        return []
    return [c for c, d in raw["sensor_data"].items() if "rgb" in d]


def _action_bounds(space) -> tuple[float, float]:
    return float(np.min(space.low)), float(np.max(space.high))


# ----------------------------------------------------------------------------------------------------
def observe_after_reset(base):
    """The observation of the state a ManiSkill ``reset`` just set, with the contacts of *that* state
    (``base``: the unwrapped env; every env's state is kept).

    Why: ManiSkill's reset computes its observation without a physics step, and contact queries
    (PickCube's ``is_grasped``, StackCube's ``is_cubeA_grasped``) report the last step's contacts, i.e. the
    previous episode's. After an episode that ended holding the cube, the next one began with
    ``is_grasped = 1``: evaluation rounds after the first, and every training iteration, depended on what the
    env did before (``benchmarks/reset_repeatability.py``: one PickCube env, three repeats of the same 32
    seeds, read -77.07 / -81.41 / -79.00 mean return before, -77.44 / -77.48 / -77.46 with this). One
    physics step from the reset state refreshes the contacts, and the state is then put back, so the episode
    starts from the same state (only PhysX's solver warm start differs: an open-loop replay of a demo
    recorded without this step drifts ~1.5 cm over 70 steps). On the GPU backend the step runs every env,
    and all of them are put back."""
    state = base.get_state_dict()
    base.scene.step()
    base.set_state_dict(state)    # on physx_cuda this also applies and fetches the GPU buffers
    return base.get_obs(base.get_info())


class ManiSkillSingleEnv:
    """One ManiSkill env on the CPU backend, numpy in / numpy out (the single-env protocol of
    :mod:`envs.workers`). Several can share a process: each has its own scene and physics system."""

    def __init__(self, cfg: ManiSkillConfig):
        self.cfg = cfg
        ensure_vulkan()
        check_task(cfg.task)
        self.max_episode_steps = cfg.max_episode_steps or task_max_episode_steps(cfg.task)
        self.env = _make(cfg, 1, gpu=False)
        self.instruction = cfg.task_instruction
        space = self.env.action_space
        low, high = _action_bounds(space)
        self._low, self._high = np.asarray(space.low, np.float32), np.asarray(space.high, np.float32)
        raw, _ = self.env.reset(seed=0)                      # probe the observation layout
        self.cameras = _camera_names(raw, cfg)
        _, state = _convert_obs(raw, cfg, self.cameras)
        self.spec = EnvSpec(num_envs=1, action_dim=int(space.shape[-1]), state_dim=int(state.shape[1]),
                            num_cameras=len(self.cameras), image_size=cfg.image_size,
                            max_episode_steps=self.max_episode_steps, action_low=low, action_high=high)
        self._t = 0
        self._seeds = np.random.default_rng(0)   # the seeds of unseeded resets: see reset()
        self._rebuild = False

    def _obs(self, raw) -> dict:
        images, state = _convert_obs(raw, self.cfg, self.cameras)
        return {"images": images[0].numpy().copy(), "state": state[0].numpy().astype(np.float32, copy=True),
                "instruction": self.instruction}

    def reset(self, seed: int | None = None) -> dict:
        """Start an episode; the same seed gives the same initial state, whatever the env did before.

        An unseeded reset (the next episode after one ends inside a chunk) takes its seed from a generator
        seeded by the last seeded reset. Why: ManiSkill draws an unseeded episode from the process's global
        torch RNG, which torch seeds at random in every new process and which every earlier unseeded reset
        advanced, so two runs of the same config differed from their first partial reset on."""
        if seed is None:
            seed = int(self._seeds.integers(2**31))
        else:
            self._seeds = np.random.default_rng(seed)
        options = {"reconfigure": True} if self._rebuild else None
        self._rebuild = False
        self.env.reset(seed=seed, options=options)
        self._t = 0
        return self._obs(observe_after_reset(self.env.unwrapped))

    def forget_history(self) -> None:
        """Rebuild the PhysX scene at the next reset (ManiSkill's ``reconfigure``; ~0.18 s CPU for PushCube or
        PickCube, against ~5 ms for a plain reset), so what follows is what a newly built env would do.

        Why: the physics carries state from one episode to the next. The same seed and the same actions give
        a trajectory that differs by up to 1.4 cm once the gripper touches the cube, depending on the episodes
        before (the order in which PhysX found its contact pairs); after a rebuild it is bit-identical to a new
        env's (``tests/envs/test_maniskill.py -k history``)."""
        self._rebuild = True

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, bool]:
        """One action ``[A]`` -> (obs, reward, terminated, truncated, success)."""
        a = np.asarray(action, dtype=np.float32)
        if a.shape != (self.spec.action_dim,):
            raise ValueError(f"action must have shape ({self.spec.action_dim},), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("action contains NaN or inf")
        tol = 1e-4
        if (a < self._low - tol).any() or (a > self._high + tol).any():
            raise ValueError(f"action out of range [{self.spec.action_low}, {self.spec.action_high}]: {a}")
        raw, reward, terminated, _, info = self.env.step(a)
        self._t += 1
        terminated = bool(terminated.reshape(-1)[0])
        success = bool(info["success"].reshape(-1)[0]) if "success" in info else terminated
        truncated = not terminated and self._t >= self.max_episode_steps
        reward = float(reward.reshape(-1)[0]) + REWARD_OFFSET[self.cfg.reward]
        return self._obs(raw), reward, terminated, truncated, success

    def render_frame(self) -> np.ndarray:
        """An RGB frame ``[H, W, 3]`` uint8 from ManiSkill's human-view camera (``render_size``)."""
        frame = self.env.render()
        if isinstance(frame, Tensor):
            frame = frame.cpu().numpy()
        return np.asarray(frame).reshape(-1, *np.asarray(frame).shape[-3:])[0]

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None


# ----------------------------------------------------------------------------------------------------
class ManiSkillGPUEnv:
    """``num_envs`` ManiSkill envs in one process on ``physx_cuda``; the batched interface of
    :mod:`envs.base`.

    All envs step together on the GPU, so an env whose episode ends inside a chunk cannot be paused:
    it is fed zero actions for the rest of the chunk, its rewards are masked, its final observation is
    recorded at the step it ended, and it is reset (ManiSkill partial reset) after the chunk.
    """

    def __init__(self, cfg: ManiSkillConfig, num_envs: int, *, device="cuda", seed: int = 0):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"ManiSkillGPUEnv needs a CUDA device, got {device!r} "
                               f"(cuda available: {torch.cuda.is_available()})")
        self.cfg, self.seed = cfg, seed
        # Keep the NVIDIA Vulkan driver where there is one; lavapipe otherwise (state obs still work).
        ensure_vulkan(lavapipe=not any(os.path.isfile(p) for p in NVIDIA_ICDS))
        check_task(cfg.task)
        enable_physx_gpu()
        self.max_episode_steps = cfg.max_episode_steps or task_max_episode_steps(cfg.task)
        self.env = _make(cfg, num_envs, gpu=True)
        base = self.env.unwrapped
        space = base.single_action_space
        low, high = _action_bounds(space)
        raw, _ = self.env.reset(seed=[seed + i for i in range(num_envs)])
        self.cameras = _camera_names(raw, cfg)
        _, state = _convert_obs(raw, cfg, self.cameras)
        self.spec = EnvSpec(num_envs=num_envs, action_dim=int(space.shape[-1]), state_dim=int(state.shape[1]),
                            num_cameras=len(self.cameras), image_size=cfg.image_size,
                            max_episode_steps=self.max_episode_steps, action_low=low, action_high=high)
        self._t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._final_frames: list[int] = []   # envs whose ended episodes are rendered before their reset
        self._idle = torch.zeros(num_envs, self.spec.action_dim, device=self.device)
        self.tracker = EpisodeTracker(num_envs, self.device)
        self.instructions = [cfg.task_instruction] * num_envs

    @property
    def num_envs(self) -> int:
        return self.spec.num_envs

    def _observe(self, raw) -> dict:
        images, state = _convert_obs(raw, self.cfg, self.cameras)
        return {"images": images.to(self.device), "state": state.to(self.device),
                "instruction": list(self.instructions)}

    def reset(self, seed: int | None = None, *, group_size: int = 1) -> dict:
        """Reset every env; env ``i`` gets seed ``seed + i // group_size`` (default seed: the constructor's)."""
        base = self.seed if seed is None else seed
        self.env.reset(seed=[base + i // group_size for i in range(self.num_envs)])
        raw = observe_after_reset(self.env.unwrapped)
        self._t.zero_()
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self._observe(raw)

    def step(self, chunk: Tensor) -> ChunkStep:
        """Execute up to H actions of ``chunk`` ``[N, H, A]`` per env (see :mod:`envs.base`)."""
        chunk = check_action_chunk(chunk, self.spec, device=self.device)
        n, horizon = chunk.shape[:2]
        dev = self.device
        book = ChunkBook(n, horizon, dev)
        final = None
        raw = None
        for h in range(horizon):
            action = torch.where(book.active[:, None], chunk[:, h], self._idle)
            raw, r, term, _, info = self.env.step(action)
            r = r.to(dev).float().reshape(n) + REWARD_OFFSET[self.cfg.reward]
            term = term.to(dev).bool().reshape(n)
            succ = info["success"].to(dev).bool().reshape(n) if "success" in info else term
            ended = book.book(h, r, succ, term, self._t, self.max_episode_steps, self.tracker)
            if bool(ended.any()):
                obs = self._observe(raw)
                if final is None:
                    final = {k: obs[k].clone() for k in ("images", "state")}
                else:
                    for k in ("images", "state"):
                        final[k][ended] = obs[k][ended]
            if not bool(book.active.any()):
                break
        done = book.done
        final_obs, episodes, frames = None, {}, None
        if bool(done.any()):
            final_obs = {**final, "instruction": list(self.instructions)}
            episodes = self.tracker.finish(done, book.success)
            ended_rows = [i for i in self._final_frames if bool(done[i])]
            if ended_rows:   # held by idle actions since they ended: close to their last state
                frames = dict(zip(ended_rows, self.render_frames(ended_rows)))
            idx = done.nonzero(as_tuple=True)[0]
            self.env.reset(options={"env_idx": idx})
            raw = observe_after_reset(self.env.unwrapped)
            self._t[idx] = 0
        return book.result(self._observe(raw), final_obs=final_obs, episodes=episodes, final_frames=frames)

    def set_final_frames(self, indices: list[int]) -> None:
        """Render the last state of each episode that ends in envs ``indices`` into the step's ``final_frames``
        (videos of camera-less envs); ``[]`` stops it."""
        self._final_frames = sorted(set(check_env_indices(indices, self.num_envs)))

    def render(self) -> Tensor:
        """RGB frames ``[N, H, W, 3]`` uint8 of ManiSkill's human-view camera."""
        return self.env.render()

    def render_frames(self, indices: list[int] | None = None) -> list[np.ndarray]:
        """One RGB frame ``[H, W, 3]`` uint8 per requested env, in the order asked (what videos of envs without
        cameras use, as the worker pool's ``render_frames``). ManiSkill renders every env at once."""
        indices = list(range(self.num_envs)) if indices is None else check_env_indices(indices, self.num_envs)
        frames = self.render()
        frames = frames.cpu().numpy() if isinstance(frames, Tensor) else np.asarray(frames)
        frames = frames.reshape(-1, *frames.shape[-3:])
        return [np.ascontiguousarray(frames[i]) for i in indices]

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None


# ----------------------------------------------------------------------------------------------------
def make_maniskill_env(cfg: ManiSkillConfig, num_envs: int, device="cpu", seed: int = 0,
                       envs_per_worker: int | None = None, max_restarts: int = 0, log=None):
    """``num_envs`` envs of ``cfg.task``: on a cuda device (or ``sim_backend="gpu"``) one
    :class:`ManiSkillGPUEnv`, else a :class:`envs.workers.WorkerVectorEnv` of CPU single envs
    (``envs_per_worker`` per process, None: one process per CPU core; their observations are CPU
    tensors; ``max_restarts`` / ``log``: see the worker pool)."""
    device = torch.device(device)
    backend = cfg.sim_backend
    if backend == "auto":
        backend = "gpu" if device.type == "cuda" else "cpu"
    if backend == "gpu":
        if device.type != "cuda":
            raise ValueError(f"sim_backend='gpu' needs a cuda device, got {str(device)!r}")
        if envs_per_worker not in (None, 1):
            raise ValueError("envs_per_worker is for the CPU backend's worker processes; the GPU simulator "
                             "runs all envs in one batch")
        return ManiSkillGPUEnv(cfg, num_envs, device=device, seed=seed)

    return WorkerVectorEnv(functools.partial(ManiSkillSingleEnv, cfg), num_envs, seed=seed,
                           envs_per_worker=envs_per_worker, max_restarts=max_restarts, log=log,
                           name=f"maniskill-{task_base_name(cfg.task)}")



def describe_robot(task: ManiSkillConfig, *, state_dim: int, action_dim: int) -> dict:
    """What the task's state and actions mean, for an exported policy's spec: its normalised delta controllers take
    [-1, 1]; other modes' bounds are the robot's (not recorded). Cameras: the exporter's generic ones."""
    delta = "delta" in task.control_mode
    names = DELTA_POSE_ACTIONS if task.control_mode == "pd_ee_delta_pose" and action_dim == 7 else \
        [f"joint_{i + 1}_delta" for i in range(7)] + ["gripper"] \
        if task.control_mode == "pd_joint_delta_pos" and action_dim == 8 else []
    return {"control_mode": f"maniskill:{task.control_mode}", "action_low": -1.0 if delta else None,
            "action_high": 1.0 if delta else None,
            "action_names": names, "action_units": ["normalized [-1, 1]"] * len(names) if delta else [],
            "instruction": task.task_instruction,
            "notes": "gripper: +1 opens, -1 closes. State: ManiSkill's "
                     + ("flat privileged state vector" if task.obs_mode != "rgb" else
                        "proprioception and task extras, flattened in sorted key order")
                     + ("" if delta else "; action bounds of this control mode are not recorded (not clipped)")}
