"""Sharded learners (FSDP2, vla_rl/distributed/fsdp.py) on the CPU: two processes over gloo, each holding half of
every trained tensor, take the step one unsharded learner takes on the whole batch (to float tolerance), and their
gathered weights and optimizer state load into an unsharded learner (what a checkpoint of a sharded run holds)."""

import copy
import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers import perturbed_model
from safetensors.torch import load_file, save_file

from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import collect_rollout

SMALL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
# 16 samples: minibatches of 6, 6, 4 with gradient accumulation; LoRA with checkpointing inside FSDP's hooks
CASES = {"full": dict(update_epochs=1, minibatches=3, grad_accum=2, lr_actor=1e-3),
         "lora": dict(update_epochs=1, minibatches=2, lr_actor=1e-3, grad_checkpointing="all",
                      lora={"rank": 4, "parts": ["prefix", "expert"]})}


def setup(case: str):
    from vla_rl.core.schema import from_dict

    model = perturbed_model("tiny", SMALL)
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    env = ColorReachEnv(8, config=ColorReachConfig(max_episode_steps=6), seed=0)
    actor = Actor(copy.deepcopy(model), norm, env_state_dim=4, env_action_dim=2)
    ro, _ = collect_rollout(actor, env, env.reset(seed=1), num_chunks=2, sampler=SamplerConfig(3, "noise"),
                            execute=4, generator=torch.Generator().manual_seed(0))
    return model, norm, ro, from_dict(LearnerConfig, CASES[case])


def sharded_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vla_rl.distributed.fsdp import full_optimizer_state, full_weights, metrics_sync, shard_learner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        sync = metrics_sync(lambda t, op: dist.all_reduce(t, op=ops[op]))
        for case in CASES:
            model, norm, ro, cfg = setup(case)
            learner = Learner(Actor(model, norm, env_state_dim=4, env_action_dim=2), cfg, PPO(PPOConfig()),
                              shard=(rank, world), sync=sync)
            shard_learner(learner, mesh)
            shard = next(p for p in model.parameters() if p.requires_grad)
            local = shard.to_local().shape[0]
            metrics = learner.update(ro, iteration=0)
            weights = full_weights(model)
            opt = full_optimizer_state(learner.optimizer)
            if rank == 0:
                save_file(weights, f"{out}/{case}_weights.safetensors")
                save_file({f"{i}.{k}": v for i, st in opt["state"].items() for k, v in st.items()},
                          f"{out}/{case}_optimizer.safetensors")
                with open(f"{out}/{case}_metrics.json", "w") as f:
                    json.dump({"metrics": metrics, "local_rows": local, "rows": shard.shape[0]}, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    # fork: the workers inherit the imported modules (spawn re-imports torch and vla_rl: seconds per process)
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(sharded_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="fork")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_sharded_learners_take_the_step_of_one_learner(sharded, case):
    model, norm, ro, cfg = setup(case)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    one = Learner(Actor(model, norm, env_state_dim=4, env_action_dim=2), cfg, PPO(PPOConfig()))
    want_metrics = one.update(ro, iteration=0)
    got = json.loads((sharded / f"{case}_metrics.json").read_text())
    assert got["local_rows"] < got["rows"]   # each process held a shard, not a replica
    for k, v in want_metrics.items():
        assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    weights = load_file(sharded / f"{case}_weights.safetensors")
    reference = dict(one.actor.model.named_parameters())
    assert weights.keys() == reference.keys()
    # Tolerance as for the replicated learners (tests/distributed/test_distributed.py): the halves' gradients are
    # summed in another order, and Adam scales rounding noise of near-zero gradients to steps of size lr.
    with torch.no_grad():
        want = torch.cat([(reference[n] - start[n]).flatten() for n in start])
        have = torch.cat([(weights[n] - start[n]).flatten() for n in start])
        assert float(want.abs().max()) > 1e-3
        assert float((have - want).norm() / want.norm()) < 1e-3
        assert float((have - want).abs().max()) < cfg.lr_actor / 20
    # the gathered optimizer state is an unsharded learner's: same keys, shapes; it loads into one
    flat = load_file(sharded / f"{case}_optimizer.safetensors")
    state = {}
    for key, v in flat.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    ref_state = one.optimizer.state_dict()
    assert state.keys() == ref_state["state"].keys()
    for i, st in ref_state["state"].items():
        assert torch.allclose(state[i]["exp_avg"], st["exp_avg"], rtol=1e-3, atol=1e-6)
    one.optimizer.load_state_dict({"state": state, "param_groups": ref_state["param_groups"]})


def test_sharding_config_is_checked():
    from vla_rl.core.ranges import ConfigError
    from vla_rl.core.schema import from_dict
    from vla_rl.train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="sharding: fsdp splits the learners' tensors among several learners"):
        from_dict(TrainConfig, {"runtime": "ray", "ray": {"learners": 1, "sharding": "fsdp"}})
    with pytest.raises(ConfigError, match="ray.sharding=fsdp goes with learner.param_dtype=fp32"):
        from_dict(TrainConfig, {"runtime": "ray", "ray": {"learners": 2, "sharding": "fsdp"},
                                "learner": {"optimizer_state_dtype": "bf16"}})
    from_dict(TrainConfig, {"runtime": "ray", "ray": {"learners": 2, "sharding": "fsdp"},
                            "learner": {"lora": {"rank": 4}}})
