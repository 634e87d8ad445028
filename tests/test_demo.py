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
    model, norm, _ = load_policy(out / "sft")
    assert (norm.state.mean.shape[0], norm.action.mean.shape[0]) == (4, 2)   # the built-in task's state / action
    assert (out / "rl" / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
