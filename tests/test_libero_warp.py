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

from vla_rl.envs import osc
from vla_rl.envs.bddl_predicates import Atom, GoalEvaluator, GoalSpec, contact_hits
from vla_rl.envs.libero import quat_to_axis_angle
from vla_rl.envs.libero_warp import LiberoWarpConfig, LiberoWarpNotInstalled, import_warp, quat_wxyz_to_axis_angle

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
