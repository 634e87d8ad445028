"""The flow policy: cache equivalence, attention structure, heads, presets, input errors."""

import pytest
import torch
from helpers import make_obs, perturbed_model

from vla_rl.core.ranges import ConfigError
from vla_rl.policies import flow
from vla_rl.policies.model import FlowPolicy, count_parameters
from vla_rl.presets import policy_preset

PRESETS = ["tiny", "tiny_pi05"]


@pytest.mark.parametrize("name", PRESETS)
def test_cached_prefix_equals_uncached_joint_pass(name):
    model = perturbed_model(name)
    cfg = model.cfg
    obs = make_obs(cfg, 5)
    x_t = torch.randn(5, cfg.action_horizon, cfg.action_dim)
    t = torch.rand(5)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        cached = model.expert(prefix, x_t, t)
        prefix_hidden, joint = model.forward_joint(obs, x_t, t)
    for a, b in [(cached.velocity, joint.velocity), (cached.noise_std, joint.noise_std),
                 (cached.value, joint.value), (prefix.hidden, prefix_hidden)]:
        assert (a - b).abs().max().item() <= 1e-5
    assert cached.velocity.abs().mean() > 1e-3  # not trivially zero


@pytest.mark.parametrize("name", PRESETS)
def test_cached_sampler_equals_uncached_sampler(name):
    model = perturbed_model(name)
    cfg = model.cfg
    obs = make_obs(cfg, 3)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        cached = flow.sample(model.field(prefix), noise, num_steps=5, method="ode")

        def uncached(x, t):
            out = model.forward_joint(obs, x, t)[1]
            return out.velocity, out.noise_std

        full = flow.sample(uncached, noise, num_steps=5, method="ode")
    assert (cached.actions - full.actions).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", PRESETS)
def test_action_tokens_never_change_prefix_outputs(name):
    model = perturbed_model(name)
    cfg = model.cfg
    obs = make_obs(cfg, 2)
    with torch.no_grad():
        h1, out1 = model.forward_joint(obs, torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2))
        h2, out2 = model.forward_joint(obs, torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2))
    assert torch.equal(h1, h2)
    assert not torch.allclose(out1.velocity, out2.velocity)


def test_padding_tokens_do_not_leak_into_outputs():
    model = perturbed_model("tiny")
    cfg = model.cfg
    obs = make_obs(cfg, 1)
    prepared = model.prepare(obs)
    garbage = prepared["tokens"].clone()
    garbage[~prepared["token_mask"]] = 7  # change only padded positions
    x_t, t = torch.randn(1, cfg.action_horizon, cfg.action_dim), torch.rand(1)
    with torch.no_grad():
        a = model.expert(model.encode_prefix(prepared), x_t, t).velocity
        b = model.expert(model.encode_prefix({**prepared, "tokens": garbage}), x_t, t).velocity
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_instruction_changes_the_velocity():
    model = perturbed_model("tiny")
    cfg = model.cfg
    obs = make_obs(cfg, 1)
    x_t, t = torch.randn(1, cfg.action_horizon, cfg.action_dim), torch.rand(1)
    with torch.no_grad():
        a = model.velocity(model.encode_prefix(obs), x_t, t)
        b = model.velocity(model.encode_prefix({**obs, "instruction": ["something else"]}), x_t, t)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("name", [*PRESETS, "tiny_smolvla"])
def test_noise_std_is_bounded(name):
    model = perturbed_model(name)
    cfg = model.cfg
    with torch.no_grad():
        model.noise_head.weight.mul_(100.0)  # push tanh into saturation on both sides
        prefix = model.encode_prefix(make_obs(cfg, 8))
        std = model.noise_std(prefix, torch.randn(8, cfg.action_horizon, cfg.action_dim) * 5, torch.rand(8))
    assert std.min() >= cfg.noise_std_min - 1e-6 and std.max() <= cfg.noise_std_max + 1e-6
    assert std.max() - std.min() > 0.5 * (cfg.noise_std_max - cfg.noise_std_min)


@pytest.mark.parametrize("name, overrides", [("tiny", None), ("tiny_pi05", None),
                                             ("tiny", {"state_input": "suffix"}), ("tiny_smolvla", None)])
def test_parameter_groups_are_what_the_prefix_and_the_value_read(name, overrides):
    """The prefix group is exactly the parameters the prefix's outputs depend on; the value group is the head."""
    model = perturbed_model(name, overrides)
    groups = model.parameter_groups()
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for g in groups.values() for n in g) == sorted(names)   # a partition
    prefix = model.encode_prefix(model.prepare(make_obs(model.cfg, 2)))
    (sum(k.sum() + v.sum() for k, v in zip(prefix.keys, prefix.values)) + prefix.hidden.sum()).backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == set(groups["prefix"])
    assert set(groups["value"]) == {n for n in names if n.startswith("value_head.")}


@pytest.mark.parametrize("source", ["expert", "prefix"])
def test_value_head_source_and_stop_gradient(source):
    for detach in (False, True):
        torch.manual_seed(0)
        model = FlowPolicy(policy_preset("tiny", {"value_source": source, "value_detach": detach}))
        cfg = model.cfg
        prefix = model.encode_prefix(make_obs(cfg, 2))
        value = model.value(prefix, torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2))
        assert value.shape == (2,)
        value.sum().backward()
        backbone_grad = model.prefix_layers[0].q_proj.weight.grad
        head_grad = model.value_head[0].weight.grad
        assert head_grad is not None and head_grad.abs().sum() > 0
        if detach:
            assert backbone_grad is None or backbone_grad.abs().sum() == 0
        else:
            assert backbone_grad is not None and backbone_grad.abs().sum() > 0


def test_model_flow_log_prob_recompute_is_ratio_one():
    model = perturbed_model("tiny")
    cfg = model.cfg
    obs = make_obs(cfg, 6)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        for method, mode in [("sde", "mixed"), ("sde", "all"), ("noise", "all")]:
            out = flow.sample(model.field(prefix), torch.randn(6, cfg.action_horizon, cfg.action_dim),
                              num_steps=4, method=method, sde_mode=mode)
            re = flow.chain_log_prob(model.field(prefix), out.chain, out.stochastic, method=method)
            old = flow.aggregate(out.log_probs, out.stochastic)
            new = flow.aggregate(re.log_probs, out.stochastic)
            torch.testing.assert_close(torch.exp(new - old), torch.ones(6), atol=1e-5, rtol=0)


def test_images_of_other_size_are_resized():
    model = perturbed_model("tiny")
    obs = make_obs(model.cfg, 2, size=48)
    with torch.no_grad():
        assert model.encode_prefix(obs).hidden.shape[0] == 2


def test_real_pi0_dimensions_build_on_meta_device():
    for name, lo, hi in [("pi0", 3.0e9, 3.6e9), ("pi05", 3.0e9, 3.6e9)]:
        with torch.device("meta"):
            model = FlowPolicy(policy_preset(name))
        n = count_parameters(model)
        assert lo < n < hi, (name, n)
        cfg = model.cfg
        assert model.prefix_layers[0].k_proj.weight.shape == (256, 2048)  # one KV head of 256
        assert model.expert_layers[0].q_proj.weight.shape == (8 * 256, 1024)
        assert len(model.prefix_layers) == len(model.expert_layers) == 18
        # A meta forward pass checks every shape without allocating memory.
        obs = {
            "images": torch.zeros(1, 3, 224, 224, 3, dtype=torch.uint8, device="meta"),
            "state": torch.zeros(1, 32, device="meta"),
            "tokens": torch.zeros(1, cfg.max_text_tokens, dtype=torch.long, device="meta"),
            "token_mask": torch.ones(1, cfg.max_text_tokens, dtype=torch.bool, device="meta"),
        }
        prefix = model.encode_prefix(obs)
        out = model.expert(prefix, torch.zeros(1, 50, 32, device="meta"), torch.zeros(1, device="meta"))
        assert out.velocity.shape == (1, 50, 32)
        assert prefix.keys[0].shape == (1, 1, cfg.num_prefix_tokens, 256)
        # π0's state is in the suffix, π0.5's in the text
        assert cfg.num_prefix_tokens == 3 * 256 + cfg.max_text_tokens


def test_bad_observations_get_clear_errors():
    model = perturbed_model("tiny")
    cfg = model.cfg
    obs = make_obs(cfg, 2)
    with pytest.raises(ValueError, match=r"scaled to \[-1, 1\].*uint8"):   # 0..255 pixels as floats
        model.encode_prefix({**obs, "images": obs["images"].float()})
    with pytest.raises(TypeError, match="uint8"):
        model.encode_prefix({**obs, "images": obs["images"].long()})
    with pytest.raises(ValueError, match="images must have shape"):
        model.encode_prefix({**obs, "images": obs["images"][:, :, :, :, :1]})
    with pytest.raises(ValueError, match="state must have shape"):
        model.encode_prefix({**obs, "state": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="NaN"):
        model.encode_prefix({**obs, "state": torch.full((2, cfg.state_dim), float("nan"))})
    with pytest.raises(ValueError, match="instructions"):
        model.encode_prefix({**obs, "instruction": ["only one"]})
    with pytest.raises(KeyError, match="state"):
        model.encode_prefix({"images": obs["images"], "instruction": obs["instruction"]})
    prefix = model.encode_prefix(obs)
    with pytest.raises(ValueError, match="x_t must have shape"):
        model.expert(prefix, torch.zeros(2, 3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="batch"):
        model.expert(prefix, torch.zeros(3, cfg.action_horizon, cfg.action_dim), torch.zeros(3))


def test_unknown_or_mistyped_config_keys_are_errors():
    with pytest.raises(ConfigError, match="unknown config key.*expert.widht"):
        policy_preset("tiny", {"expert": {"widht": 3}})
    with pytest.raises(ConfigError, match="depth: expected an integer"):
        policy_preset("tiny", {"depth": "three"})
    with pytest.raises(ConfigError, match="time_conditioning"):
        policy_preset("tiny", {"time_conditioning": "film"})
    with pytest.raises(ConfigError, match="unknown model preset"):
        policy_preset("nope")
    with pytest.raises(ValueError, match="num_heads must be a multiple"):
        policy_preset("tiny", {"num_kv_heads": 3})


def test_state_only_policy_has_no_image_tokens_and_uses_the_state():
    """num_cameras=0 (ManiSkill state observations): the prefix is text + state tokens only; the velocity
    depends on the state, and a camera where none is expected is an error."""
    cfg = policy_preset("tiny", {"num_cameras": 0, "state_dim": 35, "action_dim": 7})
    assert cfg.num_prefix_tokens == cfg.max_text_tokens + 1
    torch.manual_seed(0)
    model = FlowPolicy(cfg).eval()
    obs = make_obs(cfg, 3)
    assert tuple(obs["images"].shape) == (3, 0, 32, 32, 3)
    tokens, mask = model.embed_prefix(obs)
    assert tokens.shape[:2] == (3, cfg.num_prefix_tokens) and mask.shape == (3, cfg.num_prefix_tokens)
    x, t = torch.randn(3, cfg.action_horizon, 7), torch.full((3,), 0.5)
    v1 = model.field(model.encode_prefix(obs))(x, t)[0]
    v2 = model.field(model.encode_prefix({**obs, "state": obs["state"] + 1.0}))(x, t)[0]
    assert v1.shape == (3, cfg.action_horizon, 7) and not torch.allclose(v1, v2)
    with pytest.raises(ValueError, match=r"images must have shape \[N, 0"):
        model.embed_prefix({**obs, "images": torch.zeros(3, 1, 32, 32, 3, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"num_cameras = -1 is outside its valid range \[0, inf\)"):
        policy_preset("tiny", {"num_cameras": -1})
