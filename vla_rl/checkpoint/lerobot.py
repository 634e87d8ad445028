"""LeRobot policy folders read as ours, whatever the architecture: ``vla-rl import lerobot``, ``init=`` and
``vla-rl eval`` of a LeRobot folder come here, and ``config.json``'s ``type`` picks the family
(:mod:`.lerobot_pi`: ``pi0`` / ``pi05``; :mod:`.lerobot_smolvla`: ``smolvla``); :mod:`.lerobot_format` does the
rest for all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from vla_rl.checkpoint import lerobot_pi, lerobot_smolvla
from vla_rl.checkpoint.lerobot_format import (
    Family,
    ImportReport,
    LeRobotImportError,
    import_with,
    load_with,
    read_config,
)
from vla_rl.policies.normalize import NormStats
from vla_rl.policies.seam import FlowVLA

FAMILIES: dict[str, Family] = {**{t: lerobot_pi.PI0 for t in lerobot_pi.TYPES},
                               **{t: lerobot_smolvla.SMOLVLA for t in lerobot_smolvla.TYPES}}


def is_lerobot_folder(path: str | Path) -> bool:
    """True if ``path`` looks like a LeRobot policy folder this importer reads (``config.json`` of a known type,
    no ``config.yaml`` of ours)."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "config.yaml").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get("type") in FAMILIES
    except (OSError, ValueError, AttributeError):
        return False


def _open(src: str | Path) -> tuple[Family, Path, dict]:
    src = Path(src)
    if not src.is_dir():
        raise LeRobotImportError(f"no LeRobot policy folder at {src}")
    lr = read_config(src, tuple(FAMILIES))
    return FAMILIES[lr["type"]], src, lr


def load_lerobot(src: str | Path, *, tokenizer: str | Path | None = None, overrides: dict | None = None,
                 device="cpu", dtype: torch.dtype = torch.float32) -> tuple[FlowVLA, NormStats, dict]:
    """A LeRobot folder as (model in eval mode, normalisation, a config dict like ``config.yaml``'s)
    (:func:`~vla_rl.checkpoint.lerobot_format.load_with`)."""
    family, src, lr = _open(src)
    return load_with(family, src, lr, tokenizer=tokenizer, overrides=overrides, device=device, dtype=dtype)


def import_lerobot(src: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
                   overrides: dict | None = None, dtype: str = "fp32",
                   progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Write the LeRobot folder ``src`` as one of our policy folders at ``out``
    (:func:`~vla_rl.checkpoint.lerobot_format.import_with`)."""
    family, src, lr = _open(src)
    return import_with(family, src, lr, out, tokenizer=tokenizer, overrides=overrides, dtype=dtype,
                       progress=progress)
