"""``vla-rl export SRC OUT --format openpi``: an (RL-improved) π0 / π0.5 policy in the layout openpi's PyTorch
policies load (what ``examples/convert_jax_model_to_pytorch.py`` writes, RLinf's starting-point layout):
``model.safetensors`` with openpi's tensor names, ``config.json`` and ``assets/<asset_id>/norm_stats.json``.

The tensor names are the inverse of the import's (:func:`vla_rl.checkpoint.lerobot_pi.weight_sources`, LeRobot's
names without ``model.``): SigLIP's fused ``qkv`` splits back into ``q_proj`` / ``k_proj`` / ``v_proj``; the text
embedding is written as PaliGemma's ``lm_head.weight``, the name of the tied pair openpi's file keeps; the action
expert's unused ``lm_head`` is written as zeros (openpi's model has the parameter). Our RL heads (Flow-Noise std,
value) have no counterpart in openpi and are left out. The normalisation statistics are written back into openpi's
maps (std - 1e-6; q99 - 1e-6), so openpi normalises exactly as the policy did here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vla_rl.checkpoint import lerobot_pi
from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.checkpoint.openpi import EPS, NORM_FILE
from vla_rl.core.ranges import ConfigError
from vla_rl.interop.export import open_source
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.policy_config import PolicyConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_ASSET_ID = "vla-rl"


def check_openpi_compatible(cfg: PolicyConfig) -> None:
    """Refuse, naming the setting, a policy openpi's π0 / π0.5 model cannot express."""
    problems = []
    if cfg.arch not in ("pi0", "pi05"):
        problems.append(f"arch {cfg.arch} (openpi has π0 and π0.5)")
    want = {"time_conditioning": "adarms" if cfg.arch == "pi05" else "concat",
            "state_input": ("prompt", "none") if cfg.arch == "pi05" else ("suffix",),
            "tokenizer": ("sentencepiece",), "image_resize": ("pad",), "num_kv_heads": (1,)}
    for key, ok in want.items():
        ok = ok if isinstance(ok, tuple) else (ok,)
        if getattr(cfg, key) not in ok:
            problems.append(f"{key} {getattr(cfg, key)!r} (openpi: {' or '.join(map(str, ok))})")
    if cfg.num_cameras > 3:
        problems.append(f"{cfg.num_cameras} camera slots (openpi: 3)")
    if problems:
        raise ConfigError("this policy cannot be written in openpi's layout: " + "; ".join(problems))


def openpi_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under openpi PyTorch's names: LeRobot's without ``model.``, the tied embedding as
    ``lm_head`` (see the module docstring)."""
    return {k.removeprefix("model."): v
            for k, v in lerobot_pi.lerobot_tensors(model, dtype, embed_tokens=False).items()}


def openpi_norm_stats(norm: NormStats) -> dict:
    """Our statistics as openpi's ``norm_stats.json`` content, undoing what the import added (its 1e-6)."""
    def block(s: Stats) -> dict:
        std, q99 = s.std, s.q99
        if norm.mode == "mean_std":
            std = std - EPS
        else:
            q99 = q99 - EPS
        return {"mean": s.mean.tolist(), "std": std.tolist(), "q01": s.q01.tolist(), "q99": q99.tolist()}

    return {"norm_stats": {"state": block(norm.state), "actions": block(norm.action)}}


def export_openpi(src: str | Path, out: str | Path, *, dtype: str = "fp32", asset_id: str | None = None,
                  overwrite: bool = False) -> Path:
    """Write the policy at ``src`` in openpi's PyTorch layout at ``out`` (atomically)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    folder, out, model, norm, config = open_source(src, out, overwrite=overwrite)
    cfg = model.cfg
    check_openpi_compatible(cfg)
    if norm.relative_actions and norm.relative_actions != tuple(range(len(norm.relative_actions))):
        raise ConfigError(f"relative action dims {list(norm.relative_actions)}: openpi's DeltaActions makes the "
                          "first n dims relative only")
    source = config.get("source") or {}
    asset_id = asset_id or source.get("asset_id") or DEFAULT_ASSET_ID
    if Path(asset_id).is_absolute() or ".." in Path(asset_id).parts:
        raise ConfigError(f"asset id {asset_id!r} must be a relative name like 'physical-intelligence/libero'")
    tensors = openpi_tensors(model, DTYPES[dtype])
    meta = {"action_dim": cfg.action_dim, "action_horizon": cfg.action_horizon,
            "paligemma_variant": "unknown", "action_expert_variant": "unknown",
            "precision": "float32" if dtype == "fp32" else "bfloat16",
            # not read by openpi; what its training config must say for this checkpoint
            "vla_rl": {"pi05": cfg.arch == "pi05", "max_token_len": cfg.max_text_tokens,
                       "discrete_state_input": cfg.state_input == "prompt",
                       "extra_delta_transform": bool(norm.relative_actions),
                       "delta_action_dims": list(norm.relative_actions), "asset_id": asset_id,
                       "source": str(Path(folder).resolve())}}
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        stats = tmp / "assets" / asset_id / NORM_FILE
        stats.parent.mkdir(parents=True)
        stats.write_text(json.dumps(openpi_norm_stats(norm), indent=2) + "\n")
        (tmp / "vla_rl_export.json").write_text(json.dumps(   # marks the folder as an export (openpi reads neither)
            {"written_by": "vla-rl export --format openpi", "source": str(Path(folder).resolve()), "dtype": dtype,
             "left_out": ["the Flow-Noise std head and the value head (RL only)"]}, indent=2) + "\n")
    return out
