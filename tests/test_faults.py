"""Fault injection: what a user does by mistake, or what the machine does to a run, never loses saved work
and never ends in a traceback.

One section per class of fault: config values out of range, reused output folders, non-finite weights,
self-contained resume, clean command-line errors, checkpoint / metrics damage, kill -9 and resume, dead env
workers, bad ManiSkill demonstrations.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import typing

import pytest

import vla_rl
from vla_rl.config import ConfigError, describe_range, from_dict

# ----------------------------------------------------------------------------------------------------
# 1. Every numeric field of every config declares its range, and a value outside it is refused at build
# ----------------------------------------------------------------------------------------------------
SKIP_MODULES = ("vla_rl.cli",)


def module_names() -> list[str]:
    """Every module of vla_rl and its rooms, envs/ and policies/ included. (Not walk_packages over
    ``vla_rl.__path__``: in a checkout that path holds the repository root too, which would recurse.)"""
    own = [vla_rl.__path__[0]]
    names = [f"vla_rl.{m.name}" for m in pkgutil.iter_modules(own)] + ["vla_rl.envs", "vla_rl.policies"]
    for pkg in [n for n in names if importlib.import_module(n).__spec__.submodule_search_locations]:
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__)]
    return sorted(n for n in names if n not in SKIP_MODULES)


def config_classes() -> list[type]:
    """Every dataclass named ``*Config`` defined in vla_rl (envs/ and policies/ included)."""
    found = {}
    for name in module_names():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__name__.endswith("Config")
                    and obj.__module__ == module.__name__):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def numeric_arms(tp) -> set[type]:
    """The int / float types a field's annotation admits (``int | None`` -> {int})."""
    if tp in (int, float):
        return {tp}
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        return {a for a in typing.get_args(tp) if a in (int, float)}
    return set()


def numeric_fields(cls) -> list[tuple[dataclasses.Field, set[type]]]:
    hints = typing.get_type_hints(cls)
    return [(f, numeric_arms(hints[f.name])) for f in dataclasses.fields(cls) if numeric_arms(hints[f.name])]


CONFIGS = config_classes()


def test_the_walk_finds_the_configs_of_every_room():
    names = {c.__name__ for c in CONFIGS}
    assert {"TrainConfig", "PPOConfig", "SamplerConfig", "SFTConfig", "SFTRunConfig", "CollectConfig",
            "EvalConfig", "LiberoEvalConfig", "DemoConfig", "ColorReachConfig", "ManiSkillConfig",
            "LiberoConfig", "LiberoRecordConfig", "PolicyConfig", "VisionConfig", "StreamConfig",
            "EnvConfig", "LogProbConfig"} <= names


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_field_declares_its_range(cls):
    missing = [f.name for f, _ in numeric_fields(cls) if "range" not in f.metadata]
    assert not missing, f"{cls.__name__}: numeric fields without a declared range: {missing}"


def bad_values(spec: tuple, arms: set[type]) -> list:
    """Values just outside a declared range, and the non-finite floats."""
    lo, hi, lo_open, hi_open = (tuple(spec) + (False, False))[:4]
    step = 1 if arms == {int} else 0.5
    out = []
    if lo is not None:
        out.append(lo if lo_open else lo - step)
    if hi is not None:
        out.append(hi if hi_open else hi + step)
    if float in arms:
        out += [math.nan, math.inf, -math.inf]
    if arms == {int}:
        out = [int(v) for v in out]
    return out


CASES = [(cls, f.name, v, f.metadata["range"]) for cls in CONFIGS for f, arms in numeric_fields(cls)
         if "range" in f.metadata for v in bad_values(f.metadata["range"], arms)]


@pytest.mark.parametrize("cls,name,value,spec", CASES,
                         ids=[f"{c.__name__}.{n}={v}" for c, n, v, _ in CASES])
def test_a_value_outside_the_range_is_refused_naming_field_value_and_range(cls, name, value, spec):
    with pytest.raises(ConfigError) as err:
        from_dict(cls, {name: value})
    msg = str(err.value)
    assert name in msg and repr(value) in msg, msg
    if not (isinstance(value, float) and not math.isfinite(value)):
        assert describe_range(spec) in msg, msg


def test_range_errors_carry_the_key_path_of_nested_configs():
    from vla_rl.rl.trainer import TrainConfig

    for over, want in [({"ppo": {"clip": -0.1}}, "ppo.clip = -0.1 is outside its valid range (0, inf)"),
                       ({"ppo": {"gamma": 5.0}}, "ppo.gamma = 5.0 is outside its valid range [0, 1]"),
                       ({"ppo": {"lam": -1.0}}, "ppo.lam = -1.0 is outside its valid range [0, 1]"),
                       ({"ppo": {"lr_actor": "nan"}}, "ppo.lr_actor = nan is not a finite number"),
                       ({"ppo": {"lr_critic": float("inf")}}, "ppo.lr_critic = inf is not a finite number"),
                       ({"keep_last": 0}, "keep_last = 0 is outside its valid range [1, inf)"),
                       ({"sampler": {"num_steps": 0}}, "sampler.num_steps = 0 is outside"),
                       ({"env": {"builtin": {"step_size": 0.0}}}, "env.builtin.step_size = 0.0 is outside")]:
        with pytest.raises(ConfigError, match=None) as err:
            from_dict(TrainConfig, over)
        assert want in str(err.value), (want, str(err.value))
