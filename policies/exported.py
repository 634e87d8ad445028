"""A policy exported for a robot: it loads with this package alone (no trainer, simulator or dataset code) and
turns observations into action chunks in the robot's units.

An exported folder (written by ``vla-rl export``):

    model.safetensors       weights, bf16 or fp32
    norm_stats.safetensors  state / action statistics (fp32)
    config.json             format, weight dtype, the :class:`PolicyConfig`, the normalisation mode
    spec.json               the robot interface (:class:`ExportSpec`): state / action names and units, control
                            mode, chunk length H, actions to execute per chunk, cameras, sampler and K
    README.md               the same, for a person
    tokenizer files         when the policy's tokenizer needs one

``load_exported(path).infer(obs)`` takes a dict of camera images, the state and the instruction (see
:meth:`ExportedPolicy.observation_keys`) and returns the chunk ``[H, a]`` (or ``[N, H, a]`` for a batch),
unnormalised and clipped like the training actor's, drawn with the deterministic ODE sampler in K steps
from Gaussian noise (pass ``seed`` to fix the noise).

Glossary: N observations, H actions per chunk, a robot action dims, A model action dims, s robot state dims,
C cameras, K denoising steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from vla_rl.core.ranges import ConfigError, setting
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.inference import CompileMode, Denoiser, cast_weights
from vla_rl.policies.layers import resize_with_pad
from vla_rl.policies.normalize import NormStats, actions_from_model, read_meta, state_to_model
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import FlowVLA
from vla_rl.policies.tokenizer import FILE_TOKENIZERS, TokenizerError

EXPORT_FORMAT = "vla-rl-export/1"
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_KEYS = ("state", "observation/state")
PROMPT_KEYS = ("prompt", "instruction")
SEED_KEY = "seed"
MAX_PROMPT_CHARS = 4096
# A normalised state value larger than this is refused: far beyond any robot's data (a few units at most), and far
# below where float32 overflows inside the model (squares in RMSNorm pass 3e38 near 1e19).
MAX_NORMALIZED_STATE = 1e12
_RESERVED = {*STATE_KEYS, *PROMPT_KEYS, SEED_KEY, "images"}


class ExportError(RuntimeError):
    """An exported folder is missing, corrupt or inconsistent."""


class ObservationError(ValueError):
    """An observation handed to :meth:`ExportedPolicy.infer` is malformed; the message names the problem."""


# ----------------------------------------------------------------------------------------------------
# The robot interface
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CameraSpec:
    """One camera: its name (the observation key), the resolution the policy was trained at, and other keys
    it is also read from (e.g. ``image`` for openpi's LIBERO convention)."""

    name: str
    height: int
    width: int
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or any(not a for a in self.aliases):
            raise ValueError("camera names and aliases must be non-empty strings")
        if self.height < 1 or self.width < 1:
            raise ValueError(f"camera {self.name!r}: height and width must be >= 1, got {self.height}x{self.width}")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every observation key this camera is read from: its name and aliases, bare and under ``observation/``."""
        names = (self.name, *self.aliases)
        return (*names, *(f"observation/{n}" for n in names))


@dataclass(frozen=True)
class ExportSpec:
    """What a robot needs to know to run the policy (``spec.json``)."""

    state_dim: int = setting(doc="s: state values the robot sends, in its units")
    action_dim: int = setting(doc="a: action values per step the policy returns, in the robot's units")
    action_horizon: int = setting(doc="H: actions per chunk (the policy's; checked against its config)")
    execute: int = setting(doc="actions of each chunk to run before asking for the next one")
    num_steps: int = setting(doc="K: ODE denoising steps per chunk")
    sampler: Literal["ode"] = setting("ode", doc="the deterministic ODE sampler")
    action_low: float | None = setting(-1.0, doc="actions are clipped to [action_low, action_high]; None: not clipped")
    action_high: float | None = setting(1.0, doc="upper clip bound of actions; None: not clipped")
    control_mode: str = setting("unknown", doc="what an action means on the robot (e.g. maniskill:pd_ee_delta_pose)")
    state_names: tuple[str, ...] = setting((), doc="empty, or one per state value")
    state_units: tuple[str, ...] = setting((), doc="empty, or one unit per state value")
    action_names: tuple[str, ...] = setting((), doc="empty, or one per action value")
    action_units: tuple[str, ...] = setting((), doc="empty, or one unit per action value")
    cameras: tuple[CameraSpec, ...] = setting((), doc="each camera: name, height, width, aliases")
    instruction: str | None = setting(None, doc="used when an observation carries no prompt")
    max_image_side: int = setting(2048, doc="larger images are refused (smaller ones of any size are resized)")
    notes: str = setting("", doc="conventions a person must know (gripper sign, image orientation)")
    source: dict[str, Any] = setting(default_factory=dict, doc="where the policy came from (informational)")

    def __post_init__(self):
        problems = []
        for name in ("state_dim", "action_dim", "action_horizon", "num_steps", "max_image_side"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.execute <= self.action_horizon:
            problems.append(f"execute must be in [1, action_horizon={self.action_horizon}], got {self.execute}")
        bounds = [b for b in (self.action_low, self.action_high) if b is not None]
        if any(not math.isfinite(b) for b in bounds):
            problems.append("action_low / action_high must be finite numbers or null")
        elif len(bounds) == 2 and not self.action_low < self.action_high:
            problems.append(f"need action_low < action_high, got {self.action_low}, {self.action_high}")
        for what, dim in (("state", self.state_dim), ("action", self.action_dim)):
            for kind in ("names", "units"):
                values = getattr(self, f"{what}_{kind}")
                if values and len(values) != dim:
                    problems.append(f"{what}_{kind} has {len(values)} entries for {dim} {what} dims")
        keys = [k for c in self.cameras for k in c.keys]
        clash = sorted({k for k in keys if keys.count(k) > 1 or k in _RESERVED})
        if clash:
            problems.append(f"camera keys {clash} are used twice or clash with {sorted(_RESERVED)}")
        if problems:
            raise ValueError("; ".join(problems))


# ----------------------------------------------------------------------------------------------------
# Observations
# ----------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """A validated observation: ``images`` per camera uint8 ``[N, h, w, 3]``, ``state`` float32 ``[N, s]``,
    ``prompts`` N strings, ``batched`` (whether the caller sent a batch), ``seed`` (None: fresh noise)."""

    images: list[np.ndarray]
    state: np.ndarray
    prompts: list[str]
    batched: bool
    seed: int | None

    @property
    def size(self) -> int:
        return self.state.shape[0]


def _array(value: Any, key: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple, int, float, np.generic)):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise ObservationError(f"{key}: not a rectangular array ({e})") from None
    if not isinstance(value, np.ndarray):
        raise ObservationError(f"{key}: expected an array, got {type(value).__name__}")
    return value


def _image(value: Any, key: str, batched: bool, max_side: int) -> np.ndarray:
    """A camera image as uint8 ``[N, h, w, 3]``; accepts HWC, or CHW (openpi's ALOHA convention)."""
    x = _array(value, key)
    if x.dtype != np.uint8:
        raise ObservationError(f"{key}: images must be uint8, got {x.dtype}")
    want = 4 if batched else 3
    if x.ndim != want:
        raise ObservationError(f"{key}: expected {'[N, H, W, 3]' if batched else '[H, W, 3]'} (a "
                               f"{'batched' if batched else 'single'} observation), got shape {x.shape}")
    if not batched:
        x = x[None]
    if x.shape[-1] != 3 and x.shape[1] == 3:
        x = x.transpose(0, 2, 3, 1)
    if x.shape[-1] != 3:
        raise ObservationError(f"{key}: images must have 3 colour channels (HWC or CHW), got shape {x.shape[1:]}")
    h, w = x.shape[1:3]
    if not (1 <= h <= max_side and 1 <= w <= max_side):
        raise ObservationError(f"{key}: image of {h}x{w} pixels; each side must be in [1, {max_side}]")
    return x


def _state(value: Any, key: str, dim: int) -> np.ndarray:
    x = _array(value, key)
    if x.dtype.kind not in "iuf":
        raise ObservationError(f"{key}: state must be numbers (float or int), got dtype {x.dtype}")
    if x.ndim not in (1, 2) or x.shape[-1] != dim or (x.ndim == 2 and x.shape[0] < 1):
        raise ObservationError(f"{key}: state must have shape [{dim}] or [N, {dim}], got {x.shape}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ObservationError(f"{key}: state contains NaN or inf")
    return x


def _prompts(value: Any, key: str, n: int, batched: bool) -> list[str]:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ObservationError(f"{key}: not UTF-8 text") from None
    if isinstance(value, np.ndarray) and value.dtype.kind == "U":
        value = value.tolist()
    if isinstance(value, str):
        texts = [value] * n
    elif batched and isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        if len(value) != n:
            raise ObservationError(f"{key}: {len(value)} prompts for {n} observations")
        texts = list(value)
    else:
        raise ObservationError(f"{key}: expected a string{' (or a list of N strings)' if batched else ''}, "
                               f"got {type(value).__name__}")
    if any(len(t) > MAX_PROMPT_CHARS for t in texts):
        raise ObservationError(f"{key}: prompts are limited to {MAX_PROMPT_CHARS} characters")
    return texts


def parse_observation(obs: Any, spec: ExportSpec) -> Batch:
    """Validate an observation (see :meth:`ExportedPolicy.observation_keys`); raise :class:`ObservationError`
    naming the first problem. Unknown keys are errors: a camera sent under a wrong name must not go unseen."""
    if not isinstance(obs, Mapping):
        raise ObservationError(f"an observation must be a mapping of keys to values, got {type(obs).__name__}")
    bad = [k for k in obs if not isinstance(k, str)]
    if bad:
        raise ObservationError(f"observation keys must be strings, got {bad[:3]!r}")
    camera_of = {k: i for i, c in enumerate(spec.cameras) for k in c.keys}
    nested = obs.get("images")
    if nested is not None and not isinstance(nested, Mapping):
        raise ObservationError("'images' must map camera names to images")
    unknown = sorted(k for k in obs if k not in camera_of and k not in _RESERVED)
    unknown += sorted(f"images/{k}" for k in (nested or {}) if k not in camera_of)
    if unknown:
        raise ObservationError(f"unknown observation key(s) {unknown}; accepted: {_accepted(spec)}")
    found = [k for k in STATE_KEYS if k in obs]
    if len(found) != 1:
        raise ObservationError(f"the observation needs exactly one of {list(STATE_KEYS)}, got {found or 'none'}")
    state = _state(obs[found[0]], found[0], spec.state_dim)
    batched, n = state.ndim == 2, state.shape[0] if state.ndim == 2 else 1
    state = state if batched else state[None]

    sources: list[list[tuple[str, Any]]] = [[] for _ in spec.cameras]
    for k, v in obs.items():
        if k in camera_of:
            sources[camera_of[k]].append((k, v))
    for k, v in (nested or {}).items():
        sources[camera_of[k]].append((f"images/{k}", v))
    images = []
    for cam, src in zip(spec.cameras, sources):
        if len(src) != 1:
            got = [k for k, _ in src]
            raise ObservationError(f"camera {cam.name!r} must be sent once, under one of {list(cam.keys)}, got "
                                   f"{got or 'none'}")
        key, value = src[0]
        img = _image(value, key, batched, spec.max_image_side)
        if img.shape[0] != n:
            raise ObservationError(f"{key}: {img.shape[0]} images for {n} states")
        images.append(img)

    given = [k for k in PROMPT_KEYS if k in obs]
    if len(given) > 1:
        raise ObservationError(f"give one of {list(PROMPT_KEYS)}, not both")
    if given:
        prompts = _prompts(obs[given[0]], given[0], n, batched)
    elif spec.instruction is not None:
        prompts = [spec.instruction] * n
    else:
        raise ObservationError(f"the observation needs a prompt (one of {list(PROMPT_KEYS)}): this policy has no "
                               "default instruction")
    seed = obs.get(SEED_KEY)
    if seed is not None:
        if isinstance(seed, np.integer):
            seed = int(seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ObservationError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return Batch(images=images, state=state, prompts=prompts, batched=batched, seed=seed)


def _accepted(spec: ExportSpec) -> dict[str, list[str]]:
    out = {"state": list(STATE_KEYS), "prompt": list(PROMPT_KEYS), "seed (optional)": [SEED_KEY]}
    for c in spec.cameras:
        out[f"camera {c.name}"] = [*c.keys, f"images/{c.name}"]
    return out


def _resize(images: Tensor, size: int, mode: str = "stretch", antialias: bool = True) -> Tensor:
    """uint8 ``[N, h, w, 3]`` -> uint8 ``[N, size, size, 3]`` as the model's own resize does (``image_resize``:
    bilinear, or that keeping the aspect ratio with black padding; ``image_antialias``)."""
    x = images.permute(0, 3, 1, 2).float()
    if mode == "pad":
        x = (resize_with_pad(x / 127.5 - 1.0, size, antialias=antialias) + 1.0) * 127.5
    else:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=antialias)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


# ----------------------------------------------------------------------------------------------------
# The policy
# ----------------------------------------------------------------------------------------------------
class ExportedPolicy:
    """A flow policy with its normalisation and robot interface, ready to act."""

    def __init__(self, model: FlowVLA, norm: NormStats, spec: ExportSpec, *, weight_dtype: str = "fp32",
                 compile: CompileMode = "none"):
        check_consistency(model.cfg, spec, norm)
        self.model, self.norm, self.spec = model.eval(), norm, spec
        self.weight_dtype = weight_dtype
        # how the K denoising steps run: eagerly, torch.compile'd or as one CUDA graph (policies/inference.py)
        self.denoiser = Denoiser(self.model, compile)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def compute_dtype(self) -> str:
        return {v: k for k, v in WEIGHT_DTYPES.items()}.get(self.model.dtype, "other")

    def observation_keys(self) -> dict[str, list[str]]:
        """Accepted observation keys: state, prompt, the optional seed, and each camera's names."""
        return _accepted(self.spec)

    def metadata(self) -> dict:
        """What a client is told about the policy (the server sends it on connect)."""
        return {"format": EXPORT_FORMAT, **to_dict(self.spec), "weight_dtype": self.weight_dtype,
                "compute_dtype": self.compute_dtype, "observation_keys": self.observation_keys()}

    def parse(self, obs: Any) -> Batch:
        """:func:`parse_observation`, plus the check that the state stays in range once normalised."""
        batch = parse_observation(obs, self.spec)
        self._check_normalized_state(batch.state)
        return batch

    def _check_normalized_state(self, state: np.ndarray) -> None:
        """Raise :class:`ObservationError` naming the first state value that normalises to more than
        :data:`MAX_NORMALIZED_STATE` in size (or to inf): a finite but huge value (1e38) would otherwise overflow
        inside the model and come out as NaN actions."""
        z = self.norm.normalize_state(torch.from_numpy(np.ascontiguousarray(state, np.float32))).numpy()
        bad = ~(np.abs(z) <= MAX_NORMALIZED_STATE)
        if bad.any():
            n, j = (int(i) for i in np.argwhere(bad)[0])
            where = f"state[{n}, {j}]" if state.shape[0] > 1 else f"state[{j}]"
            raise ObservationError(f"{where} = {float(state[n, j]):.6g} is {abs(float(z[n, j])):.3g} normalised "
                                   f"units from the training data (at most {MAX_NORMALIZED_STATE:g}); check its units")

    @torch.inference_mode()
    def run(self, batch: Batch) -> np.ndarray:
        """Actions for a validated batch: float32 ``[N, H, a]`` (``[H, a]`` if the caller sent one observation)."""
        cfg, dev = self.model.cfg, self.device
        size = cfg.vision.image_size
        cams = [torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else x.copy()).to(dev)
                for x in batch.images]   # decoded messages are read-only views of their bytes
        if len({tuple(c.shape[1:3]) for c in cams}) > 1:   # the model resizes a stack; a mixed one is resized here
            cams = [c if c.shape[1:3] == (size, size) else _resize(c, size, cfg.image_resize, cfg.image_antialias)
                    for c in cams]
        n = batch.size
        images = torch.stack(cams, dim=1) if cams else torch.zeros(n, 0, size, size, 3, dtype=torch.uint8,
                                                                    device=dev)
        raw_state = torch.from_numpy(batch.state).to(dev)
        state = state_to_model(self.norm, raw_state, cfg.state_dim)
        prefix = self.model.encode_prefix({"images": images, "state": state, "instruction": batch.prompts},
                                          hidden=False)
        # Noise is drawn on the CPU, so a seed gives the same chunk on any device.
        gen = None if batch.seed is None else torch.Generator().manual_seed(batch.seed)
        noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=gen).to(dev)
        x = self.denoiser(prefix, noise, num_steps=self.spec.num_steps)
        low, high = self.spec.action_low, self.spec.action_high
        if low is None and high is None:
            actions = actions_from_model(self.norm, x, self.spec.action_dim, -float("inf"), float("inf"), raw_state)
        else:
            actions = actions_from_model(self.norm, x, self.spec.action_dim, low, high, raw_state)
        out = actions.cpu().numpy().astype(np.float32)
        if not np.isfinite(out).all():   # the weights are finite (checked at load): the input drove it there
            raise ObservationError("the policy's actions are not finite for this observation (its state or images "
                                   "are far outside what it was trained on)")
        return out if batch.batched else out[0]

    def infer(self, obs: Any, *, seed: int | None = None) -> np.ndarray:
        """Action chunk in robot units for ``obs``: ``[H, a]``, or ``[N, H, a]`` for a batched observation.
        ``seed`` (or an observation's ``seed`` key) fixes the sampler's initial noise."""
        batch = self.parse(obs)
        if seed is not None:
            batch.seed = seed
        return self.run(batch)


def check_consistency(cfg: PolicyConfig, spec: ExportSpec, norm: NormStats) -> None:
    """Raise :class:`ExportError` unless config, spec and statistics describe the same policy."""
    problems = []
    if spec.action_horizon != cfg.action_horizon:
        problems.append(f"spec action_horizon {spec.action_horizon} != the policy's {cfg.action_horizon}")
    if spec.state_dim > cfg.state_dim or spec.action_dim > cfg.action_dim:
        problems.append(f"spec state/action dims {spec.state_dim}/{spec.action_dim} exceed the policy's "
                        f"{cfg.state_dim}/{cfg.action_dim}")
    if len(spec.cameras) > cfg.num_cameras or (len(spec.cameras) < cfg.num_cameras and (
            cfg.missing_cameras != "mask" or not spec.cameras)):
        problems.append(f"spec names {len(spec.cameras)} camera(s), the policy takes {cfg.num_cameras}"
                        + (" (or fewer, down to 1: the rest are masked)" if cfg.missing_cameras == "mask" else ""))
    if norm.state.mean.shape[0] != spec.state_dim or norm.action.mean.shape[0] != spec.action_dim:
        problems.append(f"statistics cover {norm.state.mean.shape[0]} state / {norm.action.mean.shape[0]} action "
                        f"dims, the spec {spec.state_dim} / {spec.action_dim}")
    if problems:
        raise ExportError("inconsistent export: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(f"exported policy file missing: {path}")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"corrupt JSON in {path}: {e}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object")
    return data


def _read_tensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ExportError(f"exported policy file missing: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"corrupt safetensors file {path}: {e}") from None


def read_export_config(path: str | Path) -> tuple[PolicyConfig, NormStats, ExportSpec, str]:
    """An exported folder's policy config, statistics, spec and weight dtype (no weights read)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"no exported policy folder at {path}")
    config = _read_json(path / "config.json")
    if config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path}/config.json: format {config.get('format')!r} is not {EXPORT_FORMAT!r}")
    unknown = sorted(set(config) - {"format", "dtype", "policy", "normalization"})
    if unknown:
        raise ExportError(f"{path}/config.json: unknown key(s) {unknown}")
    dtype = config.get("dtype")
    if dtype not in WEIGHT_DTYPES:
        raise ExportError(f"{path}/config.json: dtype {dtype!r} is not one of {list(WEIGHT_DTYPES)}")
    try:
        cfg = from_dict(PolicyConfig, config.get("policy"), prefix="policy")
        spec = from_dict(ExportSpec, _read_json(path / "spec.json"), prefix="spec")
        normalization = config.get("normalization")
        if not isinstance(normalization, dict) or not {"mode", "hidden_state_dims"} <= set(normalization):
            raise ConfigError("normalization must hold 'mode' and 'hidden_state_dims' (and optionally "
                              "'relative_action_dims')")
        try:
            mode, hidden, relative = read_meta(normalization)
        except (KeyError, ValueError) as e:
            raise ConfigError(str(e)) from None
        stats = _read_tensors(path / "norm_stats.safetensors")
        bad = sorted(k for k, v in stats.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
        if bad:
            raise ExportError(f"{path}/norm_stats.safetensors: {bad[0]} contains NaN or inf")
        norm = NormStats.from_tensors(stats, mode, hidden, relative)
    except (ConfigError, ValueError) as e:
        raise ExportError(f"{path}: {e}") from None
    check_consistency(cfg, spec, norm)
    return cfg, norm, spec, dtype


def _compute_dtype(stored: str, device: torch.device, dtype: str) -> torch.dtype:
    if dtype == "auto":
        # bf16 weights compute in bf16 on a GPU that has it; on a CPU they are upcast to fp32 (CPU bf16 matmuls are
        # slow on most CPUs, and the upcast changes no weight: bf16 -> fp32 is exact).
        gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if stored == "bf16" and gpu_bf16 else torch.float32
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(WEIGHT_DTYPES)}, got {dtype!r}")
    return WEIGHT_DTYPES[dtype]


def load_exported(path: str | Path, *, device: str | torch.device = "cpu",
                  dtype: Literal["auto", "fp32", "bf16"] = "auto", compile: CompileMode = "none") -> ExportedPolicy:
    """Load an exported policy folder onto ``device``. ``dtype`` is the compute dtype: ``auto`` runs bf16 weights
    in bf16 on a CUDA GPU and in fp32 on a CPU, fp32 weights in fp32 (bf16 keeps the RMSNorm scales in fp32,
    :func:`~vla_rl.policies.inference.cast_weights`). ``compile`` says how the denoising loop runs (``none``,
    ``compile``, ``cudagraph``: :class:`~vla_rl.policies.inference.Denoiser`)."""
    path, device = Path(path), torch.device(device)
    cfg, norm, spec, stored = read_export_config(path)
    compute = _compute_dtype(stored, device, dtype)
    state = _read_tensors(path / "model.safetensors")
    # Built on the meta device and filled with the stored tensors: no random init, and no second copy of the
    # weights in memory (a pi0-size model is ~3.3B parameters).
    with torch.device("meta"):
        model = make_policy(cfg)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{path}/model.safetensors does not match its config: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise ExportError(f"{path}/model.safetensors: {k} has shape {tuple(state[k].shape)}, the config needs "
                              f"{tuple(v.shape)}")
        if state[k].is_floating_point() and not torch.isfinite(state[k]).all():
            raise ExportError(f"{path}/model.safetensors: {k} contains NaN or inf")
    model.load_state_dict(state, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):   # a tensor the state dict does not hold
        model = make_policy(cfg)
        model.load_state_dict(state)
    model = cast_weights(model.to(device), "bf16" if compute == torch.bfloat16 else "fp32")
    if cfg.tokenizer in FILE_TOKENIZERS:
        try:
            model.set_tokenizer(FILE_TOKENIZERS[cfg.tokenizer].from_file(path / cfg.tokenizer_file))
        except (TokenizerError, ValueError) as e:
            raise ExportError(f"{path}: {e}") from None
    return ExportedPolicy(model, norm, spec, weight_dtype=stored, compile=compile)
