"""envs/libero/substeps.py: robosuite's substep pattern (forward, a controller reading the state and forwarding
again, ctrl written, step) inside SplitSubsteps gives the plain loop's trajectory bit for bit, with one forward
pass a substep. A small MuJoCo model with contacts stands in for robosuite's sim; the LIBERO end-to-end check
(whole expert episodes both ways) is in tests/envs/libero/test_libero_expert.py."""

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

mujoco = pytest.importorskip("mujoco")

from vla_rl.envs.libero.substeps import SplitSubsteps  # noqa: E402

ARM = """
<mujoco>
  <option timestep="0.002" integrator="{integrator}"/>
  <worldbody>
    <geom type="plane" size="1 1 0.1"/>
    <body pos="0 0 0.5">  <!-- a two-link arm the "controller" steers; a box dropping onto the floor -->
      <joint name="a" type="hinge" axis="0 1 0"/>
      <geom type="capsule" fromto="0 0 0 0.3 0 0" size="0.03"/>
      <body pos="0.3 0 0">
        <joint name="b" type="hinge" axis="0 1 0"/>
        <geom type="capsule" fromto="0 0 0 0.3 0 0" size="0.03"/>
        <site name="tip" pos="0.3 0 0"/>
      </body>
    </body>
    <body pos="0.8 0 0.3"><freejoint/><geom type="box" size="0.05 0.05 0.05"/></body>
  </worldbody>
  <actuator><motor joint="a"/><motor joint="b"/></actuator>
</mujoco>
"""


class Sim:
    """The two methods and two handles of robosuite's MjSim that SplitSubsteps uses."""

    def __init__(self, integrator="Euler"):
        m = mujoco.MjModel.from_xml_string(ARM.format(integrator=integrator))
        self.model, self.data = SimpleNamespace(_model=m), SimpleNamespace(_data=mujoco.MjData(m))
        self.data._data.qpos[:2] = [0.4, -0.3]

    def forward(self):
        mujoco.mj_forward(self.model._model, self.data._data)

    def step(self):
        mujoco.mj_step(self.model._model, self.data._data)


def substep(sim, target, disturb=False):
    """One substep as robosuite runs it: forward, the controller's update (forward again, read kinematics, the
    Jacobian and bias forces), ctrl, step."""
    m, d = sim.model._model, sim.data._data
    sim.forward()
    sim.forward()
    jac = np.zeros((3, m.nv))
    mujoco.mj_jacSite(m, d, jac, None, 0)
    err = target - d.site_xpos[0]
    d.ctrl[:] = (jac.T @ (40.0 * err))[:2] - 2.0 * d.qvel[:2] + d.qfrc_bias[:2]
    if disturb:                       # something other than ctrl changed before the step: no split step
        d.qvel[0] += 1e-3
    sim.step()


def trajectory(split, integrator="Euler", actions=60, substeps=5, disturb_every=0):
    """``actions`` env steps of ``substeps`` substeps each (LIBERO: 25), a SplitSubsteps around each env step as
    the adapter does; returns the state after every substep, the summed counters and the sim."""
    sim, out, counts = Sim(integrator), [], np.zeros(4, int)
    for a in range(actions):
        target = np.array([0.3 + 0.2 * np.sin(a / 8), 0.0, 0.2])
        with SplitSubsteps(sim) if split else nullcontext() as s:
            for k in range(substeps):
                n = a * substeps + k
                substep(sim, target, disturb=bool(disturb_every) and n % disturb_every == 0)
                d = sim.data._data
                out.append(np.concatenate([d.qpos, d.qvel, d.qacc, d.ctrl, d.sensordata, d.qacc_warmstart]))
        if split:
            counts += (s.step1, s.skipped, s.step2, s.full)
            assert s.enabled == (integrator != "RK4")
    return np.array(out), counts, sim


def test_split_substeps_give_the_plain_trajectory_bit_for_bit():
    plain, _, _ = trajectory(False)
    split, counts, sim = trajectory(True)
    assert np.array_equal(plain, split)
    assert plain[0, 4] - plain[-1, 4] > 0.2 and sim.data._data.ncon > 0   # the box fell onto the floor (contacts)
    assert counts.tolist() == [300, 300, 300, 0]     # step1, skipped forwards, step2, full steps: per substep


def test_a_state_change_before_the_step_takes_the_full_step():
    plain, _, _ = trajectory(False, disturb_every=3)
    split, counts, _ = trajectory(True, disturb_every=3)
    assert np.array_equal(plain, split)
    assert counts.tolist() == [300, 300, 200, 100]   # every third substep was disturbed after the controller


def test_rk4_is_left_to_the_plain_loop_and_the_sim_is_restored():
    plain, _, _ = trajectory(False, integrator="RK4", actions=10)
    split, counts, sim = trajectory(True, integrator="RK4", actions=10)
    assert np.array_equal(plain, split) and counts.tolist() == [0, 0, 0, 0]
    _, _, sim = trajectory(True, actions=2)
    assert "forward" not in vars(sim) and "step" not in vars(sim)   # the class's methods again
