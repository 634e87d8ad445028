"""Data-parallel learning without a cluster: the gradient sum over learners, and two learners (threads with an
in-process all-reduce) against one learner on the whole batch; the Ray config's checks."""

import copy
import sys
import threading

import pytest
import torch

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.distributed.gradsync import pack_gradients, sum_over_learners, unpack_gradients
from vla_rl.distributed.ray_config import RayConfig
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import collect_rollout
from vla_rl.train.trainer import TrainConfig, resumed_config

SMALL = {"depth": 1, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}


class InProcessGroup:
    """An all-reduce over ``world`` threads: every rank deposits its tensor, all wait, all read the result."""

    def __init__(self, world: int):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world)

    def reducer(self, rank: int):
        def all_reduce(t: torch.Tensor, op: str = "sum") -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            result = stacked.sum(0) if op == "sum" else stacked.max(0).values
            self.barrier.wait()   # nobody overwrites a slot before every rank has read them all
            t.copy_(result)
        return all_reduce


def test_summed_half_batch_gradients_equal_the_whole_batch_gradient():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    unused = torch.nn.Parameter(torch.ones(2))          # reached by no loss: must keep grad None
    x, y = torch.randn(10, 3), torch.randn(10, 1)
    params = list(net.parameters()) + [unused]

    def grads(idx, weight):
        for p in params:
            p.grad = None
        (((net(x[idx]) - y[idx]) ** 2).mean() * weight).backward()
        return pack_gradients(params)

    full, present = grads(torch.arange(10), 1.0)
    a, pa = grads(torch.arange(0, 10, 2), 5 / 10)   # each half weighted by its share of the batch
    b, pb = grads(torch.arange(1, 10, 2), 5 / 10)
    assert present.tolist() == pa.tolist() == [1, 1, 1, 1, 0]
    assert torch.allclose(a + b, full, atol=1e-7)
    unpack_gradients(params, a + b, pa + pb)
    assert unused.grad is None and torch.allclose(net[0].weight.grad.flatten(), full[:12], atol=1e-7)

    metrics = [{"m": 1.5, "r_max": 2.0}, {"m": 0.5, "r_max": 3.0}]
    group = InProcessGroup(2)
    out = [None, None]

    def rank(r):
        out[r] = sum_over_learners(params, metrics[r], group.reducer(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out[0] == out[1] == {"m": 2.0, "r_max": 3.0}


def test_unpack_refuses_buffers_of_another_size():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="buffers of 2 values"):
        unpack_gradients([p], torch.zeros(2), torch.ones(1))


@pytest.mark.parametrize("minibatches, grad_accum, epochs", [(3, 1, 2), (6, 2, 1)])
def test_two_data_parallel_learners_take_the_step_of_one_learner(minibatches, grad_accum, epochs):
    """16 samples in minibatches of 6, 6, 4 (or six of 3, 3, 3, 3, 3, 1: a learner with an empty share);
    two learners on alternate samples of each minibatch end with the weights, optimizer state and metrics of
    one learner on the whole batch."""
    torch.manual_seed(0)
    env = ColorReachEnv(8, config=ColorReachConfig(max_episode_steps=6), seed=0)
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    model = FlowPolicy(policy_preset("tiny", SMALL))
    actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
    ro, _ = collect_rollout(actor, env, env.reset(seed=1), num_chunks=2, sampler=SamplerConfig(3, "noise"),
                            execute=4, generator=torch.Generator().manual_seed(0))
    cfg = LearnerConfig(update_epochs=epochs, minibatches=minibatches, grad_accum=grad_accum, lr_actor=1e-3)
    def learner(**extra):
        return Learner(Actor(copy.deepcopy(model), norm, env_state_dim=4, env_action_dim=2), cfg, PPO(PPOConfig()),
                       **extra)

    one = learner()
    expected = [one.update(ro, iteration=0)]
    group = InProcessGroup(2)
    pair = [learner(shard=(r, 2), sync=lambda p, m, r=r: sum_over_learners(p, m, group.reducer(r))) for r in range(2)]
    got: list = [None, None]

    def run(r):
        got[r] = [pair[r].update(ro, iteration=0)]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    cores = torch.get_num_threads()
    torch.set_num_threads(1)   # two threads each driving torch's OpenMP pool make both spin-wait for seconds
    try:
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        torch.set_num_threads(cores)
    assert got[0] == got[1]
    for want, have in zip(expected, got[0]):
        assert want.keys() == have.keys()
        for k in want:
            assert have[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    # Float tolerance on the update, not bit equality: summing two halves rounds differently, and a gradient that
    # is zero in exact arithmetic (attention's key bias: the softmax ignores it) is rounding noise, which Adam
    # scales up to steps of size lr. The updates agree to 1e-3 of their size, every weight to lr / 20.
    start = dict(model.named_parameters())
    reference = dict(one.actor.model.named_parameters())
    with torch.no_grad():
        want = torch.cat([(reference[n] - start[n]).flatten() for n in start])
        for r in range(2):
            params = dict(pair[r].actor.model.named_parameters())
            have = torch.cat([(params[n] - start[n]).flatten() for n in start])
            assert float((have - want).norm() / want.norm()) < 1e-3
            assert float((have - want).abs().max()) < cfg.lr_actor / 20
            state = pair[r].optimizer.state_dict()["state"]
            for i, s in one.optimizer.state_dict()["state"].items():
                assert torch.allclose(state[i]["exp_avg"], s["exp_avg"], rtol=1e-3, atol=1e-6)
    assert float(want.abs().max()) > 1e-3   # the updates did move the weights


def test_data_parallel_learner_checks_its_shard():
    actor = Actor(FlowPolicy(policy_preset("tiny", SMALL)), NormStats(Stats.identity(4), Stats.identity(2)),
                  env_state_dim=4, env_action_dim=2)
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        Learner(actor, LearnerConfig(), PPO(PPOConfig()), shard=(2, 2))
    with pytest.raises(ValueError, match="need a sync function"):
        Learner(actor, LearnerConfig(), PPO(PPOConfig()), shard=(0, 2))


def test_ray_config_is_checked():
    for over, want in [({"ray": {"learners": 2}}, "ray is set but runtime is 'local'"),
                       ({"runtime": "ray", "ray": {"learners": 0}}, "nothing would run on Ray"),
                       ({"runtime": "ray", "ray": {"env_actors": 9}}, "ray.env_actors = 9 is more than env.num_envs"),
                       ({"runtime": "ray", "env": {"kind": "libero", "envs_per_worker": 2}, "ray": {"env_actors": 2}},
                        "env.envs_per_worker groups envs into local worker processes"),
                       ({"runtime": "ray", "ray": {"placement": "scattered"}}, "ray.placement: 'scattered' is not"),
                       ({"runtime": "ray", "ray": {"learner_cpus": 0}}, "ray.learner_cpus = 0.0 is outside"),
                       ({"runtime": "ray", "ray": {"backend": "nccl"}}, "nccl needs GPU learners"),
                       ({"runtime": "ray", "ray": {"backend": "nccl", "learners": 2, "learner_gpus": 0.5}},
                        "learners sharing a GPU cannot form an NCCL group"),
                       ({"runtime": "ray", "ray": {"address": "auto", "num_cpus": 2}}, "num_cpus / num_gpus size"),
                       ({"runtime": "ray", "ray": {"workers": 2}}, "unknown config key(s): ray.workers"),
                       ({"runtime": "cluster"}, "runtime: 'cluster' is not one of")]:
        with pytest.raises(ConfigError) as err:
            from_dict(TrainConfig, {"env": {"num_envs": 8}, **over})
        assert want in str(err.value), (want, str(err.value))
    cfg = RayConfig(placement="disaggregated", learner_gpus=1)
    assert (cfg.dist_backend, cfg.strategy_for("env"), cfg.strategy_for("learner")) == ("nccl", "SPREAD", "PACK")
    assert RayConfig(learners=2, learner_gpus=0.5).dist_backend == "gloo"   # two learners may share one GPU
    assert RayConfig().strategy_for("all") == "STRICT_PACK" and RayConfig().dist_backend == "gloo"


def test_runtime_ray_without_ray_installed_is_a_config_error(monkeypatch):
    from vla_rl.distributed.runtime import make_runtime

    monkeypatch.setitem(sys.modules, "ray", None)   # import ray fails as if not installed
    with pytest.raises(ConfigError, match=r"runtime: ray needs Ray: pip install 'vla-rl\[ray\]'"):
        make_runtime("ray", RayConfig())


def test_resuming_with_runtime_local_drops_the_ray_section():
    saved = {"runtime": "ray", "ray": {"learners": 2, "address": "auto"}, "iterations": 4}
    assert resumed_config(saved, {"runtime": "local", "iterations": 6}) == {"runtime": "local", "iterations": 6}
    assert resumed_config(saved, {"ray": {"learners": 1}}) == {"runtime": "ray", "iterations": 4,
                                                               "ray": {"learners": 1, "address": "auto"}}
    from_dict(TrainConfig, resumed_config(saved, {"runtime": "local"}))   # a valid config
