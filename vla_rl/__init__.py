"""vla-rl: online RL fine-tuning of flow-matching VLA policies."""

import os as _os

__version__ = "0.1.0"

# In a source checkout, envs/, policies/ and configs/ sit beside this folder; an installed wheel carries them
# inside it (pyproject's package-dir). Adding the checkout's root to this package's path makes
# `vla_rl.envs` / `vla_rl.policies` resolve from the checkout too, so `python -m pytest` run from the root
# (which puts the root's vla_rl/ first on sys.path) works with any kind of install, or none.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "envs")) and _os.path.isfile(
        _os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "envs")):
    __path__.append(_root)  # noqa: F821  (a package's __path__)
