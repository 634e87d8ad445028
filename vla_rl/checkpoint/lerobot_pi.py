"""LeRobot π0 / π0.5 checkpoints -> our :class:`~vla_rl.policies.model.FlowPolicy` (one model, its π0 / π0.5 options).

A LeRobot policy folder (``PI0Policy`` / ``PI05Policy.save_pretrained``, LeRobot 0.4) holds ``config.json``,
``model.safetensors`` and the processor pipelines ``policy_preprocessor.json`` / ``policy_postprocessor.json``
with their normaliser statistics (``*_normalizer_processor.safetensors``). This module

- infers our :class:`PolicyConfig` from ``config.json`` and the weights' shapes (``config.json`` only names the
  Gemma variants; what shapes cannot tell, the SigLIP head count, comes from :data:`SIGLIP_HEADS` or an
  override),
- maps LeRobot's tensor names onto ours (:func:`convert_weights`), reading the file lazily, tensor by tensor,
  so a 3.5 B checkpoint never needs two copies in memory; the action expert's unused ``lm_head`` is skipped,
  the tied PaliGemma embedding is read from either of its names, and anything unknown, missing or of the wrong
  shape is refused with the names listed,
- initialises the heads LeRobot checkpoints lack (Flow-Noise std: zero output layer, so the std starts at the
  geometric middle of its range; value: fresh hidden layer, zero output layer, so V = 0 at the start),
- turns the normaliser statistics (mean-std, min-max, quantiles, identity, per feature) into our
  :class:`~vla_rl.policies.normalize.NormStats`,
- writes one of our policy folders (:func:`import_lerobot`, ``vla-rl import lerobot SRC OUT``) or loads the
  policy in memory (:func:`load_lerobot`, which ``init=`` / ``vla-rl eval`` use when given a LeRobot folder).

The tokenizer (PaliGemma's SentencePiece ``tokenizer.model``) is not part of a LeRobot folder; it is found next
to the checkpoint, in the Hugging Face cache (``google/paligemma-3b-pt-224``), or given by path, and stored in the
policy folder as ``tokenizer.safetensors`` (the protobuf's bytes as a uint8 tensor; nothing is unpickled).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vla_rl.checkpoint.folders import FORMAT_VERSION, atomic_folder
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import check_keys, from_dict, to_dict
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import FlowVLA
from vla_rl.policies.tokenizer import SentencePieceTokenizer, TokenizerError
from vla_rl.presets import merge

LEROBOT_TYPES = ("pi0", "pi05")
TOKENIZER_FILE = "tokenizer.model"          # PaliGemma's SentencePiece model, as its repository names it
POLICY_TOKENIZER = "tokenizer.safetensors"   # the same bytes inside our policy folder (see SentencePieceTokenizer)
PALIGEMMA_REPO = "google/paligemma-3b-pt-224"
# SigLIP's head count is not visible in its weights: known widths (So400m/14: 1152 wide, 16 heads of 72).
SIGLIP_HEADS = {1152: 16}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "keep": None}

_PG = "model.paligemma_with_expert.paligemma."
_VIS = _PG + "model.vision_tower.vision_model."
_LM = _PG + "model.language_model."
_EX = "model.paligemma_with_expert.gemma_expert."
# Earlier transformers layouts of PaliGemma (before 4.52 moved the submodules under `model.`).
_ALIASES = ((_PG + "language_model.model.", _LM), (_PG + "language_model.lm_head.", _PG + "lm_head."),
            (_PG + "vision_tower.", _PG + "model.vision_tower."),
            (_PG + "multi_modal_projector.", _PG + "model.multi_modal_projector."))
_IGNORED = (_EX + "lm_head.weight",)   # the action expert's unused language-model head


class LeRobotImportError(CheckpointError):
    """A LeRobot folder cannot be imported: a file is missing or the checkpoint is not understood."""


def is_lerobot_folder(path: str | Path) -> bool:
    """True if ``path`` looks like a LeRobot π0 / π0.5 policy folder (``config.json`` of type pi0 / pi05)."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "config.yaml").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get("type") in LEROBOT_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise LeRobotImportError(f"{path} has no config.json: not a LeRobot policy folder")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LeRobotImportError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("type") not in LEROBOT_TYPES:
        kind = cfg.get("type") if isinstance(cfg, dict) else None
        raise LeRobotImportError(f"{f}: policy type {kind!r} is not one this importer understands "
                                 f"({', '.join(LEROBOT_TYPES)})")
    return cfg


# ----------------------------------------------------------------------------------------------------
# Reading the weights lazily
# ----------------------------------------------------------------------------------------------------
class LazyWeights:
    """The tensors of a safetensors file by (alias-normalised) name, read one at a time."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise LeRobotImportError(f"checkpoint file missing: {path}")
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            raw = list(self._file.keys())
            self.shapes = {}
            self._names = {}
            for k in raw:
                name = canonical_name(k)
                self._names[name] = k
                self.shapes[name] = tuple(self._file.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise LeRobotImportError(f"corrupt safetensors file {path}: {e}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(self._names[name])
        except (SafetensorError, OSError) as e:
            raise LeRobotImportError(f"{self.path}: cannot read {self._names[name]}: {e}") from None


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


def _layers(shapes: dict, prefix: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if found != set(range(len(found))):
        raise LeRobotImportError(f"the layers under {prefix} are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def _shape(shapes: dict, name: str) -> tuple[int, ...]:
    if name not in shapes:
        raise LeRobotImportError(f"model.safetensors has no {name}: not a LeRobot π0 / π0.5 checkpoint")
    return shapes[name]


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
    cameras = [k for k, f in (lr.get("input_features") or {}).items()
               if isinstance(f, dict) and f.get("type") == "VISUAL"]
    empty = int(lr.get("empty_cameras") or 0)
    names = cameras + [f"empty_camera_{i}" for i in range(empty)]
    resolution = lr.get("image_resolution") or [grid * patch_size] * 2
    if grid * patch_size != resolution[0]:
        raise LeRobotImportError(f"config.json's image_resolution {resolution} does not match SigLIP's "
                                 f"{grid}x{grid} patches of {patch_size}")
    action_in = _shape(shapes, "model.action_in_proj.weight")
    state_dim = _shape(shapes, "model.state_proj.weight")[1] if not pi05 else int(lr.get("max_state_dim", 32))
    base = {
        "arch": "pi05" if pi05 else "pi0",
        "vision": {"image_size": grid * patch_size, "patch_size": patch_size, "width": vis_width,
                   "depth": _layers(shapes, _VIS + "encoder.layers."),
                   "num_heads": SIGLIP_HEADS.get(vis_width, 0),
                   "mlp_dim": _shape(shapes, _VIS + "encoder.layers.0.mlp.fc1.weight")[0]},
        "prefix": {"width": wp, "mlp_dim": _shape(shapes, _LM + "layers.0.mlp.gate_proj.weight")[0]},
        "expert": {"width": we, "mlp_dim": _shape(shapes, _EX + "model.layers.0.mlp.gate_proj.weight")[0]},
        "depth": _layers(shapes, _LM + "layers."), "num_heads": q_rows // head_dim, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "tokenizer": "sentencepiece", "tokenizer_file": POLICY_TOKENIZER, "vocab_size": vocab,
        "max_text_tokens": int(lr.get("tokenizer_max_length", 200 if pi05 else 48)),
        "num_cameras": len(names), "camera_names": names, "missing_cameras": "mask", "image_resize": "pad",
        "image_antialias": False,   # LeRobot resizes with resize_with_pad_torch: plain bilinear
        "state_dim": state_dim, "action_dim": action_in[1], "action_horizon": int(lr["chunk_size"]),
        "time_conditioning": "adarms" if pi05 else "concat", "adarms_final_norm": pi05,
        "time_min_period": float(lr.get("min_period", 4e-3)), "time_max_period": float(lr.get("max_period", 4.0)),
        "time_embedding_precision": "float64",
        "state_input": "prompt" if pi05 else "suffix", "value_source": "prefix" if pi05 else "expert",
        "value_hidden": min(1024, wp if pi05 else we),
    }
    if _layers(shapes, _EX + "model.layers.") != base["depth"]:
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


def new_heads(cfg: PolicyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The RL heads a LeRobot checkpoint lacks, initialised: the Flow-Noise std head outputs 0 (its std starts
    at the geometric middle of [noise_std_min, noise_std_max] everywhere) and the value head's output layer is
    zero (V = 0 until the critic learns); the value head's hidden layer is a fresh default initialisation."""
    g = torch.Generator().manual_seed(seed)
    we, wp = cfg.expert.width, cfg.prefix.width
    value_in = we if cfg.value_source == "expert" else wp
    bound = 1.0 / math.sqrt(value_in)   # nn.Linear's default uniform(-1/sqrt(in), 1/sqrt(in))
    return {
        "noise_head.weight": torch.zeros(cfg.action_dim, we), "noise_head.bias": torch.zeros(cfg.action_dim),
        "value_head.0.weight": (torch.rand(cfg.value_hidden, value_in, generator=g) * 2 - 1) * bound,
        "value_head.0.bias": (torch.rand(cfg.value_hidden, generator=g) * 2 - 1) * bound,
        "value_head.2.weight": torch.zeros(1, cfg.value_hidden), "value_head.2.bias": torch.zeros(1),
    }


def check_names(cfg: PolicyConfig, weights: LazyWeights) -> dict[str, tuple[str, ...]]:
    """The name map for ``cfg``, after checking that ``weights`` holds exactly those tensors, of the right shapes.
    Raises :class:`LeRobotImportError` listing what is unknown, missing or misshapen."""
    sources = weight_sources(cfg, weights.shapes)
    with torch.device("meta"):
        expected = make_policy(cfg).state_dict()
    if set(sources) - set(expected):   # a mapping bug, not the user's
        raise AssertionError(f"mapped names that the model does not have: {sorted(set(sources) - set(expected))}")
    used = {n for names in sources.values() for n in names}
    tied = {_PG + "lm_head.weight", _LM + "embed_tokens.weight"}
    missing = sorted(n for n in used if n not in weights)
    unknown = sorted(n for n in weights.shapes if n not in used and n not in _IGNORED and n not in tied)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) this importer does not understand: {', '.join(unknown[:8])}"
                        + (" ..." if len(unknown) > 8 else ""))
    if not problems:
        for ours, names in sources.items():
            shapes = [weights.shapes[n] for n in names]
            got = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
            if tuple(got) != tuple(expected[ours].shape):
                problems.append(f"{names[0]} has shape {tuple(shapes[0])}, the inferred config needs "
                                f"{tuple(expected[ours].shape)} for {ours}")
    if problems:
        kind = "π0.5" if cfg.state_input == "prompt" else "π0"
        raise LeRobotImportError(f"{weights.path} does not match a LeRobot {kind} checkpoint: " + "; ".join(problems))
    return sources


def convert_weights(cfg: PolicyConfig, weights: LazyWeights, dtype: torch.dtype | None = torch.float32,
                    seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors, one at a time (name, tensor in ``dtype``; None keeps the file's dtype), the new heads last.
    Non-finite values are refused."""
    sources = check_names(cfg, weights)
    for ours, names in sources.items():
        parts = [weights.get(n) for n in names]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        del parts
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LeRobotImportError(f"{weights.path}: {names[0]} holds NaN or inf")
        t = (t if dtype is None or not t.is_floating_point() else t.to(dtype)).contiguous()
        head_dtype = t.dtype
        yield ours, t
    for name, t in new_heads(cfg, seed).items():
        yield name, t.to(head_dtype)


# ----------------------------------------------------------------------------------------------------
# Normalisation statistics
# ----------------------------------------------------------------------------------------------------
_MODE_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
               "QUANTILE10": ("q10", "q90"), "IDENTITY": ()}


def _normalizer_step(path: Path, name: str, registry: str) -> tuple[dict, dict[str, torch.Tensor]]:
    f = path / name
    if not f.is_file():
        raise LeRobotImportError(f"{path} has no {name} (LeRobot's processor pipeline with the normalisation "
                                 "statistics)")
    try:
        pipeline = json.loads(f.read_text())
        step = next(s for s in pipeline["steps"] if s.get("registry_name") == registry)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise LeRobotImportError(f"{f} has no {registry} step") from None
    state_file = step.get("state_file")
    if not state_file or Path(state_file).name != state_file or not (path / state_file).is_file():
        raise LeRobotImportError(f"{f}: the {registry} step's statistics file {state_file!r} is missing")
    try:
        with safe_open(str(path / state_file), framework="pt") as sf:
            stats = {k: sf.get_tensor(k).float() for k in sf.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError) as e:
        raise LeRobotImportError(f"corrupt safetensors file {path / state_file}: {e}") from None
    return step.get("config") or {}, stats


def _affine(stats: dict[str, torch.Tensor], key: str, mode: str, dim: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(center, half-range or std, the mode used) of LeRobot's normalisation of feature ``key`` in ``mode``.
    A file that lacks the mode's statistics but has mean / std (LeRobot itself would stop there) is read in
    MEAN_STD, and the returned mode says so."""
    if mode not in _MODE_STATS:
        raise LeRobotImportError(f"normalisation mode {mode!r} of {key} is not one of {sorted(_MODE_STATS)}")
    if mode == "IDENTITY":
        return torch.zeros(dim), torch.ones(dim), mode
    lo_name, hi_name = _MODE_STATS[mode]
    missing = [f"{key}.{n}" for n in (lo_name, hi_name) if f"{key}.{n}" not in stats]
    if missing:
        if mode != "MEAN_STD" and f"{key}.mean" in stats and f"{key}.std" in stats:
            c, s, _ = _affine(stats, key, "MEAN_STD", dim)
            return c, s, f"MEAN_STD (the file has no {mode} statistics)"
        raise LeRobotImportError(f"{mode} normalisation of {key} needs the statistics {missing}, which the "
                                 "processor's file lacks")
    a, b = stats[f"{key}.{lo_name}"].reshape(-1), stats[f"{key}.{hi_name}"].reshape(-1)
    if a.shape[0] != dim or b.shape[0] != dim:
        raise LeRobotImportError(f"{key} statistics have {a.shape[0]} dims, the feature has {dim}")
    if mode == "MEAN_STD":
        return a, b, mode
    return (a + b) / 2, (b - a) / 2, mode


def read_norm_stats(path: Path, lr: dict) -> tuple[NormStats, dict]:
    """Our statistics from the pre-processor's normaliser (state) and the post-processor's unnormaliser
    (action), and the LeRobot mode applied to each. Each feature's affine map ``(x - c) / s`` is stored so that
    both of our modes apply it (mean = c, std = s, q01 = c - s, q99 = c + s)."""
    pre_cfg, pre = _normalizer_step(path, "policy_preprocessor.json", "normalizer_processor")
    post_cfg, post = _normalizer_step(path, "policy_postprocessor.json", "unnormalizer_processor")
    feats = lr.get("input_features") or {}
    outs = lr.get("output_features") or {}
    if "observation.state" not in feats or "action" not in outs:
        raise LeRobotImportError("config.json must declare observation.state (input) and action (output) features")
    sdim, adim = int(feats["observation.state"]["shape"][-1]), int(outs["action"]["shape"][-1])
    norm_map = {**(lr.get("normalization_mapping") or {}), **(pre_cfg.get("norm_map") or {})}
    s_mode = norm_map.get("STATE", "IDENTITY")
    a_mode = {**norm_map, **(post_cfg.get("norm_map") or {})}.get("ACTION", "IDENTITY")
    sc, ss, s_used = _affine(pre, "observation.state", s_mode, sdim)
    ac, as_, a_used = _affine(post, "action", a_mode, adim)
    stat = lambda c, s: Stats(mean=c, std=s, q01=c - s, q99=c + s)  # noqa: E731
    mode = "mean_std" if s_used.startswith(("MEAN_STD", "IDENTITY")) else "quantile"
    return NormStats(stat(sc, ss), stat(ac, as_), mode), {"state": s_used, "action": a_used}


# The processor steps whose effect this importer reproduces (LeRobot 0.4 - 0.6), by pipeline. Any other step could
# change what the inputs or actions mean, so a folder with one is refused rather than imported silently wrong.
KNOWN_STEPS = {
    "policy_preprocessor.json": {"rename_observations_processor", "to_batch_processor", "pi0_new_line_processor",
                                 "tokenizer_processor", "device_processor", "normalizer_processor",
                                 "pi05_prepare_state_tokenizer_processor_step",
                                 "relative_actions_processor", "delta_actions_processor"},   # only when disabled
    "policy_postprocessor.json": {"unnormalizer_processor", "device_processor",
                                  "absolute_actions_processor"},                              # only when disabled
}
_RELATIVE_STEPS = {"relative_actions_processor", "delta_actions_processor", "absolute_actions_processor"}


def check_processor_steps(path: Path, lr: dict) -> None:
    """Refuse, in one line, a checkpoint whose actions are relative to the state (``use_relative_actions``, LeRobot
    >= 0.5: the model predicts ``action - state`` on the dims not named in ``relative_exclude_joints`` and the
    post-processor adds the state back), or whose processors hold a step this importer does not reproduce."""
    relative = bool(lr.get("use_relative_actions"))
    for name, known in KNOWN_STEPS.items():
        f = path / name
        try:
            steps = json.loads(f.read_text())["steps"] if f.is_file() else []
            names = [(s["registry_name"], bool((s.get("config") or {}).get("enabled"))) for s in steps]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise LeRobotImportError(f"{f} is not a LeRobot processor pipeline (a 'steps' list of registry names)") \
                from None
        unknown = [n for n, _ in names if n not in known]
        if unknown:
            raise LeRobotImportError(f"{f}: processor step(s) {unknown} are not ones this importer reproduces "
                                     f"(known: {sorted(known)}); importing would change what the policy's inputs "
                                     "or actions mean")
        relative |= any(on for n, on in names if n in _RELATIVE_STEPS)
    if relative:
        raise LeRobotImportError(
            f"{path}: trained with relative actions (use_relative_actions: the model predicts offsets from the state "
            f"for all dims but {lr.get('relative_exclude_joints') or []}, which LeRobot adds back); this importer "
            "reads absolute actions only, and refuses rather than import them as absolute")


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------
def find_tokenizer(src: Path, given: str | Path | None = None) -> Path | None:
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
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snaps = Path(hub) / ("models--" + PALIGEMMA_REPO.replace("/", "--")) / "snapshots"
    found = sorted(snaps.glob(f"*/{TOKENIZER_FILE}")) if snaps.is_dir() else []
    return found[-1] if found else None


def load_tokenizer(path: Path, cfg: PolicyConfig) -> SentencePieceTokenizer:
    try:
        tok = SentencePieceTokenizer.from_file(path)
    except TokenizerError as e:
        raise LeRobotImportError(str(e)) from None
    if tok.vocab_size > cfg.vocab_size:
        raise LeRobotImportError(f"the tokenizer {path} has {tok.vocab_size} pieces, more than the checkpoint's "
                                 f"{cfg.vocab_size} token embeddings (not this checkpoint's tokenizer?)")
    return tok


# ----------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------
@dataclass
class ImportReport:
    """What an import did, for the CLI's message."""

    kind: str
    config: PolicyConfig
    parameters: int
    tokenizer: str
    normalization: dict
    notes: list[str]


def _open(src: str | Path, overrides: dict | None) -> tuple[Path, dict, LazyWeights, PolicyConfig]:
    src = Path(src)
    if not src.is_dir():
        raise LeRobotImportError(f"no LeRobot policy folder at {src}")
    lr = read_config(src)
    check_processor_steps(src, lr)
    weights = LazyWeights(src / "model.safetensors")
    cfg = infer_policy_config(lr, weights.shapes, overrides)
    return src, lr, weights, cfg


def _notes(cfg: PolicyConfig) -> list[str]:
    return ["the Flow-Noise std head and the value head are not in LeRobot checkpoints: initialised here "
            f"(std at the middle of [{cfg.noise_std_min}, {cfg.noise_std_max}], value 0)",
            "the action expert's lm_head is not used by the model and was skipped"]


def load_lerobot(src: str | Path, *, tokenizer: str | Path | None = None, overrides: dict | None = None,
                 device="cpu", dtype: torch.dtype = torch.float32) -> tuple[FlowVLA, NormStats, dict]:
    """A LeRobot π0 / π0.5 folder as (model in eval mode, normalisation, a config dict like ``config.yaml``'s).

    The model is built on the meta device and takes the converted tensors as they are read, so memory holds
    one copy of the weights. Without a tokenizer (none given, none found) the model still runs on given
    ``tokens``; instructions then raise a clear error."""
    src, lr, weights, cfg = _open(src, overrides)
    norm, modes = read_norm_stats(src, lr)
    tok_path = find_tokenizer(src, tokenizer)
    tok = load_tokenizer(tok_path, cfg) if tok_path else None
    with torch.device("meta"):
        model = make_policy(cfg)
    state = dict(convert_weights(cfg, weights, dtype))
    model.load_state_dict(state, assign=True, strict=True)
    del state
    model.set_tokenizer(tok)
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(cfg),
              "normalization": {"mode": norm.mode, "hidden_state_dims": []},
              "source": {"lerobot": str(src.resolve()), "type": lr["type"], "normalization": modes}}
    return model.to(device).eval(), norm, config


def import_lerobot(src: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
                   overrides: dict | None = None, dtype: str = "fp32",
                   progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Write the LeRobot folder ``src`` as one of our policy folders at ``out`` (atomically): ``model.safetensors``
    (in ``dtype``: fp32, bf16, or keep the file's), ``norm_stats.safetensors``, ``config.yaml`` and
    ``tokenizer.model``. Tensors are converted one at a time; the output holds one copy."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    src, lr, weights, cfg = _open(src, overrides)
    norm, modes = read_norm_stats(src, lr)
    tok_path = find_tokenizer(src, tokenizer)
    if tok_path is None:
        raise LeRobotImportError(
            f"no PaliGemma tokenizer found next to {src} or in the Hugging Face cache ({PALIGEMMA_REPO}); give it "
            f"with --tokenizer PATH/{TOKENIZER_FILE} (the SentencePiece model of {PALIGEMMA_REPO})")
    tok = load_tokenizer(tok_path, cfg)
    tensors: dict[str, torch.Tensor] = {}
    total = len(weight_sources(cfg, weights.shapes))
    for i, (name, t) in enumerate(convert_weights(cfg, weights, DTYPES[dtype])):
        tensors[name] = t
        if progress is not None:
            progress(min(i + 1, total), total)
    notes = _notes(cfg)
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(cfg),
              "normalization": {"mode": norm.mode, "hidden_state_dims": []},
              "source": {"lerobot": str(src.resolve()), "type": lr["type"], "normalization": modes,
                         "dtype": dtype, "notes": notes}}
    out = Path(out)
    n_params = sum(t.numel() for t in tensors.values())
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        tensors.clear()
        save_file(norm.to_tensors(), str(tmp / "norm_stats.safetensors"))
        with open(tmp / "config.yaml", "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        save_file(tok.to_tensors(), str(tmp / POLICY_TOKENIZER))
    return ImportReport(kind=lr["type"], config=cfg, parameters=n_params, tokenizer=str(tok_path),
                        normalization=modes, notes=notes)
