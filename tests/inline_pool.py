"""A worker pool without processes or actors: the same single envs, in blocks, in this process. The local
reference that worker processes and Ray env actors must match; its transport implements only ``_call_each``
(a group's chunk runs when it is waited for)."""

from __future__ import annotations

import numpy as np

from vla_rl.envs.env_group import EnvGroup, land_reset, land_step, obs_layout
from vla_rl.envs.worker_pool import WorkerPool, worker_slices


class InProcessPool(WorkerPool):
    def __init__(self, factory, num_envs: int, *, seed: int = 0, envs_per_worker: int = 4):
        super().__init__(num_envs, worker_slices(num_envs, envs_per_worker), seed=seed, name="inline",
                         max_restarts=0, log=None)
        self.groups = [EnvGroup(factory, len(sl)) for sl in self.slices]
        for w, group in enumerate(self.groups):
            if self._accept_spec(w, group.spec):
                layout = obs_layout(num_envs, self.spec)
                self.arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in layout.items()}

    def _call_each(self, msgs):
        out = {}
        for w, (cmd, arg) in msgs.items():
            group, first = self.groups[w], self.slices[w][0]
            if cmd == "reset":
                out[w] = land_reset(self.arrays, first, group.reset(arg))
            elif cmd == "step":
                out[w] = land_step(self.arrays, first, group.step(arg))
            elif cmd == "final_frames":
                out[w] = group.set_final_frames([i - first for i in arg])
            elif cmd == "forget_history":
                out[w] = group.forget_history()
            else:
                out[w] = group.render([i - first for i in arg])
        return out, {}

    def close(self):
        for group in self.groups:
            group.close()
