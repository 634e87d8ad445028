"""``vla-rl export``: a policy folder, training run or checkpoint -> a self-contained folder for a robot.

The exported folder (format in :mod:`vla_rl.policies.exported`) loads with the policy package alone. Its
robot interface (:class:`~vla_rl.policies.exported.ExportSpec`) is filled in from what the source recorded:
the env the policy was trained for (state / action names and units, control mode, cameras, action bounds,
where this module knows them), the chunk length, how many actions the run executed per chunk, and the K of
its ODE sampler; any field can be overridden (``key=value``).

Weights are converted tensor by tensor while reading (``safe_open``), so exporting a pi0-size checkpoint holds
one converted copy in memory, not two.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vla_rl.checkpoint.folders import FORMAT_VERSION, atomic_folder, read_tensors, read_yaml_file
from vla_rl.checkpoint.policy import adapter_scaling, load_policy
from vla_rl.checkpoint.training import list_checkpoints
from vla_rl.core.errors import CheckpointError
from vla_rl.core.outputs import EXPORT, check_output
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.envs.registry import BUILTIN, ENV_KINDS, EnvConfig
from vla_rl.policies import lora
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.exported import (
    EXPORT_FORMAT,
    WEIGHT_DTYPES,
    ExportError,
    ExportSpec,
    check_consistency,
)
from vla_rl.policies.normalize import NormStats, read_meta
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.presets import merge

DEFAULT_NUM_STEPS = 10   # π0's K, for a source that does not record its own


def open_source(src: str | Path, out: str | Path, *, overwrite: bool):
    """``(folder, out, model, norm, config)`` of an export in another framework's layout: the policy folder
    :func:`resolve_source` finds, loaded, after checking the output (an earlier export there is replaced only with
    ``overwrite``)."""
    folder = resolve_source(src)
    out = Path(out)
    check_output(out, overwrite=overwrite, kind=EXPORT, inputs={"source": src, "source checkpoint": folder},
                 elsewhere="another OUT folder")
    model, norm, config = load_policy(folder)
    return folder, out, model, norm, config


def resolve_source(src: str | Path) -> Path:
    """The policy folder to export: ``src`` itself if it is one (an SFT policy, a training checkpoint, a run's
    ``checkpoints/best``, an imported checkpoint), else a training run's best checkpoint, else its newest."""
    path = Path(src)
    if (path / "config.yaml").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "checkpoints").is_dir():
        best = path / "checkpoints" / "best"
        if (best / "config.yaml").is_file():
            return best
        # Export needs the policy files only (a resume point also needs the optimizer and RNG state).
        policies = [c for c in list_checkpoints(path) if (c / "config.yaml").is_file()
                    and (c / "model.safetensors").is_file()]
        if policies:
            return policies[-1]
        raise CheckpointError(f"{path / 'checkpoints'} holds no policy checkpoint to export")
    raise CheckpointError(f"{path} is neither a policy folder (config.yaml + model.safetensors) nor a training run "
                          "(a checkpoints/ folder)")


# ----------------------------------------------------------------------------------------------------
# What the envs' observations and actions mean: each env kind describes its own (envs/registry.py)
# ----------------------------------------------------------------------------------------------------
def _generic_cameras(count: int, size: int, names: tuple[str, ...] = ()) -> list[dict]:
    """Cameras ``camera_<i>``, or named after the policy's camera slots (an imported LeRobot checkpoint's image
    features: ``observation.images.base_0_rgb`` is read as ``base_0_rgb`` or by its full name)."""
    if names:
        return [{"name": n.rsplit(".", 1)[-1], "height": size, "width": size,
                 "aliases": ([n] if "." in n else []) + (["image"] if i == 0 else [])} for i, n in enumerate(names)]
    return [{"name": f"camera_{i}", "height": size, "width": size, "aliases": ["image"] if i == 0 else []}
            for i in range(count)]


def describe_env(env: dict, *, state_dim: int, action_dim: int, num_cameras: int, image_size: int,
                 camera_names: tuple[str, ...] = ()) -> dict:
    """ExportSpec fields known from the env config ``env`` (``{"kind": ..., <kind>: {...}}``; {} if unknown): what
    the env kind says of its robot (:attr:`~vla_rl.envs.registry.EnvKind.describe`), its settings as the source."""
    kind = env.get("kind") if isinstance(env, dict) else None
    if kind not in ENV_KINDS:
        return {"control_mode": "unknown", "action_low": None, "action_high": None,
                "cameras": _generic_cameras(num_cameras, image_size, camera_names),
                "notes": "The source did not record its robot: actions are not clipped; set names, units and bounds "
                         "with key=value overrides at export."}
    task = from_dict(EnvConfig, env, prefix="env").task
    out = ENV_KINDS[kind].describe(task, state_dim=state_dim, action_dim=action_dim)
    out.setdefault("cameras", _generic_cameras(num_cameras, image_size))
    return {**out, "source": {"env": {"kind": kind, **to_dict(task)}}}


def _section(doc: dict, key: str) -> dict:
    return doc[key] if isinstance(doc.get(key), dict) else {}


def spec_defaults(folder: Path, cfg: PolicyConfig, norm: NormStats, config: dict, out: Path | None = None) -> dict:
    """ExportSpec fields from a policy folder: its statistics (the robot's state / action sizes), config.yaml
    (``config``: the env and sampler an SFT policy was evaluated with, ``sft``; or ``demo`` for ``vla-rl demo``'s)
    and, for a training checkpoint, its ``train_config.yaml``. ``source.unknown`` lists what none of them
    recorded; ``source.checkpoint`` is the source's path relative to the export folder ``out``."""
    train = read_yaml_file(folder / "train_config.yaml") if (folder / "train_config.yaml").is_file() else {}
    # deploy: how an imported policy's framework ran it (openpi: replan steps, denoising steps)
    sft, demo = _section(config, "sft") or _section(config, "deploy"), _section(config, "demo")
    env = _section(train, "env") or config.get("env_config") or \
        ({"kind": BUILTIN, BUILTIN: _section(demo, "env")} if demo else {})
    sampler = _section(train, "sampler")
    state_dim, action_dim = norm.state.mean.shape[0], norm.action.mean.shape[0]
    execute = train.get("execute", sft.get("execute", demo.get("execute", cfg.action_horizon)))
    num_steps = next((k for k in (sampler.get("num_steps"), _num_steps(sft), _num_steps(demo)) if k is not None), None)
    unknown = [] if num_steps is not None else ["num_steps"]
    out_fields = {"state_dim": state_dim, "action_dim": action_dim, "action_horizon": cfg.action_horizon,
                  "execute": min(int(execute), cfg.action_horizon),
                  "num_steps": int(num_steps if num_steps is not None else DEFAULT_NUM_STEPS)}
    described = describe_env(env, state_dim=state_dim, action_dim=action_dim, num_cameras=cfg.num_cameras,
                             image_size=cfg.vision.image_size, camera_names=cfg.camera_names)
    if described["control_mode"] == "unknown":
        unknown = ["control_mode", "action_low", "action_high", "action_names", "cameras", *unknown]
    where = os.path.relpath(folder.resolve(), out.resolve()) if out is not None else folder.name
    source = {"checkpoint": where, **described.pop("source", {}), "unknown": unknown}
    if (folder / "best.yaml").is_file():
        source["best"] = read_yaml_file(folder / "best.yaml")
    if (folder / "trainer_state.yaml").is_file():
        source["iteration"] = read_yaml_file(folder / "trainer_state.yaml").get("iteration")
    return {**out_fields, **described, "source": source}


def _num_steps(job: dict) -> int | None:
    """The K an SFT or demo config recorded: ``sampler.num_steps``, or ``num_steps`` in folders written before the
    sampler section."""
    return _section(job, "sampler").get("num_steps", job.get("num_steps"))


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------
def convert_tensor(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A weight as stored in an export of ``dtype``: floating tensors in that dtype, others unchanged."""
    return t.to(WEIGHT_DTYPES[dtype]) if t.is_floating_point() else t


def tokenizer_files(folder: Path, policy: dict) -> list[str]:
    """Files of ``folder`` the tokenizer needs: ``tokenizer*`` files, and any file a policy config string names
    (relative, inside ``folder``)."""
    names = {p.name for p in folder.iterdir() if p.is_file() and p.name.startswith("tokenizer")}

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, str) and v and not Path(v).is_absolute():
            p = (folder / v).resolve()
            if p.is_file() and folder.resolve() in p.parents:
                names.add(str(p.relative_to(folder.resolve())))

    walk(policy)
    return sorted(names)


def _read_weights(path: Path, cfg: PolicyConfig, dtype: str,
                  adapters: tuple[dict[str, torch.Tensor], float] | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights converted to ``dtype``; LoRA ``adapters`` (tensors, scaling) are folded into the
    weights they adapt first, in float32."""
    lora_tensors, scaling = adapters or ({}, 1.0)
    adapted = {k.rsplit(".", 1)[0] + ".weight" for k in lora_tensors}
    with torch.device("meta"):
        expected = make_policy(cfg).state_dict()
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected))
            if missing or unexpected:
                raise CheckpointError(f"{path} does not match its config: missing {missing[:5]}, "
                                      f"unexpected {unexpected[:5]}")
            out = {}
            for k in sorted(keys):
                t = f.get_tensor(k)
                if t.shape != expected[k].shape:
                    raise CheckpointError(f"{path}: {k} has shape {tuple(t.shape)}, the config needs "
                                          f"{tuple(expected[k].shape)}")
                if k in adapted:
                    layer = k[: -len(".weight")]
                    pair = {n: lora_tensors[n] for n in (f"{layer}.lora_A", f"{layer}.lora_B") if n in lora_tensors}
                    try:
                        t = lora.merge_state({k: t.float()}, pair, scaling)[k]
                    except ValueError as e:
                        raise CheckpointError(f"{path.parent}/adapters.safetensors: {e}") from None
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise CheckpointError(f"{path}: {k} contains NaN or inf; not exporting it")
                out[k] = convert_tensor(t, dtype).contiguous()
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None


def export_policy(src: str | Path, out: str | Path, *, dtype: str = "bf16", overrides: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Export the policy of ``src`` (see :func:`resolve_source`) to folder ``out``, written atomically. An ``out``
    that holds anything is refused before any work unless ``overwrite`` (an earlier export, or files of no known
    kind: replaced only once the new folder is complete); another kind of data (a run, a dataset ...) and an
    ``out`` inside the source are refused whatever (:mod:`vla_rl.core.outputs`). ``overrides``: ExportSpec fields."""
    if dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"dtype must be one of {list(WEIGHT_DTYPES)}, got {dtype!r}")
    folder = resolve_source(src)
    out = Path(out)
    check_output(out, overwrite=overwrite, kind=EXPORT, inputs={"source": src, "source checkpoint": folder},
                 elsewhere="another OUT folder")
    config = read_yaml_file(folder / "config.yaml")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: unsupported checkpoint format_version {config.get('format_version')!r}")
    try:
        cfg = from_dict(PolicyConfig, config.get("policy", {}), prefix="policy")
        normalization = config["normalization"]
        mode, hidden, relative = read_meta(normalization)
        norm = NormStats.from_tensors(read_tensors(folder / "norm_stats.safetensors"), mode, hidden, relative)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}/config.yaml: {e}") from None
    try:
        defaults = spec_defaults(folder, cfg, norm, config, out)
        defaults["source"]["unknown"] = [k for k in defaults["source"]["unknown"] if k not in (overrides or {})]
        spec = from_dict(ExportSpec, merge(defaults, overrides or {}), prefix="spec")
        check_consistency(cfg, spec, norm)
    except (ConfigError, ExportError) as e:
        raise ConfigError(str(e)) from None
    adapters = None
    if config.get("lora") is not None:   # a LoRA run's checkpoint: the adapters are merged into the export
        adapters = (read_tensors(folder / "adapters.safetensors"), adapter_scaling(folder, config))
    weights = _read_weights(folder / "model.safetensors", cfg, dtype, adapters)
    policy = to_dict(cfg)
    files = tokenizer_files(folder, config.get("policy", {}))
    with atomic_folder(out) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": EXPORT_FORMAT, "dtype": dtype})
        save_file(norm.to_tensors(), str(tmp / "norm_stats.safetensors"))
        (tmp / "config.json").write_text(json.dumps(
            {"format": EXPORT_FORMAT, "dtype": dtype, "policy": policy,
             "normalization": norm.meta()}, indent=1))
        (tmp / "spec.json").write_text(json.dumps(to_dict(spec), indent=1))
        for name in files:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / name, tmp / name)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        (tmp / "README.md").write_text(readme(spec, cfg, dtype=dtype, nbytes=nbytes, files=files))
    return out


def _table(names: tuple[str, ...], units: tuple[str, ...], dim: int) -> str:
    rows = [f"| {i} | {names[i] if names else '?'} | {units[i] if units else '?'} |" for i in range(dim)]
    return "\n".join(["| index | name | unit |", "| --- | --- | --- |", *rows])


def readme(spec: ExportSpec, cfg: PolicyConfig, *, dtype: str, nbytes: int, files: list[str]) -> str:
    """The exported folder's README.md: what the policy takes and returns, and how to run it."""
    cams = "\n".join(f"- `{c.name}`: {c.height}x{c.width} RGB, uint8 HWC (also read from "
                     f"{', '.join(f'`{k}`' for k in c.keys[1:])})" for c in spec.cameras) or "- none (state only)"
    bounds = ("not clipped" if spec.action_low is None and spec.action_high is None
              else f"clipped to [{spec.action_low}, {spec.action_high}]")
    params = sum(math.prod(v.shape) for v in _meta_state(cfg).values())
    example = "{" + "".join(f'"{c.name}": rgb_{i}, ' for i, c in enumerate(spec.cameras)) + \
        '"state": state, "prompt": "pick up the cube"}'

    return f"""# Exported vla-rl policy

A flow-matching VLA policy ({params / 1e6:.1f}M parameters, weights stored as {dtype}, {nbytes / 2**20:.1f} MiB).
Control mode: `{spec.control_mode}`.

## Run it
```python
from vla_rl.policies import load_exported
policy = load_exported("path/to/this/folder")            # device="cuda" for a GPU
actions = policy.infer({example})   # [{spec.action_horizon}, {spec.action_dim}]
```
or serve it to a robot over openpi's websocket protocol: `vla-rl serve path/to/this/folder --port 8000`.

## Observation
- `state` (or `observation/state`): {spec.state_dim} numbers in the robot's units
- `prompt` (or `instruction`): the task in words{f' (default: "{spec.instruction}")' if spec.instruction else ''}
{cams}

Images of another size are resized to {cfg.vision.image_size}x{cfg.vision.image_size}.

{_table(spec.state_names, spec.state_units, spec.state_dim)}

## Action chunk
`infer` returns {spec.action_horizon} actions of {spec.action_dim} values (a chunk, H = {spec.action_horizon}), in the
robot's units, {bounds}. Execute the first {spec.execute}, then ask again with a fresh observation.
Sampler: deterministic ODE, K = {spec.num_steps} steps.

{_table(spec.action_names, spec.action_units, spec.action_dim)}
{f'{chr(10)}Notes: {spec.notes}{chr(10)}' if spec.notes else ''}
Files: model.safetensors, norm_stats.safetensors, config.json (model), spec.json (this interface){
''.join(f', {f}' for f in files)}.
"""


def _meta_state(cfg: PolicyConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return make_policy(cfg).state_dict()


def export_nbytes(cfg: PolicyConfig, dtype: str) -> int:
    """Bytes of the weights an export of ``cfg`` in ``dtype`` stores (computed on the meta device: no memory)."""
    return sum(t.numel() * convert_tensor(t, dtype).element_size() for t in _meta_state(cfg).values())


def summary(path: str | Path) -> dict[str, Any]:
    """A few facts about an exported folder (for the CLI's message)."""
    path = Path(path)
    spec = json.loads((path / "spec.json").read_text())
    return {"path": str(path), "bytes": (path / "model.safetensors").stat().st_size,
            **{k: spec[k] for k in ("state_dim", "action_dim", "action_horizon", "execute", "num_steps",
                                    "control_mode")},
            "cameras": [c["name"] for c in spec["cameras"]], "unknown": spec.get("source", {}).get("unknown", [])}


def unknown_note(unknown: list[str]) -> str:
    """One line on what an export's source did not record (``source.unknown`` of its spec) and what was assumed."""
    parts = []
    if "control_mode" in unknown:
        parts.append("its robot (control mode, action bounds and names, cameras): actions are not clipped and "
                     "cameras get generic names")
    if "num_steps" in unknown:
        parts.append(f"the sampler it was evaluated with: K={DEFAULT_NUM_STEPS} (π0's) is used")
    rest = [k for k in unknown if k not in ("control_mode", "action_low", "action_high", "action_names", "cameras",
                                            "num_steps")]
    parts += [f"{k}" for k in rest]
    return (f"the source does not record {'; nor '.join(parts)}. Set them with key=value overrides "
            "(docs/deploy.md)")
