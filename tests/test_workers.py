"""The worker-process pool, tested with the built-in task's single-env wrapper (no simulator needed)."""

import functools
import os
import signal

import pytest
import torch
from contract import check_env_contract

from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv, ColorReachSingleEnv
from vla_rl.envs.workers import WorkerError, WorkerVectorEnv

SHORT = ColorReachConfig(max_episode_steps=6)


def test_builtin_env_passes_the_contract():
    check_env_contract(ColorReachEnv(4, config=SHORT))


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
    state_before = pool.step(torch.zeros(2, 1, 2)).obs["state"][1].clone()
    os.kill(pool._procs[0].pid, signal.SIGKILL)
    pool._procs[0].join(timeout=10)
    with pytest.raises(WorkerError, match=r"worker 0 \(env 0\) died: killed by signal SIGKILL") as err:
        pool.step(torch.zeros(2, 1, 2))
    assert err.value.index == 0
    obs = pool.restart(0, seed=11)
    assert torch.equal(obs["state"][1], state_before)  # env 1 kept its episode
    out = pool.step(torch.zeros(2, 1, 2))
    assert out.obs["state"].shape == (2, 4)


def _broken_factory():
    raise RuntimeError("simulator exploded at start")


def test_worker_that_fails_at_start_reports_its_traceback():
    with pytest.raises(WorkerError, match="simulator exploded at start"):
        WorkerVectorEnv(_broken_factory, 1)


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
