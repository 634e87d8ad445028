"""The deployment / evaluation fast path gives the reference path's actions: the ODE sampler without step
noise, densities or chain (flow.denoise), through the actor and the exported policy."""

import pytest
import torch
from helpers import make_obs, perturbed_model

from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.normalize import NormStats, Stats

PRESETS = ["tiny", "tiny_pi05"]


def norm_for(cfg) -> NormStats:
    g = torch.Generator().manual_seed(0)
    return NormStats(Stats.of(torch.randn(64, cfg.state_dim, generator=g)),
                     Stats.of(torch.randn(64, cfg.action_dim, generator=g)))


@pytest.mark.parametrize("name", PRESETS)
def test_actor_chunk_equals_act_for_the_ode_sampler(name):
    model = perturbed_model(name)
    actor = Actor(model, norm_for(model.cfg))
    obs = make_obs(model.cfg, 4)
    sampler = SamplerConfig(5, "ode")
    with torch.inference_mode():
        reference = actor.act(actor.observe(obs), sampler, generator=torch.Generator().manual_seed(7)).actions
        fast = actor.chunk(obs, sampler, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fast, reference)


def test_actor_chunk_with_a_stochastic_sampler_is_act():
    model = perturbed_model("tiny")
    actor = Actor(model, norm_for(model.cfg))
    obs = make_obs(model.cfg, 3)
    sampler = SamplerConfig(4, "sde", sde_mode="all")
    with torch.inference_mode():
        reference = actor.act(actor.observe(obs), sampler, generator=torch.Generator().manual_seed(3)).actions
        chunk = actor.chunk(obs, sampler, generator=torch.Generator().manual_seed(3))
    assert torch.equal(chunk, reference)


@pytest.mark.parametrize("name", PRESETS)
def test_prefix_for_sampling_has_the_same_keys_and_values(name):
    model = perturbed_model(name)
    obs = make_obs(model.cfg, 3)
    with torch.inference_mode():
        full = model.encode_prefix(obs)
        lean = model.encode_prefix(obs, hidden=False)
    assert lean.hidden is None and full.hidden is not None
    assert len(lean.keys) == len(full.keys) == model.cfg.depth
    for a, b in zip(full.keys + full.values, lean.keys + lean.values):
        assert torch.equal(a, b)
    assert lean.repeat(2).batch_size == 6


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_velocity_field_equals_the_expert_velocity_bit_for_bit(name, mode):
    model = perturbed_model(name)
    cfg = model.cfg
    obs = make_obs(cfg, 3)
    scope = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    g = torch.Generator().manual_seed(1)
    with scope():
        prefix = model.encode_prefix(obs)
        field = model.velocity_field(prefix)
        for _ in range(3):   # the buffers are reused from call to call
            x_t = torch.randn(3, cfg.action_horizon, cfg.action_dim, generator=g)
            t = torch.rand(3, generator=g)
            assert torch.equal(field(x_t, t), model.expert(prefix, x_t, t).velocity)


@pytest.mark.parametrize("name", PRESETS)
def test_fast_sampler_equals_reference_and_uncached_samplers(name):
    model = perturbed_model(name)
    cfg = model.cfg
    obs = make_obs(cfg, 4)
    noise = torch.randn(4, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        fast = flow.denoise(model.velocity_field(model.encode_prefix(obs, hidden=False)), noise, num_steps=6)
        reference = flow.sample(model.field(model.encode_prefix(obs)), noise, num_steps=6, method="ode")

        def uncached(x, t):
            out = model.forward_joint(obs, x, t)[1]
            return out.velocity, out.noise_std

        joint = flow.sample(uncached, noise, num_steps=6, method="ode")
    assert torch.equal(fast, reference.actions)
    assert (fast - joint.actions).abs().max().item() <= 1e-5
    assert fast.abs().mean() > 1e-3


def test_prefix_value_needs_the_hidden_states():
    model = perturbed_model("tiny_pi05")
    assert model.cfg.value_source == "prefix"
    with torch.inference_mode():
        prefix = model.encode_prefix(make_obs(model.cfg, 2), hidden=False)
        with pytest.raises(ValueError, match="hidden=False"):
            model.value(prefix)
