"""Where the project runs from (:func:`checkout_root`) and where the simulators' setup scripts leave their files
(:func:`cache_dir`: the Mesa lavapipe Vulkan driver, LIBERO's config).

``$VLA_RL_CACHE`` if set; in a source checkout (an editable install, or running from the repository) its
``.cache/`` folder, where ``scripts/setup_maniskill.sh`` and ``scripts/setup_libero.sh`` write by default; for
an installed (non-editable) package, ``~/.cache/vla-rl``. An installed package never looks inside
site-packages: run the setup scripts with ``VLA_RL_CACHE=~/.cache/vla-rl`` (or point ``VLA_RL_CACHE`` at a
checkout's ``.cache``).
"""

from __future__ import annotations

import os
from pathlib import Path


def checkout_root() -> Path | None:
    """The source checkout this package runs from (the folder holding ``envs/`` and ``pyproject.toml``), or
    None for an installed package (there ``envs/`` sits inside ``vla_rl/``). Ray's workers put it on their
    PYTHONPATH, so that they import the same code."""
    root = Path(__file__).resolve().parents[2]   # <checkout>/vla_rl/core/paths.py
    return root if (root / "pyproject.toml").is_file() and (root / "envs").is_dir() else None


def cache_dir() -> Path:
    """The setup scripts' folder: ``$VLA_RL_CACHE``, else ``<checkout>/.cache``, else ``~/.cache/vla-rl``."""
    if os.environ.get("VLA_RL_CACHE"):
        return Path(os.environ["VLA_RL_CACHE"]).expanduser()
    root = checkout_root()
    return root / ".cache" if root is not None else Path.home() / ".cache" / "vla-rl"
