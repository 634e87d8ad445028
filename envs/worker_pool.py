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

from .base import ChunkStep, EnvSpec, EpisodeTracker, check_action_chunk
from .env_group import ChunkReply


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

    Subclasses implement :meth:`_start` (a worker up and its spec accepted with :meth:`_accept_spec`),
    :meth:`_stop`, :meth:`_call_each` and :meth:`close`. Their replies carry no observation arrays: a worker's
    observations are in ``self.arrays`` by the time its reply is returned."""

    def __init__(self, num_envs: int, slices: list[range], *, seed: int, name: str, max_restarts: int,
                 log: Callable[[str], None] | None):
        self.slices = slices
        self._num_envs = num_envs
        self.seed, self.name = seed, name
        self.device = torch.device("cpu")
        self._worker_of = [w for w, sl in enumerate(slices) for _ in sl]
        self._instr: list[str] = [""] * num_envs
        self._seeds: list[int | None] = [None] * num_envs   # each env's seed at the last reset()
        self.max_restarts, self.restarts = max_restarts, 0
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.spec: EnvSpec | None = None
        self.arrays: dict[str, np.ndarray] | None = None
        self.tracker = EpisodeTracker(num_envs, self.device)

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
        raise NotImplementedError

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
        for j, instr in zip(self.slices[w], self._call({w: ("reset", seeds)})[w]):
            self._instr[j] = instr

    def restart(self, i: int, seed: int | None = None) -> dict:
        """Replace the worker that runs env ``i`` (after it died) and reset its envs; envs on other workers
        are untouched. The worker's unfinished episodes are lost; with ``seed``, its env ``j`` gets
        ``seed + j - i``. Returns the batched observation."""
        if not 0 <= i < self.num_envs:
            raise IndexError(f"env index {i} out of range for {self.num_envs} envs")
        w = self._worker_of[i]
        sl = self.slices[w]
        lost = torch.zeros(self.num_envs, dtype=torch.bool)
        lost[sl[0]:sl[-1] + 1] = True
        self.tracker.finish(lost, torch.zeros(self.num_envs, dtype=torch.bool))
        self._respawn(w, [None if seed is None else seed + j - i for j in sl])
        return self._observe(final=False)

    # ------------------------------------------------------------------------------------------------
    def _observe(self, final: bool, instructions: list[str] | None = None) -> dict:
        p = "final_" if final else ""
        return {"images": torch.from_numpy(self.arrays[p + "images"].copy()),
                "state": torch.from_numpy(self.arrays[p + "state"].copy()),
                "instruction": list(instructions if instructions is not None else self._instr)}

    def reset(self, seed: int | None = None, *, group_size: int = 1) -> dict:
        """Reset every env; env ``i`` gets seed ``seed + i // group_size`` (default seed: the
        constructor's), so ``group_size`` g > 1 makes groups of g envs start from the same state."""
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
        chunk = check_action_chunk(chunk, self.spec)
        horizon = chunk.shape[1]
        actions = chunk.numpy()
        replies, errors = self._call_each({w: ("step", actions[sl[0]:sl[-1] + 1])
                                           for w, sl in enumerate(self.slices)})
        lost = torch.zeros(self.num_envs, dtype=torch.bool)
        if errors:
            self._replace_failed(errors, "a step")
            for w in errors:   # a fresh episode, reported like a chunk that ran no step
                sl = self.slices[w]
                lost[sl[0]:sl[-1] + 1] = True
                replies[w] = [ChunkReply(np.zeros(horizon, np.float32), np.zeros(horizon, bool), 0, False, False,
                                         False, self._instr[j], None) for j in sl]
            self.tracker.finish(lost, torch.zeros_like(lost))   # their unfinished episodes are dropped
        results: list[ChunkReply] = [r for w in range(self.num_workers) for r in replies[w]]
        rewards = torch.from_numpy(np.stack([r.rewards for r in results]))
        succ_h = torch.from_numpy(np.stack([r.successes for r in results]))
        steps = torch.tensor([r.steps for r in results])
        terminated = torch.tensor([r.terminated for r in results])
        truncated = torch.tensor([r.truncated for r in results])
        success = torch.tensor([r.success for r in results])
        for h in range(horizon):
            self.tracker.update(rewards[:, h], succ_h[:, h], h < steps)
        done = terminated | truncated
        final_obs, episodes = None, {}
        if bool(done.any()):
            final_instr = [r.final_instruction if r.final_instruction is not None else self._instr[i]
                           for i, r in enumerate(results)]
            final_obs = self._observe(final=True, instructions=final_instr)
            episodes = self.tracker.finish(done, success)
        self._instr = [r.instruction for r in results]
        return ChunkStep(obs=self._observe(final=False), rewards=rewards, terminated=terminated,
                         truncated=truncated, success=success, steps=steps, final_obs=final_obs,
                         episodes=episodes, lost=lost if errors else None)

    def render_frames(self, indices: list[int] | None = None) -> list[np.ndarray]:
        """One RGB frame ``[H, W, 3]`` per requested env (for videos), in the order asked."""
        indices = list(range(self.num_envs)) if indices is None else list(indices)
        for i in indices:
            if not 0 <= i < self.num_envs:
                raise IndexError(f"env index {i} out of range for {self.num_envs} envs")
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
