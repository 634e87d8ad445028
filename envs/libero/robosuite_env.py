"""LIBERO adapter: LIBERO's MuJoCo (robosuite) tasks behind the single-env worker protocol of
:mod:`envs.workers`.

Install with ``PY=.venv/bin/python bash scripts/setup_libero.sh`` (hf-libero 0.1.4, robosuite 1.4.0,
mujoco 3.8.1, the scene/object asset wheels, and ``.cache/libero/config.yaml``).

- :class:`LiberoSingleEnv` runs one LIBERO env at a time in one process (a worker of
  :class:`envs.workers.WorkerVectorEnv`, or in-process). It may hold several tasks of a suite: one
  robosuite env per task, created lazily and cached; ``reset(seed)`` draws (task, init state) from the
  seed, ``reset_to(task_id, init_state_id)`` sets an explicit episode.
- The official protocol (every task of a suite, its first 50 fixed initial states, 10 no-op settle steps,
  success within the suite's step limit) is ``episode_order="indexed"`` run through the one evaluation loop
  (:mod:`vla_rl.eval.bench`): episode ``k`` is task ``k // 50``, init state ``k % 50``.

Observations: ``images`` uint8 ``[C, S, S, 3]`` (cameras ``agentview`` then ``wrist``), ``state`` float32
``[8]`` = end-effector position (3), end-effector orientation as axis-angle (3), gripper finger qpos (2)
(openpi's LIBERO state), ``instruction`` = the task's language. Image orientation: MuJoCo renders rows
bottom-up, so ``image_orientation="upright"`` (default) flips rows and gives the true camera view;
``"rot180"`` flips rows and columns, which is what OpenVLA / openpi LIBERO pipelines (and checkpoints
trained on their datasets) use.

Actions: 7-d delta end-effector pose (OSC_POSE: 3 position, 3 rotation, gripper), all in [-1, 1];
gripper -1 opens, +1 closes (ManiSkill is the other way round). Reward: LIBERO's sparse 1.0 on success.
``terminated`` = success; ``truncated`` after ``max_episode_steps`` policy steps (the settle steps are
not counted).

Glossary: N envs, H actions per chunk, A = 7 action dims, C cameras, S image size, D = 8 state dims.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from vla_rl.core.paths import cache_dir
from vla_rl.core.ranges import check_ranges, nonneg, ranged
from vla_rl.envs.base import DELTA_POSE_ACTIONS, EnvSpec, SimulatorUnavailable
from vla_rl.envs.libero.direct import DirectStep
from vla_rl.envs.libero.reward import Shaping
from vla_rl.envs.libero.substeps import SplitSubsteps

SETUP_HINT = "run `PY=.venv/bin/python bash scripts/setup_libero.sh` (or `make sims`) to install LIBERO"

# Official per-suite step limits (openpi / OpenVLA LIBERO evaluation).
SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                   "libero_90": 400}
SUITE_NUM_TASKS = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}
CAMERAS = {"agentview": ("agentview", "agentview_image"),
           "wrist": ("robot0_eye_in_hand", "robot0_eye_in_hand_image")}  # ours -> (robosuite, obs key)
NOOP = np.array([0.0] * 6 + [-1.0])  # no motion, gripper open: what the settle steps send
STATE_DIM, ACTION_DIM = 8, 7
OBJECT_STATE_DIM = 9                  # per object of interest in state_mode "robot+objects": position, rotation (6)
NUM_FIXED_INIT_STATES = 50
# Placement numbers that init_states="sampled" draws from when init_state_ids is None. Those below are never drawn
# at random: recordings use 0, 1, ..., so training and evaluation on drawn placements never replay a demonstration.
SAMPLED_IDS = range(1_000_000, 2**31)
# A sampled placement is dropped from above the table: extra settle steps (not counted), and a draw whose objects
# moved or tipped while settling (an overlap thrown apart) is redrawn.
SAMPLED_SETTLE_STEPS, SAMPLED_ATTEMPTS, SAMPLED_MAX_SHIFT, SAMPLED_MAX_TILT = 20, 50, 0.02, 0.35
# LIBERO starts an object it places on another (a bowl on a ramekin) ~14 cm above it: when no draw of a placement
# passes, the first in which every object that fell more than SAMPLED_DROP while settling slid at most
# SAMPLED_MAX_SHIFT_DROPPED on its support (the shipped states have such bowls off-centre too) is taken. Only then:
# a placement some draw passes strictly is the same as it always was.
SAMPLED_DROP, SAMPLED_MAX_SHIFT_DROPPED = 0.05, 0.05

Suite = Literal["libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"]
Camera = Literal["agentview", "wrist"]


class LiberoNotInstalled(SimulatorUnavailable):
    """LIBERO (or its config / assets) is missing."""


class NoStablePlacement(RuntimeError):
    """``init_states="sampled"``: LIBERO's samplers gave no placement of a task's objects that settles."""


def setup_libero_env_vars() -> Path:
    """Set ``LIBERO_CONFIG_PATH`` and ``MUJOCO_GL`` unless already set; returns the config folder.

    Must run before ``import libero.libero`` (which prompts on stdin without a config) and before
    mujoco / robosuite are imported (they read ``MUJOCO_GL`` once). The default config folder is
    ``libero/`` in :func:`~vla_rl.core.paths.cache_dir` (``<repo>/.cache`` in a checkout), written by
    ``scripts/setup_libero.sh``.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("LIBERO_CONFIG_PATH", str(cache_dir() / "libero"))
    return Path(os.environ["LIBERO_CONFIG_PATH"])


def _libero():
    """Import LIBERO; returns ``(benchmark module, get_libero_path, OffScreenRenderEnv)``."""
    config_dir = setup_libero_env_vars()
    if not (config_dir / "config.yaml").is_file():
        raise LiberoNotInstalled(f"LIBERO config not found: {config_dir / 'config.yaml'} "
                                 f"(LIBERO_CONFIG_PATH={config_dir}); {SETUP_HINT}")
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as e:
        raise LiberoNotInstalled(f"cannot import LIBERO ({e}); {SETUP_HINT}") from e
    return benchmark, get_libero_path, OffScreenRenderEnv


def task_instruction(suite: str, task_id: int) -> str:
    """The language instruction of ``suite``'s task ``task_id`` (imports LIBERO)."""
    benchmark, _, _ = _libero()
    return benchmark.get_benchmark_dict()[suite]().get_task(task_id).language


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Quaternion ``(x, y, z, w)`` (robosuite's order) ``[4]`` -> axis * angle ``[3]``.

    The same map as openpi's LIBERO example (robosuite's ``quat2axisangle``): w is clipped to [-1, 1]
    and the sign is not canonicalised, so w < 0 gives angles in (pi, 2 pi]; a policy trained on openpi's
    LIBERO states sees the same numbers.
    """
    q = np.asarray(quat, dtype=np.float64)
    w = min(max(float(q[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if den == 0.0:
        return np.zeros(3)
    return q[:3] * (2.0 * math.acos(w) / den)


def robot_state(raw: dict) -> np.ndarray:
    """The 8-d robot state of a robosuite observation dict: end-effector position, its orientation as axis-angle,
    the two gripper finger joints (openpi's LIBERO example and LeRobot's ``LiberoProcessorStep`` build the same)."""
    return np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                           raw["robot0_gripper_qpos"]])


def orient(frame: np.ndarray, orientation: str) -> np.ndarray:
    """A robosuite camera frame (rendered bottom row first) as the policy sees it: ``upright`` flips the rows;
    ``rot180`` (openpi's and LeRobot's LIBERO datasets) flips rows and columns."""
    return frame[::-1] if orientation == "upright" else frame[::-1, ::-1]


def check_task_selection(cfg, *, distinct_ids: bool = False) -> None:
    """The suite, cameras, task ids and init-state ids of a LIBERO env config (this adapter's or libero_warp's)
    name things that exist; ``distinct_ids``: an id may not repeat."""
    if cfg.suite not in SUITE_MAX_STEPS:
        raise ValueError(f"unknown LIBERO suite {cfg.suite!r}; one of {list(SUITE_MAX_STEPS)}")
    bad = [c for c in cfg.cameras if c not in CAMERAS]
    if bad or len(set(cfg.cameras)) != len(cfg.cameras):
        raise ValueError(f"cameras must be distinct names from {list(CAMERAS)}, got {cfg.cameras}")
    for name in ("task_ids", "init_state_ids"):
        ids = getattr(cfg, name)
        if ids is not None and (not ids or any(i < 0 for i in ids) or (distinct_ids and len(set(ids)) != len(ids))):
            what = "distinct ids" if distinct_ids else "ids"
            raise ValueError(f"{name} must be None or a non-empty list of {what} >= 0, got {ids}")
    n = SUITE_NUM_TASKS[cfg.suite]
    if cfg.task_ids is not None and any(i >= n for i in cfg.task_ids):
        raise ValueError(f"task_ids {[i for i in cfg.task_ids if i >= n]} out of range: {cfg.suite} has {n} tasks "
                         f"(0..{n - 1})")


@dataclass(frozen=True)
class LiberoConfig:
    """One LIBERO single env (one worker). Derived values are properties."""

    suite: Suite = "libero_spatial"
    task_ids: list[int] | None = None        # tasks this env draws from; None: all tasks of the suite
    image_size: int = ranged(128, 1)         # render size S of every camera
    cameras: tuple[Camera, ...] = ("agentview", "wrist")   # () for state-only (much faster)
    num_settle_steps: int = nonneg(10)       # no-op steps after setting the init state (not counted)
    max_episode_steps: int | None = ranged(None, 1)  # None: the suite's official limit (SUITE_MAX_STEPS)
    init_state_ids: list[int] | None = None  # fixed init states to draw from; None: all 50
    image_orientation: Literal["upright", "rot180"] = "upright"
    # Soft reset (sim.reset, ~0.4 s) instead of rebuilding the MuJoCo model (5-13 s). Checked to give
    # bit-identical episodes to a freshly built env once the gripper's action memory is cleared.
    soft_reset: bool = True
    max_cached_envs: int = ranged(10, 1)     # robosuite envs (one per task) kept open in this process
    # "random": reset(seed) draws (task, init state) uniformly (training). "indexed": reset(seed) plays episode
    # number `seed` of the list [(t, i) for t in task_ids for i in init_state_ids] and reset(None) the next one,
    # so a batched evaluation whose env j resets with seed s + j covers the fixed protocol episodes in order.
    episode_order: Literal["random", "indexed"] = "random"
    # "fixed": the task's shipped init states (the official protocol). "sampled": object placements drawn anew
    # from the task's BDDL regions (the distribution LIBERO drew its fixed states from), placement number k
    # seeded by (suite, task, k): init_state_ids then number placements (None: SAMPLED_IDS).
    init_states: Literal["fixed", "sampled"] = "fixed"
    # "robot": openpi's 8 numbers. "robot+objects": then, for each of the task's first `state_objects` objects
    # of interest (BDDL :obj_of_interest; zeros where it has fewer), its position (3) and the first two columns of
    # its rotation matrix (6: continuous, unlike a quaternion's sign or an axis-angle near a half turn).
    state_mode: Literal["robot", "robot+objects"] = "robot"
    state_objects: int = ranged(2, 1, 8)
    # "sparse": LIBERO's 1.0 on success. "shaped": that plus shaping_scale x the change of a progress potential
    # (envs.libero.reward: reach, grasp, carry to the target), so an episode's shaping sums to phi_end - phi_start.
    reward: Literal["sparse", "shaped"] = "sparse"
    shaping_scale: float = nonneg(1.0)
    # MuJoCo's mirror reflections (the table and floor), which redraw the scene once more per image. False about
    # halves a camera render's CPU cost on llvmpipe (benchmarks/bench_libero_cost.py), but the images then differ
    # from LIBERO's standard renders (openpi's dataset): demos, training and evaluation must agree on it.
    reflections: bool = True
    # Each physics substep with one MuJoCo forward pass instead of robosuite's three (envs.libero.substeps):
    # the same trajectories bit for bit (tested), ~1.5x fewer CPU seconds a state-only step. False: robosuite's
    # own substep loop.
    fast_substeps: bool = True
    # Each action stepped on the MuJoCo model directly (envs.libero.direct): robosuite's controller maths and
    # observation clock, none of its per-substep bookkeeping; the same trajectories and observations bit for bit
    # (tested), fewer CPU seconds a step (benchmarks/bench_libero_floor.py). Takes precedence over fast_substeps.
    direct_step: bool = True

    def __post_init__(self):
        check_ranges(self)
        check_task_selection(self)

    @property
    def episode_steps(self) -> int:
        return self.max_episode_steps or SUITE_MAX_STEPS[self.suite]

    @property
    def state_dim(self) -> int:
        return STATE_DIM + (OBJECT_STATE_DIM * self.state_objects if self.state_mode == "robot+objects" else 0)


def episode_of(index: int, task_ids: Sequence[int], init_state_ids: Sequence[int]) -> tuple[int, int]:
    """Episode ``index`` of the task-major list ``[(t, i) for t in task_ids for i in init_state_ids]`` (wrapping
    around): the order the official protocol runs, each task's init states in turn."""
    k = index % (len(task_ids) * len(init_state_ids))
    return int(task_ids[k // len(init_state_ids)]), int(init_state_ids[k % len(init_state_ids)])


def built_fixture_poses(inner) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Body id -> (position, quaternion) of each fixture's root body (cabinet, stove, ...) in the model as LIBERO
    built it, before any reset moved it: the attributes of its ``<body>`` in the generated MJCF (absent: the
    origin, no rotation)."""
    import re

    xml, out = inner.model.get_xml(), {}
    for fixture in inner.fixtures_dict.values():
        tag = re.search(rf'<body\b[^>]*\bname="{re.escape(fixture.root_body)}"[^>]*>', xml)
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', tag.group(0))) if tag else {}
        pos = np.array([float(v) for v in attrs.get("pos", "0 0 0").split()])
        quat = np.array([float(v) for v in attrs.get("quat", "1 0 0 0").split()])
        out[inner.sim.model.body_name2id(fixture.root_body)] = (pos, quat)
    return out


class LiberoSingleEnv:
    """One LIBERO env (numpy in and out) implementing the single-env protocol of :mod:`envs.workers`.

    ``reset(seed)`` picks (task, init state) uniformly from ``config.task_ids`` x ``config.init_state_ids``
    with a generator seeded by ``seed`` (``None`` continues the sequence), or, with ``episode_order="indexed"``,
    plays episode number ``seed`` of that list (:func:`episode_of`); ``reset_to(task_id,
    init_state_id)`` starts an explicit episode (the official protocol). Both set the init state, run
    ``num_settle_steps`` no-op steps, and return the first observation.
    """

    def __init__(self, config: LiberoConfig | None = None, seed: int = 0):
        self.cfg = cfg = config or LiberoConfig()
        benchmark, self._get_libero_path, self._env_cls = _libero()
        self.suite = benchmark.get_benchmark_dict()[cfg.suite]()
        n_tasks = self.suite.get_num_tasks()
        self.task_ids = list(range(n_tasks)) if cfg.task_ids is None else list(cfg.task_ids)
        if max(self.task_ids) >= n_tasks:
            raise ValueError(f"task_ids {cfg.task_ids} out of range: {cfg.suite} has {n_tasks} tasks")
        if cfg.init_state_ids is not None:
            self.init_state_ids = list(cfg.init_state_ids)
        else:
            self.init_state_ids = SAMPLED_IDS if cfg.init_states == "sampled" else range(NUM_FIXED_INIT_STATES)
        self.spec = EnvSpec(num_envs=1, action_dim=ACTION_DIM, state_dim=cfg.state_dim,
                            num_cameras=len(cfg.cameras), image_size=cfg.image_size,
                            max_episode_steps=cfg.episode_steps, images_rot180=cfg.image_orientation == "rot180")
        self._rng = np.random.default_rng(seed)
        self._next_episode = 0
        self._envs: OrderedDict[int, object] = OrderedDict()   # task id -> robosuite env, LRU order
        self._init_states: dict[int, np.ndarray] = {}
        self._env = None
        self._raw: dict | None = None
        self._t = 0
        self._done = True
        self.task_id: int | None = None
        self.init_state_id: int | None = None
        self.instruction = ""
        self._objects: list[tuple[str, int]] = []   # ("body" | "site", id) of the objects of interest in the state
        self._shaping = None                 # envs.libero.reward.Shaping of the episode (reward="shaped")
        self._direct: DirectStep | None = None   # bound to one MjSim: rebuilt when a reset makes a new one

    # ------------------------------------------------------------------------------------------------
    @property
    def sim_env(self):
        """The current episode's robosuite env (privileged state for scripted experts and rewards), or None."""
        return None if self._env is None else self._env.env

    def instruction_of(self, task_id: int) -> str:
        return self.suite.get_task(task_id).language

    def init_states(self, task_id: int) -> np.ndarray:
        """The task's fixed initial MuJoCo states ``[50, state size]``."""
        if task_id not in self._init_states:
            # LIBERO reads these with torch.load(weights_only=False): acceptable, the files are shipped
            # inside the installed package, never user-supplied.
            self._init_states[task_id] = np.asarray(self.suite.get_task_init_states(task_id))
        return self._init_states[task_id]

    def _task_env(self, task_id: int):
        env = self._envs.pop(task_id, None)
        if env is None:
            while len(self._envs) >= self.cfg.max_cached_envs:
                _, old = self._envs.popitem(last=False)
                if old is self._env:
                    self._env, self._done = None, True
                old.close()
            task = self.suite.get_task(task_id)
            bddl = os.path.join(self._get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
            cams = [CAMERAS[c][0] for c in self.cfg.cameras]
            # ignore_done: robosuite raises after its own horizon; the step limit is counted here.
            kwargs = dict(bddl_file_name=bddl, camera_names=cams, use_camera_obs=bool(cams),
                          camera_heights=self.cfg.image_size, camera_widths=self.cfg.image_size,
                          ignore_done=True, hard_reset=not self.cfg.soft_reset)
            if cams:
                env = self._env_cls(**kwargs)
            else:
                # Without cameras no offscreen render context is opened: it costs ~0.5 GB per env on
                # llvmpipe, half of a state-only env's memory. render_frame() still works: robosuite's
                # sim.render opens one when a frame is first asked for.
                from libero.libero.envs.env_wrapper import ControlEnv

                env = ControlEnv(has_renderer=False, has_offscreen_renderer=False, **kwargs)
        self._envs[task_id] = env   # most recently used last
        return env

    def reset(self, seed: int | None = None) -> dict:
        if self.cfg.episode_order == "indexed":
            self._next_episode = self._next_episode if seed is None else int(seed)
            task_id, init_id = self.episode(self._next_episode)
            self._next_episode += 1
            return self.reset_to(task_id, init_id)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        task_id = self.task_ids[int(self._rng.integers(len(self.task_ids)))]
        init_id = self.init_state_ids[int(self._rng.integers(len(self.init_state_ids)))]
        return self.reset_to(task_id, init_id)

    def episode(self, index: int) -> tuple[int, int]:
        """(task id, init state id) of episode ``index`` in ``episode_order="indexed"`` (task-major; wraps)."""
        return episode_of(index, self.task_ids, self.init_state_ids)

    def reset_to(self, task_id: int, init_state_id: int) -> dict:
        """Start the episode of task ``task_id`` from its fixed init state ``init_state_id`` (with
        ``init_states="sampled"``: from its sampled placement number ``init_state_id``)."""
        sampled = self.cfg.init_states == "sampled"
        if sampled:
            if init_state_id < 0:
                raise ValueError(f"placement number {init_state_id} must be >= 0")
            states = None
        else:
            states = self.init_states(task_id)
            if not 0 <= init_state_id < len(states):
                raise ValueError(f"init_state_id {init_state_id} out of range: task {task_id} of "
                                 f"{self.cfg.suite} has {len(states)} init states")
        env = self._task_env(task_id)
        # The cameras are off while objects settle (rendering is ~90 % of a step's time on a CPU), then
        # every observable is sampled once at the settled state.
        self._enable_cameras(env, False)
        try:
            if sampled:
                self._place_sampled(env, task_id, init_state_id)
            else:
                self._seeded_reset(env, f"{self.cfg.suite}/{task_id}/{init_state_id}")
                env.set_init_state(states[init_state_id])
                for _ in range(self.cfg.num_settle_steps):
                    self._physics_step(env, NOOP)
        finally:
            self._enable_cameras(env, True)
        self._set_reflections(env.sim)
        self._make_current(env.sim)
        raw = env.env._get_observations(force_update=True)
        self._env, self._raw = env, raw
        self.task_id, self.init_state_id = task_id, init_state_id
        self.instruction = self.instruction_of(task_id)
        self._t, self._done = 0, False
        inner = env.env
        if self.cfg.state_mode == "robot+objects":
            names = list(inner.parsed_problem["obj_of_interest"])[:self.cfg.state_objects]
            # An object of interest is a body (the bowl) or a region site (LIBERO-Goal's
            # "wooden_cabinet_1_middle_region", which moves with its drawer): the pose of either.
            self._objects = [("body", inner.obj_body_id[n]) if n in inner.obj_body_id else
                             ("site", inner.sim.model.site_name2id(n)) for n in names]
        if self.cfg.reward == "shaped":
            self._shaping = Shaping(inner)
        return self._obs()

    @staticmethod
    def _seeded_reset(env, key: str) -> None:
        """``env.reset()`` with numpy's global RNG seeded from ``key``, then restored.

        Fixture placement (cabinet, stove, ...: bodies without joints) is not part of LIBERO's init states:
        every reset, hard or soft, redraws it (within ~2 cm and some rotation) from numpy's *global* RNG, so in
        the official scripts it depends on how many resets came before. Seeding it from the episode's identity
        makes an episode reproducible. LIBERO's object samplers draw from the same RNG."""
        rng_state = np.random.get_state()
        np.random.seed(zlib.crc32(key.encode()))
        try:
            env.reset()
        finally:
            np.random.set_state(rng_state)
        # robosuite's Panda gripper integrates its commands into `current_action`, which only a hard
        # reset clears; left over, the first steps of an episode would depend on the previous one.
        for robot in env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)

    def _place_sampled(self, env, task_id: int, number: int) -> None:
        """Draw placement ``number`` of the task's objects from its BDDL regions and let it settle.

        LIBERO's samplers keep objects apart by a radius only, so some draws overlap and the physics throws an
        object aside or tips it over as it settles (LIBERO's shipped init states have no such cases). A draw
        in which any object moved more than SAMPLED_MAX_SHIFT in the table plane, or tilted more than
        SAMPLED_MAX_TILT, while settling is replaced by the next draw of the same number; when none of them passes,
        the first within the drop rule (SAMPLED_DROP) is drawn again and taken."""
        inner = env.env
        bodies = [inner.obj_body_id[n] for n in inner.objects_dict]
        data = inner.sim.data
        as_built = built_fixture_poses(inner)

        def draw(attempt: int) -> tuple[bool, np.ndarray, np.ndarray]:
            """Draw ``attempt`` of this placement and let it settle: (every object upright, each one's shift in the
            table plane, which fell more than SAMPLED_DROP)."""
            # LIBERO places an object inside a site (a drawer) at its container's sampled pose plus the site's
            # world position, which is the site's offset only while the container sits where the model was built
            # (the origin): true on a freshly built model, not after a soft reset. Put the fixtures back there.
            for body, (pos, quat) in as_built.items():
                inner.sim.model.body_pos[body], inner.sim.model.body_quat[body] = pos, quat
            self._seeded_reset(env, f"{self.cfg.suite}/{task_id}/sampled/{number}/{attempt}")
            before = np.array([data.body_xpos[b] for b in bodies])
            up = np.array([np.asarray(data.body_xmat[b]).reshape(3, 3)[:, 2] for b in bodies])
            for _ in range(SAMPLED_SETTLE_STEPS + self.cfg.num_settle_steps):
                self._physics_step(env, NOOP)
            now = np.array([data.body_xpos[b] for b in bodies])
            up_now = np.array([np.asarray(data.body_xmat[b]).reshape(3, 3)[:, 2] for b in bodies])
            upright = bool((np.arccos(np.clip((up * up_now).sum(1), -1.0, 1.0)) < SAMPLED_MAX_TILT).all())
            return upright, np.linalg.norm(now[:, :2] - before[:, :2], axis=1), before[:, 2] - now[:, 2] > SAMPLED_DROP

        fallback = None    # the first draw within the drop rule, taken only when no draw passes strictly
        for attempt in range(SAMPLED_ATTEMPTS):
            upright, shift, dropped = draw(attempt)
            if upright and (shift < SAMPLED_MAX_SHIFT).all():
                return
            if fallback is None and upright and (shift < np.where(dropped, SAMPLED_MAX_SHIFT_DROPPED,
                                                                 SAMPLED_MAX_SHIFT)).all():
                fallback = attempt
        if fallback is not None:
            draw(fallback)
            return
        raise NoStablePlacement(f"{self.cfg.suite} task {task_id}: no stable placement in {SAMPLED_ATTEMPTS} draws "
                                f"of placement {number}; init_states=fixed plays the task's shipped ones")

    def _physics_step(self, env, action: np.ndarray):
        """``env.step(action)`` (LIBERO's env wrapper), or the same step computed directly (``direct_step``), or
        with its substeps split (``fast_substeps``)."""
        if self.cfg.direct_step:
            if self._direct is None or self._direct.env is not env or self._direct.sim is not env.env.sim:
                self._direct = DirectStep(env)
            return self._direct.step(action)
        if not self.cfg.fast_substeps:
            return env.step(action)
        with SplitSubsteps(env.sim):
            return env.step(action)

    @staticmethod
    def _make_current(sim) -> None:
        # robosuite renders into whatever GL context is current, not its own: once another env of this process
        # has opened its context (or closed the current one), this env's images are another scene's or garbage.
        ctx = sim._render_context_offscreen
        if ctx is not None:
            ctx.gl_ctx.make_current()

    def _set_reflections(self, sim) -> None:
        # After the reset: a hard reset builds a new sim and with it a new render context.
        ctx = sim._render_context_offscreen
        if ctx is not None:
            import mujoco

            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = int(self.cfg.reflections)

    def _enable_cameras(self, env, on: bool) -> None:
        for c in self.cfg.cameras:
            env.env.modify_observable(CAMERAS[c][1], "enabled", on)

    # ------------------------------------------------------------------------------------------------
    def _obs(self) -> dict:
        raw, s = self._raw, self.cfg.image_size
        if self.cfg.cameras:
            images = np.stack([orient(raw[CAMERAS[c][1]], self.cfg.image_orientation) for c in self.cfg.cameras])
        else:
            images = np.zeros((0, s, s, 3), np.uint8)
        parts = [robot_state(raw)]
        if self.cfg.state_mode == "robot+objects":
            data = self._env.env.sim.data
            objects = np.zeros((self.cfg.state_objects, OBJECT_STATE_DIM))
            for k, (kind, i) in enumerate(self._objects):
                pos, mat = (data.body_xpos[i], data.body_xmat[i]) if kind == "body" else \
                    (data.site_xpos[i], data.site_xmat[i])
                mat = np.asarray(mat).reshape(3, 3)
                objects[k] = np.r_[pos, mat[:, 0], mat[:, 1]]
            parts.append(objects.ravel())
        state = np.concatenate(parts).astype(np.float32)
        return {"images": images, "state": state, "instruction": self.instruction}

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, bool]:
        if self._done:
            raise RuntimeError("LIBERO episode has ended (or never started): call reset() first")
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (ACTION_DIM,):
            raise ValueError(f"LIBERO action must have shape ({ACTION_DIM},), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("LIBERO action contains NaN or inf")
        if np.abs(a).max() > 1.0 + 1e-4:
            raise ValueError(f"LIBERO action out of range [-1, 1]: {a.round(3).tolist()}")
        self._make_current(self._env.sim)
        raw, reward, success, _ = self._physics_step(self._env, np.clip(a, -1.0, 1.0))  # done == LIBERO's success
        self._raw = raw
        self._t += 1
        success = bool(success)
        if self._shaping is not None:
            reward = float(reward) + self.cfg.shaping_scale * self._shaping.step()
        truncated = not success and self._t >= self.spec.max_episode_steps
        self._done = success or truncated
        return self._obs(), float(reward), success, truncated, success

    def render_frame(self) -> np.ndarray:
        """The current camera images side by side ``[S, C * S, 3]`` (agentview alone when state-only)."""
        if self._raw is None:
            raise RuntimeError("nothing to render before the first reset()")
        if self.cfg.cameras:
            return np.concatenate(list(self._obs()["images"]), axis=1)
        s, sim = self.cfg.image_size, self._env.sim
        if sim._render_context_offscreen is None:   # a state-only env opens its render context on demand
            from robosuite.utils.binding_utils import MjRenderContextOffscreen

            ctx = MjRenderContextOffscreen(sim, device_id=-1)   # registers itself with sim
            ctx.vopt.geomgroup[0], ctx.vopt.geomgroup[1] = 0, 1  # visual meshes, as robosuite's renderer
            self._set_reflections(sim)
        self._make_current(sim)
        frame = sim.render(width=s, height=s, camera_name="agentview")
        return np.ascontiguousarray(orient(frame, self.cfg.image_orientation))

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self._env, self._raw, self._done, self._direct = None, None, True, None


# What LIBERO's observations and actions mean (the adapters' docstrings, in data form), the same on either backend.
LIBERO_STATE = (["eef_pos_x", "eef_pos_y", "eef_pos_z", "eef_axis_angle_x", "eef_axis_angle_y", "eef_axis_angle_z",
                 "gripper_qpos_left", "gripper_qpos_right"], ["m", "m", "m", "rad", "rad", "rad", "m", "m"])
LIBERO_CAMERA_ALIASES = {"agentview": ["image"], "wrist": ["wrist_image"]}   # openpi's LIBERO example keys


def describe_robot(task: LiberoConfig, *, state_dim: int, action_dim: int) -> dict:
    """What a LIBERO env's state, actions and cameras mean, for an exported policy's spec (robosuite or Warp alike:
    the same robot, controller and observations)."""
    names, units = LIBERO_STATE
    return {"control_mode": "libero:OSC_POSE (delta end-effector pose)", "action_low": -1.0, "action_high": 1.0,
            "state_names": names if state_dim == 8 else [], "state_units": units if state_dim == 8 else [],
            "action_names": DELTA_POSE_ACTIONS if action_dim == 7 else [],
            "action_units": ["normalized [-1, 1]"] * 7 if action_dim == 7 else [],
            "cameras": [{"name": c, "height": task.image_size, "width": task.image_size,
                         "aliases": LIBERO_CAMERA_ALIASES[c]} for c in task.cameras],
            "notes": f"gripper: -1 opens, +1 closes. Images: {task.image_orientation} orientation "
                     "(rot180 is the OpenVLA / openpi LIBERO convention)."}
