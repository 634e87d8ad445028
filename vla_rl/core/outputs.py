"""Where a command writes: one policy for every command that writes a folder or a file.

Every writing command (``train``, ``sft``, ``collect``, ``eval out=``, ``bench``, ``report``, ``demo``, ``import``,
``export``) calls :func:`check_output` before any work:

- An output that is, contains or lies inside one of the command's inputs is refused, whatever the flags
  (:func:`check_not_input`): ``--overwrite`` would otherwise delete the dataset, policy or run being read.
- An absent output, or an empty folder, is free.
- A folder that holds another kind of data (a training run, a dataset, a LeRobot checkpoint, a policy folder of
  another kind, a git checkout, a folder of runs ...: :func:`folder_kind`) is refused even with ``--overwrite``,
  naming what it is: that is never what the user meant to replace.
- A folder of no known kind that holds anything the command does not write itself (``notes.txt``, a project's
  sources: :data:`OWN_ENTRIES`) is refused even with ``--overwrite``: ``--overwrite`` replaces the command's own
  output, not whatever folder was named by mistake. A plain file that is not another kind of data is the one
  thing the user named, and ``--overwrite`` replaces it.
- Anything else that is not empty (the command's own kind of output, or the start of one) is refused unless
  ``overwrite`` (``--overwrite``); commands whose output can be continued (``bench``) or regenerated in place
  (``report``) take their own kind without it.

Why refuse at all: a fresh run into a folder that holds an earlier run would mix both runs' metrics, overwrite
the config the old checkpoints were made with, and let ``keep_last`` delete the wrong checkpoints. With
``overwrite`` the old output is removed only when the new work starts writing (:func:`clear_output`), or replaced
atomically once the new one is complete, so a command that fails before then loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class OutputExistsError(ValueError):
    """The output a command would write already holds something it may not replace."""


class OutputIsInputError(OutputExistsError):
    """The output is, contains or lies inside one of the command's inputs."""


# Kinds of folder a command may be asked to write over. Each names what it is in messages.
RUN, CHECKPOINT, POLICY, EXPORT, LEROBOT_POLICY = ("training run", "training checkpoint", "policy folder",
                                                   "exported policy", "LeRobot policy checkpoint")
DATASET, TRAJECTORIES, BENCH, REPORT, DEMO, GIT = ("dataset", "ManiSkill trajectory folder", "bench folder",
                                                   "report folder", "demo folder", "git checkout")
EVAL_FILE = "evaluation file"
# Kinds whose parts are never replaced either: an output inside one of them (a run's checkpoints/best, a file of a
# dataset) counts as that kind. Not containers of regenerable outputs (a demo, bench or report folder), nor a git
# checkout (runs/ inside the project's own checkout is the usual place for outputs).
PRECIOUS = (RUN, CHECKPOINT, POLICY, EXPORT, LEROBOT_POLICY, DATASET, TRAJECTORIES)
# What a command itself writes at the top of a folder output that may be found there before the folder is of its kind
# (a run killed before its first metrics line: config.yaml alone). Outputs written aside and renamed into place
# (policies, exports, datasets, reports) leave nothing partial, so they own nothing here.
OWN_ENTRIES = {RUN: ("config.yaml", "metrics.jsonl", "checkpoints", "tensorboard", "videos"),
               DEMO: ("sft", "rl")}
BENCH_TASK_FORMAT = "vla-rl-bench-task/1"
EVAL_FILE_FORMAT = "vla-rl-eval-episodes/2"
EVAL_FILE_OLDER = ("vla-rl-eval-episodes/1",)   # evaluation files written before episodes were named by their seeds


def _listing(path: Path, limit: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _own_kind(path: Path) -> str | None:
    """The kind of data folder ``path`` itself is, from the files it holds (None: none known)."""
    has = lambda *names: all((path / n).exists() for n in names)   # noqa: E731
    if has(".git"):
        return GIT
    if (path / "checkpoints").is_dir() or has("metrics.jsonl"):
        return RUN
    if has("model.safetensors", "trainer_state.yaml"):
        return CHECKPOINT
    if has("model.safetensors", "spec.json") or has("model.safetensors", "vla_rl_export.json"):
        return EXPORT   # ours, or one in openpi's / LeRobot's layout (vla-rl export --format)
    if has("model.safetensors", "config.yaml"):
        return POLICY
    if has("config.json") and (has("model.safetensors") or _json(path / "config.json").get("type")):
        return LEROBOT_POLICY
    if (path / "meta" / "info.json").is_file():
        return DATASET
    if any(path.glob("*.h5")):
        return TRAJECTORIES
    if has("results.json") or (path / "tasks").is_dir():
        return BENCH
    if has("report.md"):
        return REPORT
    if _own_kind_of(path / "sft") == POLICY:
        return DEMO
    return None


def _own_kind_of(path: Path) -> str | None:
    return _own_kind(path) if path.is_dir() else None


# A folder with more subfolders than this is not searched to the end: it is refused as too large to inspect.
MAX_FOLDERS_INSPECTED = 20_000
UNINSPECTED = "folder too large to inspect"


def folder_kind(path: str | Path) -> str | None:
    """What kind of data the folder ``path`` holds, in words (``"training run"``, ``"dataset"``, ...), or None for
    an absent or empty folder and a folder of no known kind. A folder that holds known kinds at any depth (``proj/``
    with ``proj/runs/rl1/`` a run) is ``"folder of training runs"`` (or of whatever they hold): an ``--overwrite``
    of ``proj`` would delete them. Links are not followed; hidden folders (``.cache``, ``.venv``) are not searched."""
    path = Path(path)
    if not path.is_dir():
        return None
    own = _own_kind(path)
    if own is not None:
        return own
    inside: set[str] = set()
    seen = 0
    for root, dirs, _ in os.walk(path):
        keep = []
        for name in dirs:
            if name.startswith("."):
                continue
            seen += 1
            if seen > MAX_FOLDERS_INSPECTED:
                return UNINSPECTED
            kind = _own_kind(Path(root) / name)
            if kind is None:
                keep.append(name)   # searched further down
            else:
                inside.add(kind)    # a known kind is not looked into
        dirs[:] = keep
    if inside:
        return "folder of " + " and ".join(f"{k.removesuffix(' folder')}s" for k in sorted(inside))
    return None


def file_kind(path: str | Path) -> str | None:
    """What the file ``path`` is: an evaluation file (``vla-rl eval out=``), a file of a folder of a
    :data:`PRECIOUS` kind (``"file of the training run runs/a"``), or None."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json" and _json(path).get("format") in (EVAL_FILE_FORMAT, *EVAL_FILE_OLDER):
        return EVAL_FILE
    return part_of(path, "file")


def part_of(path: str | Path, what: str = "part") -> str | None:
    """``"<what> of the <kind> <folder>"`` when one of the three folders above ``path`` is of a :data:`PRECIOUS`
    kind (a run's ``checkpoints/best``, a dataset's ``meta/``), else None."""
    for parent in list(Path(path).absolute().parents)[:3]:
        kind = _own_kind(parent) if parent.is_dir() else None
        if kind in PRECIOUS:
            return f"{what} of the {kind} {parent}"
    return None


def is_taken(path: str | Path) -> bool:
    """True if ``path`` is a file, or a folder with anything in it (an empty folder is free)."""
    path = Path(path)
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


Inputs = dict[str, "str | Path | None"] | list[tuple[str, "str | Path | None"]]


def check_not_input(out: str | Path, inputs: Inputs) -> None:
    """Raise :class:`OutputIsInputError` if ``out`` is, contains or lies inside one of ``inputs`` (``{what it is:
    path}`` or ``(what, path)`` pairs; None entries are skipped). Paths are compared resolved (links followed)."""
    o = Path(out).resolve()
    for what, inp in (inputs.items() if isinstance(inputs, dict) else inputs):
        if inp is None or str(inp) == "":
            continue
        i = Path(inp).resolve()
        if o == i:
            how = "is"
        elif i in o.parents:
            how = "lies inside"
        elif o in i.parents:
            how = "contains"
        else:
            continue
        raise OutputIsInputError(f"the output {out} {how} the {what} {inp}, which this command reads: write "
                                 "the output elsewhere (refused whatever the flags, --overwrite included)")


def check_not_working_folder(out: str | Path, elsewhere: str = "another out=") -> None:
    """Raise :class:`OutputExistsError` if ``out`` is the folder the command runs in, or holds it (``out=.``,
    ``out=..``): outputs are written aside and renamed into place (or cleared first with ``--overwrite``), and the
    folder a process stands in cannot be renamed; found here, before the work, not after it."""
    o, cwd = Path(out).resolve(), Path.cwd().resolve()
    if o == cwd or o in cwd.parents:
        how = "is" if o == cwd else "holds"
        raise OutputExistsError(f"the output {out} {how} the folder this command runs in, which cannot be replaced "
                                f"under it: write to a folder of its own with {elsewhere}")


def check_output(path: str | Path, *, overwrite: bool, kind: str, inputs: Inputs | None = None,
                 reuse: bool = False, resumable: bool = False, elsewhere: str = "another out=") -> None:
    """Check that a command may write its output ``path`` (the policy in the module docstring).

    ``kind``: what the command writes (:data:`RUN`, :data:`POLICY`, :data:`EVAL_FILE`, ...); ``inputs``: what
    it reads (:func:`check_not_input`); ``reuse``: the command takes a non-empty output of its own kind without
    ``overwrite`` (it continues or regenerates it); ``resumable`` adds the ``--resume`` advice (training runs);
    ``elsewhere`` says how to choose another path. Raises :class:`OutputExistsError`."""
    path = Path(path)
    check_not_input(path, inputs or {})
    check_not_working_folder(path, elsewhere)
    if not is_taken(path):
        return
    found = folder_kind(path) if path.is_dir() else file_kind(path)
    if path.is_dir() and kind == EVAL_FILE:
        found = found or "folder"
    if path.is_dir() and found in (None, kind):
        found = part_of(path) or found
    if found is not None and found != kind:
        held = f" ({_listing(path)})" if path.is_dir() else ""
        raise OutputExistsError(f"{path} is {_a(found)}{held}, not {_a(kind)}: it is not replaced, even with "
                                f"--overwrite; write elsewhere with {elsewhere}, or remove it yourself if it is no "
                                "longer needed")
    if found is None and path.is_dir():
        strangers = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                           if p.name not in OWN_ENTRIES.get(kind, ()) and not (p.name.startswith(".") and p.is_file()))
        if strangers:
            more = f", ... ({len(strangers)} entries)" if len(strangers) > 4 else ""
            raise OutputExistsError(
                f"{path} holds {', '.join(strangers[:4])}{more}, which {_a(kind)} does not hold: it is not replaced, "
                f"even with --overwrite (that replaces {_a(kind)}); write elsewhere with {elsewhere}, or empty it "
                "yourself")
    if overwrite or (reuse and found == kind):
        return
    held = f"it holds {_listing(path)}" if path.is_dir() else "the file exists"
    what = f"{kind} {path} is not empty" if found == kind else f"{path} is not empty"
    ways = ([f"continue that run with `--resume {path}`"] if resumable and found == kind else []) + \
        ["start over with `--overwrite`", f"or write elsewhere with {elsewhere}"]
    raise OutputExistsError(f"{what} ({held}); {', '.join(ways)}")


def clear_output(path: str | Path) -> None:
    """Remove what ``path`` holds (after :func:`check_output` with ``overwrite=True``), leaving an empty
    folder. The old folder is renamed aside first, so a crash half-way leaves either it or nothing at
    ``path``, never a mixture of old and new."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            return
        aside = path.parent / f".{path.name}.overwritten-{os.getpid()}"
        os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
