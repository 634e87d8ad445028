"""A LIBERO task's scene, read once from LIBERO / robosuite on the host, for the batched MuJoCo Warp env.

:func:`load_task_scene` builds the task's robosuite env through :class:`envs.libero.LiberoSingleEnv` (so the MJCF
is the one LIBERO compiles from its installed assets) and reads out what the batched env needs as plain arrays:
the compiled ``MjModel``, the Panda's joint / actuator / site indices, the OSC_POSE controller's constants
(:class:`envs.libero.osc.OSCGains`, read from robosuite's controller, not restated), the goal predicates
(:mod:`envs.libero.predicates`), and, per initial state, the state an episode starts from.

An episode start is the CPU adapter's: LIBERO's shipped initial state set after a seeded reset, then the settle
steps (no-op actions) run by robosuite itself, with the controller's orientation goal, the gripper's finger
targets and the fixtures' poses at that moment. Fixtures (cabinets, stoves, ...: bodies without joints) are not
part of LIBERO's initial states; every reset redraws their placement from numpy's global RNG, which
:class:`envs.libero.LiberoSingleEnv` seeds from (suite, task, init state). Starts are read once per (task, init
state, settle steps) and cached on disk (``<cache>/libero_warp/starts``, keyed by the LIBERO, robosuite and
MuJoCo versions), so a world started from init state k begins exactly where the CPU adapter's episode k does.

Glossary: J = 7 arm joints, F fixture bodies, I initial states.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vla_rl.core.paths import cache_dir
from vla_rl.envs.libero.osc import OSCGains
from vla_rl.envs.libero.predicates import GoalSpec, goal_spec
from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv


class UnsupportedController(ValueError):
    """The task's robot is not driven by the OSC_POSE controller this backend re-implements."""


@dataclass
class TaskScene:
    """One task's scene and robot, as arrays (see the module docstring). The ``start_*`` arrays hold, for each
    of ``start_ids`` (LIBERO init state ids), the state the CPU adapter starts that episode from: LIBERO's
    initial state after the settle steps, with the controller's and gripper's state and the fixtures' poses."""

    suite: str
    task_id: int
    instruction: str
    model: object                      # mujoco.MjModel, compiled by robosuite
    substeps: int                      # physics steps per action (robosuite: control_timestep / timestep)
    arm_qpos: np.ndarray               # [J] qpos addresses of the arm joints
    arm_dof: np.ndarray                # [J] dof addresses
    arm_joints: np.ndarray             # [J] joint ids (hinges, all ancestors of the end-effector site)
    arm_actuators: np.ndarray          # [J] torque actuators
    gripper_qpos: np.ndarray           # [2] finger joint qpos addresses
    gripper_actuators: np.ndarray      # [2]
    eef_site: int                      # robosuite's grip site (the controlled point, the state's position)
    hand_body: int                     # robot0_right_hand: the state's orientation (robosuite's eef_quat)
    gains: OSCGains
    q_rest: np.ndarray                 # [J] nullspace target (the joints when the controller was made)
    goal: GoalSpec
    fixture_bodies: np.ndarray         # [F]
    num_settle_steps: int
    start_ids: np.ndarray              # [I] init state ids
    start_qpos: np.ndarray             # [I, nq]
    start_qvel: np.ndarray             # [I, nv]
    start_qacc_warmstart: np.ndarray   # [I, nv]
    start_act: np.ndarray              # [I, na]
    start_goal_rot: np.ndarray         # [I, 3, 3] the controller's orientation goal
    start_gripper: np.ndarray          # [I, 2] the gripper's finger targets (``current_action``)
    start_fixture_pos: np.ndarray      # [I, F, 3]
    start_fixture_quat: np.ndarray     # [I, F, 4]
    static_geoms: np.ndarray           # [G] the fixtures' geoms welded to the world (see fixture_static_geoms)
    start_static_geom_xpos: np.ndarray  # [I, G, 3] their world poses in each start
    start_static_geom_xmat: np.ndarray  # [I, G, 9]

    def start_index(self, init_id: int) -> int:
        hit = np.nonzero(self.start_ids == init_id)[0]
        if not len(hit):
            raise KeyError(f"init state {init_id} of {self.suite} task {self.task_id} was not loaded")
        return int(hit[0])


def osc_gains(robot, model) -> OSCGains:
    """The OSC_POSE constants of a robosuite ``SingleArm`` robot; refuses any other controller setting."""
    c = robot.controller
    problems = []
    if type(c).__name__ != "OperationalSpaceController" or c.name != "OSC_POSE":
        problems.append(f"controller {type(c).__name__} ({getattr(c, 'name', '?')})")
    else:
        if c.impedance_mode != "fixed":
            problems.append(f"impedance_mode={c.impedance_mode}")
        if not c.use_delta:
            problems.append("absolute (non-delta) control")
        if c.interpolator_pos is not None or c.interpolator_ori is not None:
            problems.append("an interpolator")
        if c.position_limits is not None or c.orientation_limits is not None:
            problems.append("goal position / orientation limits")
    if type(robot.gripper).__name__ != "PandaGripper":
        problems.append(f"gripper {type(robot.gripper).__name__}")
    if problems:
        raise UnsupportedController("the batched controller re-implements robosuite's fixed-impedance delta OSC_POSE "
                                    "with the Panda gripper; this robot has " + ", ".join(problems))
    low, high = robot.torque_limits
    grip = np.asarray(robot._ref_joint_gripper_actuator_indexes)
    ctrl = model.actuator_ctrlrange[grip]

    def tup(x) -> tuple[float, ...]:
        return tuple(float(v) for v in np.asarray(x, dtype=np.float64).reshape(-1))

    return OSCGains(kp=tup(c.kp), kd=tup(c.kd), input_min=tup(c.input_min), input_max=tup(c.input_max),
                    output_min=tup(c.output_min), output_max=tup(c.output_max), torque_min=tup(low),
                    torque_max=tup(high), uncouple_pos_ori=bool(c.uncoupling),
                    gripper_speed=float(robot.gripper.speed), gripper_ctrl_min=tup(ctrl[:, 0]),
                    gripper_ctrl_max=tup(ctrl[:, 1]))


START_FIELDS = ("qpos", "qvel", "qacc_warmstart", "act", "goal_rot", "gripper", "fixture_pos", "fixture_quat",
                "static_geom_xpos", "static_geom_xmat")


def fixture_static_geoms(model, fixtures: np.ndarray) -> np.ndarray:
    """The geoms of the fixtures' bodies that are welded to the world (a cabinet's frame, a stove): MuJoCo Warp
    computes the world pose of such "static" geoms once, when its Data is made, and never again, so a start that
    places the fixture elsewhere must also put these poses in (its movable parts, drawers and doors, follow the
    body poses like every other body)."""
    body = model.geom_bodyid
    static = (model.body_weldid[body] == 0) & (model.body_mocapid[model.body_rootid[body]] == -1)
    return np.nonzero(static & np.isin(model.body_rootid[body], fixtures))[0].astype(np.int64)


def _start_cache(suite: str, task_id: int, settle: int) -> Path:
    from importlib.metadata import version

    tag = "_".join(f"{p}{version(p)}" for p in ("hf-libero", "robosuite", "mujoco"))
    return cache_dir() / "libero_warp" / "starts" / f"{suite}_task{task_id}_settle{settle}_{tag}.npz"


def _load_starts(path: Path) -> dict[int, dict[str, np.ndarray]]:
    if not path.is_file():
        return {}
    with np.load(path) as f:
        if any(k not in f for k in START_FIELDS):   # written before a field was added: read them again
            return {}
        return {int(i): {k: f[k][j] for k in START_FIELDS} for j, i in enumerate(f["init_ids"])}


def _save_starts(path: Path, starts: dict[int, dict[str, np.ndarray]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = sorted(starts)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez(tmp, init_ids=np.asarray(ids), **{k: np.stack([starts[i][k] for i in ids]) for k in START_FIELDS})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_start(single, task_id: int, init_id: int, fixtures: np.ndarray,
                static: np.ndarray) -> dict[str, np.ndarray]:
    """Start the CPU adapter's episode (seeded reset, init state, settle steps) and read its state."""
    single.reset_to(task_id, init_id)
    env = single._env
    sim, robot = env.sim, env.env.robots[0]
    model, data = sim.model._model, sim.data._data
    return {"qpos": data.qpos.copy(), "qvel": data.qvel.copy(), "qacc_warmstart": data.qacc_warmstart.copy(),
            "act": data.act.copy(), "goal_rot": np.asarray(robot.controller.goal_ori, dtype=np.float64).copy(),
            "gripper": np.asarray(robot.gripper.current_action, dtype=np.float64).copy(),
            "fixture_pos": model.body_pos[fixtures].copy(), "fixture_quat": model.body_quat[fixtures].copy(),
            "static_geom_xpos": data.geom_xpos[static].copy(), "static_geom_xmat": data.geom_xmat[static].copy()}


def load_task_scene(suite: str, task_id: int, init_state_ids: list[int] | None = None, *,
                    num_settle_steps: int = 10, single=None) -> TaskScene:
    """Read ``suite``'s task ``task_id`` from LIBERO (imports LIBERO and robosuite): 5-15 s to build the task's
    env, plus about half a second per episode start not cached yet. ``init_state_ids``: the initial states to
    start episodes from (None: all 50); ``num_settle_steps``: no-op steps after setting one (the protocol's 10).
    ``single``: a :class:`envs.libero.LiberoSingleEnv` of that suite to read from instead of building one (it is
    reset, not closed)."""
    own = single is None
    if own:
        single = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=[task_id], cameras=(),
                                              num_settle_steps=num_settle_steps))
    elif single.cfg.suite != suite or single.cfg.num_settle_steps != num_settle_steps:
        raise ValueError(f"the given LIBERO env runs {single.cfg.suite} with {single.cfg.num_settle_steps} settle "
                         f"steps, not {suite} with {num_settle_steps}")
    try:
        n_states = len(single.init_states(task_id))
        ids = list(range(n_states)) if init_state_ids is None else sorted(set(int(i) for i in init_state_ids))
        bad = [i for i in ids if not 0 <= i < n_states]
        if bad:
            raise ValueError(f"init_state_ids {bad} out of range: task {task_id} of {suite} has {n_states}")
        env = single._task_env(task_id)
        problem, model = env.env, env.sim.model._model
        robot = problem.robots[0]
        fixtures = np.asarray([model.body(problem.fixtures_dict[k].root_body).id for k in problem.fixtures_dict],
                              dtype=np.int64)
        static = fixture_static_geoms(model, fixtures)
        cache = _start_cache(suite, task_id, num_settle_steps)
        starts = _load_starts(cache)
        missing = [i for i in ids if i not in starts or starts[i]["fixture_pos"].shape[0] != len(fixtures)
                   or starts[i]["static_geom_xpos"].shape[0] != len(static)]
        for i in missing:
            starts[i] = _read_start(single, task_id, i, fixtures, static)
        if missing:
            _save_starts(cache, starts)
        if not missing:   # every start was cached: reset once for the controller's state
            single.reset_to(task_id, ids[0])
        arm_joints = np.asarray([model.joint(n).id for n in robot.robot_joints], dtype=np.int64)
        eef_site = int(robot.eef_site_id)
        _check_arm_chain(model, arm_joints, eef_site)
        chosen = {k: np.stack([starts[i][k] for i in ids]) for k in START_FIELDS}
        return TaskScene(
            suite=suite, task_id=task_id, instruction=single.instruction_of(task_id), model=copy.deepcopy(model),
            substeps=int(problem.control_timestep / problem.model_timestep),
            arm_qpos=np.asarray(robot._ref_joint_pos_indexes, dtype=np.int64),
            arm_dof=np.asarray(robot._ref_joint_vel_indexes, dtype=np.int64), arm_joints=arm_joints,
            arm_actuators=np.asarray(robot._ref_joint_actuator_indexes, dtype=np.int64),
            gripper_qpos=np.asarray(robot._ref_gripper_joint_pos_indexes, dtype=np.int64),
            gripper_actuators=np.asarray(robot._ref_joint_gripper_actuator_indexes, dtype=np.int64),
            eef_site=eef_site, hand_body=int(model.body(robot.robot_model.eef_name).id),
            gains=osc_gains(robot, model), q_rest=np.asarray(robot.controller.initial_joint, dtype=np.float64).copy(),
            goal=goal_spec(problem, model), fixture_bodies=fixtures, num_settle_steps=num_settle_steps,
            start_ids=np.asarray(ids, dtype=np.int64), start_qpos=chosen["qpos"], start_qvel=chosen["qvel"],
            start_qacc_warmstart=chosen["qacc_warmstart"], start_act=chosen["act"],
            start_goal_rot=chosen["goal_rot"], start_gripper=chosen["gripper"],
            start_fixture_pos=chosen["fixture_pos"], start_fixture_quat=chosen["fixture_quat"],
            static_geoms=static, start_static_geom_xpos=chosen["static_geom_xpos"],
            start_static_geom_xmat=chosen["static_geom_xmat"])
    finally:
        if own:
            single.close()


def _check_arm_chain(model, arm_joints: np.ndarray, eef_site: int) -> None:
    """The Jacobian of :func:`envs.libero.osc.hinge_jacobian` needs hinge joints that all move the end-effector site."""
    import mujoco

    body = int(model.site_bodyid[eef_site])
    ancestors = set()
    while body > 0:
        ancestors.add(body)
        body = int(model.body_parentid[body])
    for j in arm_joints:
        if model.jnt_type[j] != mujoco.mjtJoint.mjJNT_HINGE or int(model.jnt_bodyid[j]) not in ancestors:
            raise UnsupportedController(f"arm joint {model.joint(int(j)).name} is not a hinge moving the "
                                        "end-effector site")
