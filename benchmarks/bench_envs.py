"""Env-steps/s of each adapter through our batched chunk-stepping interface vs the raw simulator, with
the same number of worker processes and the same observation mode.

    python benchmarks/bench_envs.py [--cases builtin,maniskill,libero] [--seconds 20] [--workers 1,2,4]
                                    [--libero-workers 1,2] [--builtin-envs 64,1024] [--horizon 8]

Cases (random actions everywhere; an env-step is one action of one env):

- ``builtin``: ColorReach vectorised over N envs in this process (CPU). Raw: ``env.step`` with one action
  at a time (``[N, 1, 2]``, an observation rendered after every action, as a gym-style loop would); ours:
  chunks of ``--horizon`` actions.
- ``maniskill``: PickCube-v1, ``obs_mode="state"``, ``pd_ee_delta_pose``, sparse reward. Ours:
  ``WorkerVectorEnv(functools.partial(ManiSkillSingleEnv, cfg), n)`` stepping chunks of ``--horizon``
  (each worker runs the whole chunk locally, then all n report back to the main process).
- ``libero``: libero_spatial task 0 without cameras (the adapter's ``cameras=()``). Ours: a
  ``WorkerVectorEnv`` of ``LiberoSingleEnv``, whose physics substeps run one MuJoCo forward pass each
  (``fast_substeps``) where the raw sides run robosuite's three; ``--libero-plain-substeps`` gives ours
  robosuite's loop too, for the adapter's overhead alone. Every side resets the same way when an episode ends (soft
  reset, set an init state, 10 no-op settle steps, not counted) after success or 220 steps.

Two raw baselines with the same number n of processes, made with the adapter's arguments:

- free-running: n processes, each looping over its own raw env (``gym.make(..., sim_backend="physx_cpu")``
  / robosuite ``OffScreenRenderEnv``) and resetting on its own; nobody waits for anybody. An upper bound:
  a policy acting on the batched observation cannot collect experience this way.
- lockstep: the simulator's own process-per-env vector env stepped one action at a time, as a gym-style
  rollout of a batched policy would: gymnasium ``AsyncVectorEnv`` over ManiSkill's ``CPUGymWrapper``
  envs (ManiSkill's recipe for CPU vectorisation; same-step autoreset), and LIBERO's ``SubprocVectorEnv``
  (the vector env of its evaluation scripts). Every action waits for the slowest of the n envs.

Ours waits for the slowest worker once per chunk, between the two. All three sides run side by side and
are timed in alternating segments (A B C, C B A, ...; ``--rounds``) of wall-clock time, so that a change
in the machine's load hits them alike; each side gets ``--seconds`` in total. Overhead = (baseline -
ours) / baseline, negative means ours is faster. The 1-minute load average is printed before and after
each case (``/proc/loadavg``).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

RAW_BANK = 512          # pre-drawn random actions per raw worker (cycled)
OURS_BANK = 16          # pre-drawn random chunks for our env (cycled)
LIBERO_SETTLE = 10      # no-op settle steps after setting an init state (as the adapter)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


Segment = Callable[[float], tuple[int, float]]   # run for about `seconds` -> (env-steps, seconds)


def alternate(sides: dict[str, Segment], seconds: float, rounds: int) -> dict[str, float]:
    """Time the ``sides`` in alternating segments (A B C, C B A, ...); returns their env-steps/s."""
    seg = seconds / rounds
    totals = {name: [0, 0.0] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            steps, elapsed = sides[name](seg)
            totals[name][0] += steps
            totals[name][1] += elapsed
    return {name: steps / elapsed for name, (steps, elapsed) in totals.items()}


def ours_segment(env, bank: torch.Tensor) -> Segment:
    """Step ``env`` (our batched interface) with the chunks of ``bank`` ``[B, N, H, A]``, cycled."""
    def run(seconds: float) -> tuple[int, float]:
        steps, k = 0, 0
        t0 = time.perf_counter()
        while True:
            out = env.step(bank[k % len(bank)])
            k += 1
            steps += int(out.steps.sum())
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return steps, elapsed
    return run


def random_chunks(spec, n: int, horizon: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(OURS_BANK, n, horizon, spec.action_dim, generator=g)
    return spec.action_low + u * (spec.action_high - spec.action_low)


# ----------------------------------------------------------------------------------------------------
# Built-in ColorReach (vectorised, in process)

def bench_builtin(n: int, args) -> dict:
    from vla_rl.envs.builtin import ColorReachEnv

    raw_env, our_env = ColorReachEnv(n, seed=0), ColorReachEnv(n, seed=0)
    raw_env.reset()
    our_env.reset()
    bank = random_chunks(our_env.spec, n, args.horizon)

    def raw(seconds: float) -> tuple[int, float]:
        steps, k = 0, 0
        t0 = time.perf_counter()
        while True:
            chunk = bank[k % len(bank)]
            k += 1
            for h in range(args.horizon):
                raw_env.step(chunk[:, h:h + 1])   # every env executes its one action
                steps += n
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return steps, elapsed

    raw(0.5)      # warm-up
    ours_segment(our_env, bank)(0.5)
    rates = alternate({"raw": raw, "ours": ours_segment(our_env, bank)}, args.seconds, args.rounds)
    return {"adapter": f"built-in ColorReach, N={n}", "obs": "1 camera 32 px + state",
            "workers": f"1 process, N={n} (CPU, {torch.get_num_threads()} thread)", **rates,
            "raw_what": "`env.step` 1 action at a time", "ours_what": f"chunks of {args.horizon}"}


# ----------------------------------------------------------------------------------------------------
# Raw worker processes (one simulator each, stepping independently)

def _raw_loop(conn, step: Callable[[int], None]) -> None:
    """Serve ("run", seconds) -> (env-steps, seconds) until ("close", None)."""
    conn.send(("ready", None))
    k = 0
    while True:
        cmd, arg = conn.recv()
        if cmd == "close":
            return
        steps = 0
        t0 = time.perf_counter()
        while True:
            step(k)
            k += 1
            steps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= arg:
                break
        conn.send(("ok", (steps, elapsed)))


def _make_raw_maniskill(cfg):
    """A raw ManiSkill env on the CPU backend, made with the adapter's arguments."""
    torch.set_num_threads(1)   # as our workers
    from vla_rl.envs.maniskill import REWARDS, ensure_vulkan

    ensure_vulkan()            # selects the Vulkan driver (env var), imports ManiSkill
    import gymnasium as gym

    return gym.make(cfg.task, obs_mode=cfg.obs_mode, control_mode=cfg.control_mode,
                    reward_mode=REWARDS[cfg.reward], num_envs=1, render_mode="rgb_array",
                    sim_backend="physx_cpu", render_backend="sapien_cpu",
                    human_render_camera_configs=dict(width=cfg.render_size, height=cfg.render_size))


def _make_maniskill_gym_env(cfg):
    """ManiSkill's own recipe for CPU vectorisation: an unbatched numpy env for gymnasium's vector envs."""
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    return CPUGymWrapper(_make_raw_maniskill(cfg))


def _raw_maniskill_worker(conn, cfg, seed: int) -> None:
    try:
        env = _make_raw_maniskill(cfg)
        env.reset(seed=seed)
        actions = raw_actions(env.action_space.low, env.action_space.high, seed)

        def step(k: int) -> None:
            _, _, terminated, truncated, _ = env.step(actions[k % RAW_BANK])
            if bool(terminated.any()) or bool(truncated.any()):   # ManiSkill's TimeLimitWrapper truncates
                env.reset()

        _raw_loop(conn, step)
        env.close()
    except Exception as e:
        conn.send(("error", repr(e)))


def raw_actions(low, high, seed: int) -> np.ndarray:
    """The random action bank ``[RAW_BANK, A]`` of the raw env with this seed (lockstep envs reuse it)."""
    low, high = np.asarray(low, np.float32).reshape(-1), np.asarray(high, np.float32).reshape(-1)
    return np.random.default_rng(seed).uniform(low, high, (RAW_BANK, low.shape[0])).astype(np.float32)


def _make_raw_libero(suite_name: str, task_id: int, image_size: int):
    """A robosuite ``OffScreenRenderEnv`` made with the adapter's arguments, and the task's init states."""
    torch.set_num_threads(1)
    from vla_rl.envs.libero.robosuite_env import setup_libero_env_vars

    setup_libero_env_vars()   # LIBERO_CONFIG_PATH (else LIBERO prompts on stdin), MUJOCO_GL
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    suite = benchmark.get_benchmark_dict()[suite_name]()
    task = suite.get_task(task_id)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_names=[], use_camera_obs=False,
                             camera_heights=image_size, camera_widths=image_size, ignore_done=True,
                             hard_reset=False)
    return env, suite.get_task_init_states(task_id)


def _raw_libero_worker(conn, suite_name: str, task_id: int, image_size: int, max_steps: int, seed: int) -> None:
    try:
        from vla_rl.envs.libero.robosuite_env import NOOP

        env, init_states = _make_raw_libero(suite_name, task_id, image_size)
        rng = np.random.default_rng(seed)
        actions = raw_actions(-np.ones(7), np.ones(7), seed)
        state = {"t": 0}

        def reset() -> None:
            env.reset()
            env.set_init_state(init_states[int(rng.integers(len(init_states)))])
            for _ in range(LIBERO_SETTLE):
                env.step(NOOP)
            state["t"] = 0

        reset()

        def step(k: int) -> None:
            _, _, done, _ = env.step(actions[k % RAW_BANK])
            state["t"] += 1
            if done or state["t"] >= max_steps:
                reset()

        _raw_loop(conn, step)
        env.close()
    except Exception as e:
        conn.send(("error", repr(e)))


class RawPool:
    """``n`` spawned processes, each running ``target(conn, *args, seed)``: one raw simulator apiece."""

    def __init__(self, target: Callable, args: tuple, n: int, timeout: float = 600.0):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, *args, 1000 + i), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        for c in self.conns:
            self._recv(c, timeout)

    @staticmethod
    def _recv(conn, timeout: float):
        if not conn.poll(timeout):
            raise RuntimeError(f"raw worker did not answer within {timeout:.0f} s")
        kind, payload = conn.recv()
        if kind == "error":
            raise RuntimeError(f"raw worker failed: {payload}")
        return payload

    def segment(self, seconds: float) -> tuple[int, float]:
        """All workers step concurrently for ``seconds``; total env-steps over their mean time."""
        for c in self.conns:
            c.send(("run", seconds))
        results = [self._recv(c, seconds + 600) for c in self.conns]
        return sum(r[0] for r in results), float(np.mean([r[1] for r in results]))

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(("close", None))
            except (OSError, BrokenPipeError):
                pass
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            c.close()


class Lockstep:
    """A simulator's own process-per-env vector env, stepped one action at a time: every step waits for
    all n envs, as a policy that acts on the batched observation must. Subclasses set ``vec`` (after
    ``super().__init__``) and ``_step(k)``."""

    def __init__(self, n: int):
        self.n = n
        self.vec = None

    def _step(self, k: int) -> None:
        raise NotImplementedError

    def segment(self, seconds: float) -> tuple[int, float]:
        steps, k = 0, getattr(self, "_k", 0)
        t0 = time.perf_counter()
        while True:
            self._step(k)
            k += 1
            steps += self.n
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                self._k = k
                return steps, elapsed

    def close(self) -> None:
        if self.vec is not None:
            self.vec.close()
            self.vec = None


class ManiSkillLockstep(Lockstep):
    """gymnasium ``AsyncVectorEnv`` (spawned processes, shared-memory observations) over ManiSkill's
    ``CPUGymWrapper`` envs; an ended episode is reset inside the step that ended it (``SAME_STEP``), as
    the raw loop does, so every counted env-step is a simulator step."""

    def __init__(self, cfg, n: int):
        super().__init__(n)
        import gymnasium as gym

        self.vec = gym.vector.AsyncVectorEnv([functools.partial(_make_maniskill_gym_env, cfg)] * n,
                                             context="spawn", autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        self.vec.reset(seed=[1000 + i for i in range(n)])
        space = self.vec.single_action_space
        self.bank = np.stack([raw_actions(space.low, space.high, 1000 + i) for i in range(n)], axis=1)

    def _step(self, k: int) -> None:
        self.vec.step(self.bank[k % RAW_BANK])


def _make_raw_libero_env(suite_name: str, task_id: int, image_size: int):
    return _make_raw_libero(suite_name, task_id, image_size)[0]


class LiberoLockstep(Lockstep):
    """LIBERO's own ``SubprocVectorEnv`` (the vector env of its evaluation scripts), with the raw loop's
    episode handling: ended envs are reset by id, set to an init state and settled (not counted)."""

    def __init__(self, suite_name: str, task_id: int, image_size: int, max_steps: int, n: int):
        super().__init__(n)
        from vla_rl.envs.libero.robosuite_env import NOOP, setup_libero_env_vars

        setup_libero_env_vars()
        from libero.libero import benchmark
        from libero.libero.envs import SubprocVectorEnv

        self.noop, self.max_steps = NOOP, max_steps
        self.init_states = benchmark.get_benchmark_dict()[suite_name]().get_task_init_states(task_id)
        self.rng = np.random.default_rng(0)
        self.vec = SubprocVectorEnv([functools.partial(_make_raw_libero_env, suite_name, task_id, image_size)] * n)
        self.bank = np.stack([raw_actions(-np.ones(7), np.ones(7), 1000 + i) for i in range(n)], axis=1)
        self.t = np.zeros(n, int)
        self._reset(list(range(n)))

    def _reset(self, ids: list[int]) -> None:
        self.vec.reset(id=ids)
        states = [self.init_states[int(self.rng.integers(len(self.init_states)))] for _ in ids]
        self.vec.set_init_state(states, id=ids)
        for _ in range(LIBERO_SETTLE):
            self.vec.step(np.stack([self.noop] * len(ids)), id=ids)
        self.t[ids] = 0

    def _step(self, k: int) -> None:
        _, _, done, _ = self.vec.step(self.bank[k % RAW_BANK])
        self.t += 1
        ended = np.flatnonzero(np.asarray(done, bool) | (self.t >= self.max_steps)).tolist()
        if ended:
            self._reset(ended)


def bench_workers(make_ours: Callable, raw_target: Callable, raw_args: tuple, make_lockstep: Callable,
                  n: int, args) -> dict[str, float]:
    raw_pool = ours = lockstep = None
    try:
        t0 = time.perf_counter()
        raw_pool = RawPool(raw_target, raw_args, n)
        lockstep = make_lockstep(n)
        ours = make_ours(n)
        ours.reset()
        log(f"    {n} raw + {n} lockstep + {n} worker processes ready in {time.perf_counter() - t0:.0f} s")
        bank = random_chunks(ours.spec, n, args.horizon)
        sides = {"raw": raw_pool.segment, "lockstep": lockstep.segment, "ours": ours_segment(ours, bank)}
        for fn in sides.values():
            fn(1.0)                                # warm-up
        return alternate(sides, args.seconds, args.rounds)
    finally:
        for pool in (ours, lockstep, raw_pool):
            if pool is not None:
                pool.close()


def bench_maniskill(n: int, args) -> dict:
    from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    cfg = ManiSkillConfig(task="PickCube-v1", obs_mode="state", control_mode="pd_ee_delta_pose",
                          reward="sparse", sim_backend="cpu")
    rates = bench_workers(lambda k: WorkerVectorEnv(functools.partial(ManiSkillSingleEnv, cfg), k,
                                                    name="bench-maniskill"),
                          _raw_maniskill_worker, (cfg,), lambda k: ManiSkillLockstep(cfg, k), n, args)
    return {"adapter": "ManiSkill3 PickCube-v1", "obs": "state, pd_ee_delta_pose", "workers": str(n), **rates}


def bench_libero(n: int, args) -> dict:
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    plain = args.libero_plain_substeps
    cfg = LiberoConfig(suite="libero_spatial", task_ids=[0], cameras=(), fast_substeps=not plain)
    raw_args = (cfg.suite, 0, cfg.image_size, cfg.episode_steps)
    rates = bench_workers(lambda k: WorkerVectorEnv(functools.partial(LiberoSingleEnv, cfg), k,
                                                    name="bench-libero"),
                          _raw_libero_worker, raw_args, lambda k: LiberoLockstep(*raw_args, k), n, args)
    obs = "state only (no cameras)" + ", robosuite's substeps" * plain
    return {"adapter": "LIBERO libero_spatial task 0", "obs": obs, "workers": str(n),
            **rates}


# ----------------------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="builtin,maniskill,libero", help="comma-separated: builtin, maniskill, libero")
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per side (raw / ours) per case")
    p.add_argument("--rounds", type=int, default=4, help="alternating segments per side (raw/ours, ours/raw, ...)")
    p.add_argument("--workers", type=_ints, default=[1, 2, 4], help="ManiSkill worker counts")
    p.add_argument("--libero-workers", type=_ints, default=[1, 2], help="LIBERO worker counts")
    p.add_argument("--libero-plain-substeps", action="store_true",
                   help="ours steps LIBERO with robosuite's own substep loop (env.libero.fast_substeps=false), as "
                        "the raw sides do")
    p.add_argument("--builtin-envs", type=_ints, default=[64, 1024], help="ColorReach batch sizes")
    p.add_argument("--horizon", type=int, default=8, help="actions per chunk (ours)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (built-in case)")
    args = p.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"builtin", "maniskill", "libero"}
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from builtin, maniskill, libero")
    if args.rounds < 1 or args.seconds <= 0 or args.horizon < 1:
        p.error("--rounds, --seconds and --horizon must be positive")
    torch.set_num_threads(args.threads)
    # LIBERO's SubprocVectorEnv starts its processes with the default method; a fork of this process
    # after the ManiSkill cases started their threads deadlocks in the child (seen: stuck on a futex).
    mp.set_start_method("spawn", force=True)
    # Simulators print to stdout (LIBERO's task orders ...): send everything but the table to stderr,
    # worker processes included (they inherit file descriptor 1).
    sys.stdout.flush()
    table = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    jobs = []
    if "builtin" in cases:
        jobs += [(f"builtin N={n}", functools.partial(bench_builtin, n)) for n in args.builtin_envs]
    if "maniskill" in cases:
        jobs += [(f"maniskill workers={n}", functools.partial(bench_maniskill, n)) for n in args.workers]
    if "libero" in cases:
        jobs += [(f"libero workers={n}", functools.partial(bench_libero, n)) for n in args.libero_workers]

    start_load = loadavg()
    rows = []
    for name, job in jobs:
        before = loadavg().split()[0]
        log(f"[{name}] {args.seconds:g} s per side (load {before}) ...")
        row = job(args)
        row["load"] = f"{before} → {loadavg().split()[0]}"
        row["overhead"] = 100.0 * (row["raw"] - row["ours"]) / row["raw"]
        row["vs_lockstep"] = (100.0 * (row["lockstep"] - row["ours"]) / row["lockstep"]) if "lockstep" in row else None
        log(f"    raw {row['raw']:.0f}, lockstep {row.get('lockstep', float('nan')):.0f}, ours {row['ours']:.0f} "
            f"steps/s; overhead vs raw {row['overhead']:+.1f} %")
        rows.append(row)

    out = functools.partial(print, file=table)
    out(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"chunk H={args.horizon}, {args.seconds:g} s per side in {args.rounds} alternating segments each")
    out(f"load average (1, 5, 15 min): before {start_load}, after {loadavg()}\n")
    out("| adapter | obs mode | workers | raw free-running steps/s | raw lockstep steps/s | ours steps/s "
        "| overhead vs free-running % | overhead vs lockstep % | load 1-min (before → after) |")
    out("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lock = f"{r['lockstep']:,.0f}" if "lockstep" in r else "—"
        vs_lock = f"{r['vs_lockstep']:+.1f}" if r["vs_lockstep"] is not None else "—"
        out(f"| {r['adapter']} | {r['obs']} | {r['workers']} | {r['raw']:,.0f} | {lock} | {r['ours']:,.0f} | "
            f"{r['overhead']:+.1f} | {vs_lock} | {r['load']} |")
    table.flush()


if __name__ == "__main__":
    main()
