"""The worker-process pool, tested with the built-in task's single-env wrapper (no simulator needed)."""

import functools
import os
import signal

import numpy as np
import pytest
import torch
from contract import check_env_contract, check_partial_reset

from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv
from vla_rl.envs.workers import WorkerError, WorkerVectorEnv

SHORT = ColorReachConfig(max_episode_steps=6)


class _EndsOnRequest(ColorReachSingleEnv):
    """Ends its episode (a success) on an action at the upper bound, so a test can end one env's episode early
    (the contract's random actions stay inside the bounds)."""

    def step(self, action):
        obs, reward, terminated, truncated, success = super().step(action)
        if np.all(action >= self.spec.action_high):
            return obs, reward, True, False, True
        return obs, reward, terminated, truncated, success


def test_a_partial_reset_inside_a_worker_leaves_the_envs_beside_it_untouched():
    """Envs 0 and 1 share a worker process; env 0 ends early and is reset there while env 1 runs on."""
    pool = WorkerVectorEnv(functools.partial(_EndsOnRequest, SHORT), 4, envs_per_worker=2, name="ends")
    try:
        assert check_partial_reset(pool, horizon=2,
                                   end_first=lambda e: torch.full((e.spec.action_dim,), e.spec.action_high))
    finally:
        pool.close()


@pytest.fixture
def pool():
    env = WorkerVectorEnv(functools.partial(ColorReachSingleEnv, SHORT), 2, name="colorreach")
    yield env
    env.close()


def test_worker_pool_passes_the_contract(pool):
    check_env_contract(pool)


def test_worker_pool_equals_the_env_run_in_process(pool):
    obs = pool.reset(seed=5)
    local = [ColorReachSingleEnv(SHORT) for _ in range(2)]
    local_obs = [e.reset(5 + i) for i, e in enumerate(local)]
    for i in range(2):
        assert torch.equal(obs["images"][i], torch.from_numpy(local_obs[i]["images"]))
    chunk = torch.full((2, 3, 2), 0.5)
    out = pool.step(chunk)
    for i, e in enumerate(local):
        for h in range(3):
            _, r, *_ = e.step(chunk[i, h].numpy())
            assert out.rewards[i, h].item() == pytest.approx(r)
        assert torch.allclose(out.obs["state"][i], torch.from_numpy(e.env.state()[0].numpy()))


def test_dead_worker_is_reported_and_restarted_without_losing_the_others(pool):
    pool.reset(seed=0)
    pool.step(torch.zeros(2, 2, 2))
    os.kill(pool._procs[0].pid, signal.SIGKILL)
    pool._procs[0].join(timeout=10)
    with pytest.raises(WorkerError, match=r"worker 0 \(env 0\) died: killed by signal SIGKILL") as err:
        pool.step(torch.zeros(2, 1, 2))
    assert err.value.index == 0
    obs = pool.restart(0, seed=11)
    assert torch.equal(obs["state"][0], torch.from_numpy(ColorReachSingleEnv(SHORT).reset(11)["state"]))
    out = pool.step(torch.zeros(2, 1, 2))
    # env 1 kept its episode: it ran every chunk, the failed step's included (its worker was alive)
    env1 = ColorReachSingleEnv(SHORT)
    env1.reset(1)
    for _ in range(4):
        env1.step(np.zeros(2, np.float32))
    assert torch.allclose(out.obs["state"][1], torch.from_numpy(env1.env.state()[0].numpy()))


def _broken_factory():
    raise RuntimeError("simulator exploded at start")


def test_worker_that_fails_at_start_reports_its_traceback():
    with pytest.raises(WorkerError, match="simulator exploded at start"):
        WorkerVectorEnv(_broken_factory, 1)


def _chatty_factory():
    """A simulator that talks at start-up as robosuite / LIBERO / gymnasium do: stdout, a Python warning, log
    records at WARNING and ERROR."""
    import logging
    import warnings

    print("chatty: hello from a simulator", flush=True)
    warnings.warn("chatty: a deprecation", UserWarning, stacklevel=1)
    logging.getLogger("chatty").warning("chatty: no private macro file")
    logging.getLogger("chatty").error("chatty: an error")
    return ColorReachSingleEnv(SHORT)


def test_start_up_chatter_is_shown_by_one_worker_errors_by_all(capfd, monkeypatch):
    """Worker 0 of the first pool of a name shows its simulator's start-up output; its siblings and later pools
    of that name drop warnings, info and stdout, but not errors; VLA_RL_WORKER_OUTPUT=all shows every worker's."""
    def counts():
        out, err = capfd.readouterr()
        text = out + err
        return [text.count(m) for m in ("chatty: hello", "UserWarning: chatty: a deprecation",
                                        "chatty: no private macro", "chatty: an error")]

    with WorkerVectorEnv(_chatty_factory, 2, name="chatty-test"):
        pass
    assert counts() == [1, 1, 1, 2]
    with WorkerVectorEnv(_chatty_factory, 1, name="chatty-test"):   # e.g. a training's separate evaluation env
        pass
    assert counts() == [0, 0, 0, 1]
    monkeypatch.setenv("VLA_RL_WORKER_OUTPUT", "all")
    with WorkerVectorEnv(_chatty_factory, 2, name="chatty-test"):
        pass
    assert counts() == [2, 2, 2, 2]


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """A run killed with SIGKILL (no chance to close its pool) must not leave simulator processes behind,
    even when another process still holds the pipes' parent ends (here a forked child of the run, as a
    forked helper or a pre-fork data loader would), so the workers never see EOF: idle workers notice
    they were re-parented and exit within PARENT_CHECK_S."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "parent.py"
    script.write_text(
        "import functools, os, sys, time\n"
        "from vla_rl.envs.builtin import ColorReachSingleEnv\n"
        "from vla_rl.envs.workers import WorkerVectorEnv\n"
        "if __name__ == '__main__':\n"
        "    pool = WorkerVectorEnv(functools.partial(ColorReachSingleEnv), 2, name='orphan')\n"
        "    pool.reset(seed=0)\n"
        "    holder = os.fork()\n"
        "    if holder == 0:\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "    print(holder, ' '.join(str(p.pid) for p in pool._procs), flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        holder, *pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        alive = pids
        while alive and time.time() < deadline:
            time.sleep(0.5)
            alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                     "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
        assert not alive, f"workers {alive} outlived their killed parent"
    finally:
        proc.kill()
        if "holder" in locals():
            os.kill(holder, signal.SIGKILL)


@pytest.mark.parametrize("num_envs, per_worker, sizes", [(10, 4, [4, 3, 3]), (5, 2, [2, 2, 1]), (3, 8, [3]),
                                                           (4, 1, [1, 1, 1, 1])])
def test_worker_slices_are_contiguous_and_balanced(num_envs, per_worker, sizes):
    from vla_rl.envs.workers import worker_slices

    slices = worker_slices(num_envs, per_worker)
    assert [len(s) for s in slices] == sizes
    assert [i for s in slices for i in s] == list(range(num_envs))


def test_worker_slices_reject_bad_counts():
    from vla_rl.envs.workers import worker_slices

    with pytest.raises(ValueError, match="envs_per_worker must be >= 1"):
        worker_slices(4, 0)
    with pytest.raises(ValueError, match="num_envs must be >= 1"):
        worker_slices(0, 2)


@pytest.fixture
def grouped():
    env = WorkerVectorEnv(functools.partial(ColorReachSingleEnv, SHORT), 5, envs_per_worker=2, name="grouped")
    yield env
    env.close()


def test_grouped_pool_passes_the_contract(grouped):
    assert grouped.num_workers == 3 and len({p.pid for p in grouped._procs}) == 3
    check_env_contract(grouped)


def test_grouped_pool_equals_one_env_per_worker(grouped):
    """Putting several envs in one process changes no observation, reward or episode boundary: each env
    keeps its own simulator and seed (a chunk longer than the 6-step episode crosses a reset)."""
    single = WorkerVectorEnv(functools.partial(ColorReachSingleEnv, SHORT), 5, name="single")
    try:
        a, b = grouped.reset(seed=3), single.reset(seed=3)
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["state"], b["state"])
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            chunk = torch.rand(5, 4, 2, generator=gen) * 2 - 1
            x, y = grouped.step(chunk), single.step(chunk)
            assert torch.equal(x.rewards, y.rewards) and torch.equal(x.steps, y.steps)
            assert torch.equal(x.obs["state"], y.obs["state"])
            assert torch.equal(x.terminated | x.truncated, y.terminated | y.truncated)
            if x.final_obs is not None:
                assert torch.equal(x.final_obs["state"], y.final_obs["state"])
                assert torch.equal(x.episodes["return"], y.episodes["return"])
        assert (torch.stack([torch.from_numpy(f) for f in grouped.render_frames([4, 0, 3])])
                == torch.stack([torch.from_numpy(f) for f in single.render_frames([4, 0, 3])])).all()
    finally:
        single.close()


def test_dead_grouped_worker_names_its_envs_and_restarts_them_alone(grouped):
    """The other workers' envs keep their episodes: they match a pool that ran the same chunks (the
    failed step included: live workers still ran it) without a death."""
    reference = WorkerVectorEnv(functools.partial(ColorReachSingleEnv, SHORT), 5, name="reference")
    chunks = [torch.full((5, 2, 2), 0.3), torch.full((5, 1, 2), -0.2), torch.full((5, 1, 2), 0.1)]
    try:
        reference.reset(seed=0)
        expected = [reference.step(c).obs["state"] for c in chunks][-1]
    finally:
        reference.close()
    grouped.reset(seed=0)
    grouped.step(chunks[0])
    os.kill(grouped._procs[1].pid, signal.SIGKILL)
    grouped._procs[1].join(timeout=10)
    with pytest.raises(WorkerError, match=r"worker 1 \(envs 2-3\) died: killed by signal SIGKILL") as err:
        grouped.step(chunks[1])
    assert err.value.index == 2
    obs = grouped.restart(3, seed=7)
    fresh = [ColorReachSingleEnv(SHORT) for _ in range(2)]
    assert torch.equal(obs["state"][2], torch.from_numpy(fresh[0].reset(6)["state"]))  # seed + j - i
    assert torch.equal(obs["state"][3], torch.from_numpy(fresh[1].reset(7)["state"]))
    after = grouped.step(chunks[2]).obs["state"]
    assert torch.equal(after[[0, 1, 4]], expected[[0, 1, 4]])


def test_auto_grouping_gives_one_worker_per_core(monkeypatch):
    from vla_rl.envs import workers

    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    assert [workers.auto_envs_per_worker(n) for n in (1, 2, 3, 16, 64)] == [1, 1, 2, 8, 32]
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [workers.auto_envs_per_worker(n) for n in (1, 16, 17, 320)] == [1, 1, 2, 20]


def test_env_config_checks_envs_per_worker():
    from vla_rl.core.ranges import ConfigError
    from vla_rl.envs.registry import EnvConfig, make_env

    with pytest.raises(ConfigError, match=r"envs_per_worker = 0 is outside its valid range \(0, inf\)"):
        EnvConfig(kind="maniskill", envs_per_worker=0)
    with pytest.raises(ConfigError, match="envs_per_worker is for worker envs"):
        EnvConfig(kind="builtin", envs_per_worker=4)
    assert make_env(EnvConfig(kind="builtin"), num_envs=8, device=torch.device("cpu"), seed=0).num_envs == 8


class _PickyEnv(ColorReachSingleEnv):
    """Fails on the action 0.77 (a simulator error inside a live worker, not a death)."""

    def step(self, action):
        if float(action[0]) == pytest.approx(0.77):
            raise RuntimeError("picky env refused 0.77")
        return super().step(action)


def test_failing_worker_leaves_no_reply_of_the_others_unread():
    """When one worker reports an error, the others' replies to the same command are still taken, so the
    next command does not read a stale reply (checked on the pipe, and by the next step's rewards)."""
    pool = WorkerVectorEnv(functools.partial(_PickyEnv, SHORT), 4, envs_per_worker=2, name="picky")
    try:
        pool.reset(seed=0)
        chunk = torch.full((4, 2, 2), 0.3)
        chunk[1] = 0.77
        with pytest.raises(WorkerError, match="picky env refused 0.77") as err:
            pool.step(chunk)
        assert err.value.index == 0
        assert not pool._conns[1].poll(1.0)       # worker 1's reply was taken
        pool.restart(0, seed=0)
        out = pool.step(torch.full((4, 3, 2), -0.4))
        assert out.rewards.shape == (4, 3) and out.steps.tolist() == [3, 3, 3, 3]
    finally:
        pool.close()
