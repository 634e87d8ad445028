"""Where a command writes: refuse to write into an output that already holds something, unless asked to.

Every command that writes (``train``, ``sft``, ``collect``, ``eval out=``, ``eval --libero``, ``demo``)
checks its output first, before any work: a fresh run into a folder that holds an earlier run would mix
both runs' metrics, overwrite the config the old checkpoints were made with, and let ``keep_last`` delete
the wrong checkpoints. ``overwrite=True`` (``--overwrite``) starts over: the old output is removed only
when the new work starts writing (:func:`clear_output`), so a command that fails before then loses nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class OutputExistsError(ValueError):
    """The output a command would write already holds something, and ``overwrite`` was not asked for."""


def _listing(path: Path, limit: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def is_taken(path: str | Path) -> bool:
    """True if ``path`` is a file, or a folder with anything in it (an empty folder is free)."""
    path = Path(path)
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def check_output(path: str | Path, *, overwrite: bool, what: str = "output", resumable: bool = False,
                 elsewhere: str = "another out=") -> None:
    """Raise :class:`OutputExistsError` if ``path`` holds something and ``overwrite`` is False.

    ``what`` names the output in the message (``run folder``, ``dataset``, ...); ``resumable`` adds the
    ``--resume`` advice (training runs); ``elsewhere`` says how to choose another path."""
    path = Path(path)
    if overwrite or not is_taken(path):
        return
    held = f"it holds {_listing(path)}" if path.is_dir() else "the file exists"
    ways = ([f"continue that run with `--resume {path}`"] if resumable else []) + \
        ["start over with `--overwrite`", f"or write elsewhere with {elsewhere}"]
    raise OutputExistsError(f"{what} {path} is not empty ({held}); {', '.join(ways)}")


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
