"""LeRobot π0 / π0.5 checkpoints -> our :class:`~vla_rl.policies.model.FlowPolicy` (one model, its π0 / π0.5 options):
the :data:`PI0` family of :mod:`.lerobot_format`.

- our :class:`PolicyConfig` from ``config.json`` and the weights' shapes (``config.json`` only names the Gemma
  variants; what shapes cannot tell, the SigLIP head count, comes from :data:`SIGLIP_HEADS` or an override),
- LeRobot's tensor names onto ours: SigLIP's q / k / v into our fused ``qkv``, the tied PaliGemma embedding read
  from either of its names, the action expert's unused ``lm_head`` skipped,
- the tokenizer (PaliGemma's SentencePiece ``tokenizer.model``) is not part of a LeRobot folder; it is found next
  to the checkpoint, in the Hugging Face cache (``google/paligemma-3b-pt-224``), or given by path.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

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
from vla_rl.policies.tokenizer import SentencePieceTokenizer
from vla_rl.presets import merge

TYPES = ("pi0", "pi05")
TOKENIZER_FILE = "tokenizer.model"          # PaliGemma's SentencePiece model, as its repository names it
PALIGEMMA_REPO = "google/paligemma-3b-pt-224"
# SigLIP's head count is not visible in its weights: known widths (So400m/14: 1152 wide, 16 heads of 72).
SIGLIP_HEADS = {1152: 16}
LABEL = "LeRobot π0 / π0.5"

_PG = "model.paligemma_with_expert.paligemma."
_VIS = _PG + "model.vision_tower.vision_model."
_LM = _PG + "model.language_model."
_EX = "model.paligemma_with_expert.gemma_expert."
# Earlier transformers layouts of PaliGemma (before 4.52 moved the submodules under `model.`).
_ALIASES = ((_PG + "language_model.model.", _LM), (_PG + "language_model.lm_head.", _PG + "lm_head."),
            (_PG + "vision_tower.", _PG + "model.vision_tower."),
            (_PG + "multi_modal_projector.", _PG + "model.multi_modal_projector."))


def canonical_name(key: str) -> str:
    for old, new in _ALIASES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def embedding_name(shapes: dict) -> str:
    """The tensor the model embeds text tokens with. LeRobot 0.4 tied PaliGemma's input embedding to its lm_head
    and its file keeps one name of the pair (either); LeRobot >= 0.5 stores both as different tensors and embeds
    with ``embed_tokens`` (π0 never decodes text, so its lm_head is unused). So: ``embed_tokens`` when the file
    has it, else the tied ``lm_head``."""
    return _LM + "embed_tokens.weight" if _LM + "embed_tokens.weight" in shapes else _PG + "lm_head.weight"


def _shape(shapes: dict, name: str) -> tuple[int, ...]:
    return shape_of(shapes, name, LABEL)


def skipped(shapes: dict) -> set[str]:
    """The action expert's unused language-model head, and the one of PaliGemma's tied embedding pair that the
    model does not embed with."""
    return {_EX + "lm_head.weight", _PG + "lm_head.weight", _LM + "embed_tokens.weight"} - {embedding_name(shapes)}


# ----------------------------------------------------------------------------------------------------
# Our config from LeRobot's config.json and the weights' shapes
# ----------------------------------------------------------------------------------------------------
def infer_policy_config(lr: dict, shapes: dict, overrides: dict | None = None) -> PolicyConfig:
    """Our :class:`PolicyConfig` for a LeRobot ``config.json`` (``lr``) and its tensors' ``shapes``;
    ``overrides`` (PolicyConfig keys) win."""
    pi05 = lr["type"] == "pi05"
    patch = _shape(shapes, _VIS + "embeddings.patch_embedding.weight")
    vis_width, patch_size = patch[0], patch[2]
    num_patches = _shape(shapes, _VIS + "embeddings.position_embedding.weight")[0]
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches:
        raise LeRobotImportError(f"SigLIP has {num_patches} position embeddings, not a square grid")
    vocab, wp = _shape(shapes, embedding_name(shapes))
    k_rows = _shape(shapes, _LM + "layers.0.self_attn.k_proj.weight")[0]
    q_rows = _shape(shapes, _LM + "layers.0.self_attn.q_proj.weight")[0]
    over = overrides or {}
    kv_heads = over.get("num_kv_heads", 1)          # every π0 Gemma variant is multi-query (one KV head)
    head_dim = k_rows // kv_heads
    we = _shape(shapes, _EX + "model.layers.0.self_attn.q_proj.weight")[1]
    # LeRobot's config adds its empty cameras to input_features when it validates them (a saved config.json may
    # list them): they are counted by empty_cameras alone.
    cameras = [k for k, f in (lr.get("input_features") or {}).items() if isinstance(f, dict)
               and f.get("type") == "VISUAL" and not k.split(".")[-1].startswith("empty_camera_")]
    empty = int(lr.get("empty_cameras") or 0)
    names = cameras + [f"empty_camera_{i}" for i in range(empty)]
    resolution = lr.get("image_resolution") or [grid * patch_size] * 2
    if grid * patch_size != resolution[0]:
        raise LeRobotImportError(f"config.json's image_resolution {resolution} does not match SigLIP's "
                                 f"{grid}x{grid} patches of {patch_size}")
    action_in = _shape(shapes, "model.action_in_proj.weight")
    state_feature = (lr.get("input_features") or {}).get("observation.state") or {}
    robot_state = int((state_feature.get("shape") or [0])[-1]) if isinstance(state_feature, dict) else 0
    state_dim = _shape(shapes, "model.state_proj.weight")[1] if not pi05 else int(lr.get("max_state_dim", 32))
    base = {
        "arch": "pi05" if pi05 else "pi0",
        "vision": {"image_size": grid * patch_size, "patch_size": patch_size, "width": vis_width,
                   "depth": layer_count(shapes, _VIS + "encoder.layers."),
                   "num_heads": SIGLIP_HEADS.get(vis_width, 0),
                   "mlp_dim": _shape(shapes, _VIS + "encoder.layers.0.mlp.fc1.weight")[0]},
        "prefix": {"width": wp, "mlp_dim": _shape(shapes, _LM + "layers.0.mlp.gate_proj.weight")[0]},
        "expert": {"width": we, "mlp_dim": _shape(shapes, _EX + "model.layers.0.mlp.gate_proj.weight")[0]},
        "depth": layer_count(shapes, _LM + "layers."), "num_heads": q_rows // head_dim, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "tokenizer": "sentencepiece", "tokenizer_file": POLICY_TOKENIZER, "vocab_size": vocab,
        "max_text_tokens": int(lr.get("tokenizer_max_length", 200 if pi05 else 48)),
        "num_cameras": len(names), "camera_names": names, "missing_cameras": "mask", "image_resize": "pad",
        "image_antialias": False,   # LeRobot resizes with resize_with_pad_torch: plain bilinear
        "state_dim": state_dim, "action_dim": action_in[1], "action_horizon": int(lr["chunk_size"]),
        "time_conditioning": "adarms" if pi05 else "concat", "adarms_final_norm": pi05,
        "time_min_period": float(lr.get("min_period", 4e-3)), "time_max_period": float(lr.get("max_period", 4.0)),
        "time_embedding_precision": "float64",
        "state_input": "prompt" if pi05 else "suffix", "value_source": "prefix" if pi05 else "expert",
        # π0.5's prompt: LeRobot 0.4 writes the state padded to max_state_dim, LeRobot >= 0.5 (the files that
        # store embed_tokens apart, the same release) only the robot's own dims, as openpi does.
        "state_prompt_dims": robot_state if pi05 and _LM + "embed_tokens.weight" in shapes else 0,
        "value_hidden": min(1024, wp if pi05 else we),
    }
    if layer_count(shapes, _EX + "model.layers.") != base["depth"]:
        raise LeRobotImportError("the action expert and the PaliGemma language model have different depths")
    check_keys(PolicyConfig, over)   # the user's own keys, named as typed (a config error, not the checkpoint's)
    cfg = merge(base, over)
    if not cfg["vision"]["num_heads"]:
        # The override is a PolicyConfig key as `vla-rl import` takes it (no `policy.` prefix).
        raise LeRobotImportError(f"SigLIP width {vis_width} has no known head count (known: {SIGLIP_HEADS}); "
                                 "give it when importing: `vla-rl import lerobot SRC OUT vision.num_heads=N`")
    try:
        return from_dict(PolicyConfig, cfg, prefix="policy")
    except ConfigError as e:
        raise LeRobotImportError(f"the inferred config is invalid: {e}") from None


# ----------------------------------------------------------------------------------------------------
# Tensor names: ours <- LeRobot's
# ----------------------------------------------------------------------------------------------------
def weight_sources(cfg: PolicyConfig, shapes: dict) -> dict[str, tuple[str, ...]]:
    """For each of our parameters that comes from the checkpoint, the LeRobot tensor(s) it is made of
    (several: concatenated along dim 0, SigLIP's q / k / v into our fused ``qkv``)."""
    src: dict[str, tuple[str, ...]] = {
        "patch_embed.weight": (_VIS + "embeddings.patch_embedding.weight",),
        "patch_embed.bias": (_VIS + "embeddings.patch_embedding.bias",),
        "vision_pos": (_VIS + "embeddings.position_embedding.weight",),
        "vision_norm.weight": (_VIS + "post_layernorm.weight",), "vision_norm.bias": (_VIS + "post_layernorm.bias",),
        "vision_proj.weight": (_PG + "model.multi_modal_projector.linear.weight",),
        "vision_proj.bias": (_PG + "model.multi_modal_projector.linear.bias",),
        "text_embed.weight": (embedding_name(shapes),),
        "prefix_norm.weight": (_LM + "norm.weight",),
        "action_in.weight": ("model.action_in_proj.weight",), "action_in.bias": ("model.action_in_proj.bias",),
        "velocity_head.weight": ("model.action_out_proj.weight",),
        "velocity_head.bias": ("model.action_out_proj.bias",),
    }
    for i in range(cfg.vision.depth):
        lr, ours = f"{_VIS}encoder.layers.{i}.", f"vision_blocks.{i}."
        for p in ("weight", "bias"):
            src[ours + f"norm1.{p}"] = (lr + f"layer_norm1.{p}",)
            src[ours + f"norm2.{p}"] = (lr + f"layer_norm2.{p}",)
            src[ours + f"qkv.{p}"] = tuple(lr + f"self_attn.{x}_proj.{p}" for x in "qkv")
            src[ours + f"proj.{p}"] = (lr + f"self_attn.out_proj.{p}",)
            src[ours + f"fc1.{p}"] = (lr + f"mlp.fc1.{p}",)
            src[ours + f"fc2.{p}"] = (lr + f"mlp.fc2.{p}",)
    adaptive = cfg.time_conditioning == "adarms"
    for i in range(cfg.depth):
        for lr, ours, ada in ((f"{_LM}layers.{i}.", f"prefix_layers.{i}.", False),
                              (f"{_EX}model.layers.{i}.", f"expert_layers.{i}.", adaptive)):
            for x in "qkvo":
                src[ours + f"{x}_proj.weight"] = (lr + f"self_attn.{x}_proj.weight",)
            for x in ("gate", "up", "down"):
                src[ours + f"mlp.{x}_proj.weight"] = (lr + f"mlp.{x}_proj.weight",)
            for theirs, mine in (("input_layernorm", "input_norm"),
                                 ("post_attention_layernorm", "post_attention_norm")):
                if ada:
                    src[ours + f"{mine}.modulation.weight"] = (lr + f"{theirs}.dense.weight",)
                    src[ours + f"{mine}.modulation.bias"] = (lr + f"{theirs}.dense.bias",)
                else:
                    src[ours + f"{mine}.weight"] = (lr + f"{theirs}.weight",)
    if cfg.adarms_final_norm:
        src["expert_norm.modulation.weight"] = (_EX + "model.norm.dense.weight",)
        src["expert_norm.modulation.bias"] = (_EX + "model.norm.dense.bias",)
    else:
        src["expert_norm.weight"] = (_EX + "model.norm.weight",)
    if cfg.state_input == "suffix":
        src["state_proj.weight"], src["state_proj.bias"] = ("model.state_proj.weight",), ("model.state_proj.bias",)
    if cfg.time_conditioning == "adarms":
        for ours, theirs in (("time_mlp.0", "model.time_mlp_in"), ("time_mlp.2", "model.time_mlp_out")):
            src[ours + ".weight"], src[ours + ".bias"] = (theirs + ".weight",), (theirs + ".bias",)
    else:
        for ours, theirs in (("action_time_mlp.0", "model.action_time_mlp_in"),
                             ("action_time_mlp.2", "model.action_time_mlp_out")):
            src[ours + ".weight"], src[ours + ".bias"] = (theirs + ".weight",), (theirs + ".bias",)
    return src


def lerobot_tensors(model, dtype: torch.dtype, *, embed_tokens: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`weight_sources`, for the exports: the model's checkpoint weights under LeRobot's names
    (our fused SigLIP ``qkv`` split back into q / k / v), the text embedding under ``embed_tokens`` (LeRobot >= 0.5)
    or PaliGemma's tied ``lm_head`` (LeRobot 0.4, openpi), and the action expert's unused ``lm_head`` as zeros (the
    models hold that parameter, so a strict load looks for it). The RL heads are not among them."""
    cfg = model.cfg
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, sources in weight_sources(cfg, {_LM + "embed_tokens.weight": ()} if embed_tokens else {}).items():
        t = ours[name].detach().to("cpu", dtype)
        parts = t.chunk(len(sources), dim=0) if len(sources) > 1 else (t,)
        for src, part in zip(sources, parts):
            out[src] = part.contiguous().clone()
    out[_EX + "lm_head.weight"] = torch.zeros(cfg.vocab_size, cfg.expert.width, dtype=dtype)
    return out


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------
def find_tokenizer(src: Path, lr: dict | None = None, given: str | Path | None = None) -> Path | None:
    """PaliGemma's ``tokenizer.model``: ``given``, else next to the checkpoint, else in the Hugging Face hub cache
    (``$HF_HUB_CACHE`` / ``$HF_HOME/hub`` / ``~/.cache/huggingface/hub``, repo google/paligemma-3b-pt-224)."""
    if given is not None:
        path = Path(given)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise LeRobotImportError(f"tokenizer file not found: {path}")
        return path
    if (src / TOKENIZER_FILE).is_file():
        return src / TOKENIZER_FILE
    found = [snap / TOKENIZER_FILE for snap in hub_snapshots(PALIGEMMA_REPO) if (snap / TOKENIZER_FILE).is_file()]
    return found[-1] if found else None


def load_tokenizer(path: Path, cfg: PolicyConfig) -> SentencePieceTokenizer:
    return checked_tokenizer(SentencePieceTokenizer.from_file, path, cfg)


def _no_tokenizer(src: Path) -> str:
    return (f"no PaliGemma tokenizer found next to {src} or in the Hugging Face cache ({PALIGEMMA_REPO}); give it "
            f"with --tokenizer PATH/{TOKENIZER_FILE} (the SentencePiece model of {PALIGEMMA_REPO})")


def _notes(cfg: PolicyConfig) -> list[str]:
    return [rl_heads_note(cfg), "the action expert's lm_head is not used by the model and was skipped"]


PI0 = Family(label=LABEL, infer_config=lambda src, lr, shapes, over: infer_policy_config(lr, shapes, over),
             weight_sources=weight_sources, skipped=skipped, find_tokenizer=find_tokenizer,
             load_tokenizer=load_tokenizer, no_tokenizer=_no_tokenizer, notes=_notes, canonical=canonical_name)
