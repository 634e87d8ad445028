"""LIBERO on MuJoCo Warp: N worlds of LIBERO tasks batched on one device (``cuda`` or ``cpu``), behind the batched
chunk-stepping interface of :mod:`envs.base`.

Each task's scene is the MJCF LIBERO / robosuite compiles (:mod:`envs.libero.scene`), put on the device once with
``mujoco_warp.put_model``; its worlds live in one ``mujoco_warp`` Data. Several tasks (a suite mixed) are several
such batches, one model each (a Warp model is one scene): world ``i`` belongs to the task of its contiguous block,
and its instruction is that task's. Per world:

- **Episodes** start from the CPU adapter's episode starts (LIBERO's shipped initial state, seeded fixture
  placement, the settle steps already run by robosuite; cached on disk), copied in on reset: a partial reset
  touches only the ended worlds' rows and runs no physics.
- **Control**: robosuite's OSC_POSE controller and Panda gripper re-implemented batched in torch
  (:mod:`envs.libero.osc`), run at every one of the ``substeps`` (25) physics steps of an action, between
  ``mujoco_warp.step1`` (kinematics, inertia, bias forces, contacts) and ``step2`` (forces, solver, Euler), which
  is what robosuite's ``sim.forward(); controller; mj_step`` computes.
- **Success**: LIBERO's goal predicates from the worlds' positions, joint positions and contacts
  (:mod:`envs.libero.predicates`). Reward: 1 at a success step (LIBERO's sparse reward); success terminates.
- **Observations**: ``state`` [N, 8] as the CPU adapter (end-effector position, axis-angle of the hand's
  orientation, finger positions), read from the same MuJoCo fields; ``images`` from MuJoCo Warp's batch ray-tracing
  renderer (``agentview`` and ``robot0_eye_in_hand``), oriented like the CPU adapter's (``upright`` or ``rot180``).
  Everything stays on the device: Warp arrays are read as torch tensors without copies (``wp.to_torch``).

An episode that ends inside a chunk is frozen: its world keeps stepping with no-op actions until the chunk ends (all
worlds of a batch step together), then its state at the end step is put back, so its final observation is that of
its last real step; then it is reset.

What differs from robosuite-LIBERO (docs/envs.md has the measured numbers): Warp simulates in float32 (MuJoCo in
float64) and generates contacts with its own collision code, so trajectories agree closely at first and drift apart
through contacts; images come from another renderer (lighting, shadows, anti-aliasing); the episode's first
observation reads kinematics at the settled state itself (robosuite's lag one physics step behind).

Glossary: N worlds, H actions per chunk, A = 7 action dims, C cameras, S image size, D = 8 state dims,
J = 7 arm joints, I episode starts of a task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged
from vla_rl.envs.base import (
    ChunkBook,
    ChunkStep,
    EnvSpec,
    EpisodeTracker,
    SimulatorUnavailable,
    check_action_chunk,
    check_env_indices,
)
from vla_rl.envs.libero.osc import clip_torques, gripper_step, hinge_jacobian, osc_torques, set_goal
from vla_rl.envs.libero.predicates import GoalEvaluator
from vla_rl.envs.libero.robosuite_env import (
    ACTION_DIM,
    CAMERAS,
    NOOP,
    STATE_DIM,
    SUITE_MAX_STEPS,
    SUITE_NUM_TASKS,
    Camera,
    Suite,
    check_task_selection,
)
from vla_rl.envs.libero.scene import load_task_scene

INSTALL_HINT = ("install it with `pip install -e '.[warp]'` (mujoco-warp 3.8.1 with warp-lang 1.14.0, the versions "
                "that work with LIBERO's mujoco 3.8.1)")
# Data fields that make up a world's state and what its observation and images are read from: what a frozen
# world gets back at the end of a chunk.
# robosuite renders visual geoms (group 1) and MuJoCo's default group 2, not the collision geoms (group 0).
RENDER_GEOM_GROUPS = [1, 2]
STATE_FIELDS = ("qpos", "qvel", "act", "qacc_warmstart", "time")
DERIVED_FIELDS = ("xpos", "xquat", "xmat", "site_xpos", "site_xmat", "geom_xpos", "geom_xmat", "cam_xpos",
                  "cam_xmat", "light_xpos", "light_xdir")


class LiberoWarpNotInstalled(SimulatorUnavailable):
    """MuJoCo Warp (``mujoco-warp`` / ``warp-lang``) is missing or does not match the installed MuJoCo."""


def import_warp():
    """``(warp, mujoco_warp)``, or :class:`LiberoWarpNotInstalled` naming what to install."""
    try:
        import mujoco
        import mujoco_warp as mjw
        import warp as wp
    except ImportError as e:
        raise LiberoWarpNotInstalled(f"MuJoCo Warp is not installed ({e}); {INSTALL_HINT}") from e
    if mjw.__version__ != mujoco.__version__:
        raise LiberoWarpNotInstalled(f"mujoco-warp {mjw.__version__} does not match mujoco {mujoco.__version__} "
                                     f"(LIBERO's robosuite needs mujoco 3.8.1); {INSTALL_HINT}")
    if hasattr(wp, "LOG_WARNING"):   # no init banner
        wp.config.log_level = wp.LOG_WARNING
    else:
        wp.config.quiet = True
    wp.init()
    return wp, mjw


def warp_device(device: torch.device) -> str:
    """The Warp device name of a torch device (``cpu`` or ``cuda:k``)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    raise ValueError(f"libero_warp runs on cpu or cuda devices, got {device}")


@dataclass(frozen=True)
class LiberoWarpConfig:
    """LIBERO on MuJoCo Warp (``env.kind: libero_warp``). The episode settings mean what they mean for the CPU
    adapter (:class:`envs.libero.LiberoConfig`)."""

    suite: Suite = "libero_spatial"
    task_ids: list[int] | None = None        # tasks, one block of worlds each; None: all tasks of the suite
    init_state_ids: list[int] | None = None  # episode starts drawn from; None: all 50 (read once, then cached)
    image_size: int = ranged(128, 1)
    cameras: tuple[Camera, ...] = ("agentview", "wrist")
    num_settle_steps: int = nonneg(10)
    max_episode_steps: int | None = ranged(None, 1)
    image_orientation: Literal["upright", "rot180"] = "upright"
    # "random": every reset draws an init state per world; "indexed": world i's k-th episode since reset(seed) is
    # init state number (seed + i + k) of init_state_ids (cycling), its own task's (vla-rl bench's protocol).
    episode_order: Literal["random", "indexed"] = "random"
    contacts_per_world: int = positive(256)       # contact buffer per world (mujoco_warp's nconmax)
    constraints_per_world: int = positive(1024)   # constraint rows per world (njmax)
    # Success at an action = the goal held after any of its last `success_substeps` physics substeps. Warp
    # simulates in float32, where a resting object's contact flickers (robosuite's resting penetrations are
    # ~1e-8 m, below float32's resolution at 1 m); 1 is LIBERO's rule (the last substep only).
    success_substeps: int = ranged(5, 1)
    textures: bool = True                    # the renderer's textures
    shadows: bool = False                    # the renderer's shadows (robosuite's images have them; slower)

    def __post_init__(self):
        check_ranges(self)
        check_task_selection(self, distinct_ids=True)

    @property
    def episode_steps(self) -> int:
        return self.max_episode_steps or SUITE_MAX_STEPS[self.suite]


def quat_wxyz_to_axis_angle(q: Tensor) -> Tensor:
    """``[N, 4]`` MuJoCo quaternions (w, x, y, z) -> ``[N, 3]`` axis * angle, the map of
    :func:`envs.libero.quat_to_axis_angle` (openpi's): w clipped to [-1, 1], no sign canonicalisation."""
    q = q.to(torch.float64)
    w = q[:, 0].clamp(-1.0, 1.0)
    den = torch.sqrt(1.0 - w * w)
    scale = torch.where(den > 0, 2.0 * torch.acos(w) / torch.where(den > 0, den, torch.ones_like(den)),
                        torch.zeros_like(den))
    return q[:, 1:] * scale[:, None]


def torch_view(arr, device: torch.device) -> Tensor:
    """A Warp array as a torch tensor sharing its memory (``wp.to_torch``); an empty one as an empty tensor of the
    same shape (``wp.to_torch`` refuses those)."""
    import warp as wp

    if arr.size:
        return wp.to_torch(arr)
    inner = tuple(getattr(arr.dtype, "_shape_", ()))
    return torch.zeros(tuple(arr.shape) + inner, dtype=torch.float32, device=device)


def warp_compatible(model):
    """A copy of ``model`` that MuJoCo Warp collides as MuJoCo does:

    - Box-box pairs by the primitive box-box collider. MuJoCo itself always uses it for that pair (up to 8
      contacts; its NATIVECCD / MULTICCD flags do not change that), while MuJoCo Warp sends boxes through its
      convex (GJK / EPA) collider unless NATIVECCD is disabled, and that finds fewer contacts: 1 per finger pad
      on a LIBERO bowl where MuJoCo finds 2-3 (the bowls are built of boxes). One contact per pad lets a grasped
      object pivot, and the two simulations parted at every grasp.
      In MuJoCo Warp the flag changes nothing else (native CCD is its only convex collider).
    - Geom margins (and gaps) 0: MuJoCo Warp refuses margins with its multi-contact convex collision, which
      LIBERO's mesh geoms use. Only some articulated objects (the microwave: 1 mm) have one; their contacts then
      start at touch instead of 1 mm before.
    """
    import copy

    import mujoco

    model = copy.deepcopy(model)
    model.opt.disableflags |= int(mujoco.mjtDisableBit.mjDSBL_NATIVECCD)
    model.geom_margin[:] = 0.0
    model.geom_gap[:] = 0.0
    return model


def mass_matrix_index(model, dofs: np.ndarray) -> np.ndarray:
    """``[J, J]`` positions of the inertia matrix's entries ``M[dofs][:, dofs]`` in MuJoCo's sparse ``qM``
    (found by running ``mj_fullM`` on a ``qM`` that holds its own indices)."""
    import mujoco

    qm = np.arange(1, model.nM + 1, dtype=np.float64)
    full = np.zeros((model.nv, model.nv))
    mujoco.mj_fullM(model, full, qm)
    idx = full[np.ix_(dofs, dofs)].astype(np.int64) - 1
    if (idx < 0).any():
        raise ValueError("the arm's inertia block has structural zeros: the arm joints are not one chain")
    return idx


class TaskWorlds:
    """``n`` worlds of one task on one device: physics (one ``mujoco_warp`` Model and Data), the controller's and
    gripper's state, the goal predicates, the cameras. Rows are this batch's own world indices."""

    def __init__(self, scene, n: int, *, device: torch.device, cameras: Sequence[str] = (), image_size: int = 128,
                 contacts_per_world: int = 256, constraints_per_world: int = 1024, textures: bool = True,
                 shadows: bool = False, success_substeps: int = 1):
        import mujoco

        self.wp, self.mjw = wp, mjw = import_warp()
        self.scene, self.n, self.device = scene, n, torch.device(device)
        self.wdev = warp_device(self.device)
        mjm = warp_compatible(scene.model)
        with self.scope():
            self.m = mjw.put_model(mjm)
            self.d = mjw.make_data(mjm, nworld=n, nconmax=contacts_per_world, njmax=constraints_per_world)
            # One row of body poses per world: fixtures are placed per episode start.
            self.m.body_pos = wp.array(np.repeat(mjm.body_pos[None], n, 0), dtype=wp.vec3)
            self.m.body_quat = wp.array(np.repeat(mjm.body_quat[None], n, 0), dtype=wp.quat)
        t = lambda a: torch_view(a, self.device)   # noqa: E731
        d = self.d
        self.v = {k: t(getattr(d, k)) for k in STATE_FIELDS + DERIVED_FIELDS}
        self.ctrl, self.qM, self.qfrc_bias = t(d.ctrl), t(d.qM), t(d.qfrc_bias)
        self.xanchor, self.xaxis = t(d.xanchor), t(d.xaxis)
        self.body_pos, self.body_quat = t(self.m.body_pos), t(self.m.body_quat)
        self.nacon, self.nefc = t(d.nacon), t(d.nefc)
        self.contact_geom, self.contact_world = t(d.contact.geom), t(d.contact.worldid)
        self.contact_type, self.contact_dist = t(d.contact.type), t(d.contact.dist)
        self.contact_slot = torch.arange(self.contact_geom.shape[0], device=self.device)
        self.naconmax, self.njmax = int(d.naconmax), int(d.njmax)
        dev = self.device
        ix = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.long, device=dev)   # noqa: E731
        self.arm_qpos, self.arm_dof, self.arm_joints = ix(scene.arm_qpos), ix(scene.arm_dof), ix(scene.arm_joints)
        self.arm_act, self.grip_act, self.grip_qpos = (ix(scene.arm_actuators), ix(scene.gripper_actuators),
                                                       ix(scene.gripper_qpos))
        self.fixtures = ix(scene.fixture_bodies)
        self.sparse_m = bool(self.m.is_sparse)
        self.m_index = ix(mass_matrix_index(mjm, np.asarray(scene.arm_dof))) if self.sparse_m else None
        self.gains = scene.gains
        f64 = torch.float64
        self.q_rest = torch.as_tensor(scene.q_rest, dtype=f64, device=dev).expand(n, -1).clone()
        self.goal_rot = torch.eye(3, dtype=f64, device=dev).expand(n, 3, 3).clone()
        self.goal_pos = torch.zeros(n, 3, dtype=f64, device=dev)
        self.gripper = torch.zeros(n, 2, dtype=f64, device=dev)
        self.goal = GoalEvaluator(scene.goal, mjm.ngeom, dev)
        self.success_substeps = min(success_substeps, scene.substeps)
        self._success = torch.zeros(n, dtype=torch.bool, device=dev)
        self.peak_contacts = torch.zeros((), dtype=torch.int64, device=dev)
        self.peak_constraints = torch.zeros((), dtype=torch.int64, device=dev)
        # Episode starts on the device: [I, ...]
        as_t = lambda a, dt=torch.float32: torch.as_tensor(np.asarray(a), dtype=dt, device=dev)   # noqa: E731
        self.start = {"qpos": as_t(scene.start_qpos), "qvel": as_t(scene.start_qvel),
                      "qacc_warmstart": as_t(scene.start_qacc_warmstart), "act": as_t(scene.start_act),
                      "goal_rot": as_t(scene.start_goal_rot, f64), "gripper": as_t(scene.start_gripper, f64),
                      "fixture_pos": as_t(scene.start_fixture_pos), "fixture_quat": as_t(scene.start_fixture_quat),
                      "static_geom_xpos": as_t(scene.start_static_geom_xpos),
                      "static_geom_xmat": as_t(scene.start_static_geom_xmat).reshape(-1, len(scene.static_geoms), 3, 3)}
        self.static_geoms = ix(scene.static_geoms)
        self.cameras = list(cameras)
        self.image_size = image_size
        self.rc = None
        if self.cameras:
            cam_ids = [mujoco.mj_name2id(mjm, mujoco.mjtObj.mjOBJ_CAMERA, CAMERAS[c][0]) for c in self.cameras]
            active = [i in cam_ids for i in range(mjm.ncam)]
            # The render context numbers its active cameras in model order.
            self.cam_slots = [sorted(cam_ids).index(i) for i in cam_ids]
            with self.scope():
                self.rc = mjw.create_render_context(mjm, nworld=n, cam_res=(image_size, image_size),
                                                    render_rgb=True, render_depth=False, use_textures=textures,
                                                    use_shadows=shadows, cam_active=active,
                                                    enabled_geom_groups=RENDER_GEOM_GROUPS)
                self.rgb = wp.zeros((n, image_size, image_size), dtype=wp.vec3)
            self.rgb_t = torch_view(self.rgb, self.device)

    @contextlib.contextmanager
    def scope(self):
        """Warp launches on this batch's device and, on a GPU, on torch's current stream (so torch's and Warp's
        work on the same arrays is ordered without extra synchronisation)."""
        wp = self.wp
        with wp.ScopedDevice(self.wdev):
            if self.device.type == "cuda":
                with wp.ScopedStream(wp.stream_from_torch(torch.cuda.current_stream(self.device))):
                    yield
            else:
                yield

    # ------------------------------------------------------------------------------------------------ physics
    def arm_mass(self) -> Tensor:
        """``[n, J, J]`` the arm's block of the joint-space inertia (after ``step1`` / ``fwd_position``)."""
        if self.sparse_m:
            return self.qM[:, 0, :][:, self.m_index]
        full = self.qM[:, self.arm_dof][:, :, self.arm_dof]
        return torch.tril(full) + torch.tril(full, -1).transpose(1, 2)

    def controller_inputs(self) -> dict[str, Tensor]:
        """The robot state the OSC reads, from the current kinematics (after ``step1``)."""
        v, eef = self.v, self.scene.eef_site
        ee_pos = v["site_xpos"][:, eef]
        jac_pos, jac_rot = hinge_jacobian(ee_pos, self.xanchor[:, self.arm_joints], self.xaxis[:, self.arm_joints])
        return {"ee_pos": ee_pos, "ee_rot": v["site_xmat"][:, eef], "jac_pos": jac_pos, "jac_rot": jac_rot,
                "mass": self.arm_mass(), "bias": self.qfrc_bias[:, self.arm_dof], "q": v["qpos"][:, self.arm_qpos],
                "qd": v["qvel"][:, self.arm_dof]}

    def physics_step(self, action: Tensor, on_substep=None) -> None:
        """One policy action ``[n, 7]`` (in [-1, 1]): ``substeps`` physics steps under the OSC and the gripper.
        ``on_substep(s)``, if given, is called after each physics step ``s`` (diagnostics)."""
        mjw, m, d = self.mjw, self.m, self.d
        action = action.to(torch.float64)
        with self.scope():
            for s in range(self.scene.substeps):
                mjw.step1(m, d)
                inp = self.controller_inputs()
                if s == 0:
                    self.goal_pos, self.goal_rot = set_goal(action[:, :6], inp["ee_pos"], inp["ee_rot"],
                                                            self.goal_rot, self.gains)
                tau = clip_torques(osc_torques(**inp, goal_pos=self.goal_pos, goal_rot=self.goal_rot,
                                               q_rest=self.q_rest, gains=self.gains), self.gains)
                self.gripper, fingers = gripper_step(self.gripper, action[:, 6], self.gains)
                self.ctrl[:, self.arm_act] = tau.to(self.ctrl.dtype)
                self.ctrl[:, self.grip_act] = fingers.to(self.ctrl.dtype)
                mjw.step2(m, d)
                if s == self.scene.substeps - self.success_substeps:
                    self._success = self.goal_now()
                elif s > self.scene.substeps - self.success_substeps:
                    self._success |= self.goal_now()
                if on_substep is not None:
                    on_substep(s)
            # Buffer use, checked once per chunk (reading it here would synchronise every action).
            self.peak_contacts = torch.maximum(self.peak_contacts, self.nacon[0].long())
            self.peak_constraints = torch.maximum(self.peak_constraints, self.nefc.max().long())

    def check_buffers(self) -> None:
        """Error when contacts or constraints overflowed their buffers (the physics would be wrong)."""
        if int(self.peak_contacts) > self.naconmax:
            raise RuntimeError(f"libero_warp: {int(self.peak_contacts)} contacts overflowed the buffer of "
                               f"{self.naconmax} ({self.naconmax // self.n} per world): raise "
                               "env.libero_warp.contacts_per_world")
        if int(self.peak_constraints) > self.njmax:
            raise RuntimeError(f"libero_warp: {int(self.peak_constraints)} constraint rows overflowed the "
                               f"{self.njmax} per world: raise env.libero_warp.constraints_per_world")

    def forward(self) -> None:
        """Full forward dynamics at the current state (kinematics, contacts, forces; no integration)."""
        with self.scope():
            self.mjw.forward(self.m, self.d)

    def kinematics(self) -> None:
        """Positions and orientations (bodies, sites, geoms, cameras, lights) at the current qpos."""
        with self.scope():
            self.mjw.kinematics(self.m, self.d)
            self.mjw.com_pos(self.m, self.d)
            self.mjw.camlight(self.m, self.d)

    # ------------------------------------------------------------------------------------------------ episodes
    def load_starts(self, rows: Tensor, start_index: Tensor) -> None:
        """Put episode starts ``start_index`` ``[k]`` (positions in the scene's ``start_ids``) into ``rows``
        ``[k]``: state, controller, gripper, fixtures. Derived fields are stale until :meth:`kinematics`."""
        s, v = self.start, self.v
        for k in ("qpos", "qvel", "qacc_warmstart", "act"):
            v[k][rows] = s[k][start_index]
        v["time"][rows] = 0.0
        self.goal_rot[rows] = s["goal_rot"][start_index]
        self.gripper[rows] = s["gripper"][start_index]
        self.body_pos[rows[:, None], self.fixtures[None, :]] = s["fixture_pos"][start_index]
        self.body_quat[rows[:, None], self.fixtures[None, :]] = s["fixture_quat"][start_index]
        # MuJoCo Warp never recomputes the pose of a geom welded to the world (a fixture's frame): put it in.
        self.v["geom_xpos"][rows[:, None], self.static_geoms[None, :]] = s["static_geom_xpos"][start_index]
        self.v["geom_xmat"][rows[:, None], self.static_geoms[None, :]] = s["static_geom_xmat"][start_index]

    def snapshot(self, rows: Tensor) -> dict[str, Tensor]:
        out = {k: self.v[k][rows].clone() for k in STATE_FIELDS + DERIVED_FIELDS}
        out["goal_rot"], out["gripper"] = self.goal_rot[rows].clone(), self.gripper[rows].clone()
        return out

    def restore(self, rows: Tensor, snap: dict[str, Tensor]) -> None:
        for k in STATE_FIELDS + DERIVED_FIELDS:
            self.v[k][rows] = snap[k]
        self.goal_rot[rows], self.gripper[rows] = snap["goal_rot"], snap["gripper"]

    # ------------------------------------------------------------------------------------------------ observe
    def state(self) -> Tensor:
        """``[n, 8]`` float32: end-effector position, hand orientation as axis-angle, finger positions."""
        v = self.v
        pos = v["site_xpos"][:, self.scene.eef_site]
        aa = quat_wxyz_to_axis_angle(v["xquat"][:, self.scene.hand_body])
        return torch.cat([pos.double(), aa, v["qpos"][:, self.grip_qpos].double()], dim=-1).float()

    def contacts(self) -> tuple[Tensor, Tensor, Tensor]:
        """The active constraint contacts as ``(geom_a, geom_b, world)`` ``[naconmax]`` (inactive slots: geom -1)."""
        valid = (self.contact_slot < self.nacon[0]) & ((self.contact_type & 1) != 0)
        geom = torch.where(valid[:, None], self.contact_geom, torch.full_like(self.contact_geom, -1))
        return geom[:, 0], geom[:, 1], self.contact_world.clamp(0, self.n - 1)

    def goal_now(self) -> Tensor:
        """``[n]`` bool: LIBERO's goal holds (from the last physics step's kinematics and contacts)."""
        return self.goal.success(**self.goal_inputs())

    def success(self) -> Tensor:
        """``[n]`` bool: the goal held after one of the last ``success_substeps`` substeps of the last action."""
        return self._success.clone()

    def goal_inputs(self) -> dict[str, Tensor]:
        v = self.v
        ga, gb, w = self.contacts()
        return {"xpos": v["xpos"], "site_xpos": v["site_xpos"], "site_xmat": v["site_xmat"], "qpos": v["qpos"],
                "geom_a": ga, "geom_b": gb, "contact_world": w}

    def render(self) -> Tensor:
        """``[n, C, S, S, 3]`` uint8 in the renderer's orientation (row 0 at the top)."""
        if self.rc is None:
            s = self.image_size
            return torch.zeros(self.n, 0, s, s, 3, dtype=torch.uint8, device=self.device)
        mjw = self.mjw
        out = []
        with self.scope():
            mjw.refit_bvh(self.m, self.d, self.rc)
            mjw.render(self.m, self.d, self.rc)
            for slot in self.cam_slots:
                mjw.get_rgb(self.rc, slot, self.rgb)
                out.append((self.rgb_t * 255.0).round_().clamp_(0, 255).to(torch.uint8))
        return torch.stack(out, dim=1)


class LiberoWarpEnv:
    """``num_envs`` LIBERO worlds on MuJoCo Warp (see the module docstring); the batched interface of
    :mod:`envs.base`. ``scenes`` (tests): already loaded :class:`envs.libero.scene.TaskScene` s, one per task."""

    def __init__(self, cfg: LiberoWarpConfig, num_envs: int, *, device="cpu", seed: int = 0, scenes=None):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        import_warp()
        self.cfg, self.seed = cfg, seed
        self.device = torch.device(device)
        task_ids = list(range(SUITE_NUM_TASKS[cfg.suite])) if cfg.task_ids is None else list(cfg.task_ids)
        bad = [t for t in task_ids if t >= SUITE_NUM_TASKS[cfg.suite]]
        if bad:
            raise ValueError(f"task_ids {bad} out of range: {cfg.suite} has {SUITE_NUM_TASKS[cfg.suite]} tasks")
        if num_envs < len(task_ids):
            raise ValueError(f"{num_envs} envs cannot hold {len(task_ids)} tasks (one block of worlds per task)")
        self.task_ids = task_ids
        # Contiguous blocks: world i belongs to task block i * T // N.
        block = [i * len(task_ids) // num_envs for i in range(num_envs)]
        self.world_task = torch.tensor(block, dtype=torch.long)
        if scenes is None:
            scenes = [load_task_scene(cfg.suite, t, cfg.init_state_ids, num_settle_steps=cfg.num_settle_steps)
                      for t in task_ids]
        self.batches: list[TaskWorlds] = []
        self.rows: list[range] = []
        for b, scene in enumerate(scenes):
            members = [i for i in range(num_envs) if block[i] == b]
            self.rows.append(range(members[0], members[-1] + 1))
            self.batches.append(TaskWorlds(scene, len(members), device=self.device, cameras=cfg.cameras,
                                           image_size=cfg.image_size, contacts_per_world=cfg.contacts_per_world,
                                           constraints_per_world=cfg.constraints_per_world,
                                           textures=cfg.textures, shadows=cfg.shadows,
                                           success_substeps=cfg.success_substeps))
        self.instructions = [scenes[block[i]].instruction for i in range(num_envs)]
        self.spec = EnvSpec(num_envs=num_envs, action_dim=ACTION_DIM, state_dim=STATE_DIM,
                            num_cameras=len(cfg.cameras), image_size=cfg.image_size,
                            max_episode_steps=cfg.episode_steps)
        self.gen = torch.Generator().manual_seed(seed)
        self._t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._episode = torch.zeros(num_envs, dtype=torch.long)    # indexed order: next episode number per world
        self.init_ids = torch.zeros(num_envs, dtype=torch.long)    # the init state each world's episode started from
        self.tracker = EpisodeTracker(num_envs, self.device)
        self._noop = torch.as_tensor(NOOP, dtype=torch.float32, device=self.device)
        self._final_frames: list[int] = []

    @property
    def num_envs(self) -> int:
        return self.spec.num_envs

    # ------------------------------------------------------------------------------------------------ episodes
    def _draw(self, worlds: list[int], seed: int | None = None, group_size: int = 1) -> torch.Tensor:
        """Init state ids for ``worlds`` (global indices); see ``LiberoWarpConfig.episode_order``."""
        out = torch.zeros(len(worlds), dtype=torch.long)
        for k, i in enumerate(worlds):
            starts = self.batches[int(self.world_task[i])].scene.start_ids
            if self.cfg.episode_order == "indexed":
                if seed is not None:
                    self._episode[i] = seed + i
                out[k] = int(starts[int(self._episode[i]) % len(starts)])
                self._episode[i] += 1
            else:
                out[k] = int(starts[int(torch.randint(len(starts), (1,), generator=self.gen))])
        if group_size > 1 and self.cfg.episode_order == "random":
            lead = {i: k for k, i in enumerate(worlds)}
            for k, i in enumerate(worlds):
                j = i // group_size * group_size
                if int(self.world_task[j]) != int(self.world_task[i]):
                    raise ValueError(f"group_size {group_size}: envs {j} and {i} of one group hold different tasks "
                                     "(each task has a contiguous block of envs; make blocks multiples of the group)")
                out[k] = out[lead[j]]
        return out

    def _start(self, worlds: list[int], init_ids: torch.Tensor) -> None:
        """Load episode starts into ``worlds`` (global indices) and recompute their kinematics."""
        self.init_ids[worlds] = init_ids
        for b, batch in enumerate(self.batches):
            sel = [k for k, i in enumerate(worlds) if i in self.rows[b]]
            if not sel:
                continue
            rows = torch.tensor([worlds[k] - self.rows[b].start for k in sel], device=self.device)
            idx = torch.tensor([batch.scene.start_index(int(init_ids[k])) for k in sel], device=self.device)
            batch.load_starts(rows, idx)
            batch.kinematics()

    @torch.inference_mode()
    def reset(self, seed: int | None = None, *, group_size: int = 1) -> dict:
        """Every world starts a new episode; ``seed`` reseeds the draw of init states (the same seed, the same
        episodes). ``group_size`` g > 1: groups of g worlds start from the same init state (within a task)."""
        if seed is not None:
            self.gen.manual_seed(seed)
        worlds = list(range(self.num_envs))
        self._start(worlds, self._draw(worlds, seed, group_size))
        self._t.zero_()
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self.observe()

    # ------------------------------------------------------------------------------------------------ observe
    def _orient(self, images: Tensor) -> Tensor:
        # The renderer's rows run top-down already (the CPU adapter flips MuJoCo's bottom-up rows for "upright").
        return images if self.cfg.image_orientation == "upright" else images.flip(-3, -2)

    def state(self) -> Tensor:
        return torch.cat([b.state() for b in self.batches])

    def images(self) -> Tensor:
        return self._orient(torch.cat([b.render() for b in self.batches]))

    def observe(self) -> dict:
        return {"images": self.images(), "state": self.state(), "instruction": list(self.instructions)}

    def success(self) -> Tensor:
        return torch.cat([b.success() for b in self.batches])

    # ------------------------------------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self, chunk: Tensor) -> ChunkStep:
        """Execute up to H actions of ``chunk`` ``[N, H, 7]`` per world (see :mod:`envs.base`)."""
        chunk = check_action_chunk(chunk, self.spec, device=self.device).clamp(-1.0, 1.0)
        n, horizon = chunk.shape[:2]
        dev = self.device
        book = ChunkBook(n, horizon, dev)
        final_state = torch.zeros(n, STATE_DIM, device=dev)
        frozen: list[dict | None] = [None] * len(self.batches)   # per batch: snapshot of its ended rows
        frozen_rows: list[Tensor | None] = [None] * len(self.batches)
        for h in range(horizon):
            action = torch.where(book.active[:, None], chunk[:, h], self._noop)
            for b, batch in enumerate(self.batches):
                rows = self.rows[b]
                batch.physics_step(action[rows.start:rows.stop])
            succ = self.success()
            ended = book.book(h, succ.float(), succ, succ, self._t, self.spec.max_episode_steps, self.tracker)
            if bool(ended.any()):
                final_state[ended] = self.state()[ended]
                for b, batch in enumerate(self.batches):
                    rows = self.rows[b]
                    local = ended[rows.start:rows.stop].nonzero(as_tuple=True)[0]
                    if len(local):
                        snap = batch.snapshot(local)
                        if frozen[b] is None:
                            frozen[b], frozen_rows[b] = snap, local
                        else:
                            frozen[b] = {k: torch.cat([frozen[b][k], snap[k]]) for k in snap}
                            frozen_rows[b] = torch.cat([frozen_rows[b], local])
            if not bool(book.active.any()):
                break
        for batch in self.batches:
            batch.check_buffers()
        done = book.done
        if not bool(done.any()):
            return book.result(self.observe(), final_obs=None)
        for b, batch in enumerate(self.batches):
            if frozen[b] is not None:
                batch.restore(frozen_rows[b], frozen[b])
        images, state = self.images(), self.state()
        final_obs = {"images": images, "state": final_state, "instruction": list(self.instructions)}
        episodes = self.tracker.finish(done, book.success)
        rows = [i for i in self._final_frames if bool(done[i])]
        frames = {i: self._frame(images[i]) for i in rows} if rows and images.shape[1] else None
        worlds = done.nonzero(as_tuple=True)[0].tolist()
        self._start(worlds, self._draw(worlds))
        self._t[done] = 0
        # The worlds that ran on keep the observation read before the resets recomputed kinematics.
        if images.shape[1]:
            images = torch.where(done[:, None, None, None, None], self.images(), images)
        obs = {"images": images, "state": torch.where(done[:, None], self.state(), state),
               "instruction": list(self.instructions)}
        return book.result(obs, final_obs=final_obs, episodes=episodes, final_frames=frames)

    # ------------------------------------------------------------------------------------------------ videos
    def set_final_frames(self, indices: list[int]) -> None:
        """Render the last state of each episode that ends in envs ``indices`` into the step's ``final_frames``."""
        self._final_frames = sorted(set(check_env_indices(indices, self.num_envs)))

    def render_frames(self, indices: list[int] | None = None) -> list[np.ndarray]:
        """One frame ``[S, C * S, 3]`` per requested world (its cameras side by side), for videos."""
        indices = list(range(self.num_envs)) if indices is None else check_env_indices(indices, self.num_envs)
        images = self.images()
        if images.shape[1] == 0:
            raise RuntimeError("libero_warp has no cameras to render (cameras=())")
        return [self._frame(images[i]) for i in indices]

    @staticmethod
    def _frame(images: Tensor) -> np.ndarray:
        return np.ascontiguousarray(torch.cat(list(images), dim=1).cpu().numpy())

    def close(self) -> None:
        self.batches = []


def make_libero_warp_env(cfg: LiberoWarpConfig, num_envs: int, device="cpu", seed: int = 0) -> LiberoWarpEnv:
    return LiberoWarpEnv(cfg, num_envs, device=device, seed=seed)
