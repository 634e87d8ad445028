"""SmolVLA (policies/smolvla.py) as the rest of vla-rl sees it: real-size parameters, the sampling fast path, its
attention structure, the seam's layer groups and idle parameters, LoRA and recompute, config checks. Exactness
against LeRobot itself: tests/checkpoint/test_lerobot_smolvla.py."""

import pytest
import torch
from helpers import make_obs, perturbed_model

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.policies import flow
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.lora import LoRAConfig, apply_lora, lora_layers
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.recompute import activation_checkpointing
from vla_rl.presets import policy_preset

# LeRobot's SmolVLAPolicy(SmolVLAConfig()) on SmolVLM2-500M has 450,046,176 parameters (on meta tensors; see
# tests/fixtures/lerobot_smolvla_tiny/NOTES.md), of which SmolVLM2's lm_head (47,308,800) is never read.
LEROBOT_SMOLVLA, LM_HEAD = 450_046_176, 47_308_800


def test_real_smolvla_has_lerobots_parameters_on_the_meta_device():
    with torch.device("meta"):
        model = make_policy(policy_preset("smolvla"))
    ours = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("noise_head.", "value_head.")))
    assert ours == LEROBOT_SMOLVLA - LM_HEAD
    assert model.cfg.num_prefix_tokens == 3 * 64 + 48 + 1   # 64 tokens a camera after the pixel shuffle


def test_the_sampling_fast_path_equals_the_expert_pass():
    model = perturbed_model("tiny_smolvla")
    cfg = model.cfg
    obs = make_obs(cfg, 3, size=40)
    x, t = torch.randn(3, cfg.action_horizon, cfg.action_dim), torch.rand(3)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        slow = model.expert(prefix, x, t).velocity
        fast = model.velocity_field(prefix)
        assert torch.equal(fast(x, t), slow) and torch.equal(fast(x, t), slow)   # buffers reused: still equal
        lean = model.encode_prefix(obs, hidden=False)
        assert lean.hidden is None and all(torch.equal(a, b) for a, b in zip(lean.keys, prefix.keys))
    assert slow.abs().mean() > 1e-3


def test_action_tokens_are_causal_and_masked_inputs_change_nothing():
    """SmolVLA's action tokens see earlier actions only; a masked camera's pixels and padded text do not matter."""
    model = perturbed_model("tiny_smolvla", {"num_cameras": 2, "missing_cameras": "mask"})
    cfg = model.cfg
    obs = make_obs(cfg, 2)
    x, t = torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2)
    later = x.clone()
    later[:, -1] += 1.0
    masked = {**obs, "image_mask": torch.tensor([[True, False], [True, False]])}
    other = {**masked, "images": obs["images"].clone()}
    other["images"][:, 1] = 255 - other["images"][:, 1]
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        a, b = model.velocity(prefix, x, t), model.velocity(prefix, later, t)
        assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])
        m1 = model.velocity(model.encode_prefix(masked), x, t)
        m2 = model.velocity(model.encode_prefix(other), x, t)
    torch.testing.assert_close(m1, m2, atol=1e-6, rtol=0)


def test_idle_parameters_get_no_gradient_and_the_others_do():
    """What idle_parameters names (the memory plan gives it no gradient or optimizer state) is exactly what the
    losses of an update never reach: a flow-matching loss, the chain's std head and the value."""
    model = perturbed_model("tiny_smolvla").train()
    cfg = model.cfg
    obs = make_obs(cfg, 2)
    prefix = model.encode_prefix(obs)
    x, t = torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2)
    out = model.expert(prefix, x, t)
    (out.velocity.sum() + out.noise_std.sum() + out.value.sum()).backward()
    untouched = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()}
    assert untouched == model.idle_parameters(noise_head=True)
    assert model.idle_parameters(noise_head=False) - untouched == {"noise_head.weight", "noise_head.bias"}


def test_layer_groups_cover_every_block_and_lora_adapts_both_parts():
    model = perturbed_model("tiny_smolvla")
    groups = model.layer_groups()
    assert [g.part for g in groups] == ["prefix", "prefix", "expert"]
    assert sum(len(g.modules) for g in groups) == model.cfg.vision.depth + 2 * model.cfg.depth
    adapted = apply_lora(model, LoRAConfig(rank=4, parts=("prefix", "expert"),
                                           targets=("qkv", "q_proj", "k_proj", "v_proj")))
    layers = lora_layers(model)
    assert adapted and set(adapted) == set(layers)
    assert any(n.startswith("expert_layers.1.k_proj") for n in layers)   # a cross layer's prefix-wide k_proj
    assert any(n.startswith("vision_blocks.") for n in layers)


def test_recomputed_layers_give_the_same_gradients():
    torch.manual_seed(0)
    model = make_policy(policy_preset("tiny_smolvla")).train()
    cfg = model.cfg
    obs = make_obs(cfg, 2)
    actions, t, noise = torch.randn(2, cfg.action_horizon, cfg.action_dim), torch.rand(2), torch.randn(2, 8, 4)

    def grads():
        model.zero_grad()
        loss = flow.flow_matching_errors(model.field(model.encode_prefix(obs)), actions, t, noise).mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    with activation_checkpointing(model, "all"):
        again = grads()
    assert plain.keys() == again.keys()
    assert max((plain[n] - again[n]).abs().max().item() for n in plain) <= 1e-6


@pytest.mark.parametrize("change, says", [
    ({"time_conditioning": "adarms"}, "SmolVLA conditions on time by concatenation"),
    ({"smolvla": {"pixel_shuffle": 3}}, "smolvla.pixel_shuffle 3 must divide the 8 patches a side"),
    ({"depth": 4, "smolvla": {"expert_depth": 3}}, "smolvla.expert_depth 3 must divide depth 4"),
    ({"depth": 4, "smolvla": {"expert_depth": 2, "self_attn_every": 2}}, "would run an expert layer built for"),
])
def test_smolvla_settings_that_cannot_work_are_refused(change, says):
    from vla_rl.presets import merge, preset_path, read_yaml

    base = read_yaml(preset_path("model", "tiny_smolvla"))
    with pytest.raises(ConfigError, match=says):
        from_dict(PolicyConfig, merge(base, change))


def test_the_smolvla_section_belongs_to_smolvla():
    with pytest.raises(ConfigError, match="the smolvla section is for arch smolvla, not pi0"):
        from_dict(PolicyConfig, {"arch": "pi0", "smolvla": {"pixel_shuffle": 2}})
    assert policy_preset("tiny").smolvla is None and policy_preset("tiny_smolvla").smolvla.pixel_shuffle == 2
