"""Evaluation episodes are named by their seeds: an episode seed fixes the initial state and the sampler noise,
whatever num_envs, the worker count or the episode's place in its batch (counter-based draws,
vla_rl/core/keyed_random.py). The ManiSkill3 and LIBERO versions are in test_maniskill.py / test_libero_eval.py."""

import functools
import json

import pytest
import torch

from vla_rl.cli import main as cli_main
from vla_rl.core.keyed_random import keyed_bits, keyed_normal, keyed_uniform, triple32
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv, ColorReachSingleEnv
from vla_rl.envs.workers import WorkerVectorEnv
from vla_rl.eval.evaluate import evaluate_episodes
from vla_rl.policies import flow
from vla_rl.policies.actor import SamplerConfig

SHORT = {"max_episode_steps": 16}


def reference_triple32(x: int) -> int:
    """Wellons' triple32 written with Python's unbounded ints."""
    m = 0xFFFFFFFF
    x ^= x >> 17
    x = (x * 0xED5AD4BB) & m
    x ^= x >> 11
    x = (x * 0xAC4C1B51) & m
    x ^= x >> 15
    x = (x * 0x31848BAB) & m
    return x ^ (x >> 14)


def test_triple32_equals_the_reference_on_edge_and_random_values():
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    xs += torch.randint(0, 2**32, (200,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).tolist()
    got = triple32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [reference_triple32(x) for x in xs]


def test_keyed_numbers_depend_on_their_keys_alone():
    seeds = torch.arange(10_000, 10_040)
    full = keyed_normal([seeds, 3], (8, 4), domain="d")
    # a row's numbers are the same drawn alone, in another batch, or in another order
    assert torch.equal(keyed_normal([seeds[7:9], 3], (8, 4), domain="d"), full[7:9])
    assert torch.equal(keyed_normal([seeds.flip(0), 3], (8, 4), domain="d"), full.flip(0))
    assert torch.equal(keyed_normal([int(seeds[5]), 3], (8, 4), domain="d")[0], full[5])
    # ... and change with every key and the domain
    for other in (keyed_normal([seeds, 4], (8, 4), domain="d"), keyed_normal([seeds + 1, 3], (8, 4), domain="d"),
                  keyed_normal([seeds, 3], (8, 4), domain="e")):
        assert not torch.isclose(other, full).any()
    # 64-bit keys use their high half too
    assert not torch.equal(keyed_bits([2**33 + 5], 4, domain="d"), keyed_bits([5], 4, domain="d"))
    with pytest.raises(ValueError, match="non-negative"):
        keyed_bits([-1], 4, domain="d")


def test_keyed_numbers_have_the_right_distribution():
    z = keyed_normal([torch.arange(4000), 0], (50,), domain="n")
    assert abs(float(z.mean())) < 0.01 and abs(float(z.var()) - 1) < 0.02
    assert abs(float((z > 1.96).float().mean()) - 0.025) < 0.003
    # neighbouring seeds and neighbouring numbers are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([z[:-1].flatten(), z[1:].flatten()]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([z[:, :-1].flatten(), z[:, 1:].flatten()]))[0, 1])) < 0.01
    u = keyed_uniform([torch.arange(20_000)], (5,), domain="u")
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert float((counts - 10_000).abs().max()) < 500      # 5 standard deviations of a bin's count


def test_keyed_sample_noise_per_method():
    keys = [torch.arange(100, 400), 2]
    ode = flow.keyed_sample_noise(keys, 8, 4, num_steps=4, method="ode")
    sde = flow.keyed_sample_noise(keys, 8, 4, num_steps=4, method="sde", sde_mode="mixed")
    noise = flow.keyed_sample_noise(keys, 8, 4, num_steps=4, method="noise")
    assert torch.equal(ode.initial, sde.initial) and torch.equal(ode.initial, noise.initial)
    assert not ode.stochastic.any() and not ode.steps.any()
    assert noise.stochastic.all() and sde.steps.shape == (4, 300, 8, 4)
    assert (sde.stochastic.sum(1) == 1).all()
    picks = sde.stochastic.float().argmax(1).bincount(minlength=4)
    assert int(picks.min()) > 50                          # each of the 4 steps is chosen (expected 75)
    part = flow.keyed_sample_noise([torch.arange(150, 160), 2], 8, 4, num_steps=4, method="sde")
    assert torch.equal(part.steps, sde.steps[:, 50:60]) and torch.equal(part.stochastic, sde.stochastic[50:60])


def test_builtin_env_names_each_episode_by_its_seed():
    cfg = ColorReachConfig(layout="shuffled")
    batched = ColorReachEnv(12, config=cfg).reset(seed=500)
    for i in (0, 5, 11):
        alone = ColorReachEnv(1, config=cfg).reset(seed=500 + i)
        assert torch.equal(alone["images"][0], batched["images"][i])
        assert alone["instruction"][0] == batched["instruction"][i]
    # the following episodes of an env are named by (seed, episode count) as well
    a, b = ColorReachEnv(4, config=cfg), ColorReachEnv(2, config=cfg)
    a.reset(seed=7)
    b.reset(seed=7)
    assert torch.equal(a.reset()["images"][:2], b.reset()["images"])
    # groups share an initial state: env i plays seed + i // group_size
    grouped = ColorReachEnv(6, config=cfg).reset(seed=500, group_size=3)
    assert torch.equal(grouped["images"][3], batched["images"][1])
    assert torch.equal(grouped["images"][2], batched["images"][0])


@pytest.fixture(scope="module")
def policy(sft_checkpoint):
    """A briefly trained policy: its returns differ from episode to episode (dense reward)."""
    return sft_checkpoint


def episodes(path) -> dict[int, dict]:
    return {e["episode_seed"]: e for e in json.loads(path.read_text())["episodes"]}


def same_outcomes(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert sorted(a) == sorted(b)
    for s in a:
        assert (a[s]["success_once"], a[s]["success_at_end"], a[s]["length"]) == \
               (b[s]["success_once"], b[s]["success_at_end"], b[s]["length"]), s
        assert a[s]["return"] == pytest.approx(b[s]["return"], abs=1e-5), s


@pytest.mark.parametrize("method", ["ode", "sde"])
def test_vla_rl_eval_gives_the_same_episodes_with_10_or_40_envs(policy, tmp_path, method):
    runs = {}
    for n in (10, 40):
        out = tmp_path / f"{method}_{n}.json"
        assert cli_main(["eval", str(policy), "episodes=40", f"num_envs={n}", f"sampler.method={method}", f"out={out}",
                         "env.builtin.max_episode_steps=16", "threads=1", "progress=false"]) == 0
        runs[n] = episodes(out)
    same_outcomes(runs[10], runs[40])
    returns = [e["return"] for e in runs[40].values()]
    assert len(set(returns)) > 30                     # the episodes differ: the equality above says something


def test_worker_envs_play_the_episodes_of_the_in_process_env(policy):
    """The built-in task in worker processes (one env per seed, as ManiSkill and LIBERO run) gives the episodes
    the batched in-process env gives: 10 envs on 2 workers against 40 in one batch."""
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.policies.actor import Actor

    model, norm, _ = load_policy(policy)
    cfg = ColorReachConfig(**SHORT)
    sampler = SamplerConfig(4, "noise")
    results = {}
    for name, env in (("local", ColorReachEnv(40, config=cfg)),
                      ("w10", WorkerVectorEnv(functools.partial(ColorReachSingleEnv, cfg), 10, envs_per_worker=5))):
        try:
            recs = evaluate_episodes(Actor.for_env(model, norm, env.spec), env, num_episodes=40, sampler=sampler,
                                     execute=8, seed=30_000)
        finally:
            env.close()
        results[name] = {r["episode_seed"]: r for r in recs}
    same_outcomes(results["local"], results["w10"])
    assert len({r["return"] for r in results["local"].values()}) > 30
