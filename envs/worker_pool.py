"""The batched chunk-stepping interface over env workers, whatever carries their commands.

A worker runs an :class:`envs.env_group.EnvGroup` (a contiguous block of the pool's envs). :class:`WorkerPool`
holds what does not depend on where the workers live: seeds, episode statistics, the batched observation
arrays, the assembly of a :class:`~envs.base.ChunkStep`, and the replacement of workers that died. Subclasses
say how a worker starts and stops and how commands reach it: processes on this machine
(:class:`envs.workers.WorkerVectorEnv`) or Ray actors anywhere in a cluster (:class:`envs.ray_workers.RayVectorEnv`).

Glossary: N envs, H actions per chunk, A action dims.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from vla_rl.envs.base import ChunkStep, EnvSpec, EpisodeTracker, check_action_chunk, check_env_indices
from vla_rl.envs.env_group import ChunkReply


class WorkerError(RuntimeError):
    """A worker failed or died; ``index`` is the first env it ran (pass it to ``restart``, or let the pool
    restart it: ``max_restarts``)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def auto_envs_per_worker(num_envs: int) -> int:
    """One worker per CPU core this process may use (``ceil(num_envs / cores)`` envs each): more
    processes than cores add memory (~550 MB per ManiSkill worker) and context switches, not speed
    (benchmarks/bench_env_grouping.py: 16 PickCube envs on 2 cores, 418 env-steps/s in 16 workers, 472 in 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                       # not on Linux
        cores = os.cpu_count() or 1
    return max(1, -(-num_envs // max(1, cores)))


def worker_slices(num_envs: int, envs_per_worker: int) -> list[range]:
    """The envs each worker runs: ``ceil(num_envs / envs_per_worker)`` workers with contiguous, balanced
    blocks (10 envs at 4 per worker: 4, 3, 3), so no worker is left with a lone straggler env."""
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if envs_per_worker < 1:
        raise ValueError(f"envs_per_worker must be >= 1, got {envs_per_worker}")
    return split_evenly(num_envs, -(-num_envs // envs_per_worker))


def split_evenly(num_envs: int, workers: int) -> list[range]:
    """``num_envs`` envs in ``min(workers, num_envs)`` contiguous blocks whose sizes differ by at most one."""
    if num_envs < 1 or workers < 1:
        raise ValueError(f"need at least one env and one worker, got {num_envs} envs and {workers} workers")
    workers = min(workers, num_envs)
    base, extra = divmod(num_envs, workers)
    out, start = [], 0
    for w in range(workers):
        size = base + (w < extra)
        out.append(range(start, start + size))
        start += size
    return out


class WorkerPool:
    """``num_envs`` single envs in workers (the blocks ``slices``) behind the batched chunk-stepping interface.

    ``max_restarts`` > 0: a worker that dies (or fails) during ``reset`` or ``step`` is replaced, up to that
    many times over the pool's life, instead of raising :class:`WorkerError`. Its envs are reset with the
    seeds of the last ``reset`` (an evaluation replays the same initial states) and their unfinished episodes
    are dropped: in that step they report ``lost`` (no reward, no episode), and their observation is the first
    of the new episode. Each restart is reported through ``log``.

    Stepping in groups (:meth:`step_groups`, :meth:`step_async`, :meth:`step_wait`): a caller may start a chunk on
    one group of workers, work while they simulate (sample the next chunk of another group), and collect the
    group's :class:`~envs.base.ChunkStep` later. Each env's results are those of :meth:`step`: every env keeps
    its own simulator, seed and episode statistics, whatever the grouping and the timing.

    Subclasses implement :meth:`_start` (a worker up and its spec accepted with :meth:`_accept_spec`),
    :meth:`_stop`, :meth:`close`, and either :meth:`_send_each` and :meth:`_recv_each` (commands in flight
    while the caller works) or only :meth:`_call_each` (each group's step then runs when it is waited for).
    Their replies carry no observation arrays: a worker's observations are in ``self.arrays`` by the time its
    reply is returned."""

    def __init__(self, num_envs: int, slices: list[range], *, seed: int, name: str, max_restarts: int,
                 log: Callable[[str], None] | None):
        self.slices = slices
        self._num_envs = num_envs
        self.seed, self.name = seed, name
        self.device = torch.device("cpu")
        self._worker_of = [w for w, sl in enumerate(slices) for _ in sl]
        self._instr: list[str] = [""] * num_envs
        self._seeds: list[int | None] = [None] * num_envs   # each env's seed at the last reset()
        self._final_frames: list[int] = []                   # envs whose ended episodes are rendered
        self.max_restarts, self.restarts = max_restarts, 0
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.spec: EnvSpec | None = None
        self.arrays: dict[str, np.ndarray] | None = None
        self.tracker = EpisodeTracker(num_envs, self.device)
        self._deferred: dict[int, tuple] = {}          # commands of a _call_each-only transport, not yet run
        # rows of each group with a chunk in flight -> (its workers, the chunk's length, send errors)
        self._in_flight: dict[range, tuple[list[int], int, dict[int, WorkerError]]] = {}

    @property
    def num_envs(self) -> int:
        return self._num_envs

    @property
    def num_workers(self) -> int:
        return len(self.slices)

    # ------------------------------------------------------------------------------------------------
    # What a transport implements
    # ------------------------------------------------------------------------------------------------
    def _start(self, w: int) -> None:
        raise NotImplementedError

    def _stop(self, w: int) -> None:
        """End worker ``w`` if it still runs (it died or failed; a replacement follows)."""
        raise NotImplementedError

    def _call_each(self, msgs: dict[int, tuple]) -> tuple[dict[int, object], dict[int, WorkerError]]:
        """Send each worker its ``(command, argument)`` and take every reply: the replies of the workers that
        answered and the errors of the others. Commands: ``reset`` (a seed per env; replies the instructions),
        ``step`` (actions ``[count, H, A]``; replies a :class:`ChunkReply` per env) and ``render`` (env
        indices; replies a frame each)."""
        errors = self._send_each(msgs)
        out, late = self._recv_each([w for w in msgs if w not in errors])
        return out, {**errors, **late}

    def _send_each(self, msgs: dict[int, tuple]) -> dict[int, WorkerError]:
        """Send each worker its command without waiting for the reply; returns the workers that could not
        be reached. Default (a transport with only :meth:`_call_each`): keep them for :meth:`_recv_each`."""
        if type(self)._call_each is WorkerPool._call_each:
            raise NotImplementedError("a worker pool implements _send_each and _recv_each, or _call_each")
        self._deferred.update(msgs)
        return {}

    def _recv_each(self, workers: list[int]) -> tuple[dict[int, object], dict[int, WorkerError]]:
        """The replies to the commands sent to ``workers``, and the errors of the workers that failed."""
        return self._call_each({w: self._deferred.pop(w) for w in workers})

    def close(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------
    def _envs_text(self, w: int) -> str:
        sl = self.slices[w]
        return f"env {sl[0]}" if len(sl) == 1 else f"envs {sl[0]}-{sl[-1]}"

    def _accept_spec(self, w: int, spec: EnvSpec) -> bool:
        """Check worker ``w``'s spec (the first one fixes the pool's, as a batch of ``num_envs``); True when it
        was the first (the transport then allocates ``self.arrays``)."""
        spec = replace(spec, num_envs=self.num_envs)
        if self.spec is None:
            self.spec = spec
            return True
        if spec != self.spec:
            raise WorkerError(self.slices[w][0], f"{self.name} worker {w} has spec {spec}, the others {self.spec}")
        return False

    def _call(self, msgs: dict[int, tuple]) -> dict[int, object]:
        """:meth:`_call_each` that raises the first error, after every live worker has answered (no reply is
        left to be misread by the next command; the live workers' envs have still run the command)."""
        out, errors = self._call_each(msgs)
        if errors:
            raise next(iter(errors.values()))
        return out

    def _replace_failed(self, errors: dict[int, WorkerError], doing: str) -> None:
        """Restart the workers in ``errors`` and reset their envs with their last seeds, or raise the first
        error when that would exceed ``max_restarts``."""
        if self.restarts + len(errors) > self.max_restarts:
            first = next(iter(errors.values()))
            if self.max_restarts:
                raise WorkerError(first.index, f"{first} (after {self.restarts} restart(s), the most allowed: "
                                               f"{self.max_restarts})") from None
            raise first
        for w, err in errors.items():
            self.restarts += 1
            cause = str(err).splitlines()[0]
            self.log(f"{self.name} worker {w} ({self._envs_text(w)}) stopped during {doing}: {cause}; restarting it "
                     f"({self.restarts} of at most {self.max_restarts}); its unfinished episodes are dropped")
            self._respawn(w, [self._seeds[j] for j in self.slices[w]])

    def _respawn(self, w: int, seeds: list[int | None]) -> None:
        self._stop(w)
        self._start(w)
        mine = [i for i in self._final_frames if self._worker_of[i] == w]
        if mine:
            self._call({w: ("final_frames", mine)})
        for j, instr in zip(self.slices[w], self._call({w: ("reset", seeds)})[w]):
            self._instr[j] = instr

    def restart(self, i: int, seed: int | None = None) -> dict:
        """Replace the worker that runs env ``i`` (after it died) and reset its envs; envs on other workers
        are untouched. The worker's unfinished episodes are lost; with ``seed``, its env ``j`` gets
        ``seed + j - i``. Returns the batched observation."""
        self._check_idle("restart a worker")
        check_env_indices([i], self.num_envs)
        w = self._worker_of[i]
        sl = self.slices[w]
        lost = torch.zeros(self.num_envs, dtype=torch.bool)
        lost[sl[0]:sl[-1] + 1] = True
        self.tracker.finish(lost, torch.zeros(self.num_envs, dtype=torch.bool))
        self._respawn(w, [None if seed is None else seed + j - i for j in sl])
        return self._observe(final=False)

    # ------------------------------------------------------------------------------------------------
    def _observe(self, final: bool, instructions: list[str] | None = None, rows: range | None = None) -> dict:
        """The observations of ``rows`` (default all; copied: other groups' workers may be writing theirs)."""
        p = "final_" if final else ""
        sl = slice(None) if rows is None else slice(rows.start, rows.stop)
        return {"images": torch.from_numpy(self.arrays[p + "images"][sl].copy()),
                "state": torch.from_numpy(self.arrays[p + "state"][sl].copy()),
                "instruction": list(instructions if instructions is not None else self._instr[sl])}

    def _check_idle(self, doing: str) -> None:
        if self._in_flight:
            busy = ", ".join(f"envs {r.start}-{r.stop - 1}" for r in self._in_flight)
            raise RuntimeError(f"cannot {doing} while chunks are in flight ({busy}): step_wait for them first")

    def reset(self, seed: int | None = None, *, group_size: int = 1) -> dict:
        """Reset every env; env ``i`` gets seed ``seed + i // group_size`` (default seed: the
        constructor's), so ``group_size`` g > 1 makes groups of g envs start from the same state."""
        self._check_idle("reset")
        base = self.seed if seed is None else seed
        self._seeds = [base + i // group_size for i in range(self.num_envs)]
        replies, errors = self._call_each({w: ("reset", [self._seeds[i] for i in sl])
                                           for w, sl in enumerate(self.slices)})
        self._replace_failed(errors, "reset")   # a restarted worker's envs are reset with these seeds
        for w, sl in enumerate(self.slices):
            for i, instr in zip(sl, replies.get(w, [])):
                self._instr[i] = instr
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self._observe(final=False)

    def step(self, chunk: torch.Tensor) -> ChunkStep:
        self.step_async(range(self.num_envs), chunk)
        return self.step_wait(range(self.num_envs))

    def step_groups(self, count: int) -> list[range]:
        """The envs of ``count`` groups of whole workers (contiguous, with worker counts that differ by at most
        one), for :meth:`step_async`."""
        if not 1 <= count <= self.num_workers:
            raise ValueError(f"{count} groups of {self.name} workers: need 1 to {self.num_workers} "
                             f"(one worker or more per group; this pool has {self.num_workers} worker(s))")
        return [range(self.slices[ws[0]][0], self.slices[ws[-1]][-1] + 1)
                for ws in split_evenly(self.num_workers, count)]

    def _workers_of(self, rows: range) -> list[int]:
        if not isinstance(rows, range) or rows.step != 1 or not 0 <= rows.start < rows.stop <= self.num_envs:
            raise ValueError(f"rows must be a range of env indices within [0, {self.num_envs}), got {rows!r}")
        workers = sorted({self._worker_of[i] for i in rows})
        if self.slices[workers[0]][0] != rows.start or self.slices[workers[-1]][-1] != rows.stop - 1:
            raise ValueError(f"rows {rows.start}-{rows.stop - 1} split a worker's envs; the workers run "
                             f"{[(sl[0], sl[-1]) for sl in self.slices]} (use step_groups())")
        return workers

    def step_async(self, rows: range, chunk: torch.Tensor) -> None:
        """Start the chunk ``[len(rows), H, A]`` on the envs ``rows`` (whole workers: see :meth:`step_groups`) and
        return without waiting; :meth:`step_wait` ``(rows)`` collects it."""
        workers = self._workers_of(rows)
        if any(set(rows) & set(r) for r in self._in_flight):
            raise RuntimeError(f"envs {rows.start}-{rows.stop - 1} already have a chunk in flight: step_wait first")
        chunk = check_action_chunk(chunk, replace(self.spec, num_envs=len(rows)))
        actions = chunk.numpy()
        errors = self._send_each({w: ("step", actions[self.slices[w][0] - rows.start:
                                                       self.slices[w][-1] + 1 - rows.start]) for w in workers})
        self._in_flight[rows] = (workers, chunk.shape[1], errors)

    def step_wait(self, rows: range) -> ChunkStep:
        """Wait for the chunk started on ``rows``; returns its :class:`ChunkStep` (``len(rows)`` rows; the
        episodes' ``env_index`` counts in the whole pool)."""
        if rows not in self._in_flight:
            raise RuntimeError(f"no chunk in flight on envs {rows.start}-{rows.stop - 1} (step_async first)")
        workers, horizon, errors = self._in_flight.pop(rows)
        replies, late = self._recv_each([w for w in workers if w not in errors])
        errors = {**errors, **late}
        n, lo = len(rows), rows.start
        lost = torch.zeros(n, dtype=torch.bool)
        if errors:
            self._replace_failed(errors, "a step")
            for w in errors:   # a fresh episode, reported like a chunk that ran no step
                sl = self.slices[w]
                lost[sl[0] - lo:sl[-1] + 1 - lo] = True
                replies[w] = [ChunkReply(np.zeros(horizon, np.float32), np.zeros(horizon, bool), 0, False, False,
                                         False, self._instr[j], None) for j in sl]
            self.tracker.finish(lost, torch.zeros_like(lost), rows)   # their unfinished episodes are dropped
        results: list[ChunkReply] = [r for w in workers for r in replies[w]]
        rewards = torch.from_numpy(np.stack([r.rewards for r in results]))
        succ_h = torch.from_numpy(np.stack([r.successes for r in results]))
        steps = torch.tensor([r.steps for r in results])
        terminated = torch.tensor([r.terminated for r in results])
        truncated = torch.tensor([r.truncated for r in results])
        success = torch.tensor([r.success for r in results])
        for h in range(horizon):
            self.tracker.update(rewards[:, h], succ_h[:, h], h < steps, rows)
        done = terminated | truncated
        final_obs, episodes = None, {}
        if bool(done.any()):
            final_instr = [r.final_instruction if r.final_instruction is not None else self._instr[lo + i]
                           for i, r in enumerate(results)]
            final_obs = self._observe(final=True, instructions=final_instr, rows=rows)
            episodes = self.tracker.finish(done, success, rows)
        self._instr[lo:lo + n] = [r.instruction for r in results]
        frames = {i: r.final_frame for i, r in enumerate(results) if r.final_frame is not None}
        return ChunkStep(obs=self._observe(final=False, rows=rows), rewards=rewards, terminated=terminated,
                         truncated=truncated, success=success, steps=steps, final_obs=final_obs,
                         episodes=episodes, lost=lost if errors else None, final_frames=frames or None)

    def set_final_frames(self, indices: list[int]) -> None:
        """From the next chunk on, each episode that ends in envs ``indices`` is rendered in its last state, before
        its worker resets it, into the step's ``final_frames`` (videos of camera-less envs); ``[]`` stops it."""
        self._check_idle("set_final_frames")
        self._final_frames = indices = sorted(set(check_env_indices(indices, self.num_envs)))
        self._call({w: ("final_frames", [i for i in indices if self._worker_of[i] == w])
                    for w in range(self.num_workers)})

    def forget_history(self) -> None:
        """Make every env's next reset start as a newly built env's would: simulators whose physics carries
        state from one episode to the next (ManiSkill's PhysX scene) rebuild it. Workers restarted later start
        new anyway. Why: a run resumed from a checkpoint has new workers; the trainer calls this where a run
        can resume (:meth:`vla_rl.train.trainer.Trainer.run`), so an uninterrupted run takes the same steps."""
        self._check_idle("forget the envs' history")
        self._call({w: ("forget_history", None) for w in range(self.num_workers)})

    def render_frames(self, indices: list[int] | None = None) -> list[np.ndarray]:
        """One RGB frame ``[H, W, 3]`` per requested env (for videos), in the order asked."""
        self._check_idle("render")
        indices = list(range(self.num_envs)) if indices is None else check_env_indices(indices, self.num_envs)
        by_worker: dict[int, list[int]] = {}
        for i in indices:
            by_worker.setdefault(self._worker_of[i], []).append(i)
        replies = self._call({w: ("render", envs) for w, envs in by_worker.items()})
        frames = {}
        for w, envs in by_worker.items():
            frames.update(zip(envs, replies[w]))
        return [frames[i] for i in indices]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
