"""Batched envs from single-env simulators in worker processes, one or several envs per process
(ManiSkill's CPU backend builds one env per ``gym.make``; LIBERO's MuJoCo envs are single too).

Each worker runs an :class:`~envs.env_group.EnvGroup` (the single-env protocol is described there): a whole
action chunk for each of its envs locally (one round trip per chunk, not per action), writing their
observations into shared memory, which the main process reads as one batched tensor. The batching, seeding
and restarts are :class:`~envs.worker_pool.WorkerPool`'s, shared with the Ray env actors.

Glossary: N envs, H actions per chunk, A action dims, C cameras, S image size, D state dims.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import traceback
import warnings
from collections.abc import Callable, Iterable
from multiprocessing import shared_memory

import numpy as np
import torch

from vla_rl.envs.base import EnvSpec
from vla_rl.envs.env_group import EnvGroup, land_reset, land_step, obs_layout
from vla_rl.envs.worker_pool import WorkerError, WorkerPool, auto_envs_per_worker, split_evenly, worker_slices  # noqa: F401

PARENT_CHECK_S = 2.0   # how often an idle worker checks that its parent is still alive
# "all": every worker prints what its simulator says; otherwise only the first worker of each pool name in a
# process does (see quiet_worker_output).
OUTPUT_ENV = "VLA_RL_WORKER_OUTPUT"
_speaking: set[str] = set()   # pool names whose first worker already speaks in this process


def quiet_worker_output() -> None:
    """Silence what a worker's simulator says on import and at start-up, which every sibling worker would say
    again (robosuite's macro-file warnings, LIBERO's task-order lines, gymnasium / ManiSkill Python warnings):
    Python warnings are ignored, log records below ERROR dropped and stdout discarded. Errors still reach the
    parent (a failure's traceback travels over the pipe; stderr, where a crash reports, is kept)."""
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
    finally:
        os.close(devnull)


def _claim_voice(name: str) -> bool:
    """True for the first pool of this name in this process (its worker 0 shows its simulator's output)."""
    if name in _speaking:
        return False
    _speaking.add(name)
    return True


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
        self.shm, self.arrays = [], {}
        for i, (key, (shape, dtype)) in enumerate(obs_layout(n, spec).items()):
            size = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
            if create:
                shm = shared_memory.SharedMemory(create=True, size=size)
            else:
                # Spawned workers share the parent's resource tracker, so attaching only re-registers
                # the same name; the parent unlinks (and unregisters) it on close.
                shm = shared_memory.SharedMemory(name=names[i])
            self.shm.append(shm)
            self.arrays[key] = np.ndarray(shape, dtype=dtype, buffer=shm.buf)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.shm]

    def close(self, unlink: bool) -> None:
        self.arrays = {}
        for s in self.shm:
            s.close()
            if unlink:
                s.unlink()


def _worker(first: int, count: int, factory: Callable, conn, quiet: bool = False) -> None:
    """Worker loop: build envs ``first .. first + count - 1``, then serve reset / step / render / final_frames / close
    commands for all of them (one message per command, the envs run one after another). ``quiet``: see
    :func:`quiet_worker_output` (before the simulator is imported)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and closes us
    if quiet:
        quiet_worker_output()
    parent = os.getppid()
    torch.set_num_threads(1)
    bufs = None
    group = None
    try:
        group = EnvGroup(factory, count)
        conn.send(("spec", group.spec))
        msg = conn.recv()
        bufs = _Buffers(msg[1], group.spec, create=False, names=msg[2])
        while True:
            # A parent killed without closing us (SIGKILL, SIGTERM) must not leave the simulators running:
            # wait for commands in slices and leave once we have been re-parented.
            while not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    return
            cmd, arg = conn.recv()
            if cmd == "reset":       # arg: one seed (or None) per env
                conn.send(("ok", land_reset(bufs.arrays, first, group.reset(arg))))
            elif cmd == "step":      # arg: [count, H, A]
                conn.send(("ok", land_step(bufs.arrays, first, group.step(arg))))
            elif cmd == "render":    # arg: the env indices to render
                conn.send(("ok", group.render([i - first for i in arg])))
            elif cmd == "final_frames":   # arg: the env indices whose ended episodes are rendered
                group.set_final_frames([i - first for i in arg])
                conn.send(("ok", None))
            elif cmd == "forget_history":
                group.forget_history()
                conn.send(("ok", None))
            elif cmd == "close":
                group.close()
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


class WorkerVectorEnv(WorkerPool):
    """``num_envs`` single envs in worker processes behind the batched chunk-stepping interface.

    ``envs_per_worker`` > 1 puts several envs in one process, run one after another; None: one worker per
    CPU core (:func:`auto_envs_per_worker`). Why: a ManiSkill worker costs ~350-550 MB before its env and
    ~2 MB per env after (benchmarks/bench_env_grouping.py), so 64 envs take 1 GB in 2 workers and ~22 GB
    in 64; and on a machine with fewer cores than envs the extra processes only add context switches and
    pipe round trips. Results do not depend on the grouping: every env keeps its own simulator and seed.

    ``max_restarts``: see :class:`~envs.worker_pool.WorkerPool`.

    What simulators print at start-up (warnings, info lines) is the same in every worker, so only worker 0 of
    the first pool of each ``name`` in a process shows it; the others run :func:`quiet_worker_output`.
    ``VLA_RL_WORKER_OUTPUT=all`` shows every worker's."""

    def __init__(self, factory: Callable[[], object], num_envs: int, *, seed: int = 0,
                 envs_per_worker: int | None = 1, start_method: str = "spawn", timeout: float = 300.0,
                 name: str = "env", max_restarts: int = 0, log: Callable[[str], None] | None = None):
        if envs_per_worker is None:
            envs_per_worker = auto_envs_per_worker(num_envs)
        super().__init__(num_envs, worker_slices(num_envs, envs_per_worker), seed=seed, name=name,
                         max_restarts=max_restarts, log=log)
        self.factory, self.timeout = factory, timeout
        self._ctx = mp.get_context(start_method)
        self._voice = 0 if _claim_voice(name) else None   # the worker that shows its simulator's output
        self._procs: list = [None] * len(self.slices)
        self._conns: list = [None] * len(self.slices)
        self.bufs: _Buffers | None = None
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

    # ------------------------------------------------------------------------------------------------
    def _start(self, w: int) -> None:
        self._launch(w)
        self._handshake(w)

    def _stop(self, w: int) -> None:
        proc = self._procs[w]
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        if self._conns[w] is not None:
            self._conns[w].close()

    def _launch(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        sl = self.slices[w]
        quiet = w != self._voice and os.environ.get(OUTPUT_ENV) != "all"
        proc = self._ctx.Process(target=_worker, args=(sl[0], len(sl), self.factory, child, quiet), daemon=True,
                                 name=f"vla-rl-{self.name}-{w}")
        proc.start()
        child.close()
        self._procs[w], self._conns[w] = proc, parent

    def _handshake(self, w: int) -> None:
        """Take worker ``w``'s spec (the first one fixes the pool's) and hand it the shared buffers."""
        kind, spec = self._recv(w)
        if kind != "spec":
            raise WorkerError(self.slices[w][0], f"{self.name} worker {w} sent {kind!r} instead of its spec")
        if self._accept_spec(w, spec):
            self.bufs = _Buffers(self.num_envs, self.spec, create=True)
            self.arrays = self.bufs.arrays
        self._conns[w].send(("buffers", self.num_envs, self.bufs.names))

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

    def _send_each(self, msgs: dict[int, tuple]) -> dict[int, WorkerError]:
        errors = {}
        for w, msg in msgs.items():
            try:
                self._send(w, msg)
            except WorkerError as e:
                errors[w] = e
        return errors

    def _recv_each(self, workers: list[int]) -> tuple[dict[int, object], dict[int, WorkerError]]:
        out, errors = {}, {}
        for w in workers:
            try:
                out[w] = self._recv(w)[1]
            except WorkerError as e:
                errors[w] = e
        return out, errors

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
            self.arrays = None


def local_worker_processes(envs: Iterable) -> int:
    """The env worker processes on this machine behind ``envs`` (each env counted once; in-process envs and
    Ray env actors, which may run elsewhere and set their own threads, count 0)."""
    seen: dict[int, int] = {}
    for env in envs:
        if env is not None and isinstance(env, WorkerVectorEnv):
            seen[id(env)] = env.num_workers
    return sum(seen.values())
