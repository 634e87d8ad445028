"""The Ray runtime on a local Ray instance (2 CPUs, fractional actors): the same metrics as a local run, env
actors killed mid-run, a learner lost mid-run, and (slow) a two-node cluster started with `ray start`."""

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers import step_groups_like_one_batch  # noqa: E402
from inline_pool import InProcessPool  # noqa: E402

from vla_rl.checkpoint.folders import read_tensors  # noqa: E402
from vla_rl.checkpoint.policy import save_policy  # noqa: E402
from vla_rl.core.schema import from_dict  # noqa: E402
from vla_rl.distributed.ray_config import RayConfig  # noqa: E402
from vla_rl.distributed.runtime import connect  # noqa: E402
from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv  # noqa: E402
from vla_rl.envs.ray_workers import RayVectorEnv  # noqa: E402
from vla_rl.envs.registry import single_env_factory  # noqa: E402
from vla_rl.train.trainer import TrainConfig, Trainer, TrainingError, resume_trainer  # noqa: E402

SMALL = {"depth": 1, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
ROOT = Path(__file__).resolve().parents[2]
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        pytest.skip("this process is already connected to Ray")
    assert connect(RayConfig(num_cpus=2))   # a private instance, as a run starts it
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.policies.actor import Actor
    from vla_rl.policies.model import FlowPolicy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset
    from vla_rl.train.sft import SFTConfig, train_sft

    torch.manual_seed(0)
    data = collect_builtin_demos(4, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(FlowPolicy(policy_preset("tiny", SMALL)), norm, env_state_dim=4, env_action_dim=2)
    train_sft(actor, data, SFTConfig(steps=10, batch_size=16), progress=False)
    return save_policy(tmp_path_factory.mktemp("sft") / "policy", actor.model, actor.norm)


def config(init, out, **over) -> TrainConfig:
    base = {"init": str(init), "env": {"num_envs": 8, "builtin": {"max_episode_steps": 16}},
            "rollout_chunks": 2, "execute": 8, "iterations": 2, "eval_every": 1, "eval_episodes": 8,
            "save_every": 1, "keep_last": 5, "out": str(out), "progress": False, "tensorboard": False,
            "learner": {"update_epochs": 2, "minibatches": 3, "lr_actor": 1e-4}}
    return from_dict(TrainConfig, {**base, **over})


def assert_same_metrics(a: list[dict], b: list[dict], rel: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith("time/") or k == "time/env_steps"}
        assert keys == {k for k in y if not k.startswith("time/") or k == "time/env_steps"}
        for k in keys:
            assert y[k] == pytest.approx(x[k], rel=rel, abs=rel * 1e-2), (x["iteration"], k)


@pytest.fixture(scope="module")
def local_run(sft, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    with Trainer(config(sft, out), log=QUIET) as trainer:
        return trainer.run(), out


def test_two_ray_learners_give_the_metrics_and_weights_of_a_local_run(cluster, sft, local_run, tmp_path):
    """The built-in task stays in this process (env_actors 0); two learner actors (gloo) train data-parallel and
    send their weights back after every update: same metrics, weights and optimizer state as the local run."""
    history, local_dir = local_run
    cfg = config(sft, tmp_path / "ray", runtime="ray", ray={"learners": 2, "learner_cpus": 0.5})
    lines = []
    with Trainer(cfg, log=lines.append) as trainer:
        assert len({pid for _, pid in trainer.learner.where()}) == 2
        got = trainer.run()
    assert "ray: 2 learner(s) on 1 node(s), gloo (colocated)" in lines
    assert_same_metrics(history, got, rel=1e-4)
    for name in ("model", "optimizer"):
        want = read_tensors(local_dir / "checkpoints" / "iter_000002" / f"{name}.safetensors")
        have = read_tensors(tmp_path / "ray" / "checkpoints" / "iter_000002" / f"{name}.safetensors")
        assert want.keys() == have.keys()
        for k in want:
            assert torch.allclose(have[k], want[k], rtol=1e-3, atol=1e-5), (name, k)
    # The checkpoints are a local run's: `--resume RUN_DIR runtime=local` continues it on one machine.
    with resume_trainer(tmp_path / "ray", overrides={"runtime": "local"}, log=QUIET) as resumed:
        assert resumed.iteration == 2 and resumed.cfg.ray == RayConfig()
        assert type(resumed.learner).__name__ == "Learner"


@pytest.mark.slow   # ~30 s on 2 shared cores; tests/distributed/test_fsdp.py checks the sharded step itself by default
def test_two_sharded_ray_learners_give_the_metrics_and_checkpoints_of_a_local_run(cluster, sft, local_run, tmp_path):
    """``ray.sharding=fsdp``: the two learner actors shard the weights and Adam's moments (FSDP2 over gloo); the run
    has the local run's metrics, and its checkpoints (gathered) hold the local run's weights and optimizer state."""
    history, local_dir = local_run
    cfg = config(sft, tmp_path / "ray", runtime="ray", ray={"learners": 2, "learner_cpus": 0.5, "sharding": "fsdp"})
    lines = []
    with Trainer(cfg, log=lines.append) as trainer:
        got = trainer.run()
    assert "ray: 2 learner(s) on 1 node(s), gloo, sharded (fsdp) (colocated)" in lines
    assert_same_metrics(history, got, rel=1e-4)
    for name in ("model", "optimizer"):
        want = read_tensors(local_dir / "checkpoints" / "iter_000002" / f"{name}.safetensors")
        have = read_tensors(tmp_path / "ray" / "checkpoints" / "iter_000002" / f"{name}.safetensors")
        assert want.keys() == have.keys()
        for k in want:
            assert torch.allclose(have[k], want[k], rtol=1e-3, atol=1e-5), (name, k)


def test_env_actors_give_the_metrics_of_a_local_run_and_survive_a_killed_actor(cluster, sft, tmp_path,
                                                                                   monkeypatch):
    """Two env actors run the built-in task's single envs: the same metrics as a local run of the same single
    envs. An actor killed in the middle of a rollout is restarted, its envs' episodes are dropped, and the run
    finishes."""
    import vla_rl.train.trainer as trainer_mod

    def local_pool(cfg, *, num_envs, device, seed, log=None):
        return InProcessPool(single_env_factory(cfg)[0], num_envs, seed=seed)

    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "make_env", local_pool)
        with Trainer(config(sft, tmp_path / "local", iterations=1), log=QUIET) as trainer:
            want = trainer.run()

    kill_next_step = []
    real_step = RayVectorEnv.step

    def step(self, chunk):
        if kill_next_step:
            ray.kill(self.actors[kill_next_step.pop()])
        return real_step(self, chunk)

    lines = []

    def log(msg):
        lines.append(msg)
        if msg.startswith("iter    1 "):
            kill_next_step.append(1)   # in the first rollout chunk of iteration 2

    monkeypatch.setattr(RayVectorEnv, "step", step)
    cfg = config(sft, tmp_path / "ray", runtime="ray", env={"num_envs": 8, "restart_dead_workers": 1,
                                                              "builtin": {"max_episode_steps": 16}},
                 ray={"env_actors": 2, "env_actor_cpus": 0.5, "learners": 0})
    with Trainer(cfg, log=log) as trainer:
        got = trainer.run()
        assert trainer.env.restarts == 1
    assert "ray: 2 env actor(s) with 8 builtin envs on 1 node(s) (colocated)" in lines
    assert_same_metrics(want, got[:2])
    assert any("builtin worker 1 (envs 4-7) stopped during a step" in x and "died" in x for x in lines), lines
    assert got[2]["rollout/lost_episodes"] == 4 and got[2]["iteration"] == 2


@pytest.mark.slow
def test_a_lost_learner_stops_the_run_and_resume_continues_it(cluster, sft, local_run, tmp_path, monkeypatch):
    """A learner killed before the update of iteration 2: the run stops with a training error naming the
    newest checkpoint, and `resume` continues to the numbers of an uninterrupted local run."""
    from vla_rl.distributed.learners import RayLearners

    history, _ = local_run
    kill_next_update = []
    real_update = RayLearners.update

    def update(self, ro, *, iteration):
        if kill_next_update:
            ray.kill(self.actors[kill_next_update.pop()])
        return real_update(self, ro, iteration=iteration)

    def log(msg):
        if msg.startswith("iter    1 "):
            kill_next_update.append(1)

    monkeypatch.setattr(RayLearners, "update", update)
    trainer = Trainer(config(sft, tmp_path / "run", runtime="ray", ray={"learners": 2, "learner_cpus": 0.5}), log=log)
    with trainer, pytest.raises(TrainingError) as err:
        trainer.run()
    msg = str(err.value)
    assert "learner 1 died during the update of iteration 2" in msg and "stopped after iteration 1" in msg
    assert "the newest checkpoint is" in msg and "iter_000001" in msg and "--resume" in msg
    with resume_trainer(tmp_path / "run", log=QUIET) as resumed:
        assert resumed.iteration == 1
        got = resumed.run()
    assert_same_metrics(history, got, rel=1e-4)


def test_cluster_too_small_for_the_placement_is_a_clear_error(cluster, sft, tmp_path):
    from vla_rl.distributed.runtime import ClusterError

    cfg = config(sft, tmp_path / "run", runtime="ray", ray={"learners": 3, "timeout_s": 2})
    with pytest.raises(ClusterError, match=r"could not place 3 bundle\(s\) \(3 CPU in all, STRICT_PACK\).*the "
                                           r"cluster has 2 CPU"):
        Trainer(cfg, log=QUIET)


# ----------------------------------------------------------------------------------------------------
# Two "nodes" on this machine: `ray start --head` and `ray start --address` on loopback
# ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], env: dict, temp_dir: str) -> subprocess.Popen:
    """`ray start --block ...` in its own process group (stopped by killing that group, not by `ray stop`,
    which would end every Ray process of the machine)."""
    return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=1",
                             "--disable-usage-stats", f"--temp-dir={temp_dir}", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_a_run_on_a_two_node_cluster_spreads_its_env_actors(sft, tmp_path):
    # The run is a `vla-rl train` subprocess: this process's own Ray connection (if any) plays no part.
    # Token authentication is on by default in this Ray version; every process of the cluster must use it.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")   # Ray's socket paths must stay short
    port = _free_port()
    head = _ray_start(["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false"],
                      env, temp_dir)
    nodes = [head]
    try:
        time.sleep(2)
        nodes.append(_ray_start([f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"], env, temp_dir))
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "vla_rl.cli", "train", "builtin_flow_noise", f"init={sft}", f"out={out}",
               "env.num_envs=4", "env.builtin.max_episode_steps=16", "rollout_chunks=2", "iterations=2",
               "eval_every=2", "eval_episodes=4", "tensorboard=false", "--no-progress", "learner.update_epochs=1",
               "runtime=ray", f"ray.address=127.0.0.1:{port}", "ray.placement=disaggregated",
               "ray.env_actors=2", "ray.env_actor_cpus=0.5", "ray.learner_cpus=0.5", "ray.strategy=STRICT_SPREAD",
               "ray.timeout_s=240"]
        deadline = time.time() + 120
        while True:   # the second node may still be joining: the placement group waits for it (timeout_s)
            run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
            if run.returncode == 0 or time.time() > deadline or "could not place" not in run.stderr:
                break
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "ray: 2 env actor(s) with 4 builtin envs on 2 node(s) (disaggregated)" in run.stdout
        assert "ray: 1 learner(s) on 1 node(s) (disaggregated)" in run.stdout
        assert (out / "checkpoints" / "iter_000002" / "model.safetensors").is_file()
    finally:
        for proc in reversed(nodes):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_env_actor_pool_equals_the_same_envs_in_process(cluster):
    """Step by step, across partial resets, with a render (the process pool runs the same EnvGroup code,
    tests/envs/test_workers.py)."""
    factory = functools.partial(ColorReachSingleEnv, ColorReachConfig(max_episode_steps=6))
    actors = RayVectorEnv(factory, 5, num_actors=2, actor_options=lambda w: {"num_cpus": 0.5}, timeout=120)
    procs = InProcessPool(factory, 5, envs_per_worker=3)
    try:
        assert [len(s) for s in actors.slices] == [3, 2]
        # The actors run at this process's priority, as local worker processes do (not Ray's +15).
        assert {os.getpriority(os.PRIO_PROCESS, pid) for _, pid in actors.where()} == {os.nice(0)}
        a, b = actors.reset(seed=3), procs.reset(seed=3)
        assert torch.equal(a["images"], b["images"]) and a["instruction"] == b["instruction"]
        for pool in (actors, procs):
            pool.set_final_frames([4, 1])   # ended episodes of envs 4 and 1 rendered before their reset
        rendered = 0
        gen = torch.Generator().manual_seed(0)
        ended = 0
        for _ in range(4):
            chunk = torch.rand(5, 4, 2, generator=gen) * 2 - 1
            x, y = actors.step(chunk), procs.step(chunk)
            for key in ("rewards", "steps", "terminated", "truncated", "success"):
                assert torch.equal(getattr(x, key), getattr(y, key)), key
            assert torch.equal(x.obs["images"], y.obs["images"]) and x.obs["instruction"] == y.obs["instruction"]
            assert (x.final_obs is None) == (y.final_obs is None)
            if x.final_obs is not None:
                ended += len(x.episodes["return"])
                assert torch.equal(x.final_obs["state"], y.final_obs["state"])
                assert all(torch.equal(x.episodes[k], y.episodes[k]) for k in x.episodes)
            assert set(x.final_frames or {}) == set(y.final_frames or {}) == {i for i in (1, 4) if x.done[i]}
            for i, frame in (x.final_frames or {}).items():   # this env renders what its camera sees
                assert (frame == y.final_frames[i]).all() and (frame == x.final_obs["images"][i, 0].numpy()).all()
                rendered += 1
        assert ended > 0 and rendered > 0
        assert all((f == g).all() for f, g in zip(actors.render_frames([4, 0]), procs.render_frames([4, 0])))
    finally:
        actors.close()
        procs.close()


def test_env_actors_step_in_groups_like_one_batch(cluster):
    """Two groups of actors with chunks in flight at once (what rollout_groups=2 does) give each env the
    results of stepping the whole batch."""
    factory = functools.partial(ColorReachSingleEnv, ColorReachConfig(max_episode_steps=6))
    actors = RayVectorEnv(factory, 4, num_actors=2, actor_options=lambda w: {"num_cpus": 0.5}, timeout=120)
    procs = InProcessPool(factory, 4, envs_per_worker=2)
    try:
        groups = actors.step_groups(2)
        assert groups == [range(0, 2), range(2, 4)]
        actors.reset(seed=3), procs.reset(seed=3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            chunk = torch.rand(4, 4, 2, generator=gen) * 2 - 1
            step_groups_like_one_batch(actors, procs, groups, chunk)
    finally:
        actors.close()
        procs.close()


def test_a_learner_death_names_the_iteration_as_the_metrics_do(monkeypatch):
    """The update of loop index 3 is iteration 4 in the metrics and messages (the run stopped after 3): the error
    of a learner that dies during it says 4."""
    import vla_rl.distributed.learners as learners

    class Actor:
        class update:
            @staticmethod
            def remote(*args):
                return "ref"

    class Learners:
        def _live(self):
            return [Actor()]

        def _gather(self, refs, doing):
            raise learners.LearnerError(f"learner 0 died during {doing}")

    monkeypatch.setattr(learners, "rollout_to", lambda ro, device: ro, raising=False)
    monkeypatch.setattr(ray, "put", lambda value: value)
    with pytest.raises(learners.LearnerError, match="died during the update of iteration 4$"):
        learners.RayLearners.update(Learners(), object(), iteration=3)
