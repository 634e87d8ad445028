"""π0 / π0.5 checkpoints outside LeRobot's format, read as ours: ``vla-rl import openpi`` / ``vla-rl import rlinf``,
and ``init=`` / ``vla-rl eval`` / ``bench`` of such a folder.

Three layouts (tests/fixtures/openpi_tiny/NOTES.md has the facts, with the openpi commit they were read at):

- **openpi JAX**: a checkpoint folder with an orbax ``params/`` item and ``assets/<asset_id>/norm_stats.json`` (what
  Physical Intelligence publishes and what every openpi fine-tune writes); read through tensorstore
  (:mod:`.openpi_orbax`), without JAX.
- **openpi PyTorch**: ``model.safetensors`` as openpi's ``convert_jax_model_to_pytorch.py`` writes it (LeRobot's
  names without the leading ``model.``), its ``config.json`` (action_dim, action_horizon, variants) and the same
  ``assets/``.
- **RLinf**: ``actor/model_state_dict/full_weights.pt``, a ``torch.save`` of a flat dict of tensors with openpi
  PyTorch's names plus RLinf's value / noise heads. Read with ``torch.load(weights_only=True)`` only: a file that
  needs anything but tensors is refused, never unpickled. Its norm stats sit at ``<model_path>/<repo_id>/
  norm_stats.json`` (RLinf's layout) or are given with ``--norm-stats``.

All three become the tensors of a LeRobot π0 / π0.5 folder and go through :mod:`.lerobot_pi`'s mapping, so the one
model and its checks serve every format. What the weights cannot tell (the chunk length, the prompt length, whether
π0.5 reads the state in its prompt) comes from openpi's training config, named with ``--config`` or recognised
from the asset id (:data:`CONFIGS`), or from PolicyConfig overrides.

openpi's normalisation (``openpi/shared/normalize.py``): π0 mean / std as ``(x - mean) / (std + 1e-6)``, π0.5
quantiles as ``(x - q01) / (q99 - q01 + 1e-6) * 2 - 1``; stored here so that our normaliser applies exactly those
maps (std + 1e-6; q99 + 1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vla_rl.checkpoint import lerobot_pi
from vla_rl.checkpoint.lerobot import is_lerobot_folder
from vla_rl.checkpoint.lerobot_format import (
    DTYPES,
    Family,
    ImportReport,
    LazyWeights,
    LeRobotImportError,
    Opened,
    load_opened,
    write_opened,
)
from vla_rl.checkpoint.openpi_orbax import OrbaxError, OrbaxWeights
from vla_rl.core.ranges import ConfigError
from vla_rl.envs.registry import LIBERO
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.seam import FlowVLA

FORMATS = ("openpi", "rlinf")
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")   # openpi's model.IMAGE_KEYS, in slot order
NORM_FILE = "norm_stats.json"
RLINF_FILE = "full_weights.pt"
OPENPI_TOKENIZER = ("big_vision", "paligemma_tokenizer.model")   # under $OPENPI_DATA_HOME (~/.cache/openpi)
EPS = 1e-6   # openpi's normalisation epsilon


class OpenpiImportError(LeRobotImportError):
    """An openpi / RLinf checkpoint cannot be imported: a file is missing or the checkpoint is not understood."""


@dataclass(frozen=True)
class ModelSettings:
    """What an openpi training config says about its model that the weights cannot: ``Pi0Config``'s
    ``action_horizon``, ``max_token_len`` and ``discrete_state_input`` (π0.5 reads the discretised state in its
    prompt), and the asset id of its norm stats."""

    pi05: bool
    action_horizon: int = 50
    max_token_len: int | None = None   # openpi: 200 for π0.5, 48 for π0
    discrete_state_input: bool | None = None   # openpi: True for π0.5
    asset_id: str | None = None
    delta_action_dims: tuple[int, ...] = ()   # LeRobotLiberoDataConfig(extra_delta_transform): offsets from the state
    env: dict | None = None   # the env config its example client runs (LIBERO: rot180 frames rendered at 256 px)
    execute: int | None = None   # actions run per chunk before asking again (LIBERO example: replan_steps 5)

    @property
    def tokens(self) -> int:
        return self.max_token_len or (200 if self.pi05 else 48)

    @property
    def state_in_prompt(self) -> bool:
        return self.pi05 if self.discrete_state_input is None else self.discrete_state_input


# What openpi's LIBERO example client (examples/libero/main.py) runs: frames rotated 180 degrees, rendered at 256 px
# (then resized with padding to 224 by the policy).
LIBERO_CLIENT = {"kind": LIBERO, LIBERO: {"image_orientation": "rot180", "image_size": 256}}
NUM_STEPS = 10   # openpi's sample_actions default: what its policies serve with

# openpi's (src/openpi/training/config.py at 15a9616) and RLinf's (rlinf/models/embodiment/openpi/dataconfig)
# training configs for π0 / π0.5, by name.
CONFIGS: dict[str, ModelSettings] = {
    "pi0_base": ModelSettings(pi05=False),
    "pi05_base": ModelSettings(pi05=True),
    "pi0_libero": ModelSettings(pi05=False, asset_id="physical-intelligence/libero", delta_action_dims=tuple(range(6)),
                                env=LIBERO_CLIENT, execute=5),
    "pi05_libero": ModelSettings(pi05=True, action_horizon=10, discrete_state_input=False,
                                 asset_id="physical-intelligence/libero", env=LIBERO_CLIENT, execute=5),
    "pi0_droid": ModelSettings(pi05=False, action_horizon=10, asset_id="droid"),
    "pi05_droid": ModelSettings(pi05=True, action_horizon=15, asset_id="droid"),
    "pi0_maniskill": ModelSettings(pi05=False, asset_id="physical-intelligence/maniskill"),
    "pi05_maniskill": ModelSettings(pi05=True, action_horizon=10, discrete_state_input=False,
                                    asset_id="physical-intelligence/maniskill"),
}


# ----------------------------------------------------------------------------------------------------
# Finding the files
# ----------------------------------------------------------------------------------------------------
def rlinf_file(path: Path) -> Path | None:
    """RLinf's ``full_weights.pt`` for ``path`` (the file, a ``model_state_dict/`` folder, an ``actor/`` folder, a
    ``global_step_N/`` folder or a model_path), or None."""
    if path.is_file():
        return path if path.suffix == ".pt" else None
    for sub in (RLINF_FILE, f"model_state_dict/{RLINF_FILE}", f"actor/model_state_dict/{RLINF_FILE}"):
        if (path / sub).is_file():
            return path / sub
    return None


def _orbax_params(path: Path) -> Path | None:
    if (path / "params" / "_METADATA").is_file():
        return path / "params"
    if (path / "_METADATA").is_file() and path.name == "params":
        return path
    return None


def _is_openpi_pytorch(path: Path) -> bool:
    if not (path / "model.safetensors").is_file() or (path / "config.yaml").is_file():
        return False
    try:
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "type" not in cfg and (
        "action_expert_variant" in cfg or (path / "assets").is_dir() or not cfg)


def detect(path: str | Path) -> str | None:
    """``"openpi-jax"``, ``"openpi-pytorch"`` or ``"rlinf"`` for a checkpoint this module reads, else None."""
    path = Path(path)
    if path.is_dir() and _orbax_params(path) is not None:
        return "openpi-jax"
    if path.is_dir() and _is_openpi_pytorch(path):
        return "openpi-pytorch"
    if rlinf_file(path) is not None and (path.is_dir() or path.name == RLINF_FILE):
        return "rlinf"
    return None


def find_norm_stats(root: Path, asset_id: str | None = None, given: str | Path | None = None) -> tuple[Path, str]:
    """The ``norm_stats.json`` to use and its asset id: ``given`` (a file, or a folder holding one), else the one
    under ``root`` (openpi: ``assets/<asset_id>/``; RLinf: ``<repo_id>/``), chosen by ``asset_id`` when there
    are several."""
    if given is not None:
        path = Path(given)
        path = path / NORM_FILE if path.is_dir() else path
        if not path.is_file():
            raise OpenpiImportError(f"no norm stats file at {path}")
        return path, asset_id or path.parent.name
    base = root / "assets" if (root / "assets").is_dir() else root
    found = {}
    for depth in (1, 2, 3):   # asset ids are one to three names deep ("droid", "physical-intelligence/libero")
        for f in sorted(base.glob("/".join(["*"] * depth + [NORM_FILE]))):
            found[f.parent.relative_to(base).as_posix()] = f
    if asset_id is not None:
        if asset_id not in found:
            raise OpenpiImportError(f"{root} has no norm stats for asset id {asset_id!r} (found: "
                                    f"{sorted(found) or 'none'})")
        return found[asset_id], asset_id
    if len(found) == 1:
        (aid, f), = found.items()
        return f, aid
    if not found:
        raise OpenpiImportError(f"no {NORM_FILE} under {base} (openpi keeps it at assets/<asset_id>/{NORM_FILE}, "
                                "RLinf at <model_path>/<repo_id>/); give it with --norm-stats PATH")
    raise OpenpiImportError(f"{root} holds norm stats for several asset ids {sorted(found)}: choose one with "
                            "--asset-id")


def _stats_of(block: dict, key: str, path: Path, quantile: bool) -> Stats:
    def vec(name: str, required: bool = True) -> torch.Tensor | None:
        v = block.get(name)
        if v is None:
            if required:
                raise OpenpiImportError(f"{path}: {key} has no {name}"
                                        + (" (π0.5 normalises with the q01 / q99 quantiles)" if quantile else ""))
            return None
        try:
            t = torch.tensor(v, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError):
            raise OpenpiImportError(f"{path}: {key}.{name} is not a list of numbers") from None
        if not bool(torch.isfinite(t).all()):
            raise OpenpiImportError(f"{path}: {key}.{name} holds NaN or inf")
        return t

    mean, std = vec("mean"), vec("std")
    q01, q99 = vec("q01", quantile), vec("q99", quantile)
    if quantile:
        # (x - q01) / (q99 - q01 + eps) * 2 - 1 is ours with q99 moved up by eps
        q99 = q99 + EPS
    else:
        std = std + EPS
    q01 = q01 if q01 is not None else mean - std
    q99 = q99 if q99 is not None else mean + std
    dims = {t.shape[0] for t in (mean, std, q01, q99)}
    if len(dims) != 1:
        raise OpenpiImportError(f"{path}: {key}'s mean / std / q01 / q99 have different lengths")
    return Stats(mean.float(), std.float(), q01.float(), q99.float())


def read_norm_stats(path: Path, pi05: bool, relative: tuple[int, ...] = ()) -> NormStats:
    """openpi's ``norm_stats.json`` as our :class:`NormStats`: quantiles for π0.5, mean / std for π0 (openpi's
    choice, ``use_quantile_norm = model_type != PI0``); ``relative``: action dims that are offsets from the state
    (openpi's ``DeltaActions`` / ``AbsoluteActions``)."""
    try:
        data = json.loads(path.read_text())
        stats = data["norm_stats"]
        state, actions = stats["state"], stats["actions"]
    except (OSError, ValueError) as e:
        raise OpenpiImportError(f"{path} is not valid JSON: {e}") from None
    except (KeyError, TypeError):
        raise OpenpiImportError(f"{path} is not openpi's norm stats format ({{\"norm_stats\": {{\"state\": ..., "
                                "\"actions\": ...}}}})") from None
    s, a = _stats_of(state, "state", path, pi05), _stats_of(actions, "actions", path, pi05)
    try:
        return NormStats(s, a, "quantile" if pi05 else "mean_std", relative_actions=relative)
    except ValueError as e:
        raise OpenpiImportError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------------------------------
# The tensors
# ----------------------------------------------------------------------------------------------------
def _lerobot_name(key: str) -> str:
    return lerobot_pi.canonical_name("model." + key)


class TensorDictWeights:
    """A dict of tensors (RLinf's ``full_weights.pt``) under LeRobot's names, as :class:`LazyWeights` offers them."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]):
        self.path = path
        self._tensors = {_lerobot_name(k): v for k, v in tensors.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


RLINF_HEADS = ("value_head.", "noise_head.")


def load_rlinf_state(path: Path) -> dict[str, torch.Tensor]:
    """RLinf's ``full_weights.pt``, loaded with ``weights_only=True`` (memory-mapped): a flat dict of tensors, or a
    one-line refusal."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OpenpiImportError(f"{path}: not a plain state dict of tensors (torch.load weights_only=True refused "
                                f"it: {first}); vla-rl never unpickles other objects") from None
    if not isinstance(state, dict) or not state:
        raise OpenpiImportError(f"{path} holds a {type(state).__name__}, not RLinf's dict of tensors")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise OpenpiImportError(f"{path}: entries that are not named tensors: {bad[:5]}")
    lora = [k for k in state if "lora_A" in k or "lora_B" in k or ".base_layer." in k]
    if lora:
        raise OpenpiImportError(f"{path} holds LoRA adapters ({lora[0]} ...): merge them into the base weights "
                                "first (RLinf's is_lora checkpoints keep them apart)")
    return state


def _family(extra_skipped: set[str]) -> Family:
    base = lerobot_pi.PI0
    return Family(label="π0 / π0.5 (openpi layout)", infer_config=base.infer_config, weight_sources=base.weight_sources,
                  skipped=lambda shapes: base.skipped(shapes) | extra_skipped, find_tokenizer=base.find_tokenizer,
                  load_tokenizer=base.load_tokenizer, no_tokenizer=base.no_tokenizer, notes=base.notes,
                  canonical=base.canonical)


# ----------------------------------------------------------------------------------------------------
# Opening a checkpoint
# ----------------------------------------------------------------------------------------------------
def _settings(pi05: bool, config: str | None, asset_id: str | None, horizon: int | None) -> tuple[ModelSettings, str]:
    """The model settings: ``config``'s, else the one known config of this variant with this asset id, else
    openpi's ``Pi0Config`` defaults; a checkpoint's own ``config.json`` horizon wins. Also says where they came
    from."""
    if config is not None:
        if config not in CONFIGS:
            raise ConfigError(f"unknown openpi config {config!r}; known: {', '.join(CONFIGS)} (or give the settings "
                              "as PolicyConfig overrides: action_horizon=, max_text_tokens=, state_input=)")
        s = CONFIGS[config]
        if s.pi05 != pi05:
            raise OpenpiImportError(f"--config {config} is a {'π0.5' if s.pi05 else 'π0'} config, the checkpoint is "
                                    f"{'π0.5' if pi05 else 'π0'}")
        how = f"openpi config {config}"
    else:
        matches = [n for n, s in CONFIGS.items() if s.pi05 == pi05 and s.asset_id == asset_id and asset_id]
        if len(matches) == 1:
            s, how = CONFIGS[matches[0]], f"openpi config {matches[0]} (recognised by its asset id {asset_id})"
        else:
            s, how = ModelSettings(pi05=pi05), "openpi's Pi0Config defaults (no --config given)"
    if horizon is not None and horizon != s.action_horizon:
        s = dataclasses.replace(s, action_horizon=horizon)
        how += f"; action_horizon {horizon} from config.json"
    return s, how


def _open_weights(src: Path, kind: str) -> tuple[object, Path, dict, set[str], list[str]]:
    """(weights under LeRobot names, the folder around them, the checkpoint's config.json, tensors to skip, notes)."""
    notes: list[str] = []
    if kind == "openpi-jax":
        params = _orbax_params(src)
        root = params.parent
        weights = OrbaxWeights(params)
        if weights.unused:
            raise OpenpiImportError(f"{params}: {len(weights.unused)} parameter(s) this importer does not "
                                    f"understand: {', '.join(weights.unused[:8])}")
        return weights, root, {}, set(), notes
    if kind == "openpi-pytorch":
        cfg = {}
        if (src / "config.json").is_file():
            try:
                cfg = json.loads((src / "config.json").read_text())
            except (OSError, ValueError) as e:
                raise OpenpiImportError(f"{src / 'config.json'} is not valid JSON: {e}") from None
        return LazyWeights(src / "model.safetensors", _lerobot_name), src, cfg, set(), notes
    f = rlinf_file(src)
    state = load_rlinf_state(f)
    weights = TensorDictWeights(f, state)
    heads = {n for n in weights.shapes if n.startswith(tuple("model." + h for h in RLINF_HEADS))}
    if heads:
        notes.append(f"RLinf's own value / noise heads ({len(heads)} tensors) have no counterpart here and were "
                     "left out; ours start fresh")
    # The folder the weights belong to: RLinf's model_path (holding <repo_id>/norm_stats.json) or global_step_N,
    # above its actor/model_state_dict/ (a training checkpoint has no norm stats: --norm-stats names them).
    root = f.parent
    while root.name in ("model_state_dict", "actor") and root != root.parent:
        root = root.parent
    return weights, root, {}, heads, notes


def open_checkpoint(src: str | Path, *, config: str | None = None, asset_id: str | None = None,
                    norm_stats: str | Path | None = None, overrides: dict | None = None,
                    fmt: str | None = None) -> tuple[Opened, Path]:
    """An openpi (JAX or PyTorch) or RLinf checkpoint, understood (:class:`Opened`), and the folder to look for its
    tokenizer in."""
    src = Path(src)
    if not src.exists():
        raise OpenpiImportError(f"no checkpoint at {src}")
    kind = detect(src)
    if kind is None or (fmt == "rlinf") != (kind == "rlinf"):
        want = {"rlinf": f"RLinf's {RLINF_FILE} (or a folder with actor/model_state_dict/{RLINF_FILE})",
                None: "an openpi or RLinf checkpoint"}.get(fmt, "an openpi checkpoint (a folder with params/ and "
                                                           "assets/, or openpi's PyTorch model.safetensors)")
        hint = "; it is a LeRobot policy folder: vla-rl import lerobot" if is_lerobot_folder(src) else ""
        raise OpenpiImportError(f"{src} is not {want}{hint}")
    weights, root, ck_cfg, skipped, notes = _open_weights(src, kind)
    shapes = weights.shapes
    if "model.action_in_proj.weight" not in shapes:
        raise OpenpiImportError(f"{weights.path}: no action_in_proj: not a π0 / π0.5 checkpoint")
    pi05 = "model.time_mlp_in.weight" in shapes
    stats_file, aid = find_norm_stats(root, asset_id, norm_stats)
    horizon = ck_cfg.get("action_horizon")
    settings, how = _settings(pi05, config, aid, int(horizon) if isinstance(horizon, int) else None)
    ours = ck_cfg.get("vla_rl")
    if config is None and isinstance(ours, dict) and isinstance(horizon, int):   # vla-rl export --format openpi
        try:
            settings = ModelSettings(pi05, horizon, int(ours["max_token_len"]), bool(ours["discrete_state_input"]),
                                     aid, tuple(int(d) for d in ours.get("delta_action_dims") or ()),
                                     settings.env, settings.execute)
        except (KeyError, TypeError, ValueError) as e:
            raise OpenpiImportError(f"{src}/config.json: its vla_rl section is not understood ({e})") from None
        how = "the settings vla-rl's export recorded in config.json"
    action_dim = shapes["model.action_in_proj.weight"][1]
    lr = {"type": "pi05" if pi05 else "pi0", "chunk_size": settings.action_horizon,
          "tokenizer_max_length": settings.tokens, "max_state_dim": action_dim,
          "input_features": {c: {"type": "VISUAL"} for c in CAMERAS}}
    over = dict(overrides or {})
    heads = getattr(weights, "siglip_heads", None)
    if heads:   # JAX kernels keep SigLIP's heads apart; a PyTorch file does not (known sizes or an override)
        over["vision"] = {"num_heads": heads, **(over.get("vision") or {})}
    if kind == "openpi-jax":
        # openpi's JAX model computes the flow-time embedding's angles in float32 (its PyTorch port, LeRobot's and
        # RLinf's in float64): ~1e-4 apart in one denoising step on the twins. Reproduce the implementation the
        # checkpoint comes from.
        over.setdefault("time_embedding_precision", "float32")
    norm = read_norm_stats(stats_file, pi05, settings.delta_action_dims)
    over.setdefault("clean_prompt", True)   # PaligemmaTokenizer.tokenize: strip, "_" and "\n" -> " "
    # openpi resizes antialiased: its clients with PIL (LIBERO: 256 -> 224 px), its server with jax.image.resize
    over.setdefault("image_antialias", True)
    if pi05 and not settings.state_in_prompt:
        over.setdefault("state_input", "none")
    elif pi05:   # openpi discretises the normalised state before padding it: the robot's own dims only
        over.setdefault("state_prompt_dims", int(norm.state.mean.shape[0]))
    family = _family(skipped)
    try:
        cfg = family.infer_config(root, lr, shapes, over)
    except LeRobotImportError as e:
        raise OpenpiImportError(str(e).replace("vla-rl import lerobot", f"vla-rl import {fmt or 'openpi'}")
                                .replace("a LeRobot π0 / π0.5", "an openpi π0 / π0.5")) from None
    label = {"openpi-jax": "openpi JAX", "openpi-pytorch": "openpi PyTorch", "rlinf": "RLinf"}[kind]
    notes = [f"model settings from {how}: action_horizon {cfg.action_horizon}, max_text_tokens "
             f"{cfg.max_text_tokens}, state_input {cfg.state_input}", *notes,
             "the Flow-Noise std head and the value head start fresh (std at the middle of "
             f"[{cfg.noise_std_min}, {cfg.noise_std_max}], value 0)"]
    if norm.relative_actions:
        notes.append(f"action dims {list(norm.relative_actions)} are offsets from the state (openpi's "
                     "extra_delta_transform): the policy adds the state back, as openpi's AbsoluteActions does")
    source = {"format": kind, "path": str(src.resolve()), "type": lr["type"], "asset_id": aid,
              "norm_stats": str(stats_file.resolve()), "normalization": {"state": norm.mode, "action": norm.mode},
              "settings": how}
    # How openpi runs it, as defaults of our evaluation and export (deploy: like an SFT policy's sft section).
    deploy = {"sampler": {"num_steps": NUM_STEPS}, "execute": settings.execute or cfg.action_horizon}
    extra = {"deploy": deploy, **({"env_config": settings.env} if settings.env else {})}
    opened = Opened(family, weights, cfg, norm, source, {"state": norm.mode, "action": norm.mode},
                    f"{label} {'π0.5' if pi05 else 'π0'}", notes, extra)
    return opened, root


def find_tokenizer(root: Path, given: str | Path | None = None) -> Path | None:
    """PaliGemma's SentencePiece model: ``given``, next to the checkpoint, in openpi's download cache
    (``$OPENPI_DATA_HOME`` or ``~/.cache/openpi``: ``big_vision/paligemma_tokenizer.model``) or the Hugging Face
    cache."""
    found = lerobot_pi.find_tokenizer(root, None, given)
    if found is not None:
        return found
    home = Path(os.environ.get("OPENPI_DATA_HOME") or Path.home() / ".cache" / "openpi")
    for candidate in (root / OPENPI_TOKENIZER[1], home.joinpath(*OPENPI_TOKENIZER)):
        if candidate.is_file():
            return candidate
    return None


def _no_tokenizer(root: Path) -> str:
    return (f"no PaliGemma tokenizer found next to {root}, in openpi's cache (~/.cache/openpi/"
            f"{'/'.join(OPENPI_TOKENIZER)}) or the Hugging Face cache; give it with --tokenizer PATH")


# ----------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------
def load_openpi(src: str | Path, *, tokenizer: str | Path | None = None, config: str | None = None,
                asset_id: str | None = None, norm_stats: str | Path | None = None, overrides: dict | None = None,
                device="cpu", dtype: torch.dtype = torch.float32) -> tuple[FlowVLA, NormStats, dict]:
    """An openpi / RLinf checkpoint as (model in eval mode, normalisation, a config dict like ``config.yaml``'s)."""
    try:
        opened, root = open_checkpoint(src, config=config, asset_id=asset_id, norm_stats=norm_stats,
                                       overrides=overrides)
        return load_opened(opened, find_tokenizer(root, tokenizer), device=device, dtype=dtype)
    except (OrbaxError, LeRobotImportError) as e:
        if isinstance(e, OpenpiImportError):
            raise
        raise OpenpiImportError(str(e)) from None


def import_openpi(src: str | Path, out: str | Path, *, fmt: str = "openpi", tokenizer: str | Path | None = None,
                  config: str | None = None, asset_id: str | None = None, norm_stats: str | Path | None = None,
                  overrides: dict | None = None, dtype: str = "fp32",
                  progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Write an openpi (``fmt`` "openpi") or RLinf (``fmt`` "rlinf") checkpoint as one of our policy folders."""
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {FORMATS}, got {fmt!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    try:
        opened, root = open_checkpoint(src, config=config, asset_id=asset_id, norm_stats=norm_stats,
                                       overrides=overrides, fmt=fmt)
        tok_path = find_tokenizer(root, tokenizer)
        if tok_path is None:
            raise OpenpiImportError(_no_tokenizer(root))
        return write_opened(opened, tok_path, out, dtype=dtype, progress=progress)
    except (OrbaxError, LeRobotImportError) as e:
        if isinstance(e, OpenpiImportError):
            raise
        raise OpenpiImportError(str(e)) from None
