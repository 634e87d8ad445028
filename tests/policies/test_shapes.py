"""The tensor shapes written in the hot path's signatures (policies/flow.py, policies/model.py, rl/) hold at run
time: a fresh interpreter installs jaxtyping's import hook with beartype on those modules, runs the tiny preset
through PPO with Flow-Noise, GRPO with Flow-SDE and FPO with the ODE sampler on the built-in task (sampling, chain
likelihoods, CFM losses, advantages, losses, evaluation), and a deliberately misshapen call is refused."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jaxtyping")
pytest.importorskip("beartype")

SCRIPT = textwrap.dedent("""
    import tempfile
    from jaxtyping import install_import_hook
    HOT = ["vla_rl.policies.flow", "vla_rl.policies.model", "vla_rl.rl.advantages", "vla_rl.rl.losses",
           "vla_rl.rl.algorithms"]
    with install_import_hook(HOT, "beartype.beartype"):
        import vla_rl.policies.flow, vla_rl.policies.model, vla_rl.rl.advantages, vla_rl.rl.losses  # noqa
        import vla_rl.rl.algorithms  # noqa
    import torch
    from vla_rl.core.schema import from_dict
    from vla_rl.policies import flow
    from vla_rl.train.trainer import TrainConfig, Trainer

    for method, name in (("noise", "ppo"), ("sde", "grpo"), ("ode", "fpo")):
        section = {"group_size": 2} if name == "grpo" else {}
        cfg = from_dict(TrainConfig, {
            "env": {"num_envs": 4, "builtin": {"max_episode_steps": 8}}, "rollout_chunks": 2, "execute": 4,
            "iterations": 1, "eval_every": 1, "eval_episodes": 4, "out": tempfile.mkdtemp(), "progress": False,
            "tensorboard": False, "threads": 1, "sampler": {"method": method, "num_steps": 3},
            "algorithm": {"name": name, name: section}, "learner": {"update_epochs": 1, "minibatches": 2}})
        Trainer(cfg, log=lambda *a: None).run()
        print("ran", name, method)
    actions = torch.zeros(2, 3, 4)
    print("cfm", tuple(flow.flow_matching_loss(lambda x, t: x, actions)[0].shape))
    try:
        flow.sample(lambda x, t: x, torch.zeros(2, 3, 4), num_steps=2, stochastic=torch.zeros(3, 2, dtype=torch.bool))
    except Exception as e:
        print("refused", type(e).__name__)
""")


def test_hot_path_shapes_hold_on_the_tiny_preset():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.split("\n")
    assert {"ran ppo noise", "ran grpo sde", "ran fpo ode", "cfm ()"} <= set(lines), out.stdout
    assert "refused TypeCheckError" in lines, out.stdout   # the hook is really checking
