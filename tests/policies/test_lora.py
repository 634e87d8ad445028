"""LoRA adapters: a zero-initialised adapter changes nothing; merged weights compute what the adapters do; a PPO
update moves (and the optimizer holds state for) the trainable set only; checkpoints keep the adapters apart, a
resumed LoRA run repeats the uninterrupted one, and eval / export see the merged policy."""

import copy
import json

import pytest
import torch
from helpers import make_obs, perturbed_model, train_config

from vla_rl.checkpoint.policy import load_policy
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.lora import LoRAConfig, LoRALinear, apply_lora, lora_layers, merge_lora
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import collect_rollout
from vla_rl.train.trainer import TrainConfig, Trainer, resume_trainer

SMALL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
BOTH = LoRAConfig(rank=4, alpha=8.0, parts=("prefix", "expert"))


def outputs(model, n=3, seed=0):
    cfg = model.cfg
    obs = make_obs(cfg, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x_t, t = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=g), torch.rand(n, generator=g)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        out = model.expert(prefix, x_t, t)
    return torch.cat([out.velocity.flatten(), out.noise_std.flatten(), out.value.flatten(), prefix.hidden.flatten()])


@pytest.mark.parametrize("preset", ["tiny", "tiny_pi05"])
def test_zero_initialised_adapters_give_the_base_model_exactly(preset):
    base = perturbed_model(preset, SMALL)
    adapted = copy.deepcopy(base)
    names = apply_lora(adapted, BOTH)
    cfg = adapted.cfg
    # every targeted linear layer of both streams and the vision blocks: 7 per stream layer, 4 per ViT block
    assert len(names) == len(lora_layers(adapted)) == 2 * 7 * cfg.depth + 4 * cfg.vision.depth
    assert isinstance(adapted.prefix_layers[0].q_proj, LoRALinear)
    assert not any(m.training for m in lora_layers(adapted).values())   # an eval-mode model stays in eval mode
    assert not isinstance(adapted.velocity_head, LoRALinear)   # the heads are never adapted
    assert torch.equal(outputs(adapted), outputs(base))
    assert apply_lora(adapted, BOTH) == names                  # idempotent: nothing adapted twice
    assert all(not isinstance(m.weight, LoRALinear) for m in lora_layers(adapted).values())


def test_merged_weights_compute_what_the_adapters_do():
    model = perturbed_model("tiny", SMALL)
    apply_lora(model, BOTH)
    with torch.no_grad():   # non-zero B: the adapters now change the outputs
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 0.05)
    want = outputs(model)
    assert not torch.allclose(want, outputs(perturbed_model("tiny", SMALL)), atol=1e-3)
    merged = merge_lora(copy.deepcopy(model))
    assert not lora_layers(merged)
    assert set(merged.state_dict()) == set(perturbed_model("tiny", SMALL).state_dict())
    assert (outputs(merged) - want).abs().max().item() < 1e-5


def small_rollout(model, norm):
    env = ColorReachEnv(8, config=ColorReachConfig(max_episode_steps=6), seed=0)
    actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
    ro, _ = collect_rollout(actor, env, env.reset(seed=1), num_chunks=2, sampler=SamplerConfig(3, "noise"),
                            execute=4, generator=torch.Generator().manual_seed(0))
    return actor, ro


@pytest.mark.parametrize("lora", [LoRAConfig(rank=4), BOTH])
def test_ppo_moves_only_the_trainable_set_and_the_optimizer_holds_state_for_it_alone(lora):
    model = perturbed_model("tiny", SMALL)
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
    learner = Learner(actor, LearnerConfig(update_epochs=1, minibatches=2, lr_actor=1e-3, lora=lora), PPO(PPOConfig()))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    groups = model.parameter_groups()
    # prefix: adapters only; expert: all but its adapted layers' base weights; heads: all
    assert {n for n in groups["prefix"] if n in trainable} == {n for n in groups["prefix"] if "lora_" in n}
    assert set(groups["value"]) <= trainable
    assert {"velocity_head.weight", "noise_head.weight", "action_in.weight"} <= trainable
    expert_bases = {n for n in groups["expert"] if n.startswith("expert_layers.") and "lora_" not in n}
    assert (expert_bases & trainable == set()) == ("expert" in lora.parts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, ro = small_rollout(model, norm)
    learner.update(ro, iteration=0)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved <= trainable
    assert any("lora_B" in n for n in moved) and "velocity_head.weight" in moved
    state = learner.optimizer.state
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p in state} <= trainable
    assert len(state) > 0 and all(params[n].requires_grad for n in params if params[n] in state)
    held = sum(p.numel() for p in learner.params)
    assert held == sum(params[n].numel() for n in trainable)


def test_lora_config_is_checked():
    with pytest.raises(ConfigError, match="freeze_prefix freezes the prefix"):
        from_dict(TrainConfig, {"learner": {"freeze_prefix": True, "lora": {"rank": 8}}})
    from_dict(TrainConfig, {"learner": {"freeze_prefix": True, "lora": {"rank": 8, "parts": ["expert"]}}})
    with pytest.raises(ConfigError, match="lora.parts"):
        from_dict(TrainConfig, {"learner": {"lora": {"rank": 8, "parts": ["vision"]}}})
    with pytest.raises(ConfigError, match="lora.targets"):
        from_dict(TrainConfig, {"learner": {"lora": {"rank": 8, "targets": ["qproj"]}}})
    with pytest.raises(ConfigError, match="learner.lora.rank"):
        from_dict(TrainConfig, {"learner": {"lora": {"rank": -1}}})
    # a selection that adapts no layer of a part would train as if there were no LoRA: refused, naming its layers
    with pytest.raises(ConfigError, match=r"select no layer of the expert: its layers are \['q_proj'"):
        from_dict(TrainConfig, {"learner": {"lora": {"rank": 8, "parts": ["expert"], "targets": ["qkv"]}}})
    from_dict(TrainConfig, {"learner": {"lora": {"rank": 8, "parts": ["prefix"], "targets": ["qkv"]}}})


def strip_time(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


def test_lora_run_resumes_exactly_and_its_checkpoints_merge_for_eval_and_export(sft_checkpoint, tmp_path):
    from vla_rl.interop.export import export_policy
    from vla_rl.policies.exported import load_exported

    lora = {"lora": {"rank": 4, "alpha": 8.0, "parts": ["prefix", "expert"], "dropout": 0.1},
            "update_epochs": 1, "minibatches": 2, "lr_actor": 1e-3}
    quiet = lambda *_: None  # noqa: E731
    full_trainer = Trainer(train_config(sft_checkpoint, tmp_path / "full", learner=lora), log=quiet)
    full = full_trainer.run()
    Trainer(train_config(sft_checkpoint, tmp_path / "part", learner=lora, iterations=1), log=quiet).run()
    resumed = resume_trainer(tmp_path / "part", overrides={"iterations": 2}, log=quiet)
    assert strip_time(resumed.run()) == strip_time(full)
    ckpt = tmp_path / "full" / "checkpoints" / "iter_000002"
    meta = (ckpt / "config.yaml").read_text()
    assert "lora:" in meta and (ckpt / "adapters.safetensors").is_file()
    # eval / init read the merged policy: the training model's outputs, without adapters
    merged, _, _ = load_policy(ckpt)
    assert not lora_layers(merged)
    live = full_trainer.actor.model
    assert lora_layers(live) and (outputs(merged) - outputs(live.eval())).abs().max().item() < 1e-5
    out = export_policy(ckpt, tmp_path / "export", dtype="fp32")
    assert json.loads((out / "config.json").read_text())["dtype"] == "fp32"
    exported = load_exported(out)
    assert (outputs(exported.model) - outputs(merged)).abs().max().item() < 1e-6


def test_resume_refuses_other_lora_settings_by_name(sft_checkpoint, tmp_path):
    """The checkpoints hold the run's adapters: another rank would make every one look damaged ("unusable"), so the
    override is refused by name, as init= and model= are."""
    from vla_rl.train.trainer import resume_trainer

    lora = {"lora": {"rank": 4}, "update_epochs": 1, "minibatches": 2}
    Trainer(train_config(sft_checkpoint, tmp_path / "run", learner=lora, iterations=1), log=lambda *_: None).run()
    with pytest.raises(ConfigError, match=r"learner.lora cannot change on a resumed run.*'rank': 4"):
        resume_trainer(tmp_path / "run", overrides={"learner": {"lora": {"rank": 8}}}, log=lambda *_: None)
    resumed = resume_trainer(tmp_path / "run", overrides={"iterations": 2, "learner": {"lora": {"rank": 4}}},
                             log=lambda *_: None)
    assert resumed.iteration == 1

