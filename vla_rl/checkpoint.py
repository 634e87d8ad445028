"""Self-contained checkpoint folders: safetensors + YAML, written atomically, never unpickled.

A policy folder holds ``model.safetensors`` (weights), ``norm_stats.safetensors`` and ``config.yaml``
(the resolved policy config, the normalisation mode, and what the env looked like). Writing goes to a
temporary sibling folder that is renamed into place, so an interrupted save never leaves a half-written
checkpoint and never destroys the previous one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vla_rl.config import ConfigError, from_dict, to_dict
from vla_rl.policies.config import PolicyConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, corrupt or does not match what is asked of it."""


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; when the block ends without an error it replaces
    ``path`` (a folder already there is swapped out, then removed), otherwise it is removed and ``path``
    is left as it was. A crash therefore never leaves a half-written folder nor loses the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_atomic_folder(path: str | Path, *, tensors: dict[str, dict[str, torch.Tensor]],
                        yamls: dict[str, dict]) -> Path:
    """Write ``<name>.safetensors`` and ``<name>.yaml`` files into folder ``path`` atomically."""
    with atomic_folder(path) as tmp:
        for name, tens in tensors.items():
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tens.items()},
                      str(tmp / f"{name}.safetensors"))
        for name, data in yamls.items():
            with open(tmp / f"{name}.yaml", "w") as f:
                yaml.safe_dump(data, f, sort_keys=False)
    return Path(path)


def read_tensors(path: Path, device="cpu") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None


def read_yaml_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise CheckpointError(f"corrupt YAML in {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a mapping")
    return data


def policy_files(model: FlowPolicy, norm: NormStats, meta: dict | None = None) -> tuple[dict, dict]:
    """The tensors and YAML files of a policy folder (a training checkpoint adds its own to these)."""
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(model.cfg),
              "normalization": {"mode": norm.mode,
                                "hidden_state_dims": list(norm.hidden_state)}, **(meta or {})}
    return {"model": model.state_dict(), "norm_stats": norm.to_tensors()}, {"config": config}


def save_policy(path: str | Path, model: FlowPolicy, norm: NormStats, *, meta: dict | None = None) -> Path:
    """Save a policy folder; ``meta`` (env dims, sampler, ...) goes into ``config.yaml``."""
    tensors, yamls = policy_files(model, norm, meta)
    return write_atomic_folder(path, tensors=tensors, yamls=yamls)


def load_policy(path: str | Path, device="cpu") -> tuple[FlowPolicy, NormStats, dict]:
    """Load a policy folder -> (model in eval mode, normalisation, the whole config.yaml)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}")
    config = read_yaml_file(path / "config.yaml")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format_version {config.get('format_version')!r}")
    try:
        cfg = from_dict(PolicyConfig, config.get("policy", {}), prefix="policy")
        mode = config["normalization"]["mode"]
        hidden = config["normalization"].get("hidden_state_dims") or []
        if not isinstance(hidden, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in hidden):
            raise ValueError(f"normalization.hidden_state_dims must be a list of ints, got {hidden!r}")
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.yaml: {e}") from None
    model = FlowPolicy(cfg)
    state = read_tensors(path / "model.safetensors")
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"{path}/model.safetensors does not match its config: missing "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    for k, v in model.state_dict().items():
        if state[k].shape != v.shape:
            raise CheckpointError(f"{path}/model.safetensors: {k} has shape {tuple(state[k].shape)}, "
                                  f"the config needs {tuple(v.shape)}")
    model.load_state_dict(state)
    try:
        norm = NormStats.from_tensors(read_tensors(path / "norm_stats.safetensors"), mode, tuple(hidden))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return model.to(device).eval(), norm, config
