"""`vla-rl demo` (the README's main command) end to end at toy size: SFT, the sampler table, RL, and the
before / after evaluation on the same episodes."""

from vla_rl.checkpoint.policy import load_policy
from vla_rl.cli import main as cli_main


def test_demo_runs_sft_then_rl_then_evaluates(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli_main(["demo", "demos=2", "sft.steps=5", "sft.warmup_steps=1", "eval_episodes=8", "rl_iterations=1",
                   f"out={out}", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ODE (deterministic)" in text and "Flow-Noise" in text
    assert "SFT " in text and "-> after RL" in text
    assert "expected lift" not in text   # measured for the default settings only
    model, norm, _ = load_policy(out / "sft")
    assert (norm.state.mean.shape[0], norm.action.mean.shape[0]) == (4, 2)   # the built-in task's state / action
    assert (out / "rl" / "checkpoints" / "iter_000001" / "model.safetensors").is_file()


def test_demo_rl_stage_stabilisers_reach_the_rl_config(tmp_path):
    from vla_rl.core.schema import from_dict
    from vla_rl.presets import parse_overrides
    from vla_rl.train.demo import DemoConfig, demo_train_config

    learner = demo_train_config(DemoConfig(), tmp_path / "sft", out=tmp_path / "rl").learner
    assert (learner.critic_warmup_iters, learner.actor_lr_warmup_iters, learner.target_kl) == (0, 0, None)
    assert learner.lr_actor == 5e-5 and learner.actor_lr_decay == "cosine"   # the rest is the preset's
    on = from_dict(DemoConfig, parse_overrides(["rl_critic_warmup=3", "rl_actor_lr_warmup=5", "rl_target_kl=0.05",
                                                "rl=builtin_flow_noise"]))
    learner = demo_train_config(on, tmp_path / "sft", out=tmp_path / "rl").learner
    assert (learner.critic_warmup_iters, learner.actor_lr_warmup_iters, learner.target_kl) == (3, 5, 0.05)
    assert learner.lr_actor == 4e-5
    # an explicit override of the RL stage (bench_robustness --set) wins over the demo's field
    learner = demo_train_config(on, tmp_path / "sft", out=tmp_path / "rl",
                                overrides={"learner": {"target_kl": 0.2}}).learner
    assert learner.target_kl == 0.2 and learner.critic_warmup_iters == 3
    # unset fields keep the preset's own stabilisers (the PickCube preset warms its critic up for 3 iterations)
    learner = demo_train_config(DemoConfig(rl="maniskill_pickcube_flow_noise"), tmp_path / "sft",
                                out=tmp_path / "rl").learner
    assert (learner.critic_warmup_iters, learner.actor_lr_warmup_iters, learner.target_kl) == (3, 10, 0.2)


def test_demo_states_what_to_expect_only_for_the_measured_settings():
    from vla_rl.train.demo import MEASURED_LIFT, DemoConfig, demo_expectation

    lo, med, hi, n = MEASURED_LIFT
    assert lo <= med <= hi and n >= 1
    text = demo_expectation(DemoConfig(out="elsewhere"))
    assert f"{lo:+.2f} to {hi:+.2f}, median {med:+.2f}, over {n} runs" in text
    assert demo_expectation(DemoConfig(rl_iterations=40)) is None
    assert demo_expectation(DemoConfig(rl="builtin_flow_noise")) is None
