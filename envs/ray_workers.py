"""Batched envs from single-env simulators in Ray actors, which may live on any node of a Ray cluster.

The same per-worker code as the worker processes of :mod:`envs.workers` (an :class:`~envs.env_group.EnvGroup`
per actor) and the same batching, seeding and restarts (:class:`~envs.worker_pool.WorkerPool`): a pool of
env actors gives the same observations, rewards and episodes as a pool of processes with the same blocks of
envs. Observations come back in each actor's reply (through Ray's object store) instead of shared memory.

Where the actors go (CPUs, GPUs, placement group bundles) is the caller's choice: ``actor_options(w)`` gives
the Ray options of worker ``w`` (:mod:`vla_rl.distributed.runtime` derives them from the config). A dead actor
(its process or its node gone) is replaced like a dead worker process: the replacement takes the same options,
so it lands in the same placement group bundle, which Ray moves to a live node if its node died.

Glossary: N envs, H actions per chunk, A action dims.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

from vla_rl.envs.env_group import EnvGroup, land_reset, land_step, obs_layout
from vla_rl.envs.worker_pool import WorkerError, WorkerPool, split_evenly


class EnvActor:
    """The Ray actor of one worker: an :class:`EnvGroup` (made a Ray actor class by :func:`_actor_class`)."""

    def __init__(self, factory: Callable[[], object], count: int):
        torch.set_num_threads(1)   # one env actor per reserved CPU; torch's thread pool would oversubscribe it
        self.group = EnvGroup(factory, count)

    def spec(self):
        return self.group.spec

    def reset(self, seeds):
        return self.group.reset(seeds)

    def step(self, actions):
        # Ray hands numpy arguments over read-only (zero-copy from its object store); simulators may write.
        return self.group.step(np.array(actions))

    def render(self, local):
        return self.group.render(local)

    def final_frames(self, local):
        self.group.set_final_frames(local)

    def forget_history(self, _=None):
        self.group.forget_history()

    def close(self) -> None:
        self.group.close()

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id): where this actor runs."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


def _actor_class():
    import ray

    # max_restarts=0: the pool replaces a dead actor itself, since its envs must be reset and its episodes
    # dropped from the batch (an actor restarted by Ray would come back with fresh envs the pool knows nothing of).
    return ray.remote(max_restarts=0)(EnvActor)


class RayVectorEnv(WorkerPool):
    """``num_envs`` single envs from ``factory()`` split evenly over ``num_actors`` Ray actors (contiguous
    blocks), behind the batched chunk-stepping interface.

    ``actor_options(w)``: the Ray actor options of actor ``w`` (``num_cpus``, ``num_gpus``,
    ``scheduling_strategy``, ...); default one CPU each. ``timeout``: seconds an actor may take to start or to
    answer a command before it counts as dead. ``max_restarts``: see :class:`~envs.worker_pool.WorkerPool`."""

    def __init__(self, factory: Callable[[], object], num_envs: int, *, num_actors: int, seed: int = 0,
                 actor_options: Callable[[int], dict] | None = None, timeout: float = 300.0, name: str = "env",
                 max_restarts: int = 0, log: Callable[[str], None] | None = None):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayVectorEnv needs a connected Ray (ray.init) first")
        super().__init__(num_envs, split_evenly(num_envs, num_actors), seed=seed, name=name,
                         max_restarts=max_restarts, log=log)
        self.factory, self.timeout = factory, timeout
        self.actor_options = actor_options or (lambda w: {"num_cpus": 1})
        self._cls = _actor_class()
        self.actors: list = [None] * self.num_workers
        self._sent: dict[int, tuple] = {}   # worker -> (reply ref, command) of commands not yet collected
        try:
            # Create every actor before waiting for any: their imports and simulator set-up then overlap.
            for w in range(self.num_workers):
                self._create(w)
            _, errors = self._gather({w: self.actors[w].spec.remote() for w in range(self.num_workers)},
                                     "start", on_reply=self._take_spec)
            if errors:
                raise next(iter(errors.values()))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------
    def _create(self, w: int) -> None:
        sl = self.slices[w]
        self.actors[w] = self._cls.options(name=None, **self.actor_options(w)).remote(self.factory, len(sl))

    def _take_spec(self, w: int, spec) -> None:
        if self._accept_spec(w, spec):
            self.arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in obs_layout(self.num_envs, spec).items()}
        return spec

    def _start(self, w: int) -> None:
        self._create(w)
        _, errors = self._gather({w: self.actors[w].spec.remote()}, "start", on_reply=self._take_spec)
        if errors:
            raise errors[w]

    def _stop(self, w: int) -> None:
        import ray

        if self.actors[w] is not None:
            try:
                ray.kill(self.actors[w], no_restart=True)
            except Exception:
                pass   # already gone
            self.actors[w] = None

    def _gather(self, refs: dict[int, object], doing: str, on_reply: Callable[[int, object], object]):
        """Wait (up to ``timeout`` in all) for each worker's reply; ``on_reply(w, reply)`` turns it into what
        :meth:`_call_each` returns. Replies that are errors (an exception in the actor, a dead actor) and
        missing replies become :class:`WorkerError`."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        by_ref = {ref: w for w, ref in refs.items()}
        out, errors = {}, {}
        pending = list(refs.values())
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending),
                                      timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                w = by_ref[ref]
                first = self.slices[w][0]
                try:
                    out[w] = on_reply(w, ray.get(ref))
                except RayTaskError as e:   # the env raised: its traceback is in the message
                    errors[w] = WorkerError(first, f"{self.name} actor {w} ({self._envs_text(w)}) failed "
                                                   f"during {doing}:\n{e}")
                except RayActorError as e:  # the actor's process or node is gone
                    cause = str(e).strip() or type(e).__name__
                    errors[w] = WorkerError(first, f"{self.name} actor {w} ({self._envs_text(w)}) died during "
                                                   f"{doing}: {cause}")
                except WorkerError as e:
                    errors[w] = e
            if pending and time.monotonic() >= deadline:
                for ref in pending:
                    w = by_ref[ref]
                    errors[w] = WorkerError(self.slices[w][0], f"{self.name} actor {w} ({self._envs_text(w)}) "
                                                               f"timed out after {self.timeout:.0f} s during {doing}")
                break
        return out, errors

    def _send_each(self, msgs: dict[int, tuple]) -> dict[int, WorkerError]:
        for w, (cmd, arg) in msgs.items():
            if cmd in ("render", "final_frames"):
                arg = [i - self.slices[w][0] for i in arg]
            self._sent[w] = (getattr(self.actors[w], cmd).remote(arg), cmd)
        return {}   # an unreachable actor shows in its reply (RayActorError)

    def _recv_each(self, workers: list[int]) -> tuple[dict[int, object], dict[int, WorkerError]]:
        sent = {w: self._sent.pop(w) for w in workers}
        kinds = {w: cmd for w, (_, cmd) in sent.items()}
        return self._gather({w: ref for w, (ref, _) in sent.items()}, "/".join(sorted(set(kinds.values()))),
                            on_reply=lambda w, reply: self._land(w, kinds[w], reply))

    def _land(self, w: int, cmd: str, reply):
        """Write a reply's observations into the batched arrays; returns what the pool expects of it."""
        if cmd == "reset":
            return land_reset(self.arrays, self.slices[w][0], reply)
        if cmd == "step":
            return land_step(self.arrays, self.slices[w][0], reply)
        return reply

    def where(self) -> list[tuple[str, int]]:
        """(Ray node id, process id) of each env actor."""
        import ray

        return ray.get([a.where.remote() for a in self.actors], timeout=self.timeout)

    def close(self) -> None:
        import ray

        actors = [a for a in getattr(self, "actors", []) if a is not None]
        if actors and ray.is_initialized():
            ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=10)
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
        self.actors = [None] * len(getattr(self, "actors", []))
        self.arrays = None
