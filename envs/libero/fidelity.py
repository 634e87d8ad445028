"""How close LIBERO on MuJoCo Warp (``env.kind: libero_warp``) is to robosuite-LIBERO, measured on the same states.

The reference is the CPU adapter (:class:`vla_rl.envs.libero.robosuite_env.LiberoSingleEnv`, i.e. robosuite and
MuJoCo in float64); the other side is :class:`vla_rl.envs.libero.warp_env.TaskWorlds` (or the whole env) on the same
task,
initial state and actions. Each function returns plain numbers, used by ``tests/envs/libero/test_libero_warp.py`` (with
tolerances) and ``benchmarks/bench_libero_warp.py`` (which reports them):

- :func:`record_controller` / :func:`warp_torques`: the joint torques robosuite's OSC computed at every physics
  substep of an episode, and the batched OSC's on the same states read through Warp;
- :func:`goal_states` / :func:`predicate_agreement`: states where a task's goal holds or does not (objects placed
  on or in their targets and settled by robosuite's physics, articulations moved past their thresholds, plus the
  initial state), LIBERO's predicates on them against the batched ones;
- :func:`rollout_cpu` / :func:`rollout_warp`: end-effector and object trajectories under one action sequence;
- :func:`contacts_cpu` / :func:`contacts_warp`: the contacts each simulator's collision detection finds on one
  state (per geom pair: how many, how deep);
- :func:`psnr`: image agreement.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import torch

from vla_rl.envs.libero.osc import clip_torques, osc_torques
from vla_rl.envs.libero.predicates import GoalEvaluator, goal_spec
from vla_rl.envs.libero.robosuite_env import NOOP


# ------------------------------------------------------------------------------------------------ controller
@contextlib.contextmanager
def record_controller(single):
    """While active, every controller call of ``single``'s current robosuite env (one per physics substep) appends
    a dict to the yielded list: the state it saw (``qpos``, ``qvel``), the orientation goal before it, the action,
    whether it was a policy step, and what robosuite computed (clipped ``torques``, ``goal_pos``, ``goal_rot``,
    finger controls ``fingers``, gripper state ``gripper_after``)."""
    env = single._env
    sim, robot = env.sim, env.env.robots[0]
    ctrl, records = robot.controller, []
    original = robot.control

    def control(action, policy_step=False):
        rec = {"qpos": sim.data.qpos.copy(), "qvel": sim.data.qvel.copy(),
               "goal_rot_before": np.array(ctrl.goal_ori, dtype=np.float64),
               "gripper_before": np.array(robot.gripper.current_action, dtype=np.float64),
               "policy_step": bool(policy_step), "action": np.array(action, dtype=np.float64)}
        original(action, policy_step)
        fingers = sim.data.ctrl[robot._ref_joint_gripper_actuator_indexes].copy()
        rec.update(torques=np.array(robot.torques, dtype=np.float64), goal_pos=np.array(ctrl.goal_pos),
                   goal_rot=np.array(ctrl.goal_ori), fingers=fingers,
                   gripper_after=np.array(robot.gripper.current_action, dtype=np.float64))
        records.append(rec)

    robot.control = control
    # The direct step (envs.libero.direct) computes the same control without calling robot.control: record on
    # robosuite's own substep loop while active (the same trajectory, bit for bit).
    cfg, single.cfg = single.cfg, replace(single.cfg, direct_step=False)
    try:
        yield records
    finally:
        robot.control, single.cfg = original, cfg


def warp_torques(worlds, records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(ours, robosuite's)`` ``[R, J]``: clipped OSC torques on each record's state, ours computed from Warp's
    kinematics / inertia / bias forces (one world per record, ``worlds.n`` == ``len(records)``) with the record's
    goals, robosuite's as it applied them."""

    n = len(records)
    if worlds.n != n:
        raise ValueError(f"{n} records need a TaskWorlds of {n} worlds, got {worlds.n}")
    dev = worlds.device
    stack = lambda k: torch.tensor(np.stack([r[k] for r in records]), dtype=torch.float64, device=dev)  # noqa: E731
    worlds.load_starts(torch.arange(n, device=dev), torch.zeros(n, dtype=torch.long, device=dev))
    worlds.v["qpos"][:] = stack("qpos").float()
    worlds.v["qvel"][:] = stack("qvel").float()
    with worlds.scope():
        worlds.mjw.step1(worlds.m, worlds.d)
    tau = osc_torques(**worlds.controller_inputs(), goal_pos=stack("goal_pos"), goal_rot=stack("goal_rot"),
                      q_rest=worlds.q_rest, gains=worlds.gains)
    return clip_torques(tau, worlds.gains).cpu().numpy(), stack("torques").cpu().numpy()


# ------------------------------------------------------------------------------------------------ predicates
def _set_free_body(sim, obj, pos: np.ndarray) -> None:
    joint = obj.joints[-1]
    qpos = sim.data.get_joint_qpos(joint).copy()
    qpos[:3] = pos
    sim.data.set_joint_qpos(joint, qpos)
    sim.data.set_joint_qvel(joint, np.zeros(6))


def goal_states(single, task_id: int, init_state_id: int = 0, *, settle_steps: int = 15,
                record_every: int = 3) -> list[np.ndarray]:
    """Flattened MuJoCo states ``[1 + nq + nv]`` of ``task_id`` where its goal may or may not hold: the episode
    start, then every ``record_every`` no-op steps while the goal's objects, put on / in their targets (or the
    articulation past its threshold), settle under robosuite's physics for ``settle_steps`` steps."""

    single.reset_to(task_id, init_state_id)
    env = single._env
    problem, sim = env.env, env.sim
    states = [sim.get_state().flatten()]
    spec = goal_spec(problem, sim.model._model)
    per_target: dict[tuple, int] = {}
    for atom, (_, *args) in zip(spec.atoms, problem.parsed_problem["goal_state"]):
        if atom.op == "joint":
            for addr in atom.qpos:
                past = {"<": -0.02, ">": 0.02, ">=": 0.02}[atom.cmp]
                sim.data.qpos[addr] = atom.threshold + past
            continue
        key = (atom.op, atom.site, atom.target_body)
        k = per_target.get(key, 0)
        per_target[key] = k + 1
        if atom.op == "on_object":
            target = sim.data.body_xpos[atom.target_body].copy() + np.array([0.0, 0.0, 0.06 + 0.05 * k])
        else:
            target = sim.data.site_xpos[atom.site].copy()
            size = np.asarray(atom.size)
            target[0] += k * min(0.04, 0.5 * size[0])   # a second object into the same region: beside the first
            target[2] += (size[2] + 0.04) if atom.op == "on_site" else 0.02
        _set_free_body(sim, problem.get_object(args[0]), target)
    sim.forward()
    states.append(sim.get_state().flatten())
    for step in range(1, settle_steps + 1):
        env.step(NOOP)
        if step % record_every == 0:
            states.append(sim.get_state().flatten())
    return states


def libero_atoms(single, task_id: int, states: list[np.ndarray], fixture_init_id: int = 0,
                 goal=None) -> tuple[np.ndarray, np.ndarray | None]:
    """LIBERO's own predicates (``_eval_predicate``) of the task's goal atoms at each state, after ``sim.forward()``
    (fixtures: those of the episode start ``fixture_init_id``): ``[len(states), K]`` bool. With ``goal`` (a
    :class:`~vla_rl.envs.libero.predicates.GoalSpec`), also the batched predicates fed with the same MuJoCo data
    (positions, orientations, joint positions and contacts of the float64 simulation), else None."""

    single.reset_to(task_id, fixture_init_id)
    env = single._env
    problem, sim = env.env, env.sim
    model, data = sim.model._model, sim.data._data
    evaluator = None if goal is None else GoalEvaluator(goal, model.ngeom, "cpu")
    ref, ours = [], []
    for s in states:
        sim.set_state_from_flattened(s)
        sim.forward()
        ref.append([bool(problem._eval_predicate(g)) for g in problem.parsed_problem["goal_state"]])
        if evaluator is not None:
            t = lambda x: torch.as_tensor(np.array(x))[None]   # noqa: E731
            con = data.contact[:data.ncon]
            ours.append(evaluator.atoms(
                xpos=t(data.xpos), site_xpos=t(data.site_xpos), site_xmat=t(data.site_xmat.reshape(-1, 3, 3)),
                qpos=t(data.qpos), geom_a=torch.as_tensor(np.array(con.geom1, dtype=np.int64)),
                geom_b=torch.as_tensor(np.array(con.geom2, dtype=np.int64)),
                contact_world=torch.zeros(data.ncon, dtype=torch.long))[0].numpy())
    return np.asarray(ref, dtype=bool), None if goal is None else np.asarray(ours, dtype=bool)


def warp_atoms(worlds, states: list[np.ndarray], start_index: int = 0) -> np.ndarray:
    """``[len(states), K]`` bool: the batched predicates on the same states (one world each), after Warp's full
    forward pass (kinematics and contacts)."""
    n, dev = len(states), worlds.device
    if worlds.n != n:
        raise ValueError(f"{n} states need a TaskWorlds of {n} worlds, got {worlds.n}")
    nq, nv = worlds.scene.model.nq, worlds.scene.model.nv
    flat = torch.tensor(np.stack(states), dtype=torch.float32, device=dev)
    worlds.load_starts(torch.arange(n, device=dev), torch.full((n,), start_index, dtype=torch.long, device=dev))
    worlds.v["qpos"][:] = flat[:, 1:1 + nq]
    worlds.v["qvel"][:] = flat[:, 1 + nq:1 + nq + nv]
    worlds.v["qacc_warmstart"].zero_()
    worlds.forward()
    return worlds.goal.atoms(**worlds.goal_inputs()).cpu().numpy()


def warp_settled_atoms(worlds, states: list[np.ndarray], start_index: int = 0) -> dict[str, np.ndarray]:
    """Warp's own contacts: the states (one world each) run one no-op action in Warp; after each of its last
    ``worlds.success_substeps`` physics substeps, Warp's atoms (``warp``) and that substep's state (``qpos``,
    ``qvel``) for LIBERO to judge, and the env's success of that action (``success``: the goal held after one of
    them). Arrays ``[k, n, ...]`` over the recorded substeps (``success`` ``[n]``)."""

    n, dev = len(states), worlds.device
    warp_atoms(worlds, states, start_index)   # loads the states (and runs a forward pass)
    first = worlds.scene.substeps - worlds.success_substeps
    rec = {"warp": [], "qpos": [], "qvel": []}

    def record(s: int) -> None:
        if s >= first:
            rec["warp"].append(worlds.goal.atoms(**worlds.goal_inputs()).cpu().numpy())
            rec["qpos"].append(worlds.v["qpos"].double().cpu().numpy().copy())
            rec["qvel"].append(worlds.v["qvel"].double().cpu().numpy().copy())

    worlds.physics_step(torch.as_tensor(NOOP, dtype=torch.float32, device=dev).expand(n, -1), on_substep=record)
    out = {k: np.stack(v) for k, v in rec.items()}
    out["success"] = worlds.success().cpu().numpy()
    return out


# ------------------------------------------------------------------------------------------------ trajectories
def object_bodies(scene) -> list[int]:
    """The bodies whose trajectories are compared: every body the goal names (objects placed, supports)."""
    out = []
    for atom in scene.goal.atoms:
        for b in (atom.body, atom.target_body):
            if b >= 0 and b not in out:
                out.append(b)
    return out


def rollout_cpu(single, task_id: int, init_state_id: int, actions: np.ndarray, bodies: list[int]) -> dict:
    """Run ``actions`` ``[T, 7]`` in the CPU adapter from an episode start: per step ``eef`` ``[T+1, 3]``, the
    ``bodies``' positions ``[T+1, B, 3]`` (row 0: the start) and ``success`` ``[T]`` (LIBERO's, not stopping)."""
    single.reset_to(task_id, init_state_id)
    env = single._env
    sim, robot = env.sim, env.env.robots[0]
    eef, pos, succ = [sim.data.site_xpos[robot.eef_site_id].copy()], [sim.data.body_xpos[bodies].copy()], []
    for a in actions:
        _, _, done, _ = env.step(np.clip(a, -1.0, 1.0))
        eef.append(sim.data.site_xpos[robot.eef_site_id].copy())
        pos.append(sim.data.body_xpos[bodies].copy())
        succ.append(bool(done))
    return {"eef": np.stack(eef), "bodies": np.stack(pos), "success": np.asarray(succ)}


def rollout_warp(worlds, init_state_id: int, actions: np.ndarray, bodies: list[int]) -> dict:
    """The same for a :class:`~vla_rl.envs.libero.warp_env.TaskWorlds` (every world runs the same actions from the
    same start; ``[T+1, n, 3]`` / ``[T+1, n, B, 3]`` / ``[T, n]``)."""
    n, dev = worlds.n, worlds.device
    rows = torch.arange(n, device=dev)
    worlds.load_starts(rows, torch.full((n,), worlds.scene.start_index(init_state_id), dtype=torch.long, device=dev))
    worlds.kinematics()
    v, site = worlds.v, worlds.scene.eef_site
    # Copies: on the CPU backend these tensors share the simulator's memory.
    read = lambda: (v["site_xpos"][:, site].cpu().numpy().copy(), v["xpos"][:, bodies].cpu().numpy().copy())  # noqa: E731
    e0, b0 = read()
    eef, pos, succ = [e0], [b0], []
    for a in actions:
        act = torch.as_tensor(np.clip(a, -1.0, 1.0), dtype=torch.float32, device=dev).expand(n, -1)
        worlds.physics_step(act)
        e, b = read()
        eef.append(e)
        pos.append(b)
        succ.append(worlds.success().cpu().numpy())
    return {"eef": np.stack(eef), "bodies": np.stack(pos), "success": np.stack(succ)}


def contacts_cpu(model, qpos: np.ndarray) -> dict[tuple[int, int], list[float]]:
    """MuJoCo's contacts at ``qpos``: per geom pair (lower id first) the sorted penetration depths (m, < 0)."""
    import mujoco

    data = mujoco.MjData(model)
    data.qpos[:] = qpos
    mujoco.mj_forward(model, data)
    out: dict[tuple[int, int], list[float]] = {}
    for c in data.contact[:data.ncon]:
        out.setdefault((min(c.geom1, c.geom2), max(c.geom1, c.geom2)), []).append(float(c.dist))
    return {k: sorted(v) for k, v in out.items()}


def contacts_warp(worlds, qpos: np.ndarray, init_state_id: int) -> dict[tuple[int, int], list[float]]:
    """The same from MuJoCo Warp's collision detection, on world 0 of ``worlds`` (its fixtures placed as in
    episode start ``init_state_id``, the bodies at ``qpos``)."""
    dev = worlds.device
    worlds.load_starts(torch.zeros(1, dtype=torch.long, device=dev),
                       torch.full((1,), worlds.scene.start_index(init_state_id), dtype=torch.long, device=dev))
    worlds.v["qpos"][0] = torch.as_tensor(qpos, dtype=worlds.v["qpos"].dtype, device=dev)
    worlds.forward()
    ga, gb, w = worlds.contacts()
    out: dict[tuple[int, int], list[float]] = {}
    for a, b, k, x in zip(ga.tolist(), gb.tolist(), w.tolist(), worlds.contact_dist.tolist()):
        if a >= 0 and k == 0:
            out.setdefault((min(a, b), max(a, b)), []).append(float(x))
    return {k: sorted(v) for k, v in out.items()}


def random_actions(steps: int, seed: int, *, scale: float = 0.5, hold: int = 5) -> np.ndarray:
    """``[steps, 7]`` smooth random actions (a new draw every ``hold`` steps, within ``scale``; gripper +-1)."""
    rng = np.random.default_rng(seed)
    keys = rng.uniform(-scale, scale, size=(steps // hold + 1, 7))
    keys[:, 6] = np.sign(rng.uniform(-1, 1, size=len(keys)))
    return np.repeat(keys, hold, axis=0)[:steps]


# ------------------------------------------------------------------------------------------------ a test policy
class PickPlaceExpert:
    """A closed-loop scripted pick-and-place policy on privileged state, batched over worlds, for comparing success
    on the two simulators (not a LIBERO expert: on libero_spatial task 0 it succeeds in about 6 of 10 episodes on
    robosuite, which makes success sensitive to the dynamics). For a goal whose first atom places an object (on /
    in a target): move above the object's rim, descend, close, lift, carry the object over the target (with the
    in-hand offset it has), lower it, open, retreat; when the object falls out of the hand, start again.

    ``act(eef, obj, target)`` ``[N, 3]`` each -> actions ``[N, 7]``. ``rim``: where to grasp, as an x offset from
    the object's origin (the fingers close along world x in LIBERO's start pose)."""

    LIFT, CARRY, LOWER = 0.15, 0.12, 0.025

    def __init__(self, n: int, rim: float):
        self.phase = np.zeros(n, dtype=np.int64)
        self.t = np.zeros(n, dtype=np.int64)
        self.lift = np.zeros((n, 3))
        self.grasp_offset = np.array([rim - 0.012, 0.0, 0.03])

    @staticmethod
    def rim_of(model, body: int) -> float:
        """Largest x reach of the body's collision geoms around its origin (boxes: position + half size)."""
        reach = [abs(model.geom_pos[g][0]) + abs(model.geom_size[g][0]) for g in range(model.ngeom)
                 if model.geom_bodyid[g] == body and model.geom_contype[g]]
        return float(max(reach)) if reach else 0.0

    def act(self, eef: np.ndarray, obj: np.ndarray, target: np.ndarray) -> np.ndarray:
        eef, obj, target = (np.asarray(x, dtype=np.float64) for x in (eef, obj, target))
        ph = self.phase
        dropped = np.isin(ph, (3, 4, 5)) & (np.linalg.norm(eef - obj, axis=-1) > 0.12)
        ph[dropped], self.t[dropped] = 0, 0
        grasp = obj + self.grasp_offset
        hold = eef - obj
        self.lift = np.where((ph <= 2)[:, None], grasp + [0, 0, self.LIFT], self.lift)
        goal = np.select([ph[:, None] == k for k in range(7)],
                         [grasp + [0, 0, 0.12], grasp, grasp, self.lift, target + hold + [0, 0, self.CARRY],
                          target + hold + [0, 0, self.LOWER], target + hold + [0, 0, self.LOWER]], default=eef)
        d = goal - eef
        a = np.zeros((len(ph), 7))
        a[:, :3] = np.clip(d / 0.05, -1.0, 1.0)
        a[:, 6] = np.where(np.isin(ph, (2, 3, 4, 5)), 1.0, -1.0)
        done = ph == 7
        a[done, :3] = [0.0, 0.0, 1.0]
        self.t += 1
        dist = np.linalg.norm(d, axis=-1)
        reached = dist < np.where(np.isin(ph, (1, 5)), 0.01, 0.02)
        advance = (np.isin(ph, (0, 1, 3, 4, 5)) & reached) | ((ph == 1) & (self.t > 25)) | \
                  ((ph == 2) & (self.t >= 15)) | ((ph == 6) & (self.t >= 10))
        ph[advance] += 1
        self.t[advance] = 0
        return a


def expert_episodes_cpu(single, task_id: int, init_ids: list[int], max_steps: int) -> list[dict]:
    """:class:`PickPlaceExpert` in the CPU adapter, one episode per init state: success and its step."""

    out = []
    for i in init_ids:
        single.reset_to(task_id, i)
        env = single._env
        sim, eef_site = env.sim, env.env.robots[0].eef_site_id
        atom = goal_spec(env.env, sim.model._model).atoms[0]
        expert = PickPlaceExpert(1, PickPlaceExpert.rim_of(sim.model._model, atom.body))
        steps = None
        for k in range(max_steps):
            target = sim.data.body_xpos[atom.target_body] if atom.target_body >= 0 else sim.data.site_xpos[atom.site]
            a = expert.act(sim.data.site_xpos[eef_site][None], sim.data.body_xpos[atom.body][None], target[None])[0]
            _, _, _, _, success = single.step(a)
            if success:
                steps = k + 1
                break
        out.append({"init_state_id": i, "success": steps is not None, "steps": steps})
    return out


def expert_actions_cpu(single, task_id: int, init_id: int, max_steps: int) -> np.ndarray:
    """The actions ``[T, 7]`` :class:`PickPlaceExpert` takes in the CPU adapter's episode (up to its success):
    an action sequence with grasps and carried objects, for comparing contact-rich trajectories open loop."""

    single.reset_to(task_id, init_id)
    env = single._env
    sim, eef_site = env.sim, env.env.robots[0].eef_site_id
    atom = goal_spec(env.env, sim.model._model).atoms[0]
    expert = PickPlaceExpert(1, PickPlaceExpert.rim_of(sim.model._model, atom.body))
    actions = []
    for _ in range(max_steps):
        target = sim.data.body_xpos[atom.target_body] if atom.target_body >= 0 else sim.data.site_xpos[atom.site]
        a = expert.act(sim.data.site_xpos[eef_site][None], sim.data.body_xpos[atom.body][None], target[None])[0]
        actions.append(a)
        if single.step(a)[4]:
            break
    return np.stack(actions)


def expert_episodes_warp(worlds, init_ids: list[int], max_steps: int) -> list[dict]:
    """The same in a :class:`~vla_rl.envs.libero.warp_env.TaskWorlds` of ``len(init_ids)`` worlds, all at once."""
    n, dev = worlds.n, worlds.device
    if n != len(init_ids):
        raise ValueError(f"{len(init_ids)} init states need {len(init_ids)} worlds, got {n}")
    scene = worlds.scene
    atom = scene.goal.atoms[0]
    worlds.load_starts(torch.arange(n, device=dev),
                       torch.tensor([scene.start_index(i) for i in init_ids], device=dev))
    worlds.kinematics()
    expert = PickPlaceExpert(n, PickPlaceExpert.rim_of(scene.model, atom.body))
    v = worlds.v
    steps = [None] * n
    for k in range(max_steps):
        target = v["xpos"][:, atom.target_body] if atom.target_body >= 0 else v["site_xpos"][:, atom.site]
        a = expert.act(v["site_xpos"][:, scene.eef_site].cpu().numpy(), v["xpos"][:, atom.body].cpu().numpy(),
                       target.cpu().numpy())
        worlds.physics_step(torch.as_tensor(a, dtype=torch.float32, device=dev))
        for j in np.nonzero(worlds.success().cpu().numpy())[0]:
            steps[j] = steps[j] or k + 1
        if all(s is not None for s in steps):
            break
    return [{"init_state_id": i, "success": s is not None, "steps": s} for i, s in zip(init_ids, steps)]


# ------------------------------------------------------------------------------------------------ images
def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) of two uint8 images of one shape (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)
