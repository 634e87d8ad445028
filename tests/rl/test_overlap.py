"""Overlapping policy sampling with simulation (``rollout_groups``): envs stepped in groups of whole workers,
the policy sampling one group while the others simulate. Tested on the built-in task's single envs in worker
processes and in an in-process pool (no simulator needed)."""

import functools

import pytest
import torch
from helpers import step_groups_like_one_batch
from inline_pool import InProcessPool

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv
from vla_rl.envs.registry import single_env_factory
from vla_rl.envs.workers import WorkerVectorEnv
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.rl.rollout import collect_rollout
from vla_rl.train.trainer import TrainConfig, Trainer, resume_trainer

SHORT = ColorReachConfig(max_episode_steps=6)
FACTORY = functools.partial(ColorReachSingleEnv, SHORT)
SMALL = {"depth": 1, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
QUIET = lambda *_: None  # noqa: E731
FLOAT_KEYS = ("chain", "log_probs", "entropy", "values", "rewards", "final_values", "last_values")
EXACT_KEYS = ("stochastic", "terminated", "truncated", "success")


@pytest.mark.parametrize("method,sde_mode", [("ode", "mixed"), ("sde", "mixed"), ("sde", "all"), ("noise", "mixed")])
def test_draws_made_ahead_give_the_generators_sample_bit_for_bit(method, sde_mode):
    def field(x, t):
        return 0.3 * x + t[:, None, None], 0.1 + 0.05 * x.abs()

    gen = torch.Generator().manual_seed(1)
    want = flow.sample(field, torch.randn(6, 5, 3, generator=gen), num_steps=4, method=method, sde_mode=sde_mode,
                       generator=gen)
    d = flow.draw_sample_noise(6, 5, 3, num_steps=4, method=method, sde_mode=sde_mode,
                               generator=torch.Generator().manual_seed(1))
    # in two parts, as two groups would sample them
    parts = [flow.sample(field, p.initial, num_steps=4, method=method, sde_mode=sde_mode, stochastic=p.stochastic,
                         step_noise=p.steps) for p in (d.rows(range(0, 2)), d.rows(range(2, 6)))]
    for key in ("chain", "stochastic", "log_probs", "entropy"):
        assert torch.equal(torch.cat([getattr(p, key) for p in parts]), getattr(want, key)), key
    with pytest.raises(ValueError, match="step_noise must have shape"):
        flow.sample(field, d.initial, num_steps=3, step_noise=d.steps)


def test_groups_stepped_in_alternation_give_each_env_the_results_of_one_batch():
    ref, pool = InProcessPool(FACTORY, 5, envs_per_worker=2), InProcessPool(FACTORY, 5, envs_per_worker=2)
    try:
        groups = pool.step_groups(2)
        assert groups == [range(0, 4), range(4, 5)]   # 3 workers (2, 2, 1 envs): 2 workers, then 1
        assert ref.reset(seed=4)["instruction"] == pool.reset(seed=4)["instruction"]
        gen = torch.Generator().manual_seed(0)
        ended = 0
        for _ in range(5):
            chunk = torch.rand(5, 3, 2, generator=gen) * 2 - 1
            parts, want = step_groups_like_one_batch(pool, ref, groups, chunk)
            if want.episodes:
                ended += len(want.episodes["env_index"])
                got = {k: torch.cat([p.episodes[k] for p in parts if p.episodes]) for k in want.episodes}
                assert all(torch.equal(got[k], want.episodes[k]) for k in want.episodes)
        assert ended > 0
    finally:
        ref.close()
        pool.close()


def test_grouped_stepping_refuses_what_it_cannot_do():
    pool = InProcessPool(FACTORY, 4, envs_per_worker=2)
    try:
        pool.reset(seed=0)
        with pytest.raises(ValueError, match="need 1 to 2"):
            pool.step_groups(3)
        with pytest.raises(ValueError, match="split a worker's envs"):
            pool.step_async(range(0, 3), torch.zeros(3, 2, 2))
        with pytest.raises(ValueError, match=r"shape \[2, H, 2\]"):
            pool.step_async(range(0, 2), torch.zeros(4, 2, 2))
        with pytest.raises(RuntimeError, match="no chunk in flight"):
            pool.step_wait(range(0, 2))
        pool.step_async(range(0, 2), torch.zeros(2, 2, 2))
        with pytest.raises(RuntimeError, match="already have a chunk in flight"):
            pool.step_async(range(0, 2), torch.zeros(2, 2, 2))
        with pytest.raises(RuntimeError, match="cannot reset while chunks are in flight"):
            pool.reset(seed=0)
        pool.step_wait(range(0, 2))
        pool.reset(seed=0)
    finally:
        pool.close()


def _actor(spec) -> Actor:
    torch.manual_seed(0)
    model = FlowPolicy(policy_preset("tiny", SMALL)).eval()
    return Actor.for_env(model, NormStats(Stats.identity(spec.state_dim), Stats.identity(spec.action_dim)), spec)


def _rollout(env, actor, groups: int, method: str = "noise"):
    obs = env.reset(seed=11)
    ro, last = collect_rollout(actor, env, obs, num_chunks=4, sampler=SamplerConfig(num_steps=3, method=method),
                               execute=4, generator=torch.Generator().manual_seed(5), groups=groups)
    return ro, last


def _assert_same_rollout(a, b, exact: bool) -> None:
    check = (lambda x, y: torch.equal(x, y)) if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-5))
    for k in FLOAT_KEYS:
        assert check(getattr(a, k), getattr(b, k)), k
    for k in EXACT_KEYS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    for k in a.obs:
        assert check(a.obs[k].float(), b.obs[k].float()), k
    assert a.env_steps == b.env_steps and a.episodes.keys() == b.episodes.keys()
    for k in a.episodes:   # the returns sum rewards of actions that differ by rounding
        assert a.episodes[k] == (b.episodes[k] if exact or k != "return" else pytest.approx(b.episodes[k], rel=1e-5)), k


def test_grouped_rollout_in_worker_processes_is_the_one_batch_rollout(method="sde"):
    """Two worker processes, one group each: the same episodes and, up to float rounding of the model on
    smaller batches, the same tensors as the lockstep rollout; the same bits as the in-process pool's grouped
    rollout (timing changes nothing)."""
    env = WorkerVectorEnv(FACTORY, 4, envs_per_worker=2, name="overlap")
    ref = InProcessPool(FACTORY, 4, envs_per_worker=2)
    try:
        actor = _actor(env.spec)
        one, _ = _rollout(env, actor, 1, method)
        two, last = _rollout(env, actor, 2, method)
        inline, inline_last = _rollout(ref, actor, 2, method)
        assert one.episodes["env_index"], "no episode ended: the test checks nothing about episodes"
        _assert_same_rollout(one, two, exact=False)
        _assert_same_rollout(inline, two, exact=True)
        assert torch.equal(last["state"], inline_last["state"]) and last["instruction"] == inline_last["instruction"]
        assert tuple(two.chain.shape[:2]) == (4, 4)
    finally:
        env.close()
        ref.close()


def _config(init, out, **over) -> TrainConfig:
    base = {"init": str(init), "env": {"num_envs": 4, "builtin": {"max_episode_steps": 12}},
            "rollout_chunks": 3, "execute": 4, "iterations": 2, "eval_every": 1, "eval_episodes": 4,
            "save_every": 1, "keep_last": 5, "out": str(out), "progress": False, "tensorboard": False,
            "sampler": {"num_steps": 3, "method": "noise"}, "learner": {"update_epochs": 2, "minibatches": 2}}
    return from_dict(TrainConfig, {**base, **over})


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.train.sft import SFTConfig, train_sft

    torch.manual_seed(0)
    data = collect_builtin_demos(4, seed=0)
    actor = Actor(FlowPolicy(policy_preset("tiny", SMALL)), NormStats(Stats.of(data.state), Stats.of(data.action)))
    train_sft(actor, data, SFTConfig(steps=10, batch_size=16), progress=False)
    return save_policy(tmp_path_factory.mktemp("sft") / "policy", actor.model, actor.norm)


def _strip_time(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/") or k == "time/env_steps"} for h in history]


def test_training_with_rollout_groups_is_deterministic_and_resumes_exactly(sft, tmp_path, monkeypatch):
    import vla_rl.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "make_env", lambda cfg, *, num_envs, device, seed, log=None:
                        InProcessPool(single_env_factory(cfg)[0], num_envs, seed=seed, envs_per_worker=2))
    with Trainer(_config(sft, tmp_path / "one", iterations=1), log=QUIET) as t:
        one = t.run()
    with Trainer(_config(sft, tmp_path / "full", rollout_groups=2), log=QUIET) as t:
        full = t.run()
    with Trainer(_config(sft, tmp_path / "part", rollout_groups=2, iterations=1), log=QUIET) as t:
        t.run()
    with resume_trainer(tmp_path / "part", overrides={"iterations": 2}, log=QUIET) as t:
        resumed = t.run()
    assert _strip_time(resumed) == _strip_time(full)
    # the same episodes as the lockstep rollout: episode counts, successes and returns of the first rollout
    for k in ("rollout/episodes", "rollout/success_once", "time/env_steps"):
        assert full[1][k] == one[1][k], k
    assert full[1]["rollout/return"] == pytest.approx(one[1]["rollout/return"], rel=1e-5)


def test_rollout_groups_on_an_env_that_steps_as_one_batch_is_a_config_error(sft, tmp_path):
    with pytest.raises(ConfigError, match="rollout_groups = 2: .*ColorReachEnv steps all its envs as one batch"):
        Trainer(_config(sft, tmp_path / "x", rollout_groups=2), log=QUIET)
