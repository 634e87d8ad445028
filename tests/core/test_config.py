"""Strict typed config loading and command-line overrides."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from vla_rl.core.ranges import ConfigError, positive, setting
from vla_rl.core.schema import config_help, from_dict, to_dict
from vla_rl.policies import tokenizer
from vla_rl.presets import parse_overrides


@dataclass(frozen=True)
class Inner:
    width: int = 4
    rate: float = 0.1


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    mode: Literal["a", "b"] = "a"
    name: str | None = None
    flag: bool = False


def test_from_dict_builds_nested_and_checks_types():
    cfg = from_dict(Outer, {"inner": {"width": 8, "rate": 1}, "mode": "b", "flag": True})
    assert cfg.inner.width == 8 and cfg.inner.rate == 1.0 and cfg.mode == "b" and cfg.flag
    assert to_dict(cfg) == {"inner": {"width": 8, "rate": 1.0}, "mode": "b", "name": None, "flag": True}
    with pytest.raises(ConfigError, match="inner.widht"):
        from_dict(Outer, {"inner": {"widht": 8}})
    with pytest.raises(ConfigError, match="inner.width: expected an integer"):
        from_dict(Outer, {"inner": {"width": 1.5}})
    with pytest.raises(ConfigError, match="flag: expected true/false"):
        from_dict(Outer, {"flag": "yes"})
    with pytest.raises(ConfigError, match="mode"):
        from_dict(Outer, {"mode": "c"})


@dataclass(frozen=True)
class Documented:
    MOVED = {"rate": "inner.rate"}   # an older flat spelling, refused with the new one

    inner: Inner = setting(default_factory=Inner, doc="The inner section.")
    steps: int = positive(3, doc="How many steps to take.")
    mode: Literal["a", "b"] = setting("a", doc="Which way.")


def test_field_docs_are_the_help_text_and_moved_keys_name_their_new_place():
    text = config_help(Documented)
    assert "steps: int = 3  in (0, inf)\n    How many steps to take." in text
    assert "mode: 'a' | 'b' = 'a'\n    Which way." in text
    assert "inner:  section\n    The inner section." in text and "inner.rate: float = 0.1" in text
    with pytest.raises(ConfigError, match="rate is now inner.rate: write inner.rate=0.5 instead"):
        from_dict(Documented, {"rate": 0.5})
    with pytest.raises(ConfigError, match="outer.rate is now outer.inner.rate"):
        from_dict(Documented, {"rate": 0.5}, prefix="outer")
    assert from_dict(Documented, {"inner": {"rate": 0.5}}).inner.rate == 0.5


def test_every_command_lists_its_settings(capsys):
    from vla_rl.cli import CONFIGS, main

    for command in CONFIGS:
        with pytest.raises(SystemExit) as stop:
            main([command, "--help-config"])
        assert stop.value.code == 0
        out = capsys.readouterr().out
        assert f"`vla-rl {command}` settings" in out and " = " in out
    with pytest.raises(SystemExit):
        main(["eval", "--help-config"])
    assert "sampler.method: 'ode' | 'sde' | 'noise' = 'ode'\n    ode: deterministic" in capsys.readouterr().out
    # collect libero records with its own settings (suite, task_ids, ...), not the built-in / ManiSkill ones
    with pytest.raises(SystemExit):
        main(["collect", "libero", "--help-config"])
    out = capsys.readouterr().out
    assert "`vla-rl collect libero` settings" in out and "suite: str = 'libero_spatial'" in out
    assert "LiberoRecordConfig" in out and "CollectConfig" not in out


def test_overrides_parse_values_as_yaml():
    assert parse_overrides(["inner.width=3", "mode=b", "name=null", "x=[1, 2]"]) == {
        "inner": {"width": 3}, "mode": "b", "name": None, "x": [1, 2]}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["nonsense"])
    assert from_dict(Outer, parse_overrides(["inner.rate=0.5"])).inner.rate == 0.5
    # PyYAML reads 5e-5 (no dot) as a string; a float field still takes it, a non-number is still an error
    assert parse_overrides(["inner.rate=5e-5"]) == {"inner": {"rate": "5e-5"}}
    assert from_dict(Outer, parse_overrides(["inner.rate=5e-5"])).inner.rate == 5e-5
    with pytest.raises(ConfigError, match="inner.rate: expected a number, got 'fast'"):
        from_dict(Outer, {"inner": {"rate": "fast"}})


def test_word_tokenizer_is_stable_and_case_insensitive():
    a, ma = tokenizer.tokenize(["Move to the RED square.", "move to the red square"], 10)
    assert torch_equal(a[0, :7], a[1, :7]) or a[0].tolist()[:6] == a[1].tolist()[:6]
    assert ma[1].sum() == 2 + 5 and ma[0].sum() == 2 + 6  # the full stop is its own token
    b, mb = tokenizer.tokenize(["x " * 50], 6)
    assert mb.all() and b[0, -1] == tokenizer.EOS
    c, _ = tokenizer.tokenize(["hi"], 5, kind="bytes", vocab_size=300)
    assert c[0].tolist() == [tokenizer.BOS, 3 + ord("h"), 3 + ord("i"), tokenizer.EOS, tokenizer.PAD]
    with pytest.raises(TypeError):
        tokenizer.tokenize("not a list", 5)


def torch_equal(a, b):
    return bool((a == b).all())


def test_every_shipped_preset_loads_and_its_model_builds():
    """Each configs/experiment preset is a valid TrainConfig (no unknown keys, env options valid for its
    adapter); each configs/model preset builds (on the meta device: pi0 is 3B)."""
    from pathlib import Path

    import torch

    from vla_rl.policies.model import FlowPolicy
    from vla_rl.presets import load_preset, policy_preset
    from vla_rl.train.trainer import TrainConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    experiments = sorted(p.stem for p in (root / "experiment").glob("*.yaml"))
    assert {"builtin_flow_sde", "maniskill_pushcube_flow_sde", "maniskill_pushcube_gpu",
            "maniskill_pickcube_flow_noise", "libero_spatial_flow_noise", "libero_spatial_flow_sde"} <= set(experiments)
    for name in experiments:
        cfg = load_preset(TrainConfig, "experiment", name)
        if cfg.env.kind == "maniskill":
            ms = cfg.env.maniskill
            # the planners' demos are longer than the tasks' limit of 50 (PushCube 61-80 steps, PickCube <= 100)
            assert ms.max_episode_steps == {"PushCube-v1": 120, "PickCube-v1": 150}[ms.task]
        if cfg.env.kind in ("libero", "libero_warp"):
            # every episode ends (and is scored) inside its rollout: the suite's official step limit fits
            if cfg.rollout_chunks == "auto":   # one episode's worth, whatever limit episode_limit sets
                continue
            assert cfg.episode_limit == "env"
            assert cfg.rollout_chunks * cfg.execute >= cfg.env.task.episode_steps
    for name in sorted(p.stem for p in (root / "model").glob("*.yaml")):
        with torch.device("meta"):
            FlowPolicy(policy_preset(name))


def test_a_built_wheel_carries_the_presets(tmp_path):
    """`pip install vla-rl` (not editable, run outside a checkout) must still find configs/*/*.yaml: the
    wheel maps them to vla_rl/configs, where vla_rl.presets looks first."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("setuptools")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("vla_rl-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    probe = ("from vla_rl.presets import preset_path; from vla_rl.presets import policy_preset; "
             "print(preset_path('experiment', 'builtin_flow_sde')); print(policy_preset('tiny').depth)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                         check=True, capture_output=True, text=True).stdout.split()
    assert Path(out[0]) == tmp_path / "site" / "vla_rl" / "configs" / "experiment" / "builtin_flow_sde.yaml"
    assert out[1] == "3"
    # The simulators' setup files are looked for outside site-packages: $VLA_RL_CACHE, else ~/.cache/vla-rl.
    probe = ("from vla_rl.envs.maniskill import LAVAPIPE_ICD; "
             "from vla_rl.envs.libero.robosuite_env import setup_libero_env_vars; "
             "print(LAVAPIPE_ICD); print(setup_libero_env_vars())")
    home = {"PYTHONPATH": str(tmp_path / "site"), "HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=home, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == [str(tmp_path / "home" / ".cache" / "vla-rl" / "mesa25" / "lvp_icd.x86_64.json"),
                   str(tmp_path / "home" / ".cache" / "vla-rl" / "libero")]
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**home, "VLA_RL_CACHE": "/opt/c"},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == ["/opt/c/mesa25/lvp_icd.x86_64.json", "/opt/c/libero"]
    # `python -m pytest` from the checkout's root imports the checkout's vla_rl (first on sys.path) beside an
    # installed one; its envs / policies / presets then come from the checkout too.
    probe = ("import vla_rl.envs.base, vla_rl.policies.flow, vla_rl.presets as c; "
             "print(vla_rl.envs.base.__file__); print(vla_rl.policies.flow.__file__); print(c.CONFIG_DIR)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=home, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == [str(root / "envs" / "base.py"), str(root / "policies" / "flow.py"), str(root / "configs")]
