"""LIBERO on MuJoCo Warp (``env.kind: libero_warp``): its pure parts against known answers, and its fidelity to
robosuite-LIBERO (the CPU adapter) on the Warp CPU backend.

MuJoCo Warp is part of the test install (``make test`` installs the ``warp`` extra), so a missing install is a
failure, not a skip, unless ``VLA_RL_SKIP_SIMULATORS=1``. The CPU backend compiles its kernels on first use (a few
minutes once per machine, cached in ~/.cache/warp) and runs one LIBERO physics substep of a few worlds in ~0.1 s
(an action is 25 substeps), so the default tests use one task, a few worlds and a few actions; the sweeps over
every task of the four suites and the longer trajectories are ``slow``. What the tolerances are and what was
measured: docs/envs.md, benchmarks/RESULTS.md (``benchmarks/bench_libero_warp.py``).
"""

import math

import numpy as np
import pytest
import torch
from helpers import SKIP_SIMULATORS as SKIP

from vla_rl.envs.libero import osc
from vla_rl.envs.libero.predicates import Atom, GoalEvaluator, GoalSpec, contact_hits
from vla_rl.envs.libero.robosuite_env import orient, quat_to_axis_angle
from vla_rl.envs.libero.warp_env import LiberoWarpConfig, LiberoWarpNotInstalled, import_warp, quat_wxyz_to_axis_angle

needs_sim = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
GAINS = osc.OSCGains(kp=(150.0,) * 6, kd=(2 * math.sqrt(150.0),) * 6, input_min=(-1.0,) * 6, input_max=(1.0,) * 6,
                     output_min=(-0.05,) * 3 + (-0.5,) * 3, output_max=(0.05,) * 3 + (0.5,) * 3,
                     torque_min=(-80.0,) * 5 + (-12.0,) * 2, torque_max=(80.0,) * 5 + (12.0,) * 2)
F64 = torch.float64


# ---------------------------------------------------------------------------------------------- controller, pure
def test_scale_action_and_axis_angle_known_answers():
    a = torch.tensor([[1.0, -1.0, 0.5, 1.0, 0.0, -2.0]])
    np.testing.assert_allclose(osc.scale_action(a, GAINS).numpy(), [[0.05, -0.05, 0.025, 0.5, 0.0, -0.5]])
    r = osc.axis_angle_to_matrix(torch.tensor([[0.0, 0.0, math.pi / 2]], dtype=F64))[0]
    np.testing.assert_allclose(r.numpy(), [[0, -1, 0], [1, 0, 0], [0, 0, 1]], atol=1e-7)
    assert torch.equal(osc.axis_angle_to_matrix(torch.zeros(1, 3, dtype=F64))[0], torch.eye(3, dtype=F64))
    # The orientation error of a small rotation about an axis is that axis times the angle.
    small = osc.axis_angle_to_matrix(torch.tensor([[0.0, 0.01, 0.0]], dtype=F64))
    np.testing.assert_allclose(osc.orientation_error(small, torch.eye(3, dtype=F64)[None]).numpy(),
                               [[0, 0.01, 0]], atol=1e-6)


def test_set_goal_keeps_the_orientation_goal_when_rotation_is_zero():
    ee_rot = osc.axis_angle_to_matrix(torch.tensor([[0.3, -0.2, 0.1]], dtype=F64))
    old = torch.eye(3, dtype=F64)[None]
    pos, rot = osc.set_goal(torch.tensor([[1.0, 0, 0, 0, 0, 0]]), torch.zeros(1, 3), ee_rot, old, GAINS)
    assert torch.equal(rot, old) and torch.allclose(pos, torch.tensor([[0.05, 0, 0]], dtype=F64))
    _, rot = osc.set_goal(torch.tensor([[0, 0, 0, 0, 0, 1e-6]]), torch.zeros(1, 3), ee_rot, old, GAINS)
    assert torch.allclose(rot, ee_rot, atol=1e-6) and not torch.equal(rot, old)


def test_hinge_jacobian_of_a_planar_two_link_arm():
    # Joints about z at the origin and at (1, 0, 0); the site at (2, 0, 0): dp/dq = (0, 2, 0) and (0, 1, 0).
    jp, jr = osc.hinge_jacobian(torch.tensor([[2.0, 0, 0]]), torch.tensor([[[0.0, 0, 0], [1.0, 0, 0]]]),
                                torch.tensor([[[0.0, 0, 1], [0.0, 0, 1]]]))
    np.testing.assert_allclose(jp[0].numpy(), [[0, 0], [2, 1], [0, 0]])
    np.testing.assert_allclose(jr[0].numpy(), [[0, 0], [0, 0], [1, 1]])


def test_osc_at_the_goal_at_rest_outputs_gravity_compensation():
    n, j = 2, 7
    g = torch.Generator().manual_seed(0)
    jac = torch.randn(n, 6, j, generator=g, dtype=F64)
    a = torch.randn(n, j, j, generator=g, dtype=F64)
    mass = a @ a.transpose(1, 2) + j * torch.eye(j, dtype=F64)
    bias, q = torch.randn(n, j, generator=g, dtype=F64), torch.randn(n, j, generator=g, dtype=F64)
    rot = osc.axis_angle_to_matrix(torch.randn(n, 3, generator=g, dtype=F64))
    pos = torch.randn(n, 3, generator=g, dtype=F64)
    tau = osc.osc_torques(ee_pos=pos, ee_rot=rot, jac_pos=jac[:, :3], jac_rot=jac[:, 3:], mass=mass, bias=bias, q=q,
                          qd=torch.zeros(n, j, dtype=F64), goal_pos=pos, goal_rot=rot, q_rest=q, gains=GAINS)
    torch.testing.assert_close(tau, bias)
    clipped = osc.clip_torques(torch.full((1, 7), 100.0, dtype=F64), GAINS)
    assert clipped.tolist() == [[80.0] * 5 + [12.0] * 2]


def test_gripper_integrates_the_command_sign():
    cur = torch.zeros(3, 2, dtype=F64)
    cmd = torch.tensor([1.0, -0.3, 0.0])
    for _ in range(25):
        cur, ctrl = osc.gripper_step(cur, cmd, GAINS)
    np.testing.assert_allclose(cur.numpy(), [[-0.25, 0.25], [0.25, -0.25], [0, 0]], atol=1e-12)
    np.testing.assert_allclose(ctrl.numpy()[0], [0.015, -0.015])   # closing: fingers' targets move inwards
    for _ in range(200):
        cur, ctrl = osc.gripper_step(cur, cmd, GAINS)
    np.testing.assert_allclose(ctrl.numpy()[:2], [[0.0, 0.0], [0.04, -0.04]])


def test_state_orientation_matches_the_cpu_adapter_map():
    g = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(16, 4, generator=g, dtype=F64), dim=-1)
    ours = quat_wxyz_to_axis_angle(q).numpy()
    ref = np.stack([quat_to_axis_angle(np.r_[x[1:], x[0]]) for x in q.numpy()])   # robosuite's (x, y, z, w)
    np.testing.assert_allclose(ours, ref, atol=1e-12)


# ---------------------------------------------------------------------------------------------- predicates, pure
def test_contact_hits_either_order_per_world():
    first = torch.zeros(2, 6, dtype=torch.bool)
    second = torch.zeros_like(first)
    first[0, [0, 1]], second[0, [2]] = True, True
    first[1, [3]], second[1, [4]] = True, True
    ga, gb = torch.tensor([2, 3, 4, -1]), torch.tensor([1, 5, 3, 4])
    world = torch.tensor([1, 0, 2, 0])
    hits = contact_hits(first, second, ga, gb, world, 3)
    assert hits.tolist() == [[False, False], [True, False], [False, True]]


def test_goal_evaluator_known_answers():
    spec = GoalSpec(atoms=(
        Atom("on_object", "on a b", body=1, target_body=2, contact=0),
        Atom("in_site", "in a r", body=1, site=0, size=(0.1, 0.1, 0.05)),
        Atom("on_site", "on a s", body=1, site=1, size=(0.1, 0.1, 0.01)),
        Atom("joint", "open d", qpos=(0, 1), cmp="<", threshold=-0.14, any_joint=True),
        Atom("joint", "close d", qpos=(0, 1), cmp=">", threshold=0.0, any_joint=False),
    ), contacts=(((0,), (1,)),))
    ev = GoalEvaluator(spec, ngeom=2, device="cpu")
    xpos = torch.tensor([[[0, 0, 0], [0.01, 0, 1.0], [0, 0, 0.99]],       # on b (touching), in r, on s
                         [[0, 0, 0], [0.05, 0, 1.0], [0, 0, 0.99]]])      # 5 cm off in xy: not on b
    site_xpos = torch.tensor([[[0, 0, 1.0], [0, 0, 0.95]]] * 2)
    site_xmat = torch.eye(3).expand(2, 2, 3, 3)
    qpos = torch.tensor([[-0.2, 0.1], [-0.1, 0.1]])
    out = ev.atoms(xpos=xpos, site_xpos=site_xpos, site_xmat=site_xmat, qpos=qpos, geom_a=torch.tensor([0, 1]),
                   geom_b=torch.tensor([1, 0]), contact_world=torch.tensor([0, 1]))
    assert out.tolist() == [[True, True, True, True, False], [False, True, True, False, False]]
    qpos = torch.tensor([[-0.2, -0.15], [0.1, 0.2]])   # a drawer open past its threshold; one closed
    state = dict(xpos=xpos, site_xpos=site_xpos, site_xmat=site_xmat, geom_a=torch.tensor([0, 1]),
                 geom_b=torch.tensor([1, 0]), contact_world=torch.tensor([0, 1]))
    assert ev.atoms(qpos=qpos, **state)[:, 3:].tolist() == [[True, False], [False, True]]
    assert ev.success(qpos=qpos, **state).tolist() == [False, False]


def test_config_validation():
    assert LiberoWarpConfig().episode_steps == 220
    for bad in ({"suite": "libero_100"}, {"cameras": ("front",)}, {"task_ids": [1, 1]}, {"init_state_ids": []},
                {"success_substeps": 0}, {"contacts_per_world": 0}):
        with pytest.raises(ValueError):
            LiberoWarpConfig(**bad)


def test_missing_mujoco_warp_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mujoco_warp", None)
    with pytest.raises(LiberoWarpNotInstalled, match=r"\.\[warp\]"):
        import_warp()


def test_cli_without_mujoco_warp_is_an_env_error_naming_the_extra(monkeypatch, tmp_path, capsys):
    """``vla-rl train ... env.kind=libero_warp`` without the extra: one line, the ``env`` kind, what to install."""
    import sys

    from vla_rl.cli import main

    monkeypatch.setitem(sys.modules, "mujoco_warp", None)
    out = tmp_path / "run"
    assert main(["train", "libero_spatial_warp_flow_noise", "device=cpu", "bf16=false", "init=null",
                 "env.num_envs=2", f"out={out}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vla-rl: env error: MuJoCo Warp is not installed"), err
    assert "pip install -e '.[warp]'" in err[0] and "--resume" not in err[0]


# ---------------------------------------------------------------------------------------------- against robosuite
@pytest.fixture(scope="module")
def libero():
    """libero_spatial task 0: the CPU adapter (robosuite, no cameras) and the task's scene with starts 0 and 1."""
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv
    from vla_rl.envs.libero.scene import load_task_scene

    single = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], cameras=(), max_cached_envs=1))
    scene = load_task_scene("libero_spatial", 0, [0, 1], single=single)
    yield single, scene
    single.close()


@pytest.fixture(scope="module")
def controller_records(libero):
    """robosuite's controller at every physics substep of 4 actions (the third without rotation)."""
    from vla_rl.envs.libero.fidelity import random_actions, record_controller

    single, _ = libero
    single.reset_to(0, 0)
    actions = random_actions(4, seed=3, scale=1.0, hold=1)
    actions[2, 3:6] = 0.0
    with record_controller(single) as records:
        for a in actions:
            single.step(a)
    assert len(records) == 4 * 25 and sum(r["policy_step"] for r in records) == 4
    return records


@needs_sim
def test_osc_equals_robosuite_on_mujoco_state(libero, controller_records):
    """The controller maths alone: fed MuJoCo's float64 state, the batched OSC gives robosuite's torques."""
    import mujoco

    _, scene = libero
    model = scene.model
    data = mujoco.MjData(model)
    dof, joints, site = scene.arm_dof, scene.arm_joints, scene.eef_site
    t = lambda x: torch.as_tensor(np.array(x), dtype=F64)[None]   # noqa: E731
    goal_err = tau_err = finger_err = 0.0
    for r in controller_records:
        data.qpos[:], data.qvel[:] = r["qpos"], r["qvel"]
        mujoco.mj_forward(model, data)
        full = np.zeros((model.nv, model.nv))
        mujoco.mj_fullM(model, full, data.qM)
        ee_pos, ee_rot = t(data.site_xpos[site]), t(data.site_xmat[site].reshape(3, 3))
        jp, jr = osc.hinge_jacobian(ee_pos, t(data.xanchor[joints]), t(data.xaxis[joints]))
        if r["policy_step"]:
            gp, gr = osc.set_goal(t(r["action"][:6]), ee_pos, ee_rot, t(r["goal_rot_before"]), scene.gains)
            goal_err = max(goal_err, np.abs(gp[0].numpy() - r["goal_pos"]).max(),
                           np.abs(gr[0].numpy() - r["goal_rot"]).max())
        tau = osc.osc_torques(
            ee_pos=ee_pos, ee_rot=ee_rot, jac_pos=jp, jac_rot=jr, mass=t(full[np.ix_(dof, dof)]),
            bias=t(data.qfrc_bias[dof]), q=t(data.qpos[scene.arm_qpos]), qd=t(data.qvel[dof]),
            goal_pos=t(r["goal_pos"]), goal_rot=t(r["goal_rot"]), q_rest=t(scene.q_rest), gains=scene.gains)
        tau = osc.clip_torques(tau, scene.gains)
        tau_err = max(tau_err, np.abs(tau[0].numpy() - r["torques"]).max())
        grip, fingers = osc.gripper_step(t(r["gripper_before"]), t(r["action"][6:]), scene.gains)
        finger_err = max(finger_err, np.abs(fingers[0].numpy() - r["fingers"]).max(),
                         np.abs(grip[0].numpy() - r["gripper_after"]).max())
    assert tau_err < 1e-9, tau_err      # N m; measured 1.7e-13 (max |torque| 80)
    assert goal_err < 1e-6, goal_err    # robosuite builds the rotation goal in float32
    assert finger_err == 0.0


@needs_sim
def test_osc_torques_through_warp_match_robosuite(libero, controller_records):
    """End to end on the Warp side: its float32 kinematics, inertia and bias forces feed the batched OSC."""
    from vla_rl.envs.libero.fidelity import warp_torques
    from vla_rl.envs.libero.warp_env import TaskWorlds

    _, scene = libero
    records = controller_records[::13]   # 8 substeps, first substeps of actions and within them
    ours, ref = warp_torques(TaskWorlds(scene, len(records), device=torch.device("cpu")), records)
    err = np.abs(ours - ref).max()
    assert err < 1e-3, err               # N m; measured 2.1e-4 (max |torque| 80)


@needs_sim
def test_predicates_equal_libero_on_goal_states(libero):
    """The batched predicates fed MuJoCo's state equal LIBERO's, on states where the goal holds and where not."""
    from vla_rl.envs.libero.fidelity import goal_states, libero_atoms

    single, scene = libero
    states = goal_states(single, 0, 0, settle_steps=6)
    ref, ours = libero_atoms(single, 0, states, goal=scene.goal)
    assert ref.any() and not ref.all(), "the states should hold both outcomes"
    assert np.array_equal(ref, ours)


@needs_sim
@pytest.mark.slow
@pytest.mark.parametrize("suite", ["libero_spatial", "libero_object", "libero_goal", "libero_10"])
def test_predicates_equal_libero_on_every_task(suite):
    """Every task of the four suites πRL averages: the batched predicates equal LIBERO's on generated goal states
    (fed MuJoCo's state), and every goal is one the batched predicates implement (none is refused)."""
    from vla_rl.envs.libero.fidelity import goal_states, libero_atoms
    from vla_rl.envs.libero.predicates import goal_spec
    from vla_rl.envs.libero.robosuite_env import SUITE_NUM_TASKS, LiberoConfig, LiberoSingleEnv

    tasks = list(range(SUITE_NUM_TASKS[suite]))
    single = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=tasks, cameras=(), max_cached_envs=1))
    try:
        reached = 0
        for t in tasks:
            single.reset_to(t, 0)
            spec = goal_spec(single._env.env, single._env.sim.model._model)
            states = goal_states(single, t, 0)
            ref, ours = libero_atoms(single, t, states, goal=spec)
            assert np.array_equal(ref, ours), (suite, t)
            reached += bool(ref.all(1).any())
        assert reached >= len(tasks) - 2, f"the goal was reached in only {reached} of {len(tasks)} tasks"
    finally:
        single.close()


@needs_sim
def test_trajectory_first_steps_match_robosuite(libero):
    """The same two actions from the same episode start: the hand and the objects end where robosuite's do."""
    from vla_rl.envs.libero.fidelity import object_bodies, random_actions, rollout_cpu, rollout_warp
    from vla_rl.envs.libero.warp_env import TaskWorlds

    single, scene = libero
    actions, bodies = random_actions(2, seed=0), object_bodies(scene)
    cpu = rollout_cpu(single, 0, 0, actions, bodies)
    warp = rollout_warp(TaskWorlds(scene, 1, device=torch.device("cpu")), 0, actions, bodies)
    eef = np.linalg.norm(warp["eef"][:, 0] - cpu["eef"], axis=-1).max()
    objects = np.linalg.norm(warp["bodies"][:, 0] - cpu["bodies"], axis=-1).max()
    assert eef < 1e-4, eef           # m; measured < 1e-6 over 12 actions
    assert objects < 5e-4, objects   # m; resting objects chatter by ~1e-5 in float32
    assert not cpu["success"].any() and not warp["success"].any()


@needs_sim
def test_contacts_at_a_grasp_match_mujoco(libero):
    """At a grasp (the scripted policy's episode from init state 1, fingers closing on the bowl), MuJoCo Warp's
    collision detection finds MuJoCo's contacts: every pair deeper than 10 µm in both, MuJoCo's 2-3 contacts per
    finger pad and bowl box at its depths (box-box pairs by the primitive collider, as MuJoCo does; Warp's convex
    collider found 1, and the grasped bowl pivoted), and no contact between the cabinet's frame and its drawers
    (MuJoCo Warp never moves a geom welded to the world: each episode start puts the frame's pose in)."""
    from vla_rl.envs.libero.fidelity import contacts_cpu, contacts_warp, expert_actions_cpu
    from vla_rl.envs.libero.warp_env import TaskWorlds

    single, scene = libero
    actions = expert_actions_cpu(single, 0, 1, 40)
    single.reset_to(0, 1)
    for a in actions[:29]:
        single.step(a)
    model = single._env.sim.model._model
    qpos = single._env.sim.data.qpos.copy()
    cpu = contacts_cpu(model, qpos)
    warp = contacts_warp(TaskWorlds(scene, 1, device=torch.device("cpu")), qpos, 1)
    pads = {k for k in cpu if any("pad" in (model.geom(g).name or "") for g in k)}
    assert len(pads) >= 2 and all(len(cpu[k]) >= 2 for k in pads), cpu   # the state is a grasp
    # Every pair in contact by more than 10 µm in one is in contact in the other (resting touches at ~1e-8 m
    # come and go with float32 rounding).
    deep = lambda c: {k for k, v in c.items() if min(v) < -1e-5}   # noqa: E731
    assert deep(cpu) <= set(warp) and deep(warp) <= set(cpu), {k: (cpu.get(k), warp.get(k))
                                                                for k in set(cpu) ^ set(warp)}
    for k in pads:   # MuJoCo's contacts, at its depths; Warp's box-box collider adds at most one deeper corner
        assert all(np.abs(np.asarray(warp[k]) - d).min() < 2e-5 for d in cpu[k]), (k, cpu[k], warp[k])   # m
        assert 0 <= len(warp[k]) - len(cpu[k]) <= 1, (k, cpu[k], warp[k])
    assert abs(sum(map(len, warp.values())) - sum(map(len, cpu.values()))) <= 0.1 * sum(map(len, cpu.values()))


@needs_sim
def test_images_framed_and_oriented_like_the_cpu_adapter(libero):
    """Same cameras, framing and orientation as the CPU adapter's ``upright`` images (another renderer: the
    lighting differs, so the comparison is against the same image flipped, not an absolute PSNR)."""
    from vla_rl.envs.libero.fidelity import psnr
    from vla_rl.envs.libero.warp_env import CAMERAS, TaskWorlds

    single, scene = libero
    single.reset_to(0, 0)
    single.render_frame()   # a state-only env opens its render context on demand
    s = 64
    cpu = [orient(single._env.sim.render(width=s, height=s, camera_name=CAMERAS[c][0]), single.cfg.image_orientation)
           for c in ("agentview", "wrist")]
    worlds = TaskWorlds(scene, 1, device=torch.device("cpu"), cameras=("agentview", "wrist"), image_size=s)
    worlds.load_starts(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    worlds.kinematics()
    images = worlds.render()[0].numpy()
    assert images.shape == (2, s, s, 3) and images.dtype == np.uint8
    for ours, ref in zip(images, cpu):
        same = psnr(ours, ref)
        assert same > 12.0, same                                   # measured 14.6 / 17.8 dB at 128 px
        assert same > psnr(ours[::-1], ref) + 3.0 and same > psnr(ours[::-1, ::-1], ref) + 3.0


@needs_sim
def test_env_contract(libero):
    """The batched interface's promises (shapes, episode ends, partial resets that leave the other worlds alone,
    bad input). The interface, not the physics, is under test here, so the scene runs one physics substep per
    action instead of 25 (25 times faster on the CPU backend); ``slow`` runs the same with the real scene."""
    import dataclasses

    from contract import check_env_contract

    from vla_rl.envs.libero.warp_env import LiberoWarpEnv

    _, scene = libero
    cfg = LiberoWarpConfig(task_ids=[0], init_state_ids=[0, 1], cameras=(), max_episode_steps=2)
    env = LiberoWarpEnv(cfg, 2, device="cpu", seed=0, scenes=[dataclasses.replace(scene, substeps=1)])
    assert env.instructions == [scene.instruction] * 2
    check_env_contract(env, horizon=2)
    env.close()


@needs_sim
@pytest.mark.slow
def test_env_contract_two_tasks_full_scenes_with_cameras(libero):
    """Two tasks mixed (a block of worlds each, the instruction per world), the real scenes, both cameras."""
    from contract import check_env_contract

    from vla_rl.envs.libero.scene import load_task_scene
    from vla_rl.envs.libero.warp_env import LiberoWarpEnv

    single, scene = libero
    other = load_task_scene("libero_spatial", 1, [0, 1])
    cfg = LiberoWarpConfig(task_ids=[0, 1], init_state_ids=[0, 1], cameras=("agentview", "wrist"), image_size=16,
                           max_episode_steps=2)
    env = LiberoWarpEnv(cfg, 4, device="cpu", seed=0, scenes=[scene, other])
    assert env.instructions == [scene.instruction] * 2 + [other.instruction] * 2
    assert scene.instruction != other.instruction
    with pytest.raises(ValueError, match="different tasks"):
        env.reset(seed=0, group_size=4)
    env.reset(seed=0, group_size=2)
    assert env.init_ids[0] == env.init_ids[1] and env.init_ids[2] == env.init_ids[3]
    check_env_contract(env, horizon=2)
    env.close()


# ---------------------------------------------------------------------------------------------- factory, bench
def _tiny_libero_checkpoint(path, image_size=32):
    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.policies.model import FlowPolicy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    small = {"depth": 1, "vision": {"depth": 1, "image_size": image_size}, "prefix": {"width": 32, "mlp_dim": 64},
             "expert": {"width": 32, "mlp_dim": 64}, "num_cameras": 2, "action_dim": 7}
    cfg = policy_preset("tiny", small)
    norm = NormStats(Stats.identity(cfg.state_dim), Stats.identity(cfg.action_dim))
    return save_policy(path, FlowPolicy(cfg), norm, meta={"env": {"name": "test", "state_dim": 8, "action_dim": 7}})


def test_env_config_and_bench_plan_name_the_warp_backend(tmp_path):
    from vla_rl.core.ranges import ConfigError
    from vla_rl.core.schema import from_dict
    from vla_rl.envs.registry import EnvConfig, single_env_factory
    from vla_rl.eval.bench import BenchConfig, bench_markdown, plan_tasks
    from vla_rl.presets import policy_preset

    cfg = from_dict(EnvConfig, {"kind": "libero_warp", "libero_warp": {"task_ids": [0, 1], "cameras": ["agentview"]}})
    assert cfg.task.cameras == ("agentview",) and cfg.task.task_ids == [0, 1]
    with pytest.raises(ConfigError, match="libero is set but kind is 'libero_warp'"):
        from_dict(EnvConfig, {"kind": "libero_warp", "libero": {"suite": "libero_10"}})
    with pytest.raises(ConfigError, match="cannot be split over env actors"):
        single_env_factory(cfg)
    ckpt = _tiny_libero_checkpoint(tmp_path / "ckpt")
    bench = from_dict(BenchConfig, {"suite": "libero_spatial", "tasks": [3], "episodes": 5, "backend": "warp",
                                    "env": {"image_orientation": "rot180", "success_substeps": 1}})
    model = policy_preset("tiny", {"vision": {"image_size": 32}, "num_cameras": 2, "action_dim": 7})
    (task,) = plan_tasks(ckpt, bench, model, {})
    warp = task.env.libero_warp
    assert task.env.kind == "libero_warp" and warp.task_ids == [3] and warp.init_state_ids == [0, 1, 2, 3, 4]
    assert warp.episode_order == "indexed" and warp.image_orientation == "rot180" and warp.success_substeps == 1
    assert warp.cameras == ("agentview", "wrist") and warp.image_size == 32
    text = bench_markdown({"checkpoint": "c", "weights_sha256": "0" * 64, "command": "x", "tasks": [], "suites": {},
                           "average": 0.0, "settings": {"backend": "warp"}})
    assert "MuJoCo Warp" in text and "not the official protocol" in text
    with pytest.raises(ConfigError, match="backend=warp is for LIBERO"):
        plan_tasks(ckpt, from_dict(BenchConfig, {"suite": "maniskill:PushCube-v1", "backend": "warp"}), model, {})


@needs_sim
@pytest.mark.slow
def test_bench_runs_on_the_warp_backend(tmp_path, capsys):
    from vla_rl.cli import main

    ckpt = _tiny_libero_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "bench"
    assert main(["bench", str(ckpt), "--suite", "libero_spatial", "tasks=[0]", "episodes=2", "workers=2",
                 "backend=warp", "env.max_episode_steps=2", "videos=0", f"out={out}"]) == 0
    doc = __import__("json").loads((out / "tasks" / "libero_spatial" / "0.json").read_text())
    assert doc["episodes"] == 2 and [r["init_state_id"] for r in doc["records"]] == [0, 1]
    assert "MuJoCo Warp" in (out / "results.md").read_text()


def _bench_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_libero_warp.py"
    spec = importlib.util.spec_from_file_location("bench_libero_warp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_script_defaults_to_speed_and_says_when_no_gpu_measured(monkeypatch, tmp_path):
    """``bench_libero_warp.py --device cuda`` (what gpu_acceptance.py runs) is the speed measurement; without CUDA
    it writes that nothing was measured instead of failing or measuring something else."""
    import json

    bench = _bench_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda", "--out", str(tmp_path / "speed.json")]) == 0
    doc = json.loads((tmp_path / "speed.json").read_text())
    assert doc["rows"] == [] and doc["note"] == "not measured: no GPU available"
    assert doc["command"].endswith("speed --device cuda --out " + str(tmp_path / "speed.json"))
    monkeypatch.setenv("VLA_RL_SKIP_SIMULATORS", "1")
    assert bench.main(["--smoke", "--out", str(tmp_path / "smoke.json")]) == 0
    assert not (tmp_path / "smoke.json").exists()


@needs_sim
@pytest.mark.slow
def test_bench_script_smoke_runs_its_speed_code_paths(tmp_path):
    import json

    bench = _bench_script()
    assert bench.main(["--smoke", "--out", str(tmp_path / "smoke.json")]) == 0
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert [(r["cameras"], r["policy"]) for r in rows] == [(0, False), (2, True)]
    assert all(r["env_steps"] == 1 and r["env_steps_per_s"] > 0 for r in rows)


# ---------------------------------------------------------------------------------------------- CUDA (pytest -m gpu)
@needs_sim
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_env_passes_the_contract_and_stays_on_the_device(libero):
    import dataclasses

    from contract import check_env_contract

    from vla_rl.envs.libero.warp_env import LiberoWarpEnv

    _, scene = libero
    cfg = LiberoWarpConfig(task_ids=[0], init_state_ids=[0, 1], cameras=("agentview", "wrist"), image_size=32,
                           max_episode_steps=2)
    env = LiberoWarpEnv(cfg, 4, device="cuda", seed=0, scenes=[dataclasses.replace(scene, substeps=1)])
    obs = env.reset(seed=0)
    assert obs["images"].device.type == "cuda" and obs["state"].device.type == "cuda"
    check_env_contract(env, horizon=2)
    env.close()


@needs_sim
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_trajectory_matches_the_cpu_backend(libero):
    from vla_rl.envs.libero.fidelity import object_bodies, random_actions, rollout_warp
    from vla_rl.envs.libero.warp_env import TaskWorlds

    _, scene = libero
    actions, bodies = random_actions(2, seed=0), object_bodies(scene)
    cpu = rollout_warp(TaskWorlds(scene, 1, device=torch.device("cpu")), 0, actions, bodies)
    gpu = rollout_warp(TaskWorlds(scene, 8, device=torch.device("cuda")), 0, actions, bodies)
    assert np.abs(gpu["eef"] - cpu["eef"]).max() < 1e-4
    assert np.abs(gpu["bodies"] - cpu["bodies"]).max() < 5e-4
