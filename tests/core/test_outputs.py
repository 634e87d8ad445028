"""Where commands write (vla_rl.core.outputs): one policy for every command that writes a folder or a file.

An occupied output needs --overwrite; another kind of data (a training run, a dataset, a LeRobot checkpoint, a
policy folder of another kind) is refused even with it, named; an output that is, contains or lies inside one of
the command's inputs is refused whatever the flags. Each refusal comes before any work and leaves everything as
it was. The inputs here are mostly stand-ins (the refusal comes first, so they need not be real).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from exported_fixture import policy_folder

from vla_rl.cli import main as cli_main
from vla_rl.core.outputs import (
    BENCH,
    CHECKPOINT,
    DATASET,
    DEMO,
    EVAL_FILE,
    EXPORT,
    GIT,
    LEROBOT_POLICY,
    POLICY,
    REPORT,
    RUN,
    TRAJECTORIES,
    OutputExistsError,
    OutputIsInputError,
    check_output,
    file_kind,
    folder_kind,
)


def files(root: Path, *names: str, text: str = "x") -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fake_run(root: Path) -> Path:
    return files(root, "config.yaml", "metrics.jsonl", "checkpoints/iter_000001/model.safetensors",
                 "checkpoints/iter_000001/trainer_state.yaml")


def fake_dataset(root: Path) -> Path:
    return files(root, "meta/info.json", "data/chunk-000/file-000.parquet")


def error_line(capsys, kind: str = "output") -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("vla-rl: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"vla-rl: {kind} error: "), err
    return lines[0]


def test_folder_kind_names_each_kind_of_data(tmp_path):
    lerobot = files(tmp_path / "lerobot", "model.safetensors")
    (lerobot / "config.json").write_text(json.dumps({"type": "pi0"}))
    cases = {
        RUN: fake_run(tmp_path / "run"),
        CHECKPOINT: files(tmp_path / "ckpt", "model.safetensors", "trainer_state.yaml", "config.yaml"),
        POLICY: files(tmp_path / "policy", "model.safetensors", "config.yaml", "norm_stats.safetensors"),
        EXPORT: files(tmp_path / "export", "model.safetensors", "config.json", "spec.json"),
        LEROBOT_POLICY: lerobot,
        DATASET: fake_dataset(tmp_path / "dataset"),
        TRAJECTORIES: files(tmp_path / "traj", "PushCube.h5", "PushCube.json"),
        BENCH: files(tmp_path / "bench", "tasks/maniskill/PushCube-v1.json"),
        REPORT: files(tmp_path / "report", "report.md", "diagnostics.png"),
        DEMO: files(tmp_path / "demo", "sft/model.safetensors", "sft/config.yaml", "rl/metrics.jsonl"),
        GIT: files(tmp_path / "repo", ".git/HEAD", "README.md"),
        None: files(tmp_path / "notes", "a.txt", "b/c.txt"),
    }
    for want, path in cases.items():
        assert folder_kind(path) == want, path
    runs = tmp_path / "runs"
    fake_run(runs / "a")
    fake_dataset(runs / "b")
    files(runs, "notes.txt")
    assert folder_kind(runs) == "folder of datasets and training runs"
    (tmp_path / "empty").mkdir()
    assert folder_kind(tmp_path / "empty") is None and folder_kind(tmp_path / "missing") is None
    assert file_kind(cases[RUN] / "metrics.jsonl") == f"file of the training run {cases[RUN]}"
    (tmp_path / "e.json").write_text(json.dumps({"format": "vla-rl-eval-episodes/1"}))
    assert file_kind(tmp_path / "e.json") == EVAL_FILE and file_kind(tmp_path / "notes" / "a.txt") is None


def test_the_kinds_read_the_formats_their_writers_write():
    from vla_rl.core.outputs import BENCH_TASK_FORMAT, EVAL_FILE_FORMAT
    from vla_rl.eval.bench import RESULT_FORMAT
    from vla_rl.eval.evaluate import EPISODE_FILE_FORMAT

    assert (EVAL_FILE_FORMAT, BENCH_TASK_FORMAT) == (EPISODE_FILE_FORMAT, RESULT_FORMAT)


def commands(target: Path, src: Path) -> dict[str, list[str]]:
    """Every writing command, writing to ``target`` (inputs: ``src``, a stand-in policy folder)."""
    return {
        "export": ["export", str(src), str(target)],
        "import": ["import", "lerobot", str(src), str(target)],
        "sft": ["sft", str(src.parent / "no_dataset"), f"out={target}"],
        "train": ["train", "builtin_flow_noise", f"init={src}", f"out={target}"],
        "collect": ["collect", "builtin", str(target)],
        "eval": ["eval", str(src), f"out={target}"],
        "bench": ["bench", str(src), "--suite", "maniskill:PushCube-v1", f"out={target}"],
        "report": ["report", str(src.parent / "no_run"), "--out", str(target)],
        "demo": ["demo", f"out={target}"],
    }


@pytest.mark.parametrize("other", ["training run", "dataset", "folder of training runs", "deep"])
def test_no_command_replaces_another_kind_of_data_even_with_overwrite(tmp_path, capsys, other):
    """`cp -r runs/ref runs/x && vla-rl export sft runs/x` must not delete the run: with or without --overwrite,
    each command names what the folder is and leaves it whole. ``deep``: `mkdir -p proj/runs && cp -r runs/base
    proj/runs/rl1 && vla-rl export sft proj --overwrite` (the run two levels down) is refused too."""
    src = files(tmp_path / "src", "model.safetensors", "config.yaml")
    target = tmp_path / "target"
    if other == "training run":
        fake_run(target)
    elif other == "dataset":
        fake_dataset(target)
    elif other == "deep":
        fake_run(target / "runs" / "rl1")
        files(target, "notes.txt", "runs/logs/x.txt")
        other = "folder of training runs"
    else:
        fake_run(target / "a")
        fake_run(target / "b")
    before = snapshot(target)
    own = {"training run": "train", "dataset": "collect"}   # a command's own kind: test_overwrite_replaces...
    for name, argv in commands(target, src).items():
        if own.get(other) == name:
            continue
        for flags in ([], ["--overwrite"]):
            assert cli_main([*argv, *flags]) == 2, (name, flags)
            line = error_line(capsys)
            assert f"is a {other}" in line and "not replaced, even with --overwrite" in line, (name, line)
            assert snapshot(target) == before, name


def test_overwrite_replaces_the_own_kind_and_a_plain_file_only(tmp_path, capsys):
    src, _, _ = policy_folder(tmp_path / "policy")
    out = tmp_path / "export"
    assert cli_main(["export", str(src), str(out), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert cli_main(["export", str(src), str(out), "--dtype", "fp32"]) == 2    # an earlier export: needs --overwrite
    line = error_line(capsys)
    assert f"exported policy {out} is not empty" in line and "--overwrite" in line
    assert cli_main(["export", str(src), str(out), "--dtype", "bf16", "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bf16"
    # a folder holding what an export does not hold (the user's notes, a project) is not an export to replace
    plain = files(tmp_path / "plain", "notes.txt")
    for flags in ([], ["--overwrite"]):
        assert cli_main(["export", str(src), str(plain), "--dtype", "fp32", *flags]) == 2
        assert "holds notes.txt, which an exported policy does not hold: it is not replaced, even with --overwrite" \
            in error_line(capsys)
    assert (plain / "notes.txt").read_text() == "x"
    # a plain file named as the output is replaced with --overwrite, and no hidden copy of it stays behind
    (tmp_path / "file").write_text("old")
    assert cli_main(["export", str(src), str(tmp_path / "file"), "--dtype", "fp32", "--overwrite"]) == 0
    assert (tmp_path / "file" / "spec.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    # another kind of policy folder is not an export: refused even with --overwrite
    other_src, _, _ = policy_folder(tmp_path / "policy2")
    assert cli_main(["export", str(other_src), str(src), "--overwrite"]) == 2
    assert f"is a {POLICY}" in error_line(capsys)


def test_an_output_that_is_contains_or_lies_inside_an_input_is_refused_whatever_the_flags(tmp_path, capsys):
    data = fake_dataset(tmp_path / "data")
    policy = files(tmp_path / "sft", "model.safetensors", "config.yaml")
    lerobot = files(tmp_path / "lerobot", "model.safetensors", "config.json")
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "eval/success_once": 0.5}) + "\n")
    link = tmp_path / "link"
    os.symlink(data, link)
    cases = [
        (["sft", str(data), f"out={data}"], "is the dataset"),
        (["sft", str(data), f"out={data / 'policy'}"], "lies inside the dataset"),
        (["sft", str(data / "meta"), f"out={tmp_path}"], "contains the dataset"),
        (["sft", str(data), f"out={link}"], "is the dataset"),                        # the same folder by a link
        (["train", "builtin_flow_noise", f"init={policy}", f"out={policy}"], "is the init policy"),
        (["import", "lerobot", str(lerobot), str(lerobot)], "is the LeRobot checkpoint"),
        (["export", str(policy), str(policy / "exported")], "lies inside the source"),
        (["eval", str(policy), f"out={policy / 'eval.json'}"], "lies inside the checkpoint"),
        (["bench", str(policy), "--suite", "maniskill:PushCube-v1", f"out={policy}"], "is the checkpoint"),
        (["report", str(run), "--out", str(run)], "is the run folder"),
    ]
    before = {p: snapshot(p) for p in (data, policy, lerobot, run)}
    for argv, how in cases:
        for flags in ([], ["--overwrite"]):
            assert cli_main([*argv, *flags]) == 2, argv
            line = error_line(capsys)
            assert how in line and "which this command reads" in line, (argv, line)
    assert {p: snapshot(p) for p in before} == before


def test_check_output_itself(tmp_path):
    (tmp_path / "run").mkdir()
    check_output(tmp_path / "run", overwrite=False, kind=RUN)                 # empty: free
    check_output(tmp_path / "new", overwrite=False, kind=RUN)                 # absent: free
    fake_run(tmp_path / "run")
    with pytest.raises(OutputExistsError, match="--resume"):
        check_output(tmp_path / "run", overwrite=False, kind=RUN, resumable=True)
    check_output(tmp_path / "run", overwrite=True, kind=RUN)
    with pytest.raises(OutputExistsError, match="is a training run"):
        check_output(tmp_path / "run", overwrite=True, kind=DATASET)
    with pytest.raises(OutputIsInputError, match="lies inside the init policy"):
        check_output(tmp_path / "run" / "x", overwrite=True, kind=RUN, inputs={"init policy": tmp_path / "run"})
    check_output(tmp_path / "run", overwrite=True, kind=RUN, inputs={"init policy": None})


def test_a_part_of_a_run_or_dataset_counts_as_it_but_a_git_checkout_is_only_a_place(tmp_path):
    run = fake_run(tmp_path / "run")
    best = files(run / "checkpoints" / "best", "model.safetensors", "config.yaml")   # a policy folder by itself
    with pytest.raises(OutputExistsError, match=f"is a part of the training run {run}"):
        check_output(best, overwrite=True, kind=POLICY)
    check_output(run / "checkpoints" / "new", overwrite=False, kind=POLICY)       # nothing there: free
    repo = files(tmp_path / "repo", ".git/HEAD")
    (repo / "runs" / "cmp").mkdir(parents=True)
    (repo / "runs" / "cmp" / "e.json").write_text(json.dumps({"format": "vla-rl-eval-episodes/1"}))
    check_output(repo / "runs" / "cmp" / "e.json", overwrite=True, kind=EVAL_FILE)   # outputs in a checkout
    files(repo / "runs" / "old", "config.yaml")   # a run killed before its first metrics line: the start of one
    check_output(repo / "runs" / "old", overwrite=True, kind=RUN)
    files(repo / "runs" / "old", "notes.txt")     # something a run does not hold: not a run to start over
    with pytest.raises(OutputExistsError, match="holds notes.txt, which a training run does not hold"):
        check_output(repo / "runs" / "old", overwrite=True, kind=RUN)
    with pytest.raises(OutputExistsError, match="is a git checkout"):
        check_output(repo, overwrite=True, kind=RUN)


def test_a_folder_too_large_to_inspect_is_not_replaced(tmp_path, monkeypatch):
    import vla_rl.core.outputs as outputs

    for i in range(5):
        files(tmp_path / "big" / f"d{i}", "x.txt")
    monkeypatch.setattr(outputs, "MAX_FOLDERS_INSPECTED", 3)
    assert folder_kind(tmp_path / "big") == outputs.UNINSPECTED
    with pytest.raises(OutputExistsError, match="folder too large to inspect"):
        check_output(tmp_path / "big", overwrite=True, kind=POLICY)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_honour_the_umask(tmp_path, umask):
    """Folders written atomically (policies, exports, datasets, checkpoints) get the modes ordinary file creation
    gives: readable by others under umask 022 (a robot's service account reads an export), private under 077."""
    from vla_rl.interop.export import export_policy

    src, _, _ = policy_folder(tmp_path / "policy")
    old = os.umask(umask)
    try:
        export_policy(src, tmp_path / "export")
    finally:
        os.umask(old)
    modes = {p: p.stat().st_mode & 0o777 for p in [tmp_path / "export", *(tmp_path / "export").rglob("*")]}
    assert modes and all(m == (0o777 & ~umask if p.is_dir() else 0o666 & ~umask) for p, m in modes.items()), \
        {str(p): oct(m) for p, m in modes.items()}

