"""Fault injection: what a user does by mistake, or what the machine does to a run, never loses saved work
and never ends in a traceback.

One section per class of fault: config values out of range, reused output folders, non-finite weights,
self-contained resume, clean command-line errors, checkpoint / metrics damage, kill -9 and resume, dead env
workers, bad ManiSkill demonstrations.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import pkgutil
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
from helpers import needs_simulator, sft_policy

import vla_rl
from vla_rl.checkpoint.folders import NonFiniteError, read_tensors
from vla_rl.cli import main as cli_main
from vla_rl.core.errors import CheckpointError
from vla_rl.core.outputs import OutputExistsError
from vla_rl.core.ranges import ConfigError, describe_range
from vla_rl.core.schema import from_dict

# ----------------------------------------------------------------------------------------------------
# 1. Every numeric field of every config declares its range, and a value outside it is refused at build
# ----------------------------------------------------------------------------------------------------
SKIP_MODULES = ("vla_rl.cli",)


def module_names() -> list[str]:
    """Every module of vla_rl and its rooms, envs/ and policies/ included. (Not walk_packages over
    ``vla_rl.__path__``: in a checkout that path holds the repository root too, which would recurse.)"""
    own = [vla_rl.__path__[0]]
    names = [f"vla_rl.{m.name}" for m in pkgutil.iter_modules(own)] + ["vla_rl.envs", "vla_rl.policies"]
    for pkg in names:   # grows while it is walked: packages inside packages (envs.libero) too
        if importlib.import_module(pkg).__spec__.submodule_search_locations:
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
    assert {"TrainConfig", "PPOConfig", "LearnerConfig", "AlgorithmConfig", "GRPOConfig", "RLOOConfig", "DAPOConfig",
            "FPOConfig", "SamplerConfig", "SFTConfig", "SFTRunConfig", "CollectConfig",
            "EvalConfig", "BenchConfig", "DemoConfig", "ColorReachConfig", "ManiSkillConfig",
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
    from vla_rl.train.trainer import TrainConfig

    for over, want in [({"algorithm": {"ppo": {"clip": -0.1}}},
                        "algorithm.ppo.clip = -0.1 is outside its valid range (0, inf)"),
                       ({"algorithm": {"ppo": {"gamma": 5.0}}},
                        "algorithm.ppo.gamma = 5.0 is outside its valid range [0, 1]"),
                       ({"algorithm": {"ppo": {"lam": -1.0}}},
                        "algorithm.ppo.lam = -1.0 is outside its valid range [0, 1]"),
                       ({"learner": {"lr_actor": "nan"}}, "learner.lr_actor = nan is not a finite number"),
                       ({"learner": {"lr_critic": float("inf")}}, "learner.lr_critic = inf is not a finite number"),
                       ({"keep_last": 0}, "keep_last = 0 is outside its valid range [1, inf)"),
                       ({"sampler": {"num_steps": 0}}, "sampler.num_steps = 0 is outside"),
                       ({"env": {"builtin": {"step_size": 0.0}}}, "env.builtin.step_size = 0.0 is outside")]:
        with pytest.raises(ConfigError, match=None) as err:
            from_dict(TrainConfig, over)
        assert want in str(err.value), (want, str(err.value))


def test_cli_refuses_bad_numbers_before_any_work(tmp_path, capsys):
    """The values that used to crash only after an iteration's work now stop the command at once: exit 2, one
    line naming the field, and no run folder."""
    for over in ["eval_every=0", "save_every=0", "learner.minibatches=0", "eval_episodes=0", "sampler.num_steps=0",
                 "keep_last=0", "algorithm.ppo.clip=-0.1", "algorithm.ppo.gamma=5", "algorithm.ppo.lam=-1",
                 "learner.lr_actor=nan", "learner.lr_actor=1e30", "learner.lr_critic=.inf"]:
        out = tmp_path / over.replace("=", "_")
        assert cli_main(["train", "builtin_flow_noise", f"out={out}", over]) == 2, over
        err = capsys.readouterr().err
        assert err.startswith("vla-rl: config error: ") and err.count("\n") == 1, err
        assert over.split("=")[0] in err and not out.exists()
    for over in ["steps=0", "batch_size=0"]:
        assert cli_main(["sft", str(tmp_path / "no-dataset"), over, f"out={tmp_path / 'sft'}"]) == 2
        assert f"{over.split('=')[0]} = 0 is outside its valid range" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Shared fixtures: a small SFT policy on the built-in task and a short training config
# ----------------------------------------------------------------------------------------------------
SMALL = {"depth": 1, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}
ROOT = Path(__file__).resolve().parent.parent
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return sft_policy(tmp_path_factory.mktemp("sft") / "policy", SMALL, steps=10)


def overrides(init, out, iterations=2, **more) -> list[str]:
    """``vla-rl train builtin_flow_noise`` overrides of a short run (8 envs, 2 chunks, a checkpoint each
    iteration)."""
    base = {"init": str(init), "out": str(out), "env.num_envs": 8, "env.builtin.max_episode_steps": 16,
            "rollout_chunks": 2, "iterations": iterations, "eval_every": 1, "eval_episodes": 8, "save_every": 1,
            "keep_last": 5, "tensorboard": "false", "learner.update_epochs": 1, "learner.minibatches": 2}
    base.update(more)
    return [f"{k}={v}" for k, v in base.items()]


def train_config(init, out, iterations=2, **more):
    from vla_rl.presets import merge, parse_overrides
    from vla_rl.train.trainer import TrainConfig

    return from_dict(TrainConfig, merge({**parse_overrides(overrides(init, out, iterations)), "progress": False},
                                        more))


def stripped(history: list[dict]) -> list[dict]:
    """Metrics without the wall-clock ones (time/env_steps counts steps, it stays)."""
    return [{k: v for k, v in h.items() if not k.startswith("time/") or k == "time/env_steps"} for h in history]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_error_line(capsys, kind: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("vla-rl: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"vla-rl: {kind} error: "), err
    return lines[0]


# ----------------------------------------------------------------------------------------------------
# 2. A reused output is refused (exit 2, before any work); --overwrite starts over
# ----------------------------------------------------------------------------------------------------
def test_train_into_a_run_folder_is_refused_and_overwrite_starts_over(sft, tmp_path, capsys):
    from vla_rl.train.trainer import Trainer

    run = tmp_path / "run"
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=1), "--no-progress"]) == 0
    capsys.readouterr()
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=1), "--no-progress"]) == 2
    line = one_error_line(capsys, "output")
    assert f"--resume {run}" in line and "--overwrite" in line and "out=" in line
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # untouched
    with pytest.raises(OutputExistsError):
        Trainer(train_config(sft, run), log=QUIET)
    (run / "stray.txt").write_text("from the old run")
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=1), "--no-progress",
                     "--overwrite"]) == 0
    assert not (run / "stray.txt").exists()
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [0, 1]   # the new run's lines only


def test_every_writing_command_refuses_an_occupied_output_before_any_work(tmp_path, capsys):
    """The inputs here do not even exist: the refusal comes first."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("precious")
    result = tmp_path / "result.json"
    result.write_text("{}")
    missing = str(tmp_path / "missing")
    for argv in (["sft", missing, f"out={taken}"], ["collect", "builtin", str(taken)],
                 ["collect", "maniskill", str(taken)], ["collect", "libero", str(taken)],
                 ["eval", missing, f"out={result}"], ["demo", f"out={taken}"]):
        assert cli_main(argv) == 2, argv
        line = one_error_line(capsys, "output")
        assert "--overwrite" in line, line
    assert (taken / "keep.txt").read_text() == "precious" and result.read_text() == "{}"
    # --overwrite replaces the command's own output, not a folder of the user's files
    assert cli_main(["collect", "builtin", str(taken), "episodes=2", "num_envs=2", "--overwrite"]) == 2
    assert "holds keep.txt, which a dataset does not hold" in one_error_line(capsys, "output")
    assert (taken / "keep.txt").read_text() == "precious"
    data = tmp_path / "data"
    assert cli_main(["collect", "builtin", str(data), "episodes=2", "num_envs=2"]) == 0
    assert cli_main(["collect", "builtin", str(data), "episodes=3", "num_envs=2", "--overwrite"]) == 0
    assert json.loads((data / "meta" / "info.json").read_text())["total_episodes"] == 3


@pytest.mark.parametrize("out", [".", ".."])
def test_the_folder_a_command_runs_in_is_refused_as_its_output_before_any_work(out, tmp_path, monkeypatch, capsys):
    """sft out=. --overwrite trained to the end and then could not rename '.': now refused before the work."""
    import vla_rl.train.sft as sft_mod

    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sft_mod, "train_sft", lambda *a, **k: pytest.fail("the work started"))
    for argv in (["sft", "/nonexistent/dataset", f"out={out}", "--overwrite"],
                 ["collect", "builtin", out, "--overwrite"], ["demo", f"out={out}", "--overwrite"]):
        assert cli_main(argv) == 2, argv
        assert "the folder this command runs in" in one_error_line(capsys, "output")
    assert (here / "notes.txt").read_text() == "mine"


def test_every_output_of_every_command_is_readable_by_others_under_umask_022(sft, tmp_path):
    """mkdtemp makes 700 and safetensors writes 600: outputs written aside and renamed into place were readable by
    their writer alone (a robot's service account could not read an export, a lab mate a dataset). Under umask 022
    every folder is 755 and every file 644, whichever command wrote it."""
    old = os.umask(0o022)   # (import: tests/checkpoint/test_pretrained.py checks its folder's modes)
    try:
        for argv in (["collect", "builtin", str(tmp_path / "dataset"), "episodes=2", "num_envs=2"],
                     ["sft", str(tmp_path / "dataset"), f"out={tmp_path / 'policy'}", "steps=2", "eval_episodes=0"],
                     ["train", "builtin_flow_noise", *overrides(sft, tmp_path / "run", iterations=1)],
                     ["eval", str(tmp_path / "run"), "episodes=2", "num_envs=2", f"out={tmp_path / 'eval.json'}"],
                     ["export", str(tmp_path / "run"), str(tmp_path / "export")],
                     ["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")]):
            assert cli_main(argv) == 0, argv
    finally:
        os.umask(old)
    written = [p for p in tmp_path.rglob("*") if not p.is_symlink()]
    assert {p.name for p in tmp_path.iterdir()} >= {"dataset", "policy", "run", "eval.json", "export", "report"}
    wrong = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written
             if p.stat().st_mode & 0o777 != (0o755 if p.is_dir() else 0o644)}
    assert not wrong, wrong


def test_collect_help_says_what_collect_does_with_an_occupied_folder(capsys):
    with pytest.raises(SystemExit):
        cli_main(["collect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one that holds anything is refused unless --overwrite" in text   # as the test above shows
    assert "(replaced atomically if it exists)" not in text


def test_keep_last_never_deletes_the_checkpoint_just_saved_nor_later_ones(tmp_path):
    from vla_rl.checkpoint.training import checkpoint_path, list_checkpoints, prune

    for it in (1, 2, 3, 7, 12):
        checkpoint_path(tmp_path, it).mkdir(parents=True)
    (tmp_path / "checkpoints" / "best").mkdir()
    prune(tmp_path, checkpoint_path(tmp_path, 3), keep_last=2)   # a run resumed at 3; 7 and 12 are later
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_000002", "iter_000003", "iter_000007",
                                                            "iter_000012"]
    assert (tmp_path / "checkpoints" / "best").is_dir()


# ----------------------------------------------------------------------------------------------------
# 3. A non-finite model is never written; a run whose updates are all skipped stops with an error
# ----------------------------------------------------------------------------------------------------
def test_non_finite_tensors_are_never_written_and_the_old_folder_stays(tmp_path):
    from vla_rl.checkpoint.folders import write_atomic_folder

    path = write_atomic_folder(tmp_path / "ckpt", tensors={"model": {"w": torch.ones(3)}}, yamls={"config": {"a": 1}})
    before = (path / "model.safetensors").read_bytes()
    for bad in (float("nan"), float("inf"), 1e39):   # 1e39 overflows float32 to inf
        with pytest.raises(NonFiniteError, match=r"model.safetensors would hold NaN or inf in w"):
            write_atomic_folder(path, tensors={"model": {"w": torch.tensor([1.0, bad, 2.0])}}, yamls={})
    assert (path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]   # no temporary folder left behind


def test_weights_made_non_finite_stop_the_run_and_the_last_good_checkpoint_stays_newest(sft, tmp_path, monkeypatch,
                                                                                         capsys):
    from vla_rl.checkpoint.training import list_checkpoints, verify_checkpoint
    from vla_rl.rl import learner as learner_mod

    real = learner_mod.Learner.update

    def poisoned(self, ro, *, iteration):
        out = real(self, ro, iteration=iteration)
        if iteration == 1:   # the second update "diverges"
            with torch.no_grad():
                next(self.actor.model.parameters()).fill_(float("nan"))
        return out

    monkeypatch.setattr(learner_mod.Learner, "update", poisoned)
    run = tmp_path / "run"
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=3), "--no-progress"]) == 2
    line = one_error_line(capsys, "training")
    assert "made the weights non-finite" in line and "iter_000001" in line
    assert [p.name for p in list_checkpoints(run)] == ["iter_000001"]
    verify_checkpoint(list_checkpoints(run)[0])
    for folder in (run / "checkpoints" / "iter_000001", run / "checkpoints" / "best"):
        assert all(bool(torch.isfinite(t).all()) for t in read_tensors(folder / "model.safetensors").values())
    assert read_jsonl(run / "metrics.jsonl")[-1]["iteration"] == 2   # the failing iteration's metrics are kept


def test_a_run_whose_updates_are_all_skipped_stops_with_an_error(sft, tmp_path, monkeypatch, capsys):
    from vla_rl.rl import losses

    real = losses.ppo_policy_loss

    def nan_loss(**kw):
        loss, m = real(**kw)
        return loss * float("nan"), m

    monkeypatch.setattr(losses, "ppo_policy_loss", nan_loss)
    run = tmp_path / "run"
    argv = ["train", "builtin_flow_noise", *overrides(sft, run, iterations=5), "max_skipped_iterations=2",
            "--no-progress"]
    assert cli_main(argv) == 2
    line = one_error_line(capsys, "training")
    assert "iterations 1-2: every update step had a non-finite loss or gradient and was skipped" in line
    history = read_jsonl(run / "metrics.jsonl")
    assert [h["iteration"] for h in history] == [0, 1, 2] and history[-1]["train/skipped_steps"] == 4


# ----------------------------------------------------------------------------------------------------
# 4. Resume is self-contained: from another directory, after the init folder is gone, bit-identical
# ----------------------------------------------------------------------------------------------------
def test_resume_from_another_directory_without_the_init_folder_matches_the_uninterrupted_run(sft, tmp_path,
                                                                                            monkeypatch):
    from vla_rl.train.trainer import Trainer, resume_trainer

    init = tmp_path / "init"
    shutil.copytree(sft, init)
    full = Trainer(train_config(init, tmp_path / "full", iterations=3), log=QUIET).run()
    with Trainer(train_config(init, tmp_path / "part", iterations=1), log=QUIET) as part:
        part.run()
    shutil.rmtree(init)                                  # the SFT folder the run started from is gone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                         # and the resume runs from another directory
    with resume_trainer(os.path.relpath(tmp_path / "part"), overrides={"iterations": 3}, log=QUIET) as resumed:
        assert resumed.iteration == 1
        history = resumed.run()
    assert stripped(history) == stripped(full)
    assert stripped(read_jsonl(tmp_path / "part" / "metrics.jsonl")) == stripped(full)


# ----------------------------------------------------------------------------------------------------
# 5. One-line errors, exit 2; --debug / VLA_RL_DEBUG=1 show the traceback
# ----------------------------------------------------------------------------------------------------
def test_malformed_yaml_file_and_override_are_one_line_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: {lr_actor: 1e-4\nenv: [\n")
    assert cli_main(["train", str(bad)]) == 2
    assert "is not valid YAML" in one_error_line(capsys, "config")
    assert cli_main(["train", "builtin_flow_noise", "learner.lr_actor=[1,"]) == 2
    assert "override 'learner.lr_actor=[1,': the value is not valid YAML" in one_error_line(capsys, "config")
    assert cli_main(["train", "builtin_flow_noise", "--resume", str(tmp_path)]) == 2
    assert "not both" in one_error_line(capsys, "config")


def test_debug_flag_and_env_variable_show_the_traceback(tmp_path, monkeypatch, capsys):
    from vla_rl.core.ranges import ConfigError

    with pytest.raises(ConfigError, match="algorithm.ppo.clip"):
        cli_main(["train", "builtin_flow_noise", "algorithm.ppo.clip=-1", "--debug"])
    monkeypatch.setenv("VLA_RL_DEBUG", "1")
    with pytest.raises(ConfigError, match="algorithm.ppo.clip"):
        cli_main(["train", "builtin_flow_noise", "algorithm.ppo.clip=-1"])
    monkeypatch.setenv("VLA_RL_DEBUG", "0")
    assert cli_main(["train", "builtin_flow_noise", "algorithm.ppo.clip=-1"]) == 2
    one_error_line(capsys, "config")


def test_bench_export_report_and_serve_errors_take_the_one_error_path(tmp_path, capsys):
    """Every user error reaches the user through cli.main's one path (its kind from USER_ERRORS): no command
    prints its own."""
    import ast
    import inspect

    import vla_rl.cli as cli

    assert cli_main(["bench", str(tmp_path)]) == 2
    assert "give a CHECKPOINT and --suite" in one_error_line(capsys, "bench")
    assert cli_main(["report", str(tmp_path / "no_run"), "--out", str(tmp_path / "report")]) == 2
    one_error_line(capsys, "report")
    assert cli_main(["export", str(tmp_path / "no_policy"), str(tmp_path / "export")]) == 2
    assert "vla-rl: " in capsys.readouterr().err
    printers = [f.name for f in ast.walk(ast.parse(inspect.getsource(cli))) if isinstance(f, ast.FunctionDef)
                and any(isinstance(n, ast.keyword) and n.arg == "file" for n in ast.walk(f))]
    # only report_error writes an error to stderr (_stop_once's `again` says a Ctrl-C is being handled)
    assert set(printers) == {"report_error", "_stop_once", "again"}, printers


def test_every_user_error_class_exists_where_the_cli_looks_it_up():
    """USER_ERRORS names each class by the module that defines it (a moved class would turn its errors into bugs)."""
    from vla_rl.cli import USER_ERRORS

    for module, name, _ in USER_ERRORS:
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == module, (module, name)


def test_a_missing_simulator_is_an_env_error_without_the_resume_hint():
    """Every simulator's "not installed" error is one class (envs.base.SimulatorUnavailable): an env error whose
    advice is its own message (what to install), not "resume the run", which would fail the same way."""
    import argparse

    from vla_rl.cli import advice, error_kind
    from vla_rl.envs.base import SimulatorUnavailable
    from vla_rl.envs.libero.robosuite_env import LiberoNotInstalled
    from vla_rl.envs.libero.warp_env import LiberoWarpNotInstalled
    from vla_rl.envs.maniskill import ManiSkillUnavailable
    from vla_rl.envs.worker_pool import WorkerError

    args = argparse.Namespace(command="train", run_dir="runs/x")
    for cls in (LiberoNotInstalled, LiberoWarpNotInstalled, ManiSkillUnavailable):
        assert issubclass(cls, SimulatorUnavailable)
        assert error_kind(cls("x")) == "env" and advice("env", args, cls("x")) == "", cls
    assert error_kind(WorkerError(0, "died")) == "env"
    assert "--resume runs/x" in advice("env", args, WorkerError(0, "died"))


SLOW_TIDY_UP = """
import sys, time
from pathlib import Path
import vla_rl.cli as cli

def work(args):
    try:
        print("working", file=sys.stderr, flush=True)
        time.sleep(60)
    finally:   # a command's tidy-up (closing workers, removing partial files) takes a while
        time.sleep(1.0)
        Path(sys.argv[2]).write_text("tidied")

cli._demo = work
sys.exit(cli.main(["demo", *sys.argv[1:2]]))
"""


def test_a_second_ctrl_c_neither_cuts_the_tidy_up_short_nor_prints_a_traceback(tmp_path):
    """The first Ctrl-C stops the command; one pressed during its tidy-up only says that it is stopping (it used
    to interrupt the tidy-up, and from inside torch print a 30-line traceback)."""
    done = tmp_path / "tidied"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TIDY_UP, "out=x", str(done)], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
    assert proc.stderr.readline().strip() == "working"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)   # during the tidy-up
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines() == ["vla-rl: already stopping, tidying up (Ctrl-\\ ends it at once)",
                                "vla-rl: interrupted"], err
    assert done.read_text() == "tidied"


def test_a_bug_is_one_line_with_exit_1_and_points_at_debug(tmp_path, monkeypatch, capsys):
    import vla_rl.data.collect as collect

    monkeypatch.setattr(collect, "collect_dataset", lambda *a, **k: 1 / 0)
    assert cli_main(["collect", "builtin", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vla-rl: internal error: ZeroDivisionError") and "--debug" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_dataset_and_missing_cuda_are_one_line_errors(tmp_path, capsys):
    import pyarrow.parquet as pq

    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.data.lerobot import write_lerobot_dataset

    ds = write_lerobot_dataset(tmp_path / "ds", collect_builtin_demos(1), fps=10, camera_names=["top"])
    for f in [*(ds / "data").rglob("*.parquet"), *(ds / "meta" / "episodes").rglob("*.parquet")]:
        pq.write_table(pq.read_table(f).slice(0, 0), f)
    assert cli_main(["sft", str(ds), f"out={tmp_path / 'sft'}"]) == 2
    assert "holds no frames" in one_error_line(capsys, "dataset")
    if not torch.cuda.is_available():
        assert cli_main(["train", "builtin_flow_noise", "device=cuda", f"out={tmp_path / 'r'}"]) == 2
        assert "CUDA is not available" in one_error_line(capsys, "config")
        assert not (tmp_path / "r").exists()
    assert cli_main(["train", "builtin_flow_noise", "device=tpu:0", f"out={tmp_path / 'r'}"]) == 2
    assert "device" in one_error_line(capsys, "config")


def test_devices_torch_knows_but_that_cannot_run_here_are_config_errors(sft, tmp_path, capsys):
    """meta (and mps off Apple silicon) are torch devices: train, eval and serve refuse them by name at config time,
    not with an internal error from the first random generator."""
    bad = ["meta"] + ([] if torch.backends.mps.is_available() else ["mps"])
    for device in bad:
        assert cli_main(["train", "builtin_flow_noise", f"init={sft}", f"device={device}",
                         f"out={tmp_path / 'r'}"]) == 2
        assert f"device={device}" in one_error_line(capsys, "config")
        assert not (tmp_path / "r").exists()
        assert cli_main(["eval", str(sft), "episodes=2", f"device={device}"]) == 2
        assert f"device={device}" in one_error_line(capsys, "config")
        assert cli_main(["serve", str(sft), "--port", "0", "--device", device]) == 2
        assert f"--device {device}" in one_error_line(capsys, "config")


@pytest.mark.parametrize("argv, says", [
    (["collect", "libero", "suite=libero_spatail"], "unknown LIBERO suite 'libero_spatail'"),
    (["collect", "libero", "task_ids=[12]"], "task_ids [12] out of range: libero_spatial has 10 tasks"),
    (["train", "libero_spatial_flow_sde", "env.libero.task_ids=[10]"], "env.libero: task_ids [10] out of range"),
    (["train", "libero_spatial_warp_flow_noise", "env.libero_warp.task_ids=[10]"],
     "env.libero_warp: task_ids [10] out of range"),
])
def test_libero_suites_and_task_ids_are_checked_at_config_time(argv, says, tmp_path, capsys):
    """A misspelt suite or a task id past the suite's end is a config error before any simulator starts (it was an
    internal error, or in train a 'dead worker' with advice to resume a run that was never created)."""
    assert cli_main([*argv, f"out={tmp_path / 'out'}"] if argv[0] == "train" else
                    [*argv[:2], str(tmp_path / "out"), *argv[2:]]) == 2
    assert says in one_error_line(capsys, "config")
    assert not (tmp_path / "out").exists()


def test_collect_libero_takes_threads_like_every_command():
    from vla_rl.data.libero_demos import LiberoRecordConfig, recording_info

    cfg = from_dict(LiberoRecordConfig, {"threads": 1})
    assert cfg.threads == 1 and "threads" not in recording_info(cfg)["vla_rl"]["collect"]


def test_a_dead_env_worker_gives_advice_a_cli_user_can_follow(sft, tmp_path, monkeypatch, capsys):
    from vla_rl.envs.workers import WorkerError
    from vla_rl.train import trainer as trainer_mod

    def die(self):
        raise WorkerError(0, "maniskill-PickCube worker 0 (envs 0-7) died: killed by signal SIGKILL")

    monkeypatch.setattr(trainer_mod.Trainer, "run", die)
    run = tmp_path / "run"
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run)]) == 2
    line = one_error_line(capsys, "env")
    assert "killed by signal SIGKILL" in line and "env.restart_dead_workers=" in line
    assert f"--resume {run} " in line and "RUN_DIR" not in line and "restart(" not in line


@pytest.mark.parametrize("resume", [False, True])
def test_advice_after_a_stop_names_the_run_folder(sft, tmp_path, monkeypatch, capsys, resume):
    """Ctrl-C and a training error tell the user how to continue with the run's own folder, not `RUN_DIR`."""
    from vla_rl.train import trainer as trainer_mod

    run = tmp_path / "run"
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=1)]) == 0
    argv = ["train", "--resume", str(run), "iterations=2"] if resume else \
        ["train", "builtin_flow_noise", *overrides(sft, tmp_path / "fresh")]
    where = run if resume else tmp_path / "fresh"
    capsys.readouterr()
    for stop, code, kind in ((KeyboardInterrupt(), 130, None), (trainer_mod.TrainingError("weights went NaN"), 2,
                                                                 "training")):
        def run_(self, stop=stop):
            raise stop

        monkeypatch.setattr(trainer_mod.Trainer, "run", run_)
        assert cli_main(argv) == code
        err = capsys.readouterr().err
        assert f"vla-rl train --resume {where}" in err and "RUN_DIR" not in err, err
        assert (kind is None and "interrupted" in err) or err.startswith(f"vla-rl: {kind} error: ")
        shutil.rmtree(tmp_path / "fresh", ignore_errors=True)


def test_resume_refuses_overrides_that_cannot_apply_and_records_none(finished_run, tmp_path, capsys):
    """init=, model= and out= cannot change a resumed run (its policy is the checkpoint's, its folder its own),
    and --overwrite cannot start over what --resume continues: each is a config error, and the run's config.yaml
    is left as it was."""
    from vla_rl.train.trainer import resume_trainer

    run = damaged(finished_run, tmp_path)
    before = (run / "config.yaml").read_text()
    for extra, says in ((["init=runs/other_sft"], "init=runs/other_sft cannot apply to a resumed run"),
                        (["model=small"], "model=small cannot apply"), ([f"out={tmp_path / 'x'}"], "cannot apply"),
                        (["--overwrite"], "--overwrite starts a run over")):
        assert cli_main(["train", "--resume", str(run), "iterations=3", *extra]) == 2, extra
        assert says in one_error_line(capsys, "config")
        assert (run / "config.yaml").read_text() == before
    import yaml

    with resume_trainer(run, overrides={"out": str(run), "iterations": 3}, log=QUIET) as trainer:   # its own
        assert trainer.cfg.out == yaml.safe_load(before)["out"]


def test_a_full_disk_keeps_the_previous_checkpoint_and_is_one_line(sft, tmp_path, monkeypatch, capsys):
    import errno

    import vla_rl.checkpoint.folders as ckpt_mod
    from vla_rl.checkpoint.training import list_checkpoints, verify_checkpoint

    real, calls = ckpt_mod.save_file, []

    def save_file(tensors, path, *a, **k):
        calls.append(path)
        if "iter_000002" in path and path.endswith("optimizer.safetensors"):   # half-way through the 2nd save
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt_mod, "save_file", save_file)
    run = tmp_path / "run"
    assert cli_main(["train", "builtin_flow_noise", *overrides(sft, run, iterations=3), "--no-progress"]) == 2
    line = one_error_line(capsys, "checkpoint")
    assert "could not write" in line and "No space left on device" in line and "iter_000002" in line
    assert [p.name for p in list_checkpoints(run)] == ["iter_000001"]
    verify_checkpoint(run / "checkpoints" / "iter_000001")
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]   # no temporary folder
    monkeypatch.setattr(ckpt_mod, "save_file", real)                  # the disk has room again: resume
    assert cli_main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------
# 6. Damaged checkpoints and metrics: fall back to the newest intact checkpoint, say so, tidy up
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(sft, tmp_path_factory) -> Path:
    """A 2-iteration run with both checkpoints kept (copied by each test that damages it)."""
    from vla_rl.train.trainer import Trainer

    run = tmp_path_factory.mktemp("finished") / "run"
    with Trainer(train_config(sft, run, iterations=2), log=QUIET) as t:
        t.run()
    return run


def damaged(finished_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


@pytest.mark.parametrize("damage", ["trainer_state_junk", "trainer_state_no_iteration", "rng_wrong_dtype",
                                    "optimizer_bad_key", "model_truncated", "file_missing", "model_nan",
                                    "optimizer_inf"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(finished_run, tmp_path, damage):
    from safetensors.torch import save_file

    from vla_rl.train.trainer import resume_trainer

    run = damaged(finished_run, tmp_path)
    newest = run / "checkpoints" / "iter_000002"
    if damage == "trainer_state_junk":
        (newest / "trainer_state.yaml").write_text("iteration: [2\n")
    elif damage == "trainer_state_no_iteration":
        (newest / "trainer_state.yaml").write_text("skipped_steps: 0\n")
    elif damage == "rng_wrong_dtype":
        save_file({"torch_cpu": torch.zeros(5056)}, str(newest / "rng.safetensors"))
    elif damage == "optimizer_bad_key":
        save_file({"bogus": torch.zeros(2)}, str(newest / "optimizer.safetensors"))
    elif damage == "model_truncated":
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage in ("model_nan", "optimizer_inf"):   # whole files, finite everywhere but one value
        name = "model" if damage == "model_nan" else "optimizer"
        poison(newest / f"{name}.safetensors", float("nan") if damage == "model_nan" else float("inf"))
    else:
        (newest / "norm_stats.safetensors").unlink()
    said = []
    with resume_trainer(run, log=said.append) as trainer:
        assert trainer.iteration == 1
    assert any("iter_000002 is unusable" in s for s in said) and any("resuming from" in s for s in said), said


def poison(path: Path, value: float) -> str:
    """Rewrite the safetensors file ``path`` with ``value`` (NaN or inf) in its first floating tensor; returns
    that tensor's name."""
    from safetensors.torch import save_file

    tensors = read_tensors(path)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path))
    return name


def test_a_checkpoint_with_nan_weights_is_refused_at_every_load_naming_the_tensor(finished_run, tmp_path,
                                                                                 capsys):
    """eval, init= and export of a checkpoint holding a NaN: one `checkpoint error` naming the file and the
    tensor, before any episode (not a NaN action chunk deep in the rollout)."""
    ckpt = tmp_path / "nan"
    shutil.copytree(finished_run / "checkpoints" / "iter_000002", ckpt)
    name = poison(ckpt / "model.safetensors", float("nan"))
    for argv in (["eval", str(ckpt), "episodes=2", "num_envs=2"],
                 ["train", "builtin_flow_noise", *overrides(ckpt, tmp_path / "run", iterations=1)],
                 ["export", str(ckpt), str(tmp_path / "export")]):
        assert cli_main(argv) == 2, argv
        line = one_error_line(capsys, "checkpoint")
        assert name in line and "NaN or inf" in line and "model.safetensors" in line, line
    assert not (tmp_path / "export").exists()
    norm = tmp_path / "nan_norm"
    shutil.copytree(finished_run / "checkpoints" / "iter_000002", norm)
    poison(norm / "norm_stats.safetensors", float("inf"))
    assert cli_main(["eval", str(norm), "episodes=2", "num_envs=2"]) == 2
    assert "norm_stats.safetensors" in one_error_line(capsys, "checkpoint")


def test_with_no_intact_checkpoint_resume_is_a_one_line_error_naming_each(finished_run, tmp_path, capsys):
    run = damaged(finished_run, tmp_path)
    for ckpt in ("iter_000001", "iter_000002"):
        (run / "checkpoints" / ckpt / "rng.safetensors").write_bytes(b"junk")
    assert cli_main(["train", "--resume", str(run)]) == 2
    line = one_error_line(capsys, "checkpoint")
    assert "no intact checkpoint" in line and "iter_000001" in line and "iter_000002" in line


def test_a_torn_last_metrics_line_does_not_block_resume(finished_run, tmp_path):
    from vla_rl.train.trainer import resume_trainer

    run = damaged(finished_run, tmp_path)
    good = read_jsonl(run / "metrics.jsonl")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "losses/pol')       # a kill while the line was written
    said = []
    with resume_trainer(run, overrides={"iterations": 3}, log=said.append) as trainer:
        assert trainer.history == good
        trainer.run()
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
    assert any("torn last line" in s for s in said)
    (run / "metrics.jsonl").write_text('{"iteration": 0}\nnot json\n{"iteration": 1}\n')   # damage elsewhere
    with pytest.raises(CheckpointError, match="metrics.jsonl line 2 is not a metrics record"):
        resume_trainer(run, log=QUIET)


def test_leftovers_of_an_interrupted_save_are_tidied_on_resume(finished_run, tmp_path):
    from vla_rl.train.trainer import resume_trainer

    run = damaged(finished_run, tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / ".iter_000003.tmp-k1ll").mkdir()                    # killed while writing iteration 3
    (ckpts / ".iter_000003.tmp-k1ll" / "model.safetensors").write_bytes(b"half")
    os.replace(ckpts / "best", ckpts / ".best.old-4242")         # killed between the two renames of best/
    said = []
    with resume_trainer(run, log=said.append):
        pass
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "iter_000001", "iter_000002"]
    assert any("restored best" in s for s in said) and any("removed the unfinished" in s for s in said)


def test_eval_of_a_run_folder_evaluates_its_newest_checkpoint(finished_run, capsys):
    assert cli_main(["eval", str(finished_run), "episodes=2", "num_envs=2"]) == 0
    out = capsys.readouterr().out
    assert "evaluating its newest checkpoint" in out and "iter_000002" in out and "format_version" not in out


# ----------------------------------------------------------------------------------------------------
# 7. kill -9 at any moment, then --resume: the metrics equal an uninterrupted run's
# ----------------------------------------------------------------------------------------------------
KILL_IN_SAVE = """
import os, signal, sys
import vla_rl.checkpoint.folders as ckpt
real = ckpt.save_file
def save_file(tensors, path, *a, **k):
    if "iter_000002" in path and path.endswith("optimizer.safetensors"):
        os.kill(os.getpid(), signal.SIGKILL)   # half-way through writing the second checkpoint
    return real(tensors, path, *a, **k)
ckpt.save_file = save_file
from vla_rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def cli_process(args: list[str], script: str | None = None) -> subprocess.Popen:
    """``vla-rl ARGS`` in a child process running this checkout (one thread: the numbers do not depend on it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "vla_rl.cli", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    _, err = proc.communicate(timeout=timeout)
    assert "Traceback" not in err, err
    return proc.returncode


def run_to_the_end(run: Path, args: list[str]) -> None:
    """What a user does after a crash: ``--resume`` while there is a checkpoint, else start over."""
    for _ in range(5):
        if any((run / "checkpoints").glob("iter_*")):
            rc = finish(cli_process(["train", "--resume", str(run), "--no-progress"]))
        else:
            rc = finish(cli_process(["train", "builtin_flow_noise", *args, "--no-progress", "--overwrite"]))
        if rc == 0:
            return
    raise AssertionError(f"{run} did not finish")


@pytest.fixture(scope="module")
def reference(sft, tmp_path_factory):
    """An uninterrupted 4-iteration run in a child process: (its metrics, its wall time)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    t0 = time.perf_counter()
    assert finish(cli_process(["train", "builtin_flow_noise", *overrides(sft, run, iterations=4),
                               "--no-progress"])) == 0
    return stripped(read_jsonl(run / "metrics.jsonl")), time.perf_counter() - t0


def test_kill_during_a_checkpoint_write_then_resume_gives_the_same_metrics(sft, reference, tmp_path):
    run = tmp_path / "run"
    args = overrides(sft, run, iterations=4)
    proc = cli_process(["train", "builtin_flow_noise", *args, "--no-progress"], script=KILL_IN_SAVE)
    assert finish(proc) == -signal.SIGKILL
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".iter_000002.tmp-")]
    assert leftovers and not (run / "checkpoints" / "iter_000002").exists()
    run_to_the_end(run, args)
    assert stripped(read_jsonl(run / "metrics.jsonl")) == reference[0]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def kill_at_random_points(sft, reference, tmp_path, points: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    for k in range(points):
        run = tmp_path / f"run{k}"
        args = overrides(sft, run, iterations=4)
        proc = cli_process(["train", "builtin_flow_noise", *args, "--no-progress"])
        time.sleep(rng.uniform(0.2, 1.0) * reference[1])   # anywhere from start-up to the last save
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        run_to_the_end(run, args)
        assert stripped(read_jsonl(run / "metrics.jsonl")) == reference[0], f"kill point {k} of seed {seed}"


def test_kill_at_a_random_moment_then_resume_gives_the_same_metrics(sft, reference, tmp_path):
    kill_at_random_points(sft, reference, tmp_path, points=1, seed=int(time.time()))


@pytest.mark.slow   # ~10 child runs
def test_kill_at_many_random_moments_then_resume_gives_the_same_metrics(sft, reference, tmp_path):
    kill_at_random_points(sft, reference, tmp_path, points=6, seed=0)


# ----------------------------------------------------------------------------------------------------
# 8. A dead env worker is restarted (env.restart_dead_workers), its partial episodes dropped from the batch
# ----------------------------------------------------------------------------------------------------
def worker_pool(num_envs=4, per_worker=2, restarts=1, log=None):
    import functools

    from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv
    from vla_rl.envs.workers import WorkerVectorEnv

    return WorkerVectorEnv(functools.partial(ColorReachSingleEnv, ColorReachConfig(max_episode_steps=16)), num_envs,
                           envs_per_worker=per_worker, name="colorreach", max_restarts=restarts, log=log)


def kill_worker(env, w: int) -> None:
    os.kill(env._procs[w].pid, signal.SIGKILL)
    env._procs[w].join(timeout=10)


def test_a_killed_worker_is_restarted_its_envs_reset_with_their_seeds_up_to_the_limit():
    from vla_rl.envs.builtin import ColorReachConfig, ColorReachSingleEnv
    from vla_rl.envs.workers import WorkerError

    said = []
    env = worker_pool(log=said.append)
    try:
        env.reset(seed=100)
        env.step(torch.full((4, 3, 2), 0.2))
        kill_worker(env, 0)
        out = env.step(torch.full((4, 3, 2), 0.2))
        assert out.lost.tolist() == [True, True, False, False] and out.steps.tolist() == [0, 0, 3, 3]
        assert out.rewards[:2].abs().sum() == 0 and not out.done[:2].any()
        for i in (0, 1):   # the restarted envs start over from the seeds of the last reset
            fresh = ColorReachSingleEnv(ColorReachConfig(max_episode_steps=16)).reset(100 + i)["state"]
            assert torch.equal(out.obs["state"][i], torch.from_numpy(fresh))
        assert len(said) == 1 and "worker 0 (envs 0-1)" in said[0] and "restarting it (1 of at most 1)" in said[0]
        assert env.step(torch.zeros(4, 1, 2)).lost is None
        kill_worker(env, 1)
        with pytest.raises(WorkerError, match=r"SIGKILL \(after 1 restart\(s\), the most allowed: 1\)"):
            env.step(torch.zeros(4, 1, 2))
    finally:
        env.close()


def test_a_worker_killed_mid_rollout_drops_its_partial_episodes_from_the_update(sft):
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.policies.actor import Actor, SamplerConfig
    from vla_rl.rl.algorithms import PPO, PPOConfig
    from vla_rl.rl.learner import Learner, LearnerConfig
    from vla_rl.rl.rollout import collect_rollout

    model, norm, _ = load_policy(sft)
    actor = Actor(model, norm)
    env = worker_pool(log=QUIET)
    real_step, calls = env.step, []

    def step(chunk):   # the worker of envs 2-3 dies during the third chunk
        calls.append(1)
        if len(calls) == 3:
            kill_worker(env, 1)
        return real_step(chunk)

    env.step = step
    try:
        ro, _ = collect_rollout(actor, env, env.reset(seed=0), num_chunks=4, sampler=SamplerConfig(3, "noise"),
                                execute=4, generator=torch.Generator().manual_seed(0))
    finally:
        env.close()
    # 16-step episodes, 4 steps a chunk: no episode ended before the death, so chunks 0-2 of envs 2-3 are dropped
    assert ro.lost_episodes == 2
    assert ro.valid.tolist() == [[True, True, False, False]] * 3 + [[True, True, True, True]]
    assert ro.terminated[2, 2:].all() and not ro.terminated[2, :2].any()   # no bootstrap across the restart
    learner = Learner(actor, LearnerConfig(update_epochs=1, minibatches=2), PPO(PPOConfig()))
    metrics = learner.update(ro, iteration=0)
    assert metrics["train/samples"] == 10 and learner.applied_steps == 2
    assert all(math.isfinite(v) for v in metrics.values())


def test_training_survives_a_worker_killed_mid_run(sft, tmp_path, monkeypatch):
    """The trainer on worker envs (the built-in task in worker processes stands in for ManiSkill / LIBERO,
    built by make_env with env.restart_dead_workers) loses a worker during iteration 2 and carries on."""
    import vla_rl.train.trainer as trainer_mod

    def make_env(cfg, *, num_envs, device, seed, log=None):
        env = worker_pool(num_envs=num_envs, per_worker=4, restarts=cfg.restart_dead_workers, log=log)
        env.seed = seed
        return env

    monkeypatch.setattr(trainer_mod, "make_env", make_env)
    said = []
    cfg = train_config(sft, tmp_path / "run", iterations=3, env={"num_envs": 8, "restart_dead_workers": 1})
    real_collect, rollouts = trainer_mod.collect_rollout, []

    def collect_rollout(actor, env, obs, **kw):   # the second iteration's rollout: a worker dies at its 2nd chunk
        rollouts.append(1)
        if len(rollouts) == 2:
            real_step = env.step

            def step(chunk, calls=[]):  # noqa: B006  (counts this rollout's steps)
                calls.append(1)
                if len(calls) == 2:
                    kill_worker(env, 0)
                return real_step(chunk)

            env.step = step
        try:
            return real_collect(actor, env, obs, **kw)
        finally:
            env.__dict__.pop("step", None)

    monkeypatch.setattr(trainer_mod, "collect_rollout", collect_rollout)
    with trainer_mod.Trainer(cfg, log=said.append) as trainer:
        history = trainer.run()
    assert [h["iteration"] for h in history] == [0, 1, 2, 3]
    lost = [h["iteration"] for h in history if h.get("rollout/lost_episodes")]
    assert len(lost) == 1 and any("restarting it (1 of at most 1)" in s for s in said)
    assert all(math.isfinite(h["losses/policy"]) for h in history[1:])


# ----------------------------------------------------------------------------------------------------
# 9. One bad ManiSkill demonstration is dropped and reported; the collection goes on and keeps its work
# ----------------------------------------------------------------------------------------------------
needs_maniskill = needs_simulator("mani_skill", "ManiSkill")


def test_the_replay_shim_discards_a_failed_replay_before_the_next_episode():
    from vla_rl.data.maniskill_replay import discarding_unflushed

    class Recorder:   # what the converter's RecordEpisode does with its buffer, reduced to a list of frames
        save_on_reset = False

        def __init__(self):
            self._trajectory_buffer, self.saved = ["reset"], []

        def flush_trajectory(self, save=True):
            if len(self._trajectory_buffer) > 1 and save:
                self.saved.append(self._trajectory_buffer[1:])
            self._trajectory_buffer = self._trajectory_buffer[-1:]

        def reset(self, seed):
            self._trajectory_buffer[-1] = f"reset {seed}"

        def step(self, a):
            self._trajectory_buffer.append(a)

    for patched, want in ((False, [["a", "reset 2", "c"]]), (True, [["c"]])):
        rec = Recorder()
        reset = discarding_unflushed(Recorder.reset) if patched else Recorder.reset
        reset(rec, 1)
        rec.step("a")
        rec.step("b")          # this replay fails: the converter does not flush it
        reset(rec, 2)
        rec.step("c")
        rec.flush_trajectory()
        assert rec.saved == want, patched   # unpatched: the failed replay's frames joined to the next episode


def join_first_two(h5: Path) -> None:
    """Do to a converted file what ManiSkill's converter does after a failed replay: the next saved episode
    (traj_1) begins with the failed one's frames (here traj_0's)."""
    import h5py
    import numpy as np

    with h5py.File(h5, "r+") as f:
        if "traj_1" not in f:
            return
        obs = np.concatenate([f["traj_0/obs"][:-1], f["traj_1/obs"][:]])
        act = np.concatenate([f["traj_0/actions"][:], f["traj_1/actions"][:]])
        for key, value in (("obs", obs), ("actions", act)):
            del f[f"traj_1/{key}"]
            f[f"traj_1/{key}"] = value


@pytest.fixture
def corrupting_converter(monkeypatch):
    import vla_rl.data.maniskill_demos as msd

    real = msd.convert_demos

    def convert(h5, **kw):
        out = real(h5, **kw)
        join_first_two(out)
        return out

    monkeypatch.setattr(msd, "convert_demos", convert)


@needs_maniskill
def test_a_corrupt_demo_is_dropped_reported_and_replaced_by_another_seed(tmp_path, corrupting_converter, capsys):
    from vla_rl.data.lerobot import read_lerobot_dataset, read_lerobot_info

    out = tmp_path / "push"
    assert cli_main(["collect", "maniskill", str(out), "task=PushCube-v1", "episodes=2", "seed=3"]) == 0
    printed = capsys.readouterr().out
    assert "PushCube-v1 seed 4: dropped, " in printed and "differs from a reset with seed 4" in printed
    assert "wrote 2 maniskill expert episodes as a LeRobot v3.0 dataset" in printed
    info = read_lerobot_info(out)["vla_rl"]
    assert [d["seed"] for d in info["dropped"]] == [4] and len(info["source"]) == 2   # a second round
    data = read_lerobot_dataset(out)
    assert data.num_episodes == 2 and int((data.frame_index == 0).sum()) == 2


@pytest.mark.slow   # a second ManiSkill collection (~30 s)
@needs_maniskill
def test_at_the_try_limit_the_good_episodes_are_written_and_the_shortfall_said(tmp_path, corrupting_converter,
                                                                              capsys):
    from vla_rl.data.lerobot import read_lerobot_info

    out = tmp_path / "push"
    argv = ["collect", "maniskill", str(out), "task=PushCube-v1", "episodes=2", "seed=3", "max_tries=2"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "only 1 of 2 episodes are good after trying 2 seeds (max_tries=2)" in printed
    assert "wrote 1 maniskill expert episodes (of 2 asked for" in printed
    assert read_lerobot_info(out)["total_episodes"] == 1


def worker_pids(pid: int) -> list[int]:
    """The env worker processes among ``pid``'s children (spawned: ``spawn_main``; not the resource tracker)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            out.append(int(child))
    return out


@pytest.mark.slow   # ManiSkill workers on CPU: ~2-4 min
@needs_maniskill
def test_a_resumed_maniskill_run_reproduces_the_uninterrupted_run(tmp_path):
    """PushCube on 2 worker processes, episodes of 20 steps (many start inside a rollout), a checkpoint every 2
    iterations: the run resumed at iteration 2 (new workers) gives every metric of the uninterrupted run, bit for
    bit, as a second uninterrupted run does."""
    from vla_rl.train.trainer import Trainer, resume_trainer

    model = tmp_path / "state_policy.yaml"
    model.write_text("num_cameras: 0\nstate_dim: 35\naction_dim: 7\ndepth: 1\n")
    from vla_rl.train.trainer import TrainConfig

    over = {"init": None, "model": str(model), "rollout_chunks": 4, "eval_every": 2, "eval_episodes": 2,
            "save_every": 2, "keep_last": 5, "threads": 1, "tensorboard": False, "progress": False,
            "env": {"kind": "maniskill", "num_envs": 2, "envs_per_worker": 1,
                    "maniskill": {"task": "PushCube-v1", "max_episode_steps": 20}},
            "learner": {"update_epochs": 1, "minibatches": 2}}

    def run(out, iterations=4):
        with Trainer(from_dict(TrainConfig, {**over, "out": str(out), "iterations": iterations}), log=QUIET) as t:
            return t.run()

    full, again = run(tmp_path / "full"), run(tmp_path / "again")
    run(tmp_path / "part", iterations=2)
    with resume_trainer(tmp_path / "part", overrides={"iterations": 4}, log=QUIET) as resumed:
        assert resumed.iteration == 2
        history = resumed.run()
    assert stripped(again) == stripped(full)
    assert stripped(history) == stripped(full)
    # every env's episode ended inside every rollout (20 of its 32 steps), and the next one began there
    assert sum(h.get("rollout/episodes", 0) for h in full) >= 2 * 4


@pytest.mark.slow   # ManiSkill workers on CPU: ~1-2 min
@needs_maniskill
def test_a_maniskill_run_survives_a_killed_worker_with_restart_dead_workers(tmp_path):
    """`vla-rl train` on ManiSkill (2 worker processes) with env.restart_dead_workers=1; one worker is killed
    with SIGKILL once the run is under way; the run finishes and says it restarted the worker."""
    model = tmp_path / "state_policy.yaml"
    model.write_text("num_cameras: 0\nstate_dim: 35\naction_dim: 7\ndepth: 1\n")
    run = tmp_path / "run"
    args = ["train", "builtin_flow_noise", "init=null", f"model={model}", f"out={run}", "env.kind=maniskill",
            "env.num_envs=2", "env.envs_per_worker=1", "env.restart_dead_workers=1", "env.maniskill.task=PushCube-v1",
            "env.maniskill.max_episode_steps=16", "rollout_chunks=2", "iterations=3", "eval_every=1",
            "eval_episodes=2", "save_every=1", "tensorboard=false", "learner.update_epochs=1", "learner.minibatches=1",
            "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "vla_rl.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:   # wait until iteration 1 is logged
        if (run / "metrics.jsonl").is_file() and len(read_jsonl(run / "metrics.jsonl")) >= 2:
            break
        time.sleep(0.5)
    pids = worker_pids(proc.pid)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "restarting it (1 of at most 1)" in out and "Traceback" not in out
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
