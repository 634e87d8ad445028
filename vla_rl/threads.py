"""How many threads torch uses in the policy process (the ``threads`` field of the train, SFT, eval and bench
configs).

Env worker processes (ManiSkill on CPU, LIBERO) each step their simulator with one torch thread (they set it
themselves). ``threads: auto`` gives the policy process the cores left after one per local worker process, at
least one, unless ``OMP_NUM_THREADS`` is set (then that count: the variable keeps its usual meaning); a number is
used as given. Why: torch's default is one thread per core in *every* process, so a policy beside one worker
per core asks for twice the cores there are, and torch's threads spin-wait for each other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

Threads = int | Literal["auto"]


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; all cores where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def policy_threads(setting: Threads, *, worker_processes: int = 0, cores: int | None = None,
                   environ: dict | None = None) -> int:
    """The torch threads of the policy process: ``setting`` itself, or for ``"auto"`` a positive integer
    ``OMP_NUM_THREADS`` of ``environ`` (default ``os.environ``), else the ``cores`` (default
    :func:`available_cores`) left after one per worker process, at least 1."""
    if setting == "auto":
        omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
        if omp.isdigit() and int(omp) > 0:
            return int(omp)
        cores = available_cores() if cores is None else cores
        return max(1, cores - worker_processes)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {setting!r}")
    return setting


def local_worker_processes(envs: Iterable) -> int:
    """The env worker processes on this machine behind ``envs`` (each env counted once; in-process envs and
    Ray env actors, which may run elsewhere and set their own threads, count 0)."""
    from vla_rl.envs.workers import WorkerVectorEnv

    seen: dict[int, int] = {}
    for env in envs:
        if env is not None and isinstance(env, WorkerVectorEnv):
            seen[id(env)] = env.num_workers
    return sum(seen.values())


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """Run a block with ``torch.set_num_threads(count)``, restoring the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
