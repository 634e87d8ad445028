"""LeRobot SmolVLA checkpoints -> our :class:`~vla_rl.policies.smolvla.SmolVLA`: the :data:`SMOLVLA` family of
:mod:`.lerobot_format`.

- Our :class:`PolicyConfig` from ``config.json``, the weights' shapes and SmolVLM2's own ``config.json`` (the head
  counts, head size and norm epsilon, which shapes cannot tell). A LeRobot folder names SmolVLM2 by its hub id
  (``vlm_model_name``, ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``); its files are looked for in ``SRC/vlm/``,
  in ``vlm_model_name`` as a local folder, in the Hugging Face cache, or in ``--tokenizer DIR``. Without them the
  released SmolVLM2's sizes (:data:`KNOWN_TEXT`, :data:`KNOWN_VISION`) or overrides fill in.
- LeRobot's tensor names onto ours: SigLIP's q / k / v into our fused ``qkv``, the connector, SmolLM2's layers,
  the expert's layers (cross-attention layers keep their prefix-wide ``k_proj`` / ``v_proj``); SmolVLM2's unused
  ``lm_head`` is skipped.
- The tokenizer is SmolVLM2's ``tokenizer.json`` (with the pad token of its ``tokenizer_config.json``), stored in
  the policy folder as ``tokenizer.safetensors``.

Settings that change what the inputs or actions mean and that this importer does not reproduce
(``adapt_to_pi_aloha``, ``add_image_special_tokens``, a resize target other than the vision encoder's size) are
refused, naming them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from vla_rl.checkpoint.lerobot_format import (
    POLICY_TOKENIZER,
    Family,
    LeRobotImportError,
    checked_tokenizer,
    hub_snapshots,
    layer_count,
    rl_heads_note,
    shape_of,
)
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import check_keys, from_dict
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.tokenizer import HFTokenizer
from vla_rl.presets import merge

TYPES = ("smolvla",)
LABEL = "LeRobot SmolVLA"
# What SmolVLM2-500M's config.json says where it cannot be found (by the text / vision width the weights show):
# (heads, KV heads, head size, RMSNorm epsilon) and the SigLIP head count.
KNOWN_TEXT = {960: (15, 5, 64, 1e-5)}
KNOWN_VISION = {768: 12}

_M = "model.vlm_with_expert."
_VIS = _M + "vlm.model.vision_model."
_TXT = _M + "vlm.model.text_model."
_EXP = _M + "lm_expert."


def _shape(shapes: dict, name: str) -> tuple[int, ...]:
    return shape_of(shapes, name, LABEL)


def skipped(shapes: dict) -> set[str]:
    """SmolVLM2's language-model head: SmolVLA never decodes text."""
    return {_M + "vlm.lm_head.weight"}


# ----------------------------------------------------------------------------------------------------
# SmolVLM2's own files
# ----------------------------------------------------------------------------------------------------
def vlm_folders(src: Path, lr: dict, given: str | Path | None = None) -> list[Path]:
    """Where SmolVLM2's files may be, in order: ``given`` (a folder, or a file in one), ``SRC/vlm``,
    ``vlm_model_name`` as a local folder (as LeRobot resolves it: from the working directory), the Hugging Face
    cache's snapshots of ``vlm_model_name``."""
    out = []
    if given is not None:
        g = Path(given)
        out.append(g if g.is_dir() else g.parent)
    name = str(lr.get("vlm_model_name") or "")
    out += [src / "vlm"] + ([Path(name)] if name else [])
    if name and "/" in name and not Path(name).exists():
        out += list(reversed(hub_snapshots(name)))
    return [p for p in out if p.is_dir()]


def vlm_config(src: Path, lr: dict) -> dict:
    """SmolVLM2's ``config.json`` (``{}`` when none is found)."""
    for folder in vlm_folders(src, lr):
        f = folder / "config.json"
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise LeRobotImportError(f"{f} is not valid JSON: {e}") from None
            return data if isinstance(data, dict) else {}
    return {}


# ----------------------------------------------------------------------------------------------------
# Our config from LeRobot's config.json, the weights' shapes and SmolVLM2's config
# ----------------------------------------------------------------------------------------------------
def _refuse_unsupported(lr: dict, image_size: int) -> None:
    problems = []
    if lr.get("adapt_to_pi_aloha") or lr.get("use_delta_joint_actions_aloha"):
        problems.append("adapt_to_pi_aloha / use_delta_joint_actions_aloha (Aloha's joint conventions)")
    if lr.get("add_image_special_tokens"):
        problems.append("add_image_special_tokens (image start / end tokens around each camera)")
    resize = lr.get("resize_imgs_with_padding")
    if resize is not None and tuple(resize) != (image_size, image_size):
        problems.append(f"resize_imgs_with_padding {list(resize)} (the vision encoder's input is {image_size})")
    if problems:
        raise LeRobotImportError("this SmolVLA checkpoint uses settings the importer does not reproduce: "
                                 + "; ".join(problems))


def infer_policy_config(src: Path, lr: dict, shapes: dict, overrides: dict | None = None) -> PolicyConfig:
    """Our :class:`PolicyConfig` for a LeRobot SmolVLA ``config.json`` (``lr``), its tensors' ``shapes`` and
    SmolVLM2's config; ``overrides`` (PolicyConfig keys) win."""
    patch = _shape(shapes, _VIS + "embeddings.patch_embedding.weight")
    dv, patch_size = patch[0], patch[2]
    positions = _shape(shapes, _VIS + "embeddings.position_embedding.weight")[0]
    grid = math.isqrt(positions)
    if grid * grid != positions:
        raise LeRobotImportError(f"SigLIP has {positions} position embeddings, not a square grid")
    connector = _shape(shapes, _M + "vlm.model.connector.modality_projection.proj.weight")
    shuffle = math.isqrt(connector[1] // dv)
    if shuffle * shuffle * dv != connector[1]:
        raise LeRobotImportError(f"the connector reads {connector[1]} features, not a square number of {dv}-wide "
                                 "patches")
    vocab, dt = _shape(shapes, _TXT + "embed_tokens.weight")
    we = _shape(shapes, _EXP + "layers.0.self_attn.q_proj.weight")[1]
    vlm = vlm_config(src, lr)
    text, vision = vlm.get("text_config") or {}, vlm.get("vision_config") or {}
    known = KNOWN_TEXT.get(dt, (0, 0, 0, 1e-5))
    heads = int(text.get("num_attention_heads") or known[0])
    kv_heads = int(text.get("num_key_value_heads") or known[1])
    head_dim = int(text.get("head_dim") or (dt // heads if heads else known[2]))
    depth = layer_count(shapes, _TXT + "layers.")
    experts = layer_count(shapes, _EXP + "layers.")
    mode = str(lr.get("attention_mode", "cross_attn"))
    every = int(lr.get("self_attn_every_n_layers", 2)) if "cross" in mode else 1
    cameras = [k for k, f in (lr.get("input_features") or {}).items()
               if isinstance(f, dict) and f.get("type") == "VISUAL"]
    names = cameras + [f"empty_camera_{i}" for i in range(int(lr.get("empty_cameras") or 0))]
    _refuse_unsupported(lr, grid * patch_size)
    base = {
        "arch": "smolvla",
        "vision": {"image_size": grid * patch_size, "patch_size": patch_size, "width": dv,
                   "depth": layer_count(shapes, _VIS + "encoder.layers."),
                   "num_heads": int(vision.get("num_attention_heads") or KNOWN_VISION.get(dv, 0)),
                   "mlp_dim": _shape(shapes, _VIS + "encoder.layers.0.mlp.fc1.weight")[0]},
        "prefix": {"width": dt, "mlp_dim": _shape(shapes, _TXT + "layers.0.mlp.gate_proj.weight")[0]},
        "expert": {"width": we, "mlp_dim": _shape(shapes, _EXP + "layers.0.mlp.gate_proj.weight")[0]},
        "depth": depth, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
        "rope_base": 10000.0,   # LeRobot's own rotation, whatever SmolVLM2's rope theta
        "tokenizer": "hf", "tokenizer_file": POLICY_TOKENIZER, "vocab_size": vocab,
        "max_text_tokens": int(lr.get("tokenizer_max_length", 48)),
        "num_cameras": len(names), "camera_names": names, "missing_cameras": "mask", "image_resize": "pad",
        "image_antialias": False,
        "state_dim": _shape(shapes, "model.state_proj.weight")[1],
        "action_dim": _shape(shapes, "model.action_in_proj.weight")[1], "action_horizon": int(lr["chunk_size"]),
        "time_conditioning": "concat", "time_embedding_precision": "float64",
        "time_min_period": float(lr.get("min_period", 4e-3)), "time_max_period": float(lr.get("max_period", 4.0)),
        "state_input": "token", "value_source": "expert", "value_hidden": min(1024, we),
        "smolvla": {"pixel_shuffle": shuffle, "self_attn_every": every,
                    "expert_depth": 0 if experts == depth else experts,
                    "norm_eps": float(text.get("rms_norm_eps") or known[3])},
    }
    over = overrides or {}
    check_keys(PolicyConfig, over)   # the user's own keys, named as typed (a config error, not the checkpoint's)
    cfg = merge(base, over)
    unknown = [k for k, v in (("num_heads", cfg["num_heads"]), ("num_kv_heads", cfg["num_kv_heads"]),
                              ("head_dim", cfg["head_dim"]), ("vision.num_heads", cfg["vision"]["num_heads"])) if not v]
    if unknown:
        raise LeRobotImportError(
            f"SmolVLM2's config.json was not found (SRC/vlm, {lr.get('vlm_model_name')!r}, the Hugging Face cache) "
            f"and its text width {dt} / vision width {dv} are not the released model's: give "
            + " ".join(f"{k}=N" for k in unknown) + ", or --tokenizer DIR with SmolVLM2's config.json beside it")
    try:
        return from_dict(PolicyConfig, cfg, prefix="policy")
    except ConfigError as e:
        raise LeRobotImportError(f"the inferred config is invalid: {e}") from None


# ----------------------------------------------------------------------------------------------------
# Tensor names: ours <- LeRobot's
# ----------------------------------------------------------------------------------------------------
def _stream(src: dict, theirs: str, ours: str) -> None:
    for x in "qkvo":
        src[ours + f"{x}_proj.weight"] = (theirs + f"self_attn.{x}_proj.weight",)
    for x in ("gate", "up", "down"):
        src[ours + f"mlp.{x}_proj.weight"] = (theirs + f"mlp.{x}_proj.weight",)
    src[ours + "input_norm.weight"] = (theirs + "input_layernorm.weight",)
    src[ours + "post_attention_norm.weight"] = (theirs + "post_attention_layernorm.weight",)


def weight_sources(cfg: PolicyConfig, shapes: dict) -> dict[str, tuple[str, ...]]:
    """For each of our parameters that comes from the checkpoint, the LeRobot tensor(s) it is made of."""
    src: dict[str, tuple[str, ...]] = {
        "patch_embed.weight": (_VIS + "embeddings.patch_embedding.weight",),
        "patch_embed.bias": (_VIS + "embeddings.patch_embedding.bias",),
        "vision_pos": (_VIS + "embeddings.position_embedding.weight",),
        "vision_norm.weight": (_VIS + "post_layernorm.weight",), "vision_norm.bias": (_VIS + "post_layernorm.bias",),
        "connector.weight": (_M + "vlm.model.connector.modality_projection.proj.weight",),
        "text_embed.weight": (_TXT + "embed_tokens.weight",),
        "state_proj.weight": ("model.state_proj.weight",), "state_proj.bias": ("model.state_proj.bias",),
        "prefix_norm.weight": (_TXT + "norm.weight",), "expert_norm.weight": (_EXP + "norm.weight",),
        "action_in.weight": ("model.action_in_proj.weight",), "action_in.bias": ("model.action_in_proj.bias",),
        "velocity_head.weight": ("model.action_out_proj.weight",),
        "velocity_head.bias": ("model.action_out_proj.bias",),
    }
    for ours, theirs in (("action_time_mlp.0", "model.action_time_mlp_in"),
                         ("action_time_mlp.2", "model.action_time_mlp_out")):
        src[ours + ".weight"], src[ours + ".bias"] = (theirs + ".weight",), (theirs + ".bias",)
    for i in range(cfg.vision.depth):
        lr, ours = f"{_VIS}encoder.layers.{i}.", f"vision_blocks.{i}."
        for p in ("weight", "bias"):
            src[ours + f"norm1.{p}"] = (lr + f"layer_norm1.{p}",)
            src[ours + f"norm2.{p}"] = (lr + f"layer_norm2.{p}",)
            src[ours + f"qkv.{p}"] = tuple(lr + f"self_attn.{x}_proj.{p}" for x in "qkv")
            src[ours + f"proj.{p}"] = (lr + f"self_attn.out_proj.{p}",)
            src[ours + f"fc1.{p}"] = (lr + f"mlp.fc1.{p}",)
            src[ours + f"fc2.{p}"] = (lr + f"mlp.fc2.{p}",)
    for i in range(cfg.depth):
        _stream(src, f"{_TXT}layers.{i}.", f"prefix_layers.{i}.")
    for e in range(cfg.smolvla.expert_count(cfg.depth)):
        _stream(src, f"{_EXP}layers.{e}.", f"expert_layers.{e}.")
    return src


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------
def find_tokenizer(src: Path, lr: dict, given: str | Path | None = None) -> Path | None:
    """SmolVLM2's tokenizer folder (``tokenizer.json``): ``given`` (the folder or the file), else the first of
    :func:`vlm_folders` that has one."""
    if given is not None:
        g = Path(given)
        folder = g if g.is_dir() else g.parent
        if not (folder / "tokenizer.json").is_file():
            raise LeRobotImportError(f"tokenizer file not found: {folder / 'tokenizer.json'}")
        return folder
    found = [f for f in vlm_folders(src, lr) if (f / "tokenizer.json").is_file()]
    return found[0] if found else None


def load_tokenizer(folder: Path, cfg: PolicyConfig) -> HFTokenizer:
    return checked_tokenizer(HFTokenizer.from_folder, folder, cfg)


def _no_tokenizer(src: Path) -> str:
    return (f"no SmolVLM2 tokenizer found ({src}/vlm, the config's vlm_model_name as a folder, the Hugging Face "
            "cache); give it with --tokenizer DIR (the folder of SmolVLM2's tokenizer.json and "
            "tokenizer_config.json)")


def _notes(cfg: PolicyConfig) -> list[str]:
    return [rl_heads_note(cfg), "SmolVLM2's lm_head is not used by the model and was skipped"]


SMOLVLA = Family(label=LABEL, infer_config=infer_policy_config, weight_sources=weight_sources, skipped=skipped,
                 find_tokenizer=find_tokenizer, load_tokenizer=load_tokenizer, no_tokenizer=_no_tokenizer,
                 notes=_notes)
