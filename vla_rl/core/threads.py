"""How many threads torch uses in the policy process (the ``threads`` field of the train, SFT, eval, bench and
demo configs).

Env worker processes (ManiSkill on CPU, LIBERO) each step their simulator with one torch thread (they set it
themselves). ``threads: auto`` gives the policy process the cores that are idle when it starts, less one per
local worker process, at least one (:func:`auto_threads`), unless ``OMP_NUM_THREADS`` is set (then that count:
the variable keeps its usual meaning); a number is used as given. Why idle cores and not every core: torch's
threads wait for each other at the end of every parallel operation by spinning, so when another process holds
one of the cores, every operation waits for the thread that lost its core; on a 2-core machine busy with other
jobs a built-in iteration took 239 s with 2 threads and 17 s with 1 (benchmarks/RESULTS.md, bench_threads.py).
Too few threads costs at most the parallel speed-up; too many costs several times more.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import Literal

import torch

from vla_rl.core.ranges import ranged

Threads = int | Literal["auto"]

# A core counts as idle when less than this fraction of it is busy elsewhere: background daemons (a few % of a
# core) do not cost a thread, a job holding a quarter of a core or more does.
IDLE_SLACK = 0.25
LOAD_SAMPLE_S = 0.25     # how long busy_cores() watches the machine
LOAD_REUSE_S = 60.0      # a measurement this recent is reused (several jobs of one process resolve "auto")

_last_load: tuple[float, float] | None = None   # (time.monotonic() of the measurement, busy cores)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; all cores where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def idle_cores(cores: int, busy: float) -> int:
    """Of ``cores``, how many other processes leave idle when they keep ``busy`` of them busy (``IDLE_SLACK``
    forgives background noise)."""
    return max(0, min(cores, math.floor(cores - max(0.0, busy) + IDLE_SLACK)))


def auto_threads(cores: int, busy: float, worker_processes: int = 0) -> int:
    """``threads: auto`` as a pure function: of ``cores`` (this process may use), ``busy`` (how many of them
    other processes keep busy) and ``worker_processes`` (this job's env workers, one core each), the idle cores
    less one per worker, at least 1."""
    return max(1, idle_cores(cores, busy) - worker_processes)


def cpu_ticks(stat: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """(busy, total) clock ticks since boot of ``cpus`` (all where None) in ``stat``, the text of /proc/stat.
    Idle is ``idle`` + ``iowait``; busy counts steal time (a core a hypervisor gives to another machine is not
    ours); guest time is already inside ``user``."""
    busy = total = 0
    for line in stat.splitlines():
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        ticks = [int(x) for x in fields[:8]]   # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _read_ticks(cpus: set[int] | None) -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            ticks = cpu_ticks(f.read(), cpus)
    except OSError:   # not Linux
        return None
    return ticks if ticks[1] else None


def busy_cores(sample_s: float = LOAD_SAMPLE_S) -> float:
    """How many of this process's cores other processes keep busy, watched for ``sample_s`` seconds (less the
    CPU time this process spends meanwhile). An instantaneous sample, not the load average: the load average
    still counts this user's previous command (an SFT on every core) for minutes after it ended. 0 where the
    machine cannot be read (no /proc)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        cpus = None
    before, own_before = _read_ticks(cpus), os.times()
    if before is None:
        return 0.0
    time.sleep(sample_s)
    after, own_after = _read_ticks(cpus), os.times()
    if after is None or after[1] <= before[1]:
        return 0.0
    d_busy, d_total = after[0] - before[0], after[1] - before[1]
    cores = len(cpus) if cpus is not None else (os.cpu_count() or 1)
    wall = d_total / cores / os.sysconf("SC_CLK_TCK")   # seconds the sample lasted, by the kernel's clock
    own = (own_after.user + own_after.system) - (own_before.user + own_before.system)
    return max(0.0, cores * d_busy / d_total - (own / wall if wall > 0 else 0.0))


def measured_busy_cores() -> float:
    """:func:`busy_cores`, reused for ``LOAD_REUSE_S`` seconds."""
    global _last_load
    now = time.monotonic()
    if _last_load is None or now - _last_load[0] > LOAD_REUSE_S:
        _last_load = (now, busy_cores())
    return _last_load[1]


def threads_setting():
    """The ``threads`` field of a job's config."""
    return ranged("auto", 1, doc="torch threads of this process: auto = the cores idle at the start less one per env "
                                 "worker process (at least 1), or a number (1 when several jobs start together on one "
                                 "machine); see vla_rl/core/threads.py")


def policy_threads(setting: Threads, *, worker_processes: int = 0, cores: int | None = None,
                   busy: float | None = None, environ: dict | None = None) -> int:
    """The torch threads of the policy process: ``setting`` itself, or for ``"auto"`` a positive integer
    ``OMP_NUM_THREADS`` of ``environ`` (default ``os.environ``), else :func:`auto_threads` of ``cores``
    (default :func:`available_cores`), ``busy`` (default :func:`measured_busy_cores`) and the worker
    processes."""
    if setting == "auto":
        omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
        if omp.isdigit() and int(omp) > 0:
            return int(omp)
        cores = available_cores() if cores is None else cores
        if cores - worker_processes <= 1:   # one thread whatever the load: no need to look
            return 1
        return auto_threads(cores, measured_busy_cores() if busy is None else busy, worker_processes)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {setting!r}")
    return setting


def threads_note(setting: Threads, count: int, *, worker_processes: int = 0) -> str:
    """Why the policy process has ``count`` threads, for a log: ``2 (threads=auto: 2 of 2 cores idle)``."""
    workers = f", {worker_processes} env worker process(es) with one thread each" if worker_processes else ""
    if setting != "auto":
        return f"{count} (threads={setting}{workers})"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return f"{count} (threads=auto: OMP_NUM_THREADS={omp}{workers})"
    cores = available_cores()
    if cores - worker_processes <= 1:
        return f"{count} (threads=auto: {cores} core(s){workers})"
    return f"{count} (threads=auto: {idle_cores(cores, measured_busy_cores())} of {cores} cores idle{workers})"


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """Run a block with ``torch.set_num_threads(count)``, restoring the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
