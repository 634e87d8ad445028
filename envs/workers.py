"""Batched envs from single-env simulators, one worker process per env (ManiSkill's CPU backend allows
one env per process; LIBERO's MuJoCo envs are single too).

Each worker runs a whole action chunk locally (one round trip per chunk, not per action) and writes its
observations into shared memory, which the main process reads as one batched tensor.

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
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing import shared_memory

import numpy as np
import torch

from .base import ChunkStep, EnvSpec, EpisodeTracker, check_action_chunk

PARENT_CHECK_S = 2.0   # how often an idle worker checks that its parent is still alive


class WorkerError(RuntimeError):
    """A worker process failed or died; ``index`` is the env it ran."""

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


def _worker(index: int, factory: Callable, conn) -> None:
    """Worker loop: build the env, then serve reset / step_chunk / render / close commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and closes us
    parent = os.getppid()
    torch.set_num_threads(1)
    bufs = None
    try:
        env = factory()
        conn.send(("spec", env.spec))
        msg = conn.recv()
        bufs = _Buffers(msg[1], env.spec, create=False, names=msg[2])
        while True:
            # A parent killed without closing us (SIGKILL, SIGTERM) must not leave the simulators running:
            # wait for commands in slices and leave once we have been re-parented.
            while not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    return
            cmd, arg = conn.recv()
            if cmd == "reset":
                obs = env.reset(arg)
                conn.send(("ok", _write_obs(bufs, index, obs, final=False)))
            elif cmd == "step":
                horizon = arg.shape[0]
                rewards = np.zeros(horizon, np.float32)
                successes = np.zeros(horizon, bool)
                term = trunc = succ = False
                steps = 0
                for h in range(horizon):
                    obs, r, term, trunc, succ = env.step(arg[h])
                    rewards[h], successes[h] = r, succ
                    steps += 1
                    if term or trunc:
                        break
                final_instr = None
                if term or trunc:
                    final_instr = _write_obs(bufs, index, obs, final=True)
                    obs = env.reset(None)
                instr = _write_obs(bufs, index, obs, final=False)
                conn.send(("ok", (rewards, successes, steps, bool(term), bool(trunc), bool(succ), instr,
                                  final_instr)))
            elif cmd == "render":
                conn.send(("ok", env.render_frame()))
            elif cmd == "close":
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


class WorkerVectorEnv:
    """``num_envs`` single envs in worker processes behind the batched chunk-stepping interface."""

    def __init__(self, factory: Callable[[], object], num_envs: int, *, seed: int = 0,
                 start_method: str = "spawn", timeout: float = 300.0, name: str = "env"):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.factory, self.timeout, self.name, self.seed = factory, timeout, name, seed
        self.device = torch.device("cpu")
        self._ctx = mp.get_context(start_method)
        self._procs: list = [None] * num_envs
        self._conns: list = [None] * num_envs
        self._instr: list[str] = [""] * num_envs
        self.bufs: _Buffers | None = None
        self.spec: EnvSpec | None = None
        try:
            # Launch every worker before waiting for any: building a simulator env costs seconds of imports
            # and set-up per process, which then overlap instead of adding up.
            for i in range(num_envs):
                self._launch(i)
            for i in range(num_envs):
                self._handshake(i)
        except BaseException:
            self.close()
            raise
        self.tracker = EpisodeTracker(num_envs, self.device)

    @property
    def num_envs(self) -> int:
        return len(self._procs)

    # ------------------------------------------------------------------------------------------------
    def _start(self, i: int) -> None:
        self._launch(i)
        self._handshake(i)

    def _launch(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(i, self.factory, child), daemon=True,
                                 name=f"vla-rl-{self.name}-{i}")
        proc.start()
        child.close()
        self._procs[i], self._conns[i] = proc, parent

    def _handshake(self, i: int) -> None:
        """Take worker ``i``'s spec (the first one fixes the pool's) and hand it the shared buffers."""
        parent = self._conns[i]
        kind, spec = self._recv(i)
        if kind != "spec":
            raise WorkerError(i, f"{self.name} worker {i} sent {kind!r} instead of its spec")
        spec = replace(spec, num_envs=self.num_envs)
        if self.spec is None:
            self.spec = spec
            self.bufs = _Buffers(self.num_envs, spec, create=True)
        elif spec != self.spec:
            raise WorkerError(i, f"{self.name} worker {i} has spec {spec}, the others {self.spec}")
        parent.send(("buffers", self.num_envs, self.bufs.names))

    def _recv(self, i: int):
        conn, proc = self._conns[i], self._procs[i]
        try:
            if not conn.poll(self.timeout):
                raise WorkerError(i, f"{self.name} worker {i} timed out after {self.timeout:.0f} s "
                                     f"({_exit_cause(proc.exitcode)})")
            kind, payload = conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            proc.join(timeout=5)
            raise WorkerError(i, f"{self.name} worker {i} (env {i}) died: {_exit_cause(proc.exitcode)}; "
                                 f"call restart({i}) to replace it") from None
        if kind == "error":
            raise WorkerError(i, f"{self.name} worker {i} (env {i}) failed:\n{payload}")
        return kind, payload

    def _send(self, i: int, msg) -> None:
        try:
            self._conns[i].send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._procs[i].join(timeout=5)
            raise WorkerError(i, f"{self.name} worker {i} (env {i}) died: "
                                 f"{_exit_cause(self._procs[i].exitcode)}; call restart({i})") from None

    def restart(self, i: int, seed: int | None = None) -> dict:
        """Replace worker ``i`` (after it died) and reset its env; the other envs are untouched.
        The env's unfinished episode is lost; returns the batched observation."""
        proc = self._procs[i]
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        self._start(i)
        self.tracker.finish(torch.arange(self.num_envs) == i, torch.zeros(self.num_envs, dtype=torch.bool))
        self._send(i, ("reset", seed))
        self._instr[i] = self._recv(i)[1]
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
        for i in range(self.num_envs):
            self._send(i, ("reset", base + i // group_size))
        for i in range(self.num_envs):
            self._instr[i] = self._recv(i)[1]
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self._observe(final=False)

    def step(self, chunk: torch.Tensor) -> ChunkStep:
        chunk = check_action_chunk(chunk, self.spec)
        n, horizon = chunk.shape[:2]
        actions = chunk.numpy()
        for i in range(n):
            self._send(i, ("step", actions[i]))
        results = [self._recv(i)[1] for i in range(n)]
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
                         episodes=episodes)

    def render_frames(self, indices: list[int] | None = None) -> list[np.ndarray]:
        """One RGB frame ``[H, W, 3]`` per requested env (for videos)."""
        indices = list(range(self.num_envs)) if indices is None else indices
        for i in indices:
            self._send(i, ("render", None))
        return [self._recv(i)[1] for i in indices]

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
