"""A LIBERO policy step computed on the MuJoCo model directly: robosuite-LIBERO's trajectory bit for bit, with only
the work that trajectory needs.

robosuite's ``env.step`` (robosuite 1.4 ``environments/base.py``, LIBERO's ``bddl_base_domain.py``) runs, for each of
an action's 25 physics substeps: a forward pass, every robot's ``control`` (the OSC controller's ``update``, which
looks up names, allocates Jacobians and the full mass matrix and runs a second forward pass; its ``set_goal`` on the
first substep; ``run_controller``; the gripper; and, once an action, buffers of recent torques, poses and an
acceleration estimate that nothing downstream reads), ``mj_step``, and an update of every observable (each
object's pose, the joints' sines and cosines, ...). :class:`DirectStep` keeps what decides the trajectory and what
the adapter reads, in the same order and with the same arithmetic:

- per substep ``mj_step1`` (kinematics, mass matrix, bias forces: everything a controller reads), then the
  controller's state filled from those arrays exactly as its ``update`` fills it (same indices, same ``np.dot``),
  then robosuite's own ``set_goal`` on the first substep and ``run_controller``'s operations in its order (calling
  robosuite's own numba-compiled ``opspace_matrices`` / ``nullspace_torques`` / ``orientation_error``), the torque
  clip and the Panda gripper's ``format_action`` into ``ctrl``, then ``mj_step2``;
- per substep the observables the adapter reads (end-effector pose, gripper joints, enabled cameras), through
  robosuite's own ``Observable.update``: robosuite samples observations on its own clock, which drifts against the
  action period in float arithmetic (an observation is a few substeps old), and the same clock keeps them equal;
- per action LIBERO's ``_post_action`` (its sparse reward, the tracked object states such as a stove's flame) and
  ``_check_success``.

Checked, not assumed: tests/envs/libero/test_libero_direct.py plays expert and random-action episodes both ways and
compares every observation, reward, success flag and the final MuJoCo state exactly. Unsupported settings (another
controller or gripper, an interpolator, position or orientation limits, variable impedance, the RK4 integrator) are
refused by name; LIBERO's tasks use none of them.
"""

from __future__ import annotations

import numpy as np

# What the adapter reads of a step's observation dict; cameras are added per env (their enabled observables).
ROBOT_OBSERVABLES = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")


class DirectStepUnsupported(ValueError):
    """The env uses a robosuite feature this stepper does not reproduce."""


def _refuse_unsupported(inner, robot, ctrl, mujoco) -> None:
    why = []
    if len(inner.robots) != 1:
        why.append(f"{len(inner.robots)} robots")
    if type(ctrl).__name__ != "OperationalSpaceController":
        why.append(f"controller {type(ctrl).__name__}")
    else:
        if ctrl.impedance_mode != "fixed":
            why.append(f"impedance_mode {ctrl.impedance_mode!r}")
        if ctrl.interpolator_pos is not None or ctrl.interpolator_ori is not None:
            why.append("a controller interpolator")
        if ctrl.position_limits is not None or ctrl.orientation_limits is not None:
            why.append("position / orientation limits")
        if not ctrl.use_delta or not ctrl.use_ori:
            why.append("absolute or position-only control")
    if not robot.has_gripper or type(robot.gripper).__name__ != "PandaGripper":
        why.append(f"gripper {type(robot.gripper).__name__ if robot.has_gripper else None}")
    if inner.sim.model._model.opt.integrator == mujoco.mjtIntegrator.mjINT_RK4:
        why.append("the RK4 integrator (mj_step2 does not implement it)")
    if why:
        raise DirectStepUnsupported("direct stepping does not reproduce " + ", ".join(why) +
                                    "; use env.libero.direct_step=false")


class DirectStep:
    """``step(action)`` for one LIBERO env (LIBERO's wrapper ``ControlEnv`` / ``OffScreenRenderEnv``), returning
    ``(observations, reward, success, info)`` like its ``step``; ``observations`` holds :data:`ROBOT_OBSERVABLES`
    and the enabled camera images. Bound to the env's current ``MjSim``: a hard reset makes a new one, so build a
    stepper after each reset (cheap: index lookups)."""

    def __init__(self, env):
        import mujoco  # comes with robosuite (LIBERO's simulator), an optional install

        self._mj = mujoco
        inner = env.env
        robot = inner.robots[0]
        ctrl = robot.controller
        _refuse_unsupported(inner, robot, ctrl, mujoco)
        self.env, self.inner, self.robot, self.ctrl, self.gripper = env, inner, robot, ctrl, robot.gripper
        self.sim = inner.sim
        m, d = self.sim.model._model, self.sim.data._data
        self.model, self.data = m, d
        self.site = self.sim.model.site_name2id(ctrl.eef_name)
        # Index arrays, not lists: numpy converts a list on every use; the results (values and memory layout, which
        # numba's compiled maths is specialised on) are the same.
        self.qpos_index, self.qvel_index = np.array(ctrl.qpos_index), np.array(ctrl.qvel_index)
        self.arm_actuators = np.array(robot._ref_joint_actuator_indexes)
        self.grip_actuators = np.array([self.sim.model.actuator_name2id(a) for a in robot.gripper.actuators])
        rng = self.sim.model.actuator_ctrlrange[self.grip_actuators]
        self.grip_bias, self.grip_weight = 0.5 * (rng[:, 1] + rng[:, 0]), 0.5 * (rng[:, 1] - rng[:, 0])
        self.arm_dim = ctrl.control_dim
        self.substeps = int(inner.control_timestep / inner.model_timestep)
        self.jac = np.zeros((6, m.nv))                    # position rows, then rotation rows
        self.jacp, self.jacr = self.jac[:3], self.jac[3:]
        self.mass = np.zeros((m.nv, m.nv))
        self.torque_low, self.torque_high = (np.array(x) for x in robot.torque_limits)
        self.grip_direction = np.array([-1.0, 1.0])        # PandaGripper.format_action: opens / closes both fingers
        self._grip_delta = np.zeros(2)
        from robosuite.utils.control_utils import nullspace_torques, opspace_matrices, orientation_error

        self._opspace, self._nullspace, self._orientation_error = opspace_matrices, nullspace_torques, orientation_error
        # Cameras are switched off while a reset settles: which observables are on is read every step.
        self._read = [o for name, o in inner._observables.items()
                      if name in ROBOT_OBSERVABLES or o.modality == "image"]

    def _update_controller(self) -> None:
        """What the controller's ``update`` computes, read from the arrays ``mj_step1`` just filled (its own
        forward pass would recompute the same numbers), and only when ``update`` would: robosuite's flag
        ``new_update`` is down after a reset until the first ``run_controller``, so an episode's first goal is set
        from the pose the controller saw when it was made, before the init state was loaded. Same indices and the
        same ``np.dot`` calls as ``update``, into preallocated buffers."""
        c, d = self.ctrl, self.data
        if not c.new_update:
            return
        c.ee_pos = d.site_xpos[self.site].copy()
        c.ee_ori_mat = d.site_xmat[self.site].reshape(3, 3).copy()
        self._mj.mj_jacSite(self.model, d, self.jacp, self.jacr, self.site)
        c.ee_pos_vel = np.dot(self.jacp, d.qvel)
        c.ee_ori_vel = np.dot(self.jacr, d.qvel)
        c.joint_pos = d.qpos[self.qpos_index]
        c.joint_vel = d.qvel[self.qvel_index]
        # Fancy-indexed columns come out in numpy's own memory layout, which numba's compiled maths is specialised
        # on: the same expressions as update's, not views of one block, keep its results bit for bit.
        c.J_pos = np.array(self.jacp[:, self.qvel_index])
        c.J_ori = np.array(self.jacr[:, self.qvel_index])
        c.J_full = np.concatenate([c.J_pos, c.J_ori])     # np.vstack's result, C-ordered
        self._mj.mj_fullM(self.model, self.mass, d.qM)
        c.mass_matrix = self.mass[self.qvel_index, :][:, self.qvel_index]
        c.new_update = False

    def _torques(self) -> np.ndarray:
        """The OSC controller's ``run_controller`` (fixed impedance, no interpolator), operation for operation; its
        numba-compiled pieces are robosuite's own functions."""
        c = self.ctrl
        ori_error = self._orientation_error(np.array(c.goal_ori), c.ee_ori_mat)
        desired_force = np.multiply(c.goal_pos - c.ee_pos, c.kp[0:3]) + np.multiply(-c.ee_pos_vel, c.kd[0:3])
        desired_torque = np.multiply(ori_error, c.kp[3:6]) + np.multiply(-c.ee_ori_vel, c.kd[3:6])
        lambda_full, lambda_pos, lambda_ori, nullspace = self._opspace(c.mass_matrix, c.J_full, c.J_pos, c.J_ori)
        if c.uncoupling:
            wrench = np.concatenate([np.dot(lambda_pos, desired_force), np.dot(lambda_ori, desired_torque)])
        else:
            wrench = np.dot(lambda_full, np.concatenate([desired_force, desired_torque]))
        torques = np.dot(c.J_full.T, wrench) + self.data.qfrc_bias[self.qvel_index]
        torques += self._nullspace(c.mass_matrix, nullspace, c.initial_joint, c.joint_pos, c.joint_vel)
        c.torques = torques
        c.new_update = True
        return torques

    def _control(self, action: np.ndarray, policy_step: bool) -> None:
        """robosuite's ``SingleArm.control`` without its once-an-action buffers of recent values."""
        if policy_step:
            self.ctrl.set_goal(action[:self.arm_dim])
            self._grip_delta = self.grip_direction * self.gripper.speed * np.sign(action[self.arm_dim:])
        # np.clip's values (no arithmetic), without its Python wrapper.
        self.robot.torques = np.minimum(np.maximum(self._torques(), self.torque_low), self.torque_high)
        self.gripper.current_action = np.minimum(np.maximum(self.gripper.current_action + self._grip_delta, -1.0),
                                                 1.0)
        d = self.data
        d.ctrl[self.grip_actuators] = self.grip_bias + self.grip_weight * self.gripper.current_action
        d.ctrl[self.arm_actuators] = self.robot.torques

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, dict]:
        inner = self.inner
        if inner.done:
            raise ValueError("executing action in terminated episode")
        action = np.asarray(action)
        if len(action) != inner.action_dim:
            raise ValueError(f"LIBERO action must have {inner.action_dim} dims, got {len(action)}")
        inner.timestep += 1
        # robosuite makes a new controller at every reset (and may make a new gripper model): read them per action.
        self.ctrl, self.gripper = self.robot.controller, self.robot.gripper
        dt, cache = inner.model_timestep, inner._obs_cache
        observables = [o for o in self._read if o.is_enabled()]
        for k in range(self.substeps):
            self._mj.mj_step1(self.model, self.data)
            self._update_controller()
            self._control(action, policy_step=k == 0)
            self._mj.mj_step2(self.model, self.data)
            for o in observables:
                o.update(timestep=dt, obs_cache=cache)
        inner.cur_time += inner.control_timestep
        reward, _, info = inner._post_action(action)
        success = inner._check_success()
        return {o.name: o.obs for o in observables}, reward, success, info
