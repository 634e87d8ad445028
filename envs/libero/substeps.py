"""robosuite's physics substeps with one MuJoCo forward pass each instead of three, bit for bit the same.

Per physics substep robosuite's ``env.step`` (robosuite 1.4, ``environments/base.py``) calls ``sim.forward()``,
then the arm controller's ``update()`` calls ``sim.forward()`` again on the unchanged state (the OSC controller
refreshes its kinematics), then ``sim.step()`` runs ``mj_step``, whose first stage is the same forward pass once
more before it integrates. LIBERO runs 25 substeps per action, so the forward pass dominates a state-only step.

MuJoCo splits ``mj_step`` for exactly this pattern (read the state, set ``ctrl``, finish the step):
``mj_step1`` computes everything that depends on positions and velocities (kinematics, the mass matrix, bias
forces, position and velocity sensors: all a controller reads) and ``mj_step2`` the rest (actuation,
acceleration, constraints, acceleration sensors) and integrates. Inside :class:`SplitSubsteps` the first
``sim.forward()`` of a substep runs ``mj_step1``, a repeated one on the same state does nothing, and
``sim.step()`` runs ``mj_step2`` when the state is still the one ``mj_step1`` saw (otherwise the full
``mj_step``). What is compared is MuJoCo's own integration state minus the three inputs only ``mj_step2``
reads (ctrl, applied joint and body forces), which the controller writes in between.

Checked, not assumed: tests/envs/libero/test_libero_expert.py plays a whole expert episode from a sampled placement
both ways and compares every state, action and the final MuJoCo state exactly;
tests/envs/libero/test_mujoco_substeps.py does the same for robosuite's substep pattern on a small model with
contacts. The RK4 integrator, which ``mj_step2`` does not implement (it falls back to Euler), is left to robosuite's
own loop.
"""

from __future__ import annotations

import numpy as np


def step1_inputs(mujoco) -> int:
    """The mjtState bits mj_step1's results depend on: the integration state except what mj_step2 alone reads."""
    s = mujoco.mjtState
    return s.mjSTATE_INTEGRATION & ~(s.mjSTATE_CTRL | s.mjSTATE_QFRC_APPLIED | s.mjSTATE_XFRC_APPLIED)


class SplitSubsteps:
    """Context manager: while inside, ``sim`` (a robosuite ``MjSim``) runs forward / step as described above.

    ``with SplitSubsteps(sim): env.step(action)``. It shadows ``sim.forward`` and ``sim.step`` with instance
    attributes and removes them on exit, so outside the block (resets, rendering, user code) the sim is
    robosuite's own. Counters ``step1``, ``step2``, ``full``, ``skipped`` say what ran."""

    def __init__(self, sim):
        import mujoco  # comes with robosuite (LIBERO's simulator), an optional install

        self._mj, self._inputs = mujoco, step1_inputs(mujoco)
        self.sim = sim
        self.model, self.data = sim.model._model, sim.data._data
        self.enabled = self.model.opt.integrator != mujoco.mjtIntegrator.mjINT_RK4
        self._now = np.empty(mujoco.mj_stateSize(self.model, self._inputs))
        self._seen: np.ndarray | None = None     # the state mj_step1 last ran on, until the step completes
        self.step1 = self.step2 = self.full = self.skipped = 0

    def __enter__(self) -> SplitSubsteps:
        if self.enabled:
            self.sim.forward, self.sim.step = self._forward, self._step
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            del self.sim.forward, self.sim.step
        self._seen = None

    def _unchanged(self) -> bool:
        self._mj.mj_getState(self.model, self.data, self._now, self._inputs)
        return self._seen is not None and np.array_equal(self._now, self._seen)

    def _forward(self) -> None:
        if self._unchanged():
            self.skipped += 1
            return
        self._mj.mj_step1(self.model, self.data)
        self._seen = self._now.copy()
        self.step1 += 1

    def _step(self) -> None:
        if self._unchanged():
            self._mj.mj_step2(self.model, self.data)
            self.step2 += 1
        else:
            self._mj.mj_step(self.model, self.data)
            self.full += 1
        self._seen = None
