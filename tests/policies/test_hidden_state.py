"""Hidden state dims (``hidden_state_dims``): the policy never sees them, in SFT, RL and evaluation alike."""

import json

import pytest
import torch

from vla_rl.checkpoint.policy import load_policy, save_policy
from vla_rl.core.errors import CheckpointError
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats, parse_dims
from vla_rl.presets import policy_preset


def test_parse_dims_known_answers_and_errors():
    assert parse_dims("9-17", 42) == tuple(range(9, 18))
    assert parse_dims("9-11, 20", 42) == (9, 10, 11, 20)
    assert parse_dims([3, 1, 3], 42) == (1, 3)
    assert parse_dims(5, 42) == (5,)
    assert parse_dims(None, 42) == () and parse_dims("", 42) == () and parse_dims([], 42) == ()
    for bad, msg in [("17-9", "bad state dim"), ("x", "bad state dim"), ([True], "bad state dim"),
                     ("9:18", "bad state dim"), (42, r"outside the state's 42 dims"), (-1, "outside"),
                     (558, "base-60")]:  # 558: what YAML makes of an unquoted 9:18
        with pytest.raises(ValueError, match=msg):
            parse_dims(bad, 42)


def test_normalize_state_zeroes_only_the_hidden_dims():
    x = torch.randn(64, 6) * 3 + 1
    plain = NormStats(Stats.of(x), Stats.of(x[:, :2]))
    hidden = NormStats(Stats.of(x), Stats.of(x[:, :2]), hidden_state=(4, 1, 4))
    assert hidden.hidden_state == (1, 4)
    a, b = plain.normalize_state(x), hidden.normalize_state(x)
    keep = [0, 2, 3, 5]
    assert torch.equal(b[:, keep], a[:, keep]) and torch.all(b[:, [1, 4]] == 0)
    with pytest.raises(ValueError, match=r"hidden state dims \[6\] are outside the state's 6 dims"):
        NormStats(Stats.of(x), Stats.of(x[:, :2]), hidden_state=(6,))


def _actor(hidden=()):
    torch.manual_seed(0)
    cfg = policy_preset("tiny", {"num_cameras": 0, "state_dim": 8, "action_dim": 3, "depth": 1})
    x = torch.randn(32, 6)
    norm = NormStats(Stats.of(x), Stats.of(torch.randn(32, 3)), hidden_state=hidden)
    return Actor(FlowPolicy(cfg).eval(), norm)


def _act(actor, state):
    obs = {"images": torch.zeros(len(state), 0, 32, 32, 3, dtype=torch.uint8), "state": state,
           "instruction": ["go"] * len(state)}
    with torch.inference_mode():
        return actor.act(actor.observe(obs), SamplerConfig(num_steps=2),
                         generator=torch.Generator().manual_seed(1)).actions


def test_actions_do_not_depend_on_hidden_dims_but_do_on_the_others():
    actor = _actor(hidden=(2, 3))
    s = torch.randn(4, 6)
    moved_hidden, moved_seen = s.clone(), s.clone()
    moved_hidden[:, 2:4] += 5.0
    moved_seen[:, 0] += 5.0
    assert torch.equal(_act(actor, s), _act(actor, moved_hidden))
    assert not torch.allclose(_act(actor, s), _act(actor, moved_seen))
    # Without hiding, the same change does move the actions (so the check above can fail).
    assert not torch.allclose(_act(_actor(), s), _act(_actor(), moved_hidden))


def test_hidden_dims_travel_with_the_checkpoint(tmp_path):
    actor = _actor(hidden=(2, 3))
    path = save_policy(tmp_path / "p", actor.model, actor.norm)
    _, norm, config = load_policy(path)
    assert norm.hidden_state == (2, 3) and config["normalization"]["hidden_state_dims"] == [2, 3]
    # An older checkpoint without the key hides nothing.
    text = (path / "config.yaml").read_text()
    (path / "config.yaml").write_text(text.replace("hidden_state_dims:\n  - 2\n  - 3\n", ""))
    assert "hidden_state_dims" not in (path / "config.yaml").read_text()
    assert load_policy(path)[1].hidden_state == ()
    for bad, msg in [("hidden_state_dims: [9]", "outside the state's 6 dims"),
                     ("hidden_state_dims: nine", "must be a list of ints")]:
        (path / "config.yaml").write_text(text.replace("hidden_state_dims:\n  - 2\n  - 3", bad))
        with pytest.raises(CheckpointError, match=msg):
            load_policy(path)


def test_cli_sft_hides_dims_and_names_bad_specs(tmp_path, capsys):
    from vla_rl.cli import main

    ds, out = tmp_path / "demos", tmp_path / "policy"
    assert main(["collect", "builtin", str(ds), "episodes=2", "num_envs=2"]) == 0
    assert json.loads((ds / "meta" / "info.json").read_text())["vla_rl"]["env"] == "builtin"
    assert main(["sft", str(ds), "--no-progress", "steps=2", "batch_size=4", "eval_episodes=2",
                 f"out={out}", "policy.depth=1", "hidden_state_dims=2-3"]) == 0
    assert "hidden state dims (the policy sees 0 there): [2, 3]" in capsys.readouterr().out
    assert load_policy(out)[1].hidden_state == (2, 3)
    assert main(["sft", str(ds), "--no-progress", "steps=2", f"out={tmp_path / 'bad'}",
                 "hidden_state_dims=9:18"]) == 2
    assert "hidden_state_dims" in capsys.readouterr().err and not (tmp_path / "bad").exists()
