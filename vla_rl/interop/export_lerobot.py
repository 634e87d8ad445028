"""``vla-rl export SRC OUT --format lerobot``: an (RL-improved) π0 / π0.5 policy as a LeRobot 0.6 policy folder,
what ``PI0Policy`` / ``PI05Policy.save_pretrained`` and their processor pipelines' ``save_pretrained`` write:
``config.json``, ``model.safetensors``, ``policy_preprocessor.json`` / ``policy_postprocessor.json`` with their
normaliser statistics (``*_normalizer_processor.safetensors``), plus PaliGemma's ``tokenizer.model`` (LeRobot's
tokenizer step names ``google/paligemma-3b-pt-224``; our import finds the file next to the checkpoint) and
``vla_rl_export.json`` (where it came from; LeRobot reads neither).

The tensor names are the inverse of the import's (:func:`vla_rl.checkpoint.lerobot_pi.weight_sources`), in LeRobot
>= 0.5's layout: SigLIP's fused ``qkv`` splits back into ``q_proj`` / ``k_proj`` / ``v_proj``; the text embedding is
written as ``embed_tokens`` (what the model embeds with) and again as PaliGemma's ``lm_head`` (the tied pair, which
π0 never decodes with); the action expert's unused ``lm_head`` is written as zeros. Our RL heads (Flow-Noise std,
value) have no counterpart in LeRobot and are left out.

Normalisation is written so that LeRobot's normaliser computes what ours does: π0's ``mean_std`` as ``MEAN_STD``
(mean, std), π0.5's ``quantile`` as ``QUANTILES`` (q01, q99); dims whose spread ours treats as zero (scale <= 1e-6:
left unscaled) get std 1 / quantiles c -+ 1. LeRobot adds ``eps`` = 1e-8 to the std when normalising (as the
processors it writes itself do, and as our import ignores): a relative 1e-8. A policy with hidden state dims
(``hidden_state``: set to 0 after normalising) has its state written as ``MEAN_STD`` (mean = centre, std = scale,
hidden dims mean 0 and std inf: exactly 0 in LeRobot and when imported back), whatever its mode.

LeRobot's ``PI0Config`` / ``PI05Config`` name the model sizes only through the Gemma variants (``gemma_2b``,
``gemma_300m``), and SigLIP So400m/14 and the 257,152-token vocabulary are fixed in its code. A policy of other
sizes is still written (the tiny test twins are; the test's LeRobot side patches the sizes as the fixtures did), and
:func:`size_notes` says what stock LeRobot cannot build.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vla_rl.checkpoint import lerobot_pi
from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.interop.export import DEFAULT_NUM_STEPS, open_source, spec_defaults
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.policy_config import PolicyConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LEROBOT_VERSION = "0.6.1"   # the release whose file formats this writes (tests/fixtures/lerobot_pi_tiny)
EPS = 1e-8                  # LeRobot's normaliser eps (its default, as its own processors save it)
SCALE_EPS = 1e-6            # ours: a scale at or below this is left at 1 (policies/normalize.py)
PRE, POST = "policy_preprocessor.json", "policy_postprocessor.json"
NOTES_FILE = "vla_rl_export.json"
OBS_IMAGES, OBS_STATE, ACTION = "observation.images", "observation.state", "action"
# LeRobot's Gemma variants (modeling_pi0.get_gemma_config) and what its PaliGemma config fixes (SigLIP So400m/14).
GEMMA = {"gemma_2b": {"width": 2048, "mlp_dim": 16384}, "gemma_300m": {"width": 1024, "mlp_dim": 4096}}
GEMMA_SHARED = {"depth": 18, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256}
SIGLIP = {"width": 1152, "depth": 27, "num_heads": 16, "mlp_dim": 4304, "patch_size": 14}
VOCAB = 257152


def check_lerobot_compatible(cfg: PolicyConfig, norm: NormStats) -> None:
    """Refuse, naming the settings, a policy LeRobot's PI0 / PI05 policy and processors cannot express."""
    problems = []
    if cfg.arch not in ("pi0", "pi05"):
        raise ConfigError(f"this policy cannot be written as a LeRobot π0 / π0.5 folder: arch {cfg.arch} "
                          "(LeRobot's pi0 / pi05 policies are π0 and π0.5)")
    pi05 = cfg.arch == "pi05"
    want = {"tokenizer": ("sentencepiece",), "image_resize": ("pad",), "image_antialias": (False,),
            "time_conditioning": ("adarms",) if pi05 else ("concat",), "adarms_final_norm": (pi05,),
            "state_input": ("prompt",) if pi05 else ("suffix",), "time_embedding_precision": ("float64",),
            "rope_base": (10000.0,)}
    if pi05:
        want["state_bins"] = (256,)
    else:
        want["clean_prompt"] = (False,)
    why = {"image_antialias": "LeRobot resizes with plain bilinear resize_with_pad_torch",
           "time_embedding_precision": "LeRobot computes the time embedding in float64",
           "clean_prompt": "LeRobot's π0 only appends a newline to the task",
           "state_input": "LeRobot's π0 reads the state as a suffix token, π0.5 as prompt text",
           "state_bins": "LeRobot's π0.5 bins the state into 256", "rope_base": "LeRobot's Gemma: 10000"}
    for key, ok in want.items():
        if getattr(cfg, key) not in ok:
            problems.append(f"{key} {getattr(cfg, key)!r} (LeRobot: {' or '.join(map(str, ok))}"
                            + (f"; {why[key]}" if key in why else "") + ")")
    if cfg.num_cameras < 1:
        problems.append("no camera slots (LeRobot's π0 needs at least one image feature)")
    robot_state = norm.state.mean.shape[0]
    if pi05:
        written = cfg.state_prompt_dims or cfg.state_dim
        if written != robot_state:
            problems.append(f"the prompt writes {written} state dims (state_prompt_dims {cfg.state_prompt_dims}, "
                            f"state_dim {cfg.state_dim}); LeRobot's π0.5 writes the robot's {robot_state}: set "
                            f"state_prompt_dims {robot_state}")
    elif cfg.state_prompt_dims:
        problems.append(f"state_prompt_dims {cfg.state_prompt_dims} (π0 has no state in its prompt)")
    if norm.relative_actions:
        problems.append(f"relative action dims {list(norm.relative_actions)} (the policy predicts offsets from the "
                        "state; this export writes absolute actions only, and LeRobot's relative_actions_processor "
                        "makes every dim but the named joints relative)")
    empties = [n for n in cfg.camera_names if n.rsplit(".", 1)[-1].startswith("empty_camera_")]
    if empties and (cfg.missing_cameras != "mask" or list(cfg.camera_names[-len(empties):]) != empties):
        problems.append(f"empty camera slots {empties} must be the last slots of a policy that masks missing "
                        "cameras (LeRobot's empty_cameras)")
    if problems:
        raise ConfigError("this policy cannot be written as a LeRobot π0 / π0.5 folder: " + "; ".join(problems))


def variant(width: int, mlp_dim: int) -> str | None:
    return next((name for name, v in GEMMA.items() if v == {"width": width, "mlp_dim": mlp_dim}), None)


def size_notes(cfg: PolicyConfig) -> list[str]:
    """What stock LeRobot cannot build of this policy's sizes (empty for real π0 / π0.5 checkpoints): its config
    names the Gemma sizes only as the variants gemma_2b / gemma_300m; SigLIP and the vocabulary are fixed."""
    notes = []
    shared = {k: getattr(cfg, k) for k in GEMMA_SHARED}
    if shared != GEMMA_SHARED:
        notes.append(f"Gemma depth / heads {shared} (LeRobot's variants: {GEMMA_SHARED})")
    for label, stream in (("PaliGemma", cfg.prefix), ("action expert", cfg.expert)):
        if variant(stream.width, stream.mlp_dim) is None:
            notes.append(f"{label} width {stream.width} / mlp {stream.mlp_dim} is not a LeRobot Gemma variant")
    vision = {k: getattr(cfg.vision, k) for k in SIGLIP}
    if vision != SIGLIP:
        notes.append(f"SigLIP {vision} (LeRobot: So400m/14 {SIGLIP})")
    if cfg.vocab_size != VOCAB:
        notes.append(f"vocabulary {cfg.vocab_size} (LeRobot: {VOCAB})")
    return notes


# ----------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------
def lerobot_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under LeRobot 0.6's names: ``embed_tokens`` and, for the tied pair, PaliGemma's
    ``lm_head`` (see the module docstring)."""
    out = lerobot_pi.lerobot_tensors(model, dtype, embed_tokens=True)
    embed = lerobot_pi._LM + "embed_tokens.weight"   # noqa: SLF001 (the import's own name table)
    out[lerobot_pi._PG + "lm_head.weight"] = out[embed].clone()   # noqa: SLF001 (PaliGemma's tied pair)
    return out


# ----------------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------------
def _centre_scale(s: Stats, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centre, scale, dims left unscaled) as ours applies ``s`` in ``mode``."""
    if mode == "mean_std":
        c, sc = s.mean, s.std
    else:
        c, sc = (s.q99 + s.q01) / 2, (s.q99 - s.q01) / 2
    fixed = ~(sc > SCALE_EPS)
    return c, torch.where(fixed, torch.ones_like(sc), sc), fixed


def lerobot_stats(s: Stats, mode: str, hidden: tuple[int, ...] = ()) -> tuple[str, dict[str, torch.Tensor]]:
    """(LeRobot mode, statistics) under which LeRobot's (un)normaliser computes what ours does with ``s``."""
    c, sc, fixed = _centre_scale(s, mode)
    if hidden:   # set to 0 after normalising: (x - 0) / inf
        c, sc = c.clone(), sc.clone()
        c[list(hidden)], sc[list(hidden)] = 0.0, float("inf")
        return "MEAN_STD", {"mean": c, "std": sc, "q01": s.q01, "q99": s.q99}
    if mode == "mean_std":
        return "MEAN_STD", {"mean": c, "std": sc, "q01": s.q01, "q99": s.q99}
    q01, q99 = torch.where(fixed, c - 1, s.q01), torch.where(fixed, c + 1, s.q99)
    return "QUANTILES", {"mean": s.mean, "std": s.std, "q01": q01, "q99": q99}


# ----------------------------------------------------------------------------------------------------
# config.json and the processor pipelines
# ----------------------------------------------------------------------------------------------------
def _feature(kind: str, shape) -> dict:
    return {"type": kind, "shape": list(shape)}


def camera_keys(cfg: PolicyConfig) -> tuple[list[str], int]:
    """(the image feature names, how many empty cameras follow them)."""
    names = list(cfg.camera_names) or [f"camera_{i}" for i in range(cfg.num_cameras)]
    empty = [n for n in names if n.rsplit(".", 1)[-1].startswith("empty_camera_")]
    real = names[:len(names) - len(empty)]
    return [n if n.startswith(OBS_IMAGES + ".") else f"{OBS_IMAGES}.{n.rsplit('.', 1)[-1]}" for n in real], len(empty)


def lerobot_config(cfg: PolicyConfig, norm: NormStats, norm_map: dict, *, dtype: str, num_steps: int,
                   execute: int) -> dict:
    """``config.json`` as LeRobot 0.6.1's ``PI0Config`` / ``PI05Config`` saves it."""
    size = cfg.vision.image_size
    cams, empty = camera_keys(cfg)
    inputs = {k: _feature("VISUAL", (3, size, size)) for k in cams}
    inputs[OBS_STATE] = _feature("STATE", norm.state.mean.shape)
    pi05 = cfg.arch == "pi05"
    doc = {
        "type": cfg.arch, "n_obs_steps": 1, "input_features": inputs,
        "output_features": {ACTION: _feature("ACTION", norm.action.mean.shape)},
        "device": "cpu", "use_amp": False, "use_peft": False, "push_to_hub": True, "repo_id": None, "private": None,
        "tags": None, "license": None, "pretrained_path": None, "pretrained_revision": None,
        "paligemma_variant": variant(cfg.prefix.width, cfg.prefix.mlp_dim) or "gemma_2b",
        "action_expert_variant": variant(cfg.expert.width, cfg.expert.mlp_dim) or "gemma_300m",
        "dtype": "float32" if dtype == "fp32" else "bfloat16",
        "chunk_size": cfg.action_horizon, "n_action_steps": execute,
        "max_state_dim": cfg.state_dim, "max_action_dim": cfg.action_dim, "num_inference_steps": num_steps,
        "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0, "time_sampling_scale": 0.999,
        "time_sampling_offset": 0.001, "min_period": cfg.time_min_period, "max_period": cfg.time_max_period,
        "use_relative_actions": False, "relative_exclude_joints": ["gripper"], "action_feature_names": None,
        "rtc_config": None, "image_resolution": [size, size], "empty_cameras": empty,
    }
    if pi05:
        doc["tokenizer_max_length"] = cfg.max_text_tokens
    doc["normalization_mapping"] = norm_map
    doc.update({"gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
                "freeze_vision_encoder": False, "train_expert_only": False, "optimizer_lr": 2.5e-05,
                "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 0.01,
                "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000,
                "scheduler_decay_lr": 2.5e-06})
    if not pi05:
        doc["tokenizer_max_length"] = cfg.max_text_tokens
    return doc


def _normalizer(registry: str, features: dict, norm_map: dict, state_file: str) -> dict:
    return {"registry_name": registry, "config": {"eps": EPS, "features": features, "norm_map": norm_map},
            "state_file": state_file}


def pipelines(cfg: PolicyConfig, config: dict) -> tuple[dict, dict, str, str]:
    """(pre-processor, post-processor, their statistics files' names) as LeRobot 0.6.1's
    ``make_pi0_pre_post_processors`` / ``make_pi05_pre_post_processors`` save them."""
    norm_map = config["normalization_mapping"]
    feats = {**config["input_features"], **config["output_features"]}
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    relative = {"registry_name": "relative_actions_processor",
                "config": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}}
    tokenizer = {"registry_name": "tokenizer_processor",
                 "config": {"max_length": cfg.max_text_tokens, "task_key": "task", "padding_side": "right",
                            "padding": "max_length", "truncation": True,
                            "tokenizer_name": lerobot_pi.PALIGEMMA_REPO}}
    head = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}}]
    if cfg.arch == "pi0":
        steps = [*head, {"registry_name": "pi0_new_line_processor", "config": {}}, tokenizer, device, relative]
        steps.append(_normalizer("normalizer_processor", feats, norm_map,
                                 f"policy_preprocessor_step_{len(steps)}_normalizer_processor.safetensors"))
    else:
        steps = [*head, relative]
        steps.append(_normalizer("normalizer_processor", feats, norm_map,
                                 f"policy_preprocessor_step_{len(steps)}_normalizer_processor.safetensors"))
        steps += [{"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}, tokenizer, device]
    pre_file = next(s["state_file"] for s in steps if "state_file" in s)
    post_file = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    post = [_normalizer("unnormalizer_processor", dict(config["output_features"]), norm_map, post_file),
            {"registry_name": "absolute_actions_processor", "config": {"enabled": False}}, device]
    return ({"name": "policy_preprocessor", "steps": steps}, {"name": "policy_postprocessor", "steps": post},
            pre_file, post_file)


def _source_defaults(folder: Path, cfg: PolicyConfig, norm: NormStats, config: dict) -> tuple[int, int]:
    """(K, actions executed per chunk) the source recorded (:func:`vla_rl.interop.export.spec_defaults`)."""
    try:
        spec = spec_defaults(folder, cfg, norm, config)
        return int(spec["num_steps"]), int(spec["execute"])
    except (ConfigError, CheckpointError, KeyError, TypeError, ValueError):
        return DEFAULT_NUM_STEPS, cfg.action_horizon


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------
def export_lerobot(src: str | Path, out: str | Path, *, dtype: str = "fp32", overwrite: bool = False) -> Path:
    """Write the π0 / π0.5 policy at ``src`` as a LeRobot 0.6 policy folder at ``out`` (atomically)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    folder, out, model, norm, config = open_source(src, out, overwrite=overwrite)
    cfg = model.cfg
    check_lerobot_compatible(cfg, norm)
    tok = model.text_tokenizer
    if tok is None or not hasattr(tok, "proto"):   # pragma: no cover (load_policy attaches it)
        raise CheckpointError(f"{folder}: the policy's SentencePiece tokenizer is missing")
    s_mode, s_stats = lerobot_stats(norm.state, norm.mode, norm.hidden_state)
    a_mode, a_stats = lerobot_stats(norm.action, norm.mode)
    norm_map = {"VISUAL": "IDENTITY", "STATE": s_mode, "ACTION": a_mode}
    num_steps, execute = _source_defaults(folder, cfg, norm, config)
    lr_config = lerobot_config(cfg, norm, norm_map, dtype=dtype, num_steps=num_steps, execute=execute)
    pre, post, pre_file, post_file = pipelines(cfg, lr_config)
    stats = {**{f"{OBS_STATE}.{k}": v.float().contiguous() for k, v in s_stats.items()},
             **{f"{ACTION}.{k}": v.float().contiguous() for k, v in a_stats.items()}}
    tensors = lerobot_tensors(model, DTYPES[dtype])
    notes = {"written_by": "vla-rl export --format lerobot", "lerobot_format": LEROBOT_VERSION,
             "source": str(Path(folder).resolve()), "dtype": dtype,
             "not_in_stock_lerobot": size_notes(cfg),
             "left_out": ["the Flow-Noise std head and the value head (RL only)"]}
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        tensors.clear()
        (tmp / "config.json").write_text(json.dumps(lr_config, indent=4))
        (tmp / PRE).write_text(json.dumps(pre, indent=2))
        (tmp / POST).write_text(json.dumps(post, indent=2))
        save_file(stats, str(tmp / pre_file))
        save_file({k: v.clone() for k, v in stats.items()}, str(tmp / post_file))
        (tmp / lerobot_pi.TOKENIZER_FILE).write_bytes(tok.proto)
        (tmp / NOTES_FILE).write_text(json.dumps(notes, indent=2) + "\n")
    return out
