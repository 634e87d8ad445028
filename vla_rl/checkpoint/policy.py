"""Our policy folders: ``model.safetensors`` (weights), ``norm_stats.safetensors`` and ``config.yaml`` (the resolved
policy config, the normalisation mode, and what the env looked like), written atomically
(:func:`~vla_rl.checkpoint.folders.write_atomic_folder`) and loaded back without unpickling anything;
:func:`load_any_policy` also reads a LeRobot π0 / π0.5 folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vla_rl.checkpoint import openpi
from vla_rl.checkpoint.folders import (
    FORMAT_VERSION,
    read_tensors,
    read_tensors_lazily,
    read_yaml_file,
    write_atomic_folder,
)
from vla_rl.checkpoint.lerobot import is_lerobot_folder, load_lerobot
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.policies import lora
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, read_meta
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import FlowVLA
from vla_rl.policies.tokenizer import FILE_TOKENIZERS, TokenizerError


def policy_files(model: FlowVLA, norm: NormStats, meta: dict | None = None) -> tuple[dict, dict]:
    """The tensors and YAML files of a policy folder (a training checkpoint adds its own to these). A model with
    LoRA adapters keeps its base weights in ``model.safetensors`` (the keys of the plain policy) and the adapters
    in ``adapters.safetensors``, described by ``config.yaml``'s ``lora`` entry; loading merges them."""
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(model.cfg),
              "normalization": norm.meta(), **(meta or {})}
    base, adapters = lora.split_state(model.state_dict())
    tensors = {"model": base, "norm_stats": norm.to_tensors()}
    if adapters:
        tensors["adapters"] = adapters
        config["lora"] = lora.lora_meta(model)
    if model.cfg.tokenizer in FILE_TOKENIZERS:
        if model.text_tokenizer is None:
            raise CheckpointError(f"this policy tokenizes with {model.cfg.tokenizer} but has no tokenizer attached; "
                                  "a folder saved without it could not read instructions")
        name = model.cfg.tokenizer_file
        if Path(name).suffix != ".safetensors" or Path(name).name != name:
            raise CheckpointError(f"tokenizer_file must be a .safetensors file name in the policy folder, got {name!r}")
        tensors[Path(name).stem] = model.text_tokenizer.to_tensors()
    return tensors, {"config": config}


def save_policy(path: str | Path, model: FlowVLA, norm: NormStats, *, meta: dict | None = None) -> Path:
    """Save a policy folder; ``meta`` (env dims, sampler, ...) goes into ``config.yaml``."""
    tensors, yamls = policy_files(model, norm, meta)
    return write_atomic_folder(path, tensors=tensors, yamls=yamls)


def load_policy(path: str | Path, device="cpu") -> tuple[FlowVLA, NormStats, dict]:
    """Load a policy folder -> (model in eval mode, normalisation, the whole config.yaml).

    The model is built on the meta device and takes the stored tensors (as float32) one by one: one copy of the
    weights. (A LeRobot π0 / π0.5 folder too: :func:`load_any_policy`.)"""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}")
    config = read_yaml_file(path / "config.yaml")
    if "format_version" not in config:
        hint = ("; it looks like a training run folder: give one of its checkpoints (checkpoints/iter_*, "
                "checkpoints/best)" if (path / "checkpoints").is_dir() else "")
        raise CheckpointError(f"{path} is not a policy checkpoint folder (its config.yaml has no format_version)"
                              + hint)
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format_version {config.get('format_version')!r}")
    try:
        cfg = from_dict(PolicyConfig, config.get("policy", {}), prefix="policy")
        mode, hidden, relative = read_meta(config["normalization"])
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.yaml: {e}") from None
    with torch.device("meta"):
        model = make_policy(cfg)
    expected = model.state_dict()
    state = read_tensors_lazily(path / "model.safetensors", expected)
    if config.get("lora") is not None:   # LoRA adapters: folded into the weights they adapt
        state = merge_adapters(path, config, state)
    model.load_state_dict(state, assign=True)
    del state
    if cfg.tokenizer in FILE_TOKENIZERS:
        try:
            model.set_tokenizer(FILE_TOKENIZERS[cfg.tokenizer].from_file(path / cfg.tokenizer_file))
        except (TokenizerError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None
    try:
        norm = NormStats.from_tensors(read_tensors(path / "norm_stats.safetensors"), mode, hidden, relative)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return model.to(device).eval(), norm, config


def adapter_scaling(path: Path, config: dict) -> float:
    """The scaling of the LoRA adapters a policy folder's ``config.yaml`` describes."""
    meta = config.get("lora")
    scaling = meta.get("scaling") if isinstance(meta, dict) else None
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise CheckpointError(f"{path}/config.yaml: lora.scaling must be a number > 0, got {scaling!r}")
    return float(scaling)


def merge_adapters(path: Path, config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (base weights) with the folder's ``adapters.safetensors`` folded in (``W + s B A``)."""
    scaling = adapter_scaling(path, config)
    adapters = read_tensors(path / "adapters.safetensors")
    try:
        return lora.merge_state(state, adapters, scaling)
    except ValueError as e:
        raise CheckpointError(f"{path}/adapters.safetensors: {e}") from None


def foreign_kind(path: str | Path) -> str | None:
    """``"lerobot"``, ``"openpi-jax"``, ``"openpi-pytorch"`` or ``"rlinf"`` for a checkpoint another framework wrote
    that vla-rl reads directly, None for anything else (one of our folders, or nothing we know)."""
    if is_lerobot_folder(path):
        return "lerobot"
    return openpi.detect(path)


def load_any_policy(path: str | Path, device="cpu") -> tuple[FlowVLA, NormStats, dict]:
    """:func:`load_policy` of one of our policy folders, or a LeRobot π0 / π0.5 / SmolVLA folder, an openpi (JAX or
    PyTorch) or RLinf checkpoint imported on the fly (:func:`foreign_kind`; the tokenizer found next to it or in
    the openpi / Hugging Face caches; openpi's model settings recognised from its asset id)."""
    kind = foreign_kind(path)
    if kind == "lerobot":
        return load_lerobot(path, device=device)
    if kind is not None:
        return openpi.load_openpi(path, device=device)
    return load_policy(path, device=device)
