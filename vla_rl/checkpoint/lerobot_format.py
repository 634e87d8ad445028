"""What importing any LeRobot policy folder shares, whatever the architecture.

A LeRobot policy folder (``save_pretrained`` of a policy, LeRobot 0.4 - 0.6) holds ``config.json``,
``model.safetensors`` and the processor pipelines ``policy_preprocessor.json`` / ``policy_postprocessor.json`` with
their normaliser statistics (``*_normalizer_processor.safetensors``). An architecture's :class:`Family`
(:mod:`.lerobot_pi`: π0 / π0.5; :mod:`.lerobot_smolvla`: SmolVLA) says how its config and tensor names map onto
ours and where its tokenizer comes from; this module does the rest for all of them:

- reads the weights lazily, tensor by tensor (:class:`LazyWeights`), so a billions-parameter checkpoint never needs
  two copies in memory, and refuses anything unknown, missing, misshapen or non-finite with the names listed
  (:func:`convert_weights`),
- initialises the heads LeRobot checkpoints lack (Flow-Noise std: zero output layer, so the std starts at the
  geometric middle of its range; value: fresh hidden layer, zero output layer, so V = 0 at the start),
- turns the normaliser statistics (mean-std, min-max, quantiles, identity, per feature) into our
  :class:`~vla_rl.policies.normalize.NormStats` and refuses processor steps it does not reproduce,
- loads the policy in memory (:func:`load_with`) or writes one of our policy folders atomically
  (:func:`import_with`); :mod:`.lerobot` picks the family by ``config.json``'s ``type``.

Tokenizers are stored inside the policy folder as ``tokenizer.safetensors`` (bytes as a uint8 tensor; nothing is
unpickled).
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
from vla_rl.core.schema import to_dict
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import FlowVLA
from vla_rl.policies.tokenizer import TokenizerError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "keep": None}
POLICY_TOKENIZER = "tokenizer.safetensors"   # the tokenizer inside our policy folder (see policies/tokenizer.py)


class LeRobotImportError(CheckpointError):
    """A LeRobot folder cannot be imported: a file is missing or the checkpoint is not understood."""


@dataclass(frozen=True)
class Family:
    """How one architecture's LeRobot checkpoints map onto ours.

    ``infer_config(src, lr, shapes, overrides)``: our config from ``config.json`` (``lr``) and the tensors' shapes;
    ``weight_sources(cfg, shapes)``: for each of our tensors, the LeRobot tensor(s) it is made of (several are
    concatenated along dim 0); ``skipped(shapes)``: tensors of the file the model never reads (an unused language
    model head); ``canonical``: older tensor names onto current ones; ``find_tokenizer(src, lr, given)`` /
    ``load_tokenizer(path, cfg)`` / ``no_tokenizer(src)``: where the tokenizer is, how it is read, what to say when
    it is nowhere; ``notes(cfg)``: what an import did that the user should know."""

    label: str
    infer_config: Callable[[Path, dict, dict, dict | None], PolicyConfig]
    weight_sources: Callable[[PolicyConfig, dict], dict[str, tuple[str, ...]]]
    skipped: Callable[[dict], set[str]]
    find_tokenizer: Callable[[Path, dict, str | Path | None], Path | None]
    load_tokenizer: Callable[[Path, PolicyConfig], object]
    no_tokenizer: Callable[[Path], str]
    notes: Callable[[PolicyConfig], list[str]]
    canonical: Callable[[str], str] = lambda name: name


def hub_snapshots(repo: str) -> list[Path]:
    """The Hugging Face hub cache's snapshot folders of ``repo`` (``$HF_HUB_CACHE`` / ``$HF_HOME/hub`` /
    ``~/.cache/huggingface/hub``), oldest name first; none when it was never downloaded."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snaps = Path(hub) / ("models--" + repo.replace("/", "--")) / "snapshots"
    return sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []


def rl_heads_note(cfg: PolicyConfig) -> str:
    """The import note every LeRobot family shares: the RL heads are ours, initialised here."""
    return ("the Flow-Noise std head and the value head are not in LeRobot checkpoints: initialised here "
            f"(std at the middle of [{cfg.noise_std_min}, {cfg.noise_std_max}], value 0)")


def checked_tokenizer(load: Callable[[Path], object], path: Path, cfg: PolicyConfig):
    """``load(path)``, a tokenizer no larger than the checkpoint's vocabulary, or a LeRobotImportError saying why."""
    try:
        tok = load(path)
    except TokenizerError as e:
        raise LeRobotImportError(str(e)) from None
    if tok.vocab_size > cfg.vocab_size:
        raise LeRobotImportError(f"the tokenizer {path} has {tok.vocab_size} tokens, more than the checkpoint's "
                                 f"{cfg.vocab_size} token embeddings (not this checkpoint's tokenizer?)")
    return tok


def read_config(path: Path, types: tuple[str, ...]) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise LeRobotImportError(f"{path} has no config.json: not a LeRobot policy folder")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LeRobotImportError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("type") not in types:
        kind = cfg.get("type") if isinstance(cfg, dict) else None
        raise LeRobotImportError(f"{f}: policy type {kind!r} is not one this importer understands "
                                 f"({', '.join(types)})")
    return cfg


# ----------------------------------------------------------------------------------------------------
# Reading the weights lazily
# ----------------------------------------------------------------------------------------------------
class LazyWeights:
    """The tensors of a safetensors file by name (``canonical`` maps an older layout's names onto the current
    ones), read one at a time."""

    def __init__(self, path: Path, canonical: Callable[[str], str] = lambda name: name):
        if not path.is_file():
            raise LeRobotImportError(f"checkpoint file missing: {path}")
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            raw = list(self._file.keys())
            self.shapes = {}
            self._names = {}
            for k in raw:
                name = canonical(k)
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


def layer_count(shapes: dict, prefix: str) -> int:
    """Layers numbered ``prefix{i}.`` in ``shapes`` (they must be 0 .. n-1)."""
    found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if found != set(range(len(found))):
        raise LeRobotImportError(f"the layers under {prefix} are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def shape_of(shapes: dict, name: str, label: str) -> tuple[int, ...]:
    if name not in shapes:
        raise LeRobotImportError(f"the checkpoint has no {name}: not a {label} checkpoint")
    return shapes[name]


# ----------------------------------------------------------------------------------------------------
# Our tensors from theirs
# ----------------------------------------------------------------------------------------------------
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


def check_names(family: Family, cfg: PolicyConfig, weights: LazyWeights) -> dict[str, tuple[str, ...]]:
    """The name map for ``cfg``, after checking that ``weights`` holds exactly those tensors (and the ones the
    family skips), of the right shapes. Raises :class:`LeRobotImportError` listing what is unknown, missing or
    misshapen."""
    sources = family.weight_sources(cfg, weights.shapes)
    with torch.device("meta"):
        expected = make_policy(cfg).state_dict()
    if set(sources) - set(expected):   # a mapping bug, not the user's
        raise AssertionError(f"mapped names that the model does not have: {sorted(set(sources) - set(expected))}")
    used = {n for names in sources.values() for n in names}
    skipped = family.skipped(weights.shapes)
    missing = sorted(n for n in used if n not in weights)
    unknown = sorted(n for n in weights.shapes if n not in used and n not in skipped)
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
        raise LeRobotImportError(f"{weights.path} does not match a {family.label} checkpoint: "
                                 + "; ".join(problems))
    return sources


def convert_weights(family: Family, cfg: PolicyConfig, weights: LazyWeights,
                    dtype: torch.dtype | None = torch.float32, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors, one at a time (name, tensor in ``dtype``; None keeps the file's dtype), the new heads last.
    Non-finite values are refused."""
    sources = check_names(family, cfg, weights)
    head_dtype = dtype or torch.float32
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
                                 "smolvla_new_line_processor",
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
# Entry points (per family; vla_rl.checkpoint.lerobot picks the family)
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


def open_folder(family: Family, src: Path, lr: dict,
                overrides: dict | None) -> tuple[LazyWeights, PolicyConfig, NormStats, dict]:
    check_processor_steps(src, lr)
    weights = LazyWeights(src / "model.safetensors", family.canonical)
    cfg = family.infer_config(src, lr, weights.shapes, overrides)
    norm, modes = read_norm_stats(src, lr)
    return weights, cfg, norm, modes


@dataclass
class Opened:
    """A foreign checkpoint understood: its tensors (anything with ``path``, ``shapes``, ``in`` and ``get(name)``,
    named as ``family`` expects), our config for it, its normalisation, and what ``config.yaml``'s ``source``
    records. LeRobot folders (here), openpi and RLinf checkpoints (:mod:`.openpi`) open into one; building the
    model and writing the policy folder are then the same for all."""

    family: Family
    weights: object
    cfg: PolicyConfig
    norm: NormStats
    source: dict
    normalization: dict
    kind: str
    notes: list[str]
    extra: dict | None = None   # more config.yaml sections (an openpi LIBERO policy's env_config and deploy)


def trained_image_size(lr: dict) -> int | None:
    """The square camera resolution a LeRobot policy was trained on (``input_features``' VISUAL shapes, e.g. 256 for
    LeRobot's LIBERO datasets), or None when the cameras differ or are not square."""
    sizes = {tuple(f.get("shape") or ())[-2:] for k, f in (lr.get("input_features") or {}).items()
             if isinstance(f, dict) and f.get("type") == "VISUAL" and not k.split(".")[-1].startswith("empty_camera_")}
    if len(sizes) != 1:
        return None
    hw = next(iter(sizes))
    return int(hw[0]) if len(hw) == 2 and hw[0] == hw[1] and hw[0] > 0 else None


def lerobot_deploy(lr: dict, cfg: PolicyConfig) -> dict:
    """How LeRobot runs the policy, as defaults of our evaluation, bench and export (``config.yaml``'s ``deploy``):
    its denoising steps (π0 / π0.5 ``num_inference_steps``, SmolVLA ``num_steps``), the actions its
    ``select_action`` runs from each chunk before asking again (``n_action_steps``, when fewer than the chunk),
    and the frames it was trained on (an env renders this size and the policy resizes them itself: LeRobot's
    LIBERO checkpoints take 256 px frames into a 224 px encoder)."""
    deploy: dict = {}
    steps = lr.get("num_inference_steps", lr.get("num_steps"))
    if isinstance(steps, int) and steps > 0:
        deploy["sampler"] = {"num_steps": steps}
    execute = lr.get("n_action_steps")
    if isinstance(execute, int) and 0 < execute < cfg.action_horizon:
        deploy["execute"] = execute
    size = trained_image_size(lr)
    if size and size != cfg.vision.image_size:
        deploy["image_size"] = size
    return deploy


def open_lerobot(family: Family, src: Path, lr: dict, overrides: dict | None) -> Opened:
    weights, cfg, norm, modes = open_folder(family, src, lr, overrides)
    extra = {"deploy": deploy} if (deploy := lerobot_deploy(lr, cfg)) else None
    return Opened(family, weights, cfg, norm, {"lerobot": str(src.resolve()), "type": lr["type"],
                                               "normalization": modes},
                  modes, lr["type"], family.notes(cfg), extra)


def load_opened(opened: Opened, tok_path: Path | None, *, device="cpu",
                dtype: torch.dtype = torch.float32) -> tuple[FlowVLA, NormStats, dict]:
    """(model in eval mode, normalisation, a config dict like ``config.yaml``'s) of an opened checkpoint. The model
    is built on the meta device and takes the converted tensors as they are read, so memory holds one copy of the
    weights. Without a tokenizer (``tok_path`` None) the model still runs on given ``tokens``; instructions then
    raise a clear error."""
    family, cfg = opened.family, opened.cfg
    tok = family.load_tokenizer(tok_path, cfg) if tok_path else None
    with torch.device("meta"):
        model = make_policy(cfg)
    state = dict(convert_weights(family, cfg, opened.weights, dtype))
    model.load_state_dict(state, assign=True, strict=True)
    del state
    model.set_tokenizer(tok)
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(cfg), "normalization": opened.norm.meta(),
              "source": opened.source, **(opened.extra or {})}
    return model.to(device).eval(), opened.norm, config


def write_opened(opened: Opened, tok_path: Path, out: str | Path, *, dtype: str = "fp32",
                 progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Write an opened checkpoint as one of our policy folders at ``out`` (atomically): ``model.safetensors`` (in
    ``dtype``: fp32, bf16, or keep the file's), ``norm_stats.safetensors``, ``config.yaml`` and
    ``tokenizer.safetensors``. Tensors are converted one at a time; the output holds one copy."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    family, cfg = opened.family, opened.cfg
    tok = family.load_tokenizer(tok_path, cfg)
    tensors: dict[str, torch.Tensor] = {}
    total = len(family.weight_sources(cfg, opened.weights.shapes))
    for i, (name, t) in enumerate(convert_weights(family, cfg, opened.weights, DTYPES[dtype])):
        tensors[name] = t
        if progress is not None:
            progress(min(i + 1, total), total)
    config = {"format_version": FORMAT_VERSION, "policy": to_dict(cfg), "normalization": opened.norm.meta(),
              "source": {**opened.source, "dtype": dtype, "notes": opened.notes}, **(opened.extra or {})}
    out = Path(out)
    n_params = sum(t.numel() for t in tensors.values())
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        tensors.clear()
        save_file(opened.norm.to_tensors(), str(tmp / "norm_stats.safetensors"))
        with open(tmp / "config.yaml", "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        save_file(tok.to_tensors(), str(tmp / POLICY_TOKENIZER))
    return ImportReport(kind=opened.kind, config=cfg, parameters=n_params, tokenizer=str(tok_path),
                        normalization=opened.normalization, notes=opened.notes)


def load_with(family: Family, src: Path, lr: dict, *, tokenizer: str | Path | None = None,
              overrides: dict | None = None, device="cpu",
              dtype: torch.dtype = torch.float32) -> tuple[FlowVLA, NormStats, dict]:
    """The LeRobot folder ``src`` as (model in eval mode, normalisation, a config dict) (:func:`load_opened`)."""
    opened = open_lerobot(family, src, lr, overrides)
    return load_opened(opened, family.find_tokenizer(src, lr, tokenizer), device=device, dtype=dtype)


def import_with(family: Family, src: Path, lr: dict, out: str | Path, *, tokenizer: str | Path | None = None,
                overrides: dict | None = None, dtype: str = "fp32",
                progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Write the LeRobot folder ``src`` as one of our policy folders at ``out`` (:func:`write_opened`)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    opened = open_lerobot(family, src, lr, overrides)
    tok_path = family.find_tokenizer(src, lr, tokenizer)
    if tok_path is None:
        raise LeRobotImportError(family.no_tokenizer(src))
    return write_opened(opened, tok_path, out, dtype=dtype, progress=progress)
