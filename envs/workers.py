"""Batched envs from single-env simulators in worker processes, one or several envs per process
(ManiSkill's CPU backend builds one env per ``gym.make``; LIBERO's MuJoCo envs are single too).

Each worker runs a whole action chunk for each of its envs locally (one round trip per chunk, not per
action) and writes their observations into shared memory, which the main process reads as one batched tensor.

The single-env protocol (what a ``factory()`` must return)::

    spec: EnvSpec                                   # num_envs = 1
    reset(seed: int | None) -> obs                  # {"images": uint8 [C, S, S, 3], "state": float32 [D],
                                                    #  "instruction": str}   (numpy)
    step(action: float32 [A]) -> (obs, reward: float, terminated: bool, truncated: bool, success: bool)
    render_frame() -> uint8 [H, W, 3]
    close() -> None

Glossary: N envs, H actions per chunk, A action dims, C cameras, S image size, D state dims.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing import shared_memory

import numpy as np
import torch

from .base import ChunkStep, EnvSpec, EpisodeTracker, check_action_chunk

PARENT_CHECK_S = 2.0   # how often an idle worker checks that its parent is still alive


class WorkerError(RuntimeError):
    """A worker process failed or died; ``index`` is the first env it ran (pass it to ``restart``, or let the
    pool restart it: ``max_restarts``)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "still running but not answering"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Buffers:
    """Shared-memory arrays for the current and the final observation of every env."""

    def __init__(self, n: int, spec: EnvSpec, create: bool, names: list[str] | None = None):
        shapes = {
            "images": (n, spec.num_cameras, spec.image_size, spec.image_size, 3),
            "state": (n, spec.state_dim),
            "final_images": (n, spec.num_cameras, spec.image_size, spec.image_size, 3),
            "final_state": (n, spec.state_dim),
        }
        dtypes = {"images": np.uint8, "state": np.float32,
                  "final_images": np.uint8, "final_state": np.float32}
        self.shm, self.arrays = [], {}
        for i, (key, shape) in enumerate(shapes.items()):
            size = max(1, int(np.prod(shape)) * np.dtype(dtypes[key]).itemsize)
            if create:
                shm = shared_memory.SharedMemory(create=True, size=size)
            else:
                # Spawned workers share the parent's resource tracker, so attaching only re-registers
                # the same name; the parent unlinks (and unregisters) it on close.
                shm = shared_memory.SharedMemory(name=names[i])
            self.shm.append(shm)
            self.arrays[key] = np.ndarray(shape, dtype=dtypes[key], buffer=shm.buf)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.shm]

    def close(self, unlink: bool) -> None:
        self.arrays = {}
        for s in self.shm:
            s.close()
            if unlink:
                s.unlink()


def _write_obs(bufs: _Buffers, index: int, obs: dict, final: bool) -> str:
    prefix = "final_" if final else ""
    bufs.arrays[prefix + "images"][index] = obs["images"]
    bufs.arrays[prefix + "state"][index] = obs["state"]
    return obs["instruction"]


def _step_env(env, bufs: _Buffers, index: int, actions: np.ndarray) -> tuple:
    """Run one env through a chunk ``[H, A]`` (stopping where its episode ends; the next episode starts
    at once) and write its observations; returns what the main process needs of the chunk."""
    horizon = actions.shape[0]
    rewards = np.zeros(horizon, np.float32)
    successes = np.zeros(horizon, bool)
    term = trunc = succ = False
    steps = 0
    for h in range(horizon):
        obs, r, term, trunc, succ = env.step(actions[h])
        rewards[h], successes[h] = r, succ
        steps += 1
        if term or trunc:
            break
    final_instr = None
    if term or trunc:
        final_instr = _write_obs(bufs, index, obs, final=True)
        obs = env.reset(None)
    instr = _write_obs(bufs, index, obs, final=False)
    return rewards, successes, steps, bool(term), bool(trunc), bool(succ), instr, final_instr


def _worker(first: int, count: int, factory: Callable, conn) -> None:
    """Worker loop: build envs ``first .. first + count - 1``, then serve reset / step_chunk / render /
    close commands for all of them (one message per command, the envs run one after another)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and closes us
    parent = os.getppid()
    torch.set_num_threads(1)
    bufs = None
    envs = []
    try:
        for _ in range(count):
            envs.append(factory())
        if any(e.spec != envs[0].spec for e in envs):
            raise RuntimeError(f"the factory built envs with different specs: {[e.spec for e in envs]}")
        conn.send(("spec", envs[0].spec))
        msg = conn.recv()
        bufs = _Buffers(msg[1], envs[0].spec, create=False, names=msg[2])
        while True:
            # A parent killed without closing us (SIGKILL, SIGTERM) must not leave the simulators running:
            # wait for commands in slices and leave once we have been re-parented.
            while not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    return
            cmd, arg = conn.recv()
            if cmd == "reset":       # arg: one seed (or None) per env
                conn.send(("ok", [_write_obs(bufs, first + j, env.reset(s), final=False)
                                  for j, (env, s) in enumerate(zip(envs, arg))]))
            elif cmd == "step":      # arg: [count, H, A]
                conn.send(("ok", [_step_env(env, bufs, first + j, arg[j]) for j, env in enumerate(envs)]))
            elif cmd == "render":    # arg: the env indices to render
                conn.send(("ok", [envs[i - first].render_frame() for i in arg]))
            elif cmd == "close":
                for env in envs:
                    env.close()
                conn.send(("ok", None))
                break
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except Exception:  # report, then exit: the main process decides what to do
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if bufs is not None:
            bufs.close(unlink=False)


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
    workers = -(-num_envs // envs_per_worker)
    base, extra = divmod(num_envs, workers)
    out, start = [], 0
    for w in range(workers):
        size = base + (w < extra)
        out.append(range(start, start + size))
        start += size
    return out


class WorkerVectorEnv:
    """``num_envs`` single envs in worker processes behind the batched chunk-stepping interface.

    ``envs_per_worker`` > 1 puts several envs in one process, run one after another; None: one worker per
    CPU core (:func:`auto_envs_per_worker`). Why: a ManiSkill worker costs ~350-550 MB before its env and
    ~2 MB per env after (benchmarks/bench_env_grouping.py), so 64 envs take 1 GB in 2 workers and ~22 GB
    in 64; and on a machine with fewer cores than envs the extra processes only add context switches and
    pipe round trips. Results do not depend on the grouping: every env keeps its own simulator and seed.

    ``max_restarts`` > 0: a worker that dies (or fails) during ``reset`` or ``step`` is replaced, up to that
    many times over the pool's life, instead of raising :class:`WorkerError`. Its envs are reset with the
    seeds of the last ``reset`` (an evaluation replays the same initial states) and their unfinished episodes
    are dropped: in that step they report ``lost`` (no reward, no episode), and their observation is the first
    of the new episode. Each restart is reported through ``log``."""

    def __init__(self, factory: Callable[[], object], num_envs: int, *, seed: int = 0,
                 envs_per_worker: int | None = 1, start_method: str = "spawn", timeout: float = 300.0,
                 name: str = "env", max_restarts: int = 0, log: Callable[[str], None] | None = None):
        if envs_per_worker is None:
            envs_per_worker = auto_envs_per_worker(num_envs)
        self.slices = worker_slices(num_envs, envs_per_worker)
        self._num_envs = num_envs
        self.factory, self.timeout, self.name, self.seed = factory, timeout, name, seed
        self.device = torch.device("cpu")
        self._ctx = mp.get_context(start_method)
        self._worker_of = [w for w, sl in enumerate(self.slices) for _ in sl]
        self._procs: list = [None] * len(self.slices)
        self._conns: list = [None] * len(self.slices)
        self._instr: list[str] = [""] * num_envs
        self._seeds: list[int | None] = [None] * num_envs   # each env's seed at the last reset()
        self.max_restarts, self.restarts = max_restarts, 0
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.bufs: _Buffers | None = None
        self.spec: EnvSpec | None = None
        try:
            # Launch every worker before waiting for any: building a simulator env costs seconds of imports
            # and set-up per process, which then overlap instead of adding up.
            for w in range(len(self.slices)):
                self._launch(w)
            for w in range(len(self.slices)):
                self._handshake(w)
        except BaseException:
            self.close()
            raise
        self.tracker = EpisodeTracker(num_envs, self.device)

    @property
    def num_envs(self) -> int:
        return self._num_envs

    @property
    def num_workers(self) -> int:
        return len(self.slices)

    # ------------------------------------------------------------------------------------------------
    def _envs_text(self, w: int) -> str:
        sl = self.slices[w]
        return f"env {sl[0]}" if len(sl) == 1 else f"envs {sl[0]}-{sl[-1]}"

    def _start(self, w: int) -> None:
        self._launch(w)
        self._handshake(w)

    def _launch(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        sl = self.slices[w]
        proc = self._ctx.Process(target=_worker, args=(sl[0], len(sl), self.factory, child), daemon=True,
                                 name=f"vla-rl-{self.name}-{w}")
        proc.start()
        child.close()
        self._procs[w], self._conns[w] = proc, parent

    def _handshake(self, w: int) -> None:
        """Take worker ``w``'s spec (the first one fixes the pool's) and hand it the shared buffers."""
        parent = self._conns[w]
        kind, spec = self._recv(w)
        if kind != "spec":
            raise WorkerError(self.slices[w][0], f"{self.name} worker {w} sent {kind!r} instead of its spec")
        spec = replace(spec, num_envs=self.num_envs)
        if self.spec is None:
            self.spec = spec
            self.bufs = _Buffers(self.num_envs, spec, create=True)
        elif spec != self.spec:
            raise WorkerError(self.slices[w][0], f"{self.name} worker {w} has spec {spec}, the others {self.spec}")
        parent.send(("buffers", self.num_envs, self.bufs.names))

    def _recv(self, w: int):
        conn, proc, first = self._conns[w], self._procs[w], self.slices[w][0]
        try:
            if not conn.poll(self.timeout):
                raise WorkerError(first, f"{self.name} worker {w} timed out after {self.timeout:.0f} s "
                                         f"({_exit_cause(proc.exitcode)})")
            kind, payload = conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            proc.join(timeout=5)
            raise WorkerError(first, f"{self.name} worker {w} ({self._envs_text(w)}) died: "
                                     f"{_exit_cause(proc.exitcode)}") from None
        if kind == "error":
            raise WorkerError(first, f"{self.name} worker {w} ({self._envs_text(w)}) failed:\n{payload}")
        return kind, payload

    def _send(self, w: int, msg) -> None:
        try:
            self._conns[w].send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._procs[w].join(timeout=5)
            first = self.slices[w][0]
            raise WorkerError(first, f"{self.name} worker {w} ({self._envs_text(w)}) died: "
                                     f"{_exit_cause(self._procs[w].exitcode)}") from None

    def _call(self, msgs: dict[int, tuple]) -> dict[int, object]:
        """Send each worker its message, then take every reply. A failure is raised only after all the
        live workers have answered, so no reply is left in a pipe to be misread by the next command (the
        live workers' envs have still run the command)."""
        out, errors = self._call_each(msgs)
        if errors:
            raise next(iter(errors.values()))
        return out

    def _call_each(self, msgs: dict[int, tuple]) -> tuple[dict[int, object], dict[int, WorkerError]]:
        """:meth:`_call` that returns the replies of the workers that answered and the errors of the others."""
        sent, errors = [], {}
        for w, msg in msgs.items():
            try:
                self._send(w, msg)
                sent.append(w)
            except WorkerError as e:
                errors[w] = e
        out = {}
        for w in sent:
            try:
                out[w] = self._recv(w)[1]
            except WorkerError as e:
                errors[w] = e
        return out, errors

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
            self._respawn(w)

    def _respawn(self, w: int) -> None:
        proc = self._procs[w]
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        if self._conns[w] is not None:
            self._conns[w].close()
        self._start(w)
        sl = self.slices[w]
        for j, instr in zip(sl, self._call({w: ("reset", [self._seeds[j] for j in sl])})[w]):
            self._instr[j] = instr

    def restart(self, i: int, seed: int | None = None) -> dict:
        """Replace the worker that runs env ``i`` (after it died) and reset its envs; envs on other workers
        are untouched. The worker's unfinished episodes are lost; with ``seed``, its env ``j`` gets
        ``seed + j - i``. Returns the batched observation."""
        if not 0 <= i < self.num_envs:
            raise IndexError(f"env index {i} out of range for {self.num_envs} envs")
        w = self._worker_of[i]
        proc = self._procs[w]
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        self._start(w)
        sl = self.slices[w]
        lost = torch.zeros(self.num_envs, dtype=torch.bool)
        lost[sl[0]:sl[-1] + 1] = True
        self.tracker.finish(lost, torch.zeros(self.num_envs, dtype=torch.bool))
        for j, instr in zip(sl, self._call({w: ("reset", [None if seed is None else seed + j - i
                                                          for j in sl])})[w]):
            self._instr[j] = instr
        return self._observe(final=False)

    # ------------------------------------------------------------------------------------------------
    def _observe(self, final: bool, instructions: list[str] | None = None) -> dict:
        p = "final_" if final else ""
        return {"images": torch.from_numpy(self.bufs.arrays[p + "images"].copy()),
                "state": torch.from_numpy(self.bufs.arrays[p + "state"].copy()),
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
                replies[w] = [(np.zeros(horizon, np.float32), np.zeros(horizon, bool), 0, False, False, False,
                               self._instr[j], None) for j in sl]
            self.tracker.finish(lost, torch.zeros_like(lost))   # their unfinished episodes are dropped
        results = [r for w in range(self.num_workers) for r in replies[w]]
        rewards = torch.from_numpy(np.stack([r[0] for r in results]))
        succ_h = torch.from_numpy(np.stack([r[1] for r in results]))
        steps = torch.tensor([r[2] for r in results])
        terminated = torch.tensor([r[3] for r in results])
        truncated = torch.tensor([r[4] for r in results])
        success = torch.tensor([r[5] for r in results])
        for h in range(horizon):
            self.tracker.update(rewards[:, h], succ_h[:, h], h < steps)
        done = terminated | truncated
        final_obs, episodes = None, {}
        if bool(done.any()):
            final_instr = [r[7] if r[7] is not None else self._instr[i] for i, r in enumerate(results)]
            final_obs = self._observe(final=True, instructions=final_instr)
            episodes = self.tracker.finish(done, success)
        self._instr = [r[6] for r in results]
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

    def close(self) -> None:
        for i, (proc, conn) in enumerate(zip(self._procs, self._conns)):
            if proc is None:
                continue
            try:
                if proc.is_alive():
                    conn.send(("close", None))
                    if conn.poll(10):
                        conn.recv()
            except (OSError, EOFError, BrokenPipeError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
            self._procs[i] = None
        if self.bufs is not None:
            self.bufs.close(unlink=True)
            self.bufs = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
