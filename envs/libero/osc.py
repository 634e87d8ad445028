"""robosuite's OSC_POSE controller (the one LIBERO's 7-d actions drive), batched in torch.

Pure functions of tensors: the simulator reads the robot's state into tensors, these functions return joint
torques and gripper commands, and the simulator writes them into its controls. They follow robosuite 1.4's
``OperationalSpaceController`` (fixed impedance, delta control, position and orientation uncoupled, no
interpolator) and ``PandaGripper`` step for step:

- a policy action ``[x, y, z, ax, ay, az, g]`` in [-1, 1] is clipped and scaled to the output limits
  (0.05 m, 0.5 rad); at the first physics substep of the action it sets the goal: position = end-effector
  position + delta, orientation = R(delta) @ end-effector orientation, but only when some rotation
  component is non-zero (an action with zero rotation keeps the previous orientation goal, as robosuite does);
- at every substep the torques are ``J^T [Lambda_pos (kp e_p - kd v), Lambda_ori (kp e_o - kd w)] + bias``
  plus nullspace torques that pull the joints to their rest pose, clipped to the actuators' limits;
- the gripper integrates the sign of its command into a two-finger target (``speed`` per substep), mapped
  onto the finger actuators' control range.

Glossary: N worlds, J = 7 arm joints. Rotations are 3x3 matrices ``[N, 3, 3]``; orientation vectors are
axis * angle. Controller maths runs in float64 (robosuite's is numpy float64), whatever the simulator's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DTYPE = torch.float64


@dataclass(frozen=True)
class OSCGains:
    """The controller's constants, read from robosuite's controller and robot (see
    :func:`envs.libero.scene.osc_gains`). Vectors are tuples (hashable, printable)."""

    kp: tuple[float, ...]               # [6] stiffness, position then orientation
    kd: tuple[float, ...]               # [6] damping: 2 sqrt(kp) * damping_ratio
    input_min: tuple[float, ...]        # [6] action clip
    input_max: tuple[float, ...]
    output_min: tuple[float, ...]       # [6] scaled action range (metres, radians)
    output_max: tuple[float, ...]
    torque_min: tuple[float, ...]       # [J] actuator limits of the arm motors
    torque_max: tuple[float, ...]
    nullspace_kp: float = 10.0          # robosuite's nullspace_torques default (kv = 2 sqrt(kp))
    uncouple_pos_ori: bool = True
    gripper_speed: float = 0.01         # PandaGripper.speed: target change per substep
    gripper_ctrl_min: tuple[float, ...] = (0.0, -0.04)   # finger actuators' ctrlrange
    gripper_ctrl_max: tuple[float, ...] = (0.04, 0.0)

    def tensor(self, name: str, device) -> Tensor:
        return torch.tensor(getattr(self, name), dtype=DTYPE, device=device)


def scale_action(action: Tensor, gains: OSCGains) -> Tensor:
    """``[N, 6]`` policy action -> deltas in metres / radians (robosuite's ``Controller.scale_action``)."""
    dev = action.device
    lo, hi = gains.tensor("input_min", dev), gains.tensor("input_max", dev)
    out_lo, out_hi = gains.tensor("output_min", dev), gains.tensor("output_max", dev)
    scale = (out_hi - out_lo).abs() / (hi - lo).abs()
    a = torch.minimum(torch.maximum(action.to(DTYPE), lo), hi)
    return (a - (hi + lo) / 2.0) * scale + (out_hi + out_lo) / 2.0


def axis_angle_to_matrix(vec: Tensor) -> Tensor:
    """``[N, 3]`` axis * angle -> ``[N, 3, 3]`` rotation, as robosuite's ``quat2mat(axisangle2quat(vec))``.

    robosuite's ``quat2mat`` casts the quaternion to float32 before building the matrix; the same cast is
    made here, so goals agree to float64 round-off rather than float32's."""
    vec = vec.to(DTYPE)
    angle = vec.norm(dim=-1, keepdim=True)
    zero = angle == 0.0
    axis = vec / torch.where(zero, torch.ones_like(angle), angle)
    q = torch.cat([torch.cos(angle / 2.0), axis * torch.sin(angle / 2.0)], dim=-1)   # (w, x, y, z)
    q = torch.where(zero, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=DTYPE, device=vec.device), q)
    q = q.to(torch.float32)
    q = q * torch.sqrt(2.0 / (q * q).sum(-1, keepdim=True))
    w, x, y, z = q.unbind(-1)
    rows = [
        1.0 - y * y - z * z, x * y - z * w, x * z + y * w,
        x * y + z * w, 1.0 - x * x - z * z, y * z - x * w,
        x * z - y * w, y * z + x * w, 1.0 - x * x - y * y,
    ]
    return torch.stack(rows, dim=-1).reshape(*vec.shape[:-1], 3, 3).to(DTYPE)


def orientation_error(desired: Tensor, current: Tensor) -> Tensor:
    """``[N, 3]``: half the sum of cross products of matching columns (robosuite's ``orientation_error``)."""
    return 0.5 * torch.linalg.cross(current, desired, dim=-2).sum(-1)


def set_goal(action: Tensor, ee_pos: Tensor, ee_rot: Tensor, goal_rot: Tensor,
             gains: OSCGains) -> tuple[Tensor, Tensor]:
    """New goals ``(goal_pos [N, 3], goal_rot [N, 3, 3])`` from a policy action ``[N, 6]`` at the current
    end-effector pose. ``goal_rot`` (the previous orientation goal) is kept where the scaled rotation is exactly
    zero, as robosuite does."""
    delta = scale_action(action, gains)
    ee_pos, ee_rot = ee_pos.to(DTYPE), ee_rot.to(DTYPE)
    rotate = (delta[:, 3:] != 0.0).any(-1)
    new_rot = axis_angle_to_matrix(delta[:, 3:]) @ ee_rot
    goal_rot = torch.where(rotate[:, None, None], new_rot, goal_rot.to(DTYPE))
    return ee_pos + delta[:, :3], goal_rot


def hinge_jacobian(site_pos: Tensor, joint_anchor: Tensor, joint_axis: Tensor) -> tuple[Tensor, Tensor]:
    """Site Jacobians ``(J_pos, J_rot)`` ``[N, 3, J]`` of a chain of hinge joints (world-frame anchors and axes
    ``[N, J, 3]``): column j is ``axis_j x (site - anchor_j)`` and ``axis_j`` (MuJoCo's ``mj_jacSite`` for hinges)."""
    site_pos, joint_anchor, joint_axis = site_pos.to(DTYPE), joint_anchor.to(DTYPE), joint_axis.to(DTYPE)
    jp = torch.linalg.cross(joint_axis, site_pos[:, None, :] - joint_anchor, dim=-1)
    return jp.transpose(1, 2), joint_axis.transpose(1, 2)


def _pinv(x: Tensor) -> Tensor:
    # numpy's pinv (robosuite's): SVD with singular values below 1e-15 * the largest dropped.
    return torch.linalg.pinv(x, rtol=1e-15)


def osc_torques(*, ee_pos: Tensor, ee_rot: Tensor, jac_pos: Tensor, jac_rot: Tensor, mass: Tensor, bias: Tensor,
                q: Tensor, qd: Tensor, goal_pos: Tensor, goal_rot: Tensor, q_rest: Tensor,
                gains: OSCGains) -> Tensor:
    """Arm torques ``[N, J]`` before the actuator clip (robosuite's ``run_controller``).

    ``mass`` ``[N, J, J]`` is the arm's block of the joint-space inertia, ``bias`` ``[N, J]`` its Coriolis,
    centrifugal and gravity forces (``qfrc_bias``), ``q``/``qd`` ``[N, J]`` joint positions and velocities,
    ``q_rest`` ``[N, J]`` the nullspace target (the joints when the controller was made)."""
    dev = ee_pos.device
    f64 = (ee_pos, ee_rot, jac_pos, jac_rot, mass, bias, q, qd, goal_pos, goal_rot, q_rest)
    ee_pos, ee_rot, jac_pos, jac_rot, mass, bias, q, qd, goal_pos, goal_rot, q_rest = (t.to(DTYPE) for t in f64)
    kp, kd = gains.tensor("kp", dev), gains.tensor("kd", dev)
    lin_vel = (jac_pos @ qd[..., None])[..., 0]
    ang_vel = (jac_rot @ qd[..., None])[..., 0]
    force = kp[:3] * (goal_pos - ee_pos) - kd[:3] * lin_vel
    torque = kp[3:] * orientation_error(goal_rot, ee_rot) - kd[3:] * ang_vel
    jac = torch.cat([jac_pos, jac_rot], dim=1)                                  # [N, 6, J]
    mass_inv = torch.linalg.inv(mass)
    lam_full = _pinv(jac @ mass_inv @ jac.transpose(1, 2))
    if gains.uncouple_pos_ori:
        lam_pos = _pinv(jac_pos @ mass_inv @ jac_pos.transpose(1, 2))
        lam_ori = _pinv(jac_rot @ mass_inv @ jac_rot.transpose(1, 2))
        wrench = torch.cat([(lam_pos @ force[..., None])[..., 0], (lam_ori @ torque[..., None])[..., 0]], dim=-1)
    else:
        wrench = (lam_full @ torch.cat([force, torque], dim=-1)[..., None])[..., 0]
    tau = (jac.transpose(1, 2) @ wrench[..., None])[..., 0] + bias
    # Nullspace: (I - Jbar J)^T M (kp (q_rest - q) - kv qd), Jbar = M^-1 J^T Lambda.
    eye = torch.eye(jac.shape[-1], dtype=DTYPE, device=dev)
    jbar = mass_inv @ jac.transpose(1, 2) @ lam_full
    null = eye - jbar @ jac
    kv = 2.0 * gains.nullspace_kp ** 0.5
    pose = (mass @ (gains.nullspace_kp * (q_rest - q) - kv * qd)[..., None])
    return tau + (null.transpose(1, 2) @ pose)[..., 0]


def clip_torques(tau: Tensor, gains: OSCGains) -> Tensor:
    dev = tau.device
    return torch.minimum(torch.maximum(tau, gains.tensor("torque_min", dev)), gains.tensor("torque_max", dev))


def gripper_step(current: Tensor, command: Tensor, gains: OSCGains) -> tuple[Tensor, Tensor]:
    """One substep of the Panda gripper: ``current`` ``[N, 2]`` finger targets in [-1, 1], ``command`` ``[N]``
    (-1 opens, +1 closes). Returns ``(new current, finger controls [N, 2])``: the target moves by ``speed`` per
    substep in the direction of the command's sign (zero: stays), mapped onto the actuators' control range."""
    dev = current.device
    step = torch.tensor([-1.0, 1.0], dtype=DTYPE, device=dev) * gains.gripper_speed
    current = (current.to(DTYPE) + step * torch.sign(command.to(DTYPE))[:, None]).clamp(-1.0, 1.0)
    lo, hi = gains.tensor("gripper_ctrl_min", dev), gains.tensor("gripper_ctrl_max", dev)
    return current, (hi + lo) / 2.0 + (hi - lo) / 2.0 * current
