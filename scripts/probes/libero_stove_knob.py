"""Probe: can a downward, closed gripper turn LIBERO-Goal's stove knob? (docs/notes.md, LIBERO)

Drives the robosuite-LIBERO env of LIBERO-Goal task 7 ("turn on the stove") through waypoints given relative to
the knob's pivot with the expert's ``pose_action`` (gripper closed, pointing down, closing axis along ``yaw``), and
prints the grip site relative to the pivot and the knob's joint every 10 steps::

    python scripts/probes/libero_stove_knob.py 1.5708 '[[0.02,-0.045,0.1],[0.02,-0.045,0.04],[0.02,0.04,0.04]]'
    python scripts/probes/libero_stove_knob.py 1.5708 '[[-0.035,0.05,0.1],[-0.035,0.05,0.04],[-0.035,-0.05,0.04]]'

A waypoint not reached within 25 steps is passed; ``init`` (third argument) picks the init state.
"""

import json
import sys

import mujoco
import numpy as np

from vla_rl.envs.libero.expert import CLOSE, down_orientation, pose_action, read_scene
from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv


def main() -> None:
    yaw, rel = float(sys.argv[1]), json.loads(sys.argv[2])
    init = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    env = LiberoSingleEnv(LiberoConfig(suite="libero_goal", task_ids=[7], cameras=[]))
    env.reset_to(7, init)
    sim = env.sim_env
    m, d = sim.sim.model._model, sim.sim.data._data
    pivot = d.xpos[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, "flat_stove_1_button")].copy()
    way = [pivot + np.array(w) for w in rel]
    k = stuck = 0
    for t in range(1, 161):
        scene = read_scene(sim)
        action = pose_action(scene.eef_pos, scene.eef_mat, way[k], down_orientation(yaw), CLOSE, gain=4.0,
                             max_pos=0.5)
        *_, success = env.step(action)
        stuck += 1
        if (np.linalg.norm(scene.eef_pos - way[k]) < 0.01 or stuck > 25) and k < len(way) - 1:
            k, stuck = k + 1, 0
        if t % 10 == 0:
            print(t, "waypoint", k, "grip site - pivot", (scene.eef_pos - pivot).round(3), "knob",
                  scene.joints["flat_stove_1"].round(3))
        if success:
            print("turned on at step", t)
            break
    env.close()


if __name__ == "__main__":
    main()
