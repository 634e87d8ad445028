"""Training checkpoints of a run folder: the policy plus what resuming needs (optimizer, RNG, iteration),
written atomically, checked before anything is restored, and found again on resume.

A run folder::

    config.yaml  metrics.jsonl  tensorboard/
    checkpoints/iter_000005/   model.safetensors  norm_stats.safetensors  config.yaml  (a policy folder)
                               train_config.yaml  optimizer.safetensors  rng.safetensors  trainer_state.yaml
    checkpoints/best/          the policy of the best evaluation so far + best.yaml

A training checkpoint is self-contained: the model is rebuilt from its own ``config.yaml`` and weights, so a
run resumes from any directory, after its ``init`` SFT folder was moved or deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from vla_rl.checkpoint.folders import (
    clean_stale_temp,
    read_tensors,
    read_yaml_file,
    verify_folder,
    write_atomic_folder,
)
from vla_rl.core.errors import CheckpointError

CHECKPOINT_PREFIX = "iter_"
_NAME = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")
TRAINING_FILES = ("model.safetensors", "norm_stats.safetensors", "config.yaml", "train_config.yaml",
                  "optimizer.safetensors", "rng.safetensors", "trainer_state.yaml")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, iteration: int) -> Path:
    return checkpoint_dir(run_dir) / f"{CHECKPOINT_PREFIX}{iteration:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's training checkpoints, oldest first (by iteration number, not by name)."""
    found = [(int(m.group(1)), p) for p in checkpoint_dir(run_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


# ----------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------
def training_files(optimizer: torch.optim.Optimizer, *, iteration: int, skipped_steps: int) -> tuple[dict, dict]:
    """The tensors and YAML files a training checkpoint adds to a policy folder."""
    opt = optimizer.state_dict()
    opt_tensors = {f"state.{pid}.{k}": v for pid, st in opt["state"].items() for k, v in st.items()
                   if torch.is_tensor(v)}
    groups = [dict(g) for g in opt["param_groups"]]
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    return ({"optimizer": opt_tensors, "rng": rng},
            {"trainer_state": {"iteration": iteration, "skipped_steps": skipped_steps, "param_groups": groups}})


def save_checkpoint(run_dir: str | Path, iteration: int, *, policy: tuple[dict, dict],
                    optimizer: torch.optim.Optimizer, skipped_steps: int, keep_last: int) -> Path:
    """Write ``checkpoints/iter_<iteration>`` (the ``policy`` folder's files plus the training state)
    atomically, then keep the ``keep_last`` newest checkpoints up to it. Non-finite tensors are refused
    before anything is written (:class:`~vla_rl.checkpoint.NonFiniteError`)."""
    tensors, yamls = dict(policy[0]), dict(policy[1])
    t_extra, y_extra = training_files(optimizer, iteration=iteration, skipped_steps=skipped_steps)
    tensors.update(t_extra)
    yamls.update(y_extra)
    path = write_atomic_folder(checkpoint_path(run_dir, iteration), tensors=tensors, yamls=yamls)
    prune(run_dir, path, keep_last)
    return path


def prune(run_dir: str | Path, newest: Path, keep_last: int) -> None:
    """Delete the checkpoints older than ``newest`` beyond the ``keep_last`` newest. Checkpoints after
    ``newest`` (left by a run that was resumed from an earlier one) are never touched here: a later save of
    the same iteration replaces them."""
    names = [p.name for p in list_checkpoints(run_dir)]
    upto = [checkpoint_dir(run_dir) / n for n in names[: names.index(newest.name) + 1]] if newest.name in names else []
    for old in upto[: max(0, len(upto) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# Check and load
# ----------------------------------------------------------------------------------------------------
def _trainer_state(path: Path) -> dict:
    state = read_yaml_file(path / "trainer_state.yaml")
    where = path / "trainer_state.yaml"
    it, skipped, groups = state.get("iteration"), state.get("skipped_steps", 0), state.get("param_groups")
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise CheckpointError(f"{where}: iteration must be an integer >= 0, got {it!r}")
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise CheckpointError(f"{where}: skipped_steps must be an integer >= 0, got {skipped!r}")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(g.get("lr"), (int, float))
            for g in groups):
        raise CheckpointError(f"{where}: param_groups must be a list of optimizer groups (params, lr, ...)")
    return state


def _optimizer_state(path: Path, device) -> dict[int, dict[str, torch.Tensor]]:
    """``optimizer.safetensors`` -> ``{param id: {name: tensor}}``; keys must read ``state.<id>.<name>``."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in read_tensors(path / "optimizer.safetensors", device=device).items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or not parts[2]:
            raise CheckpointError(f"{path}/optimizer.safetensors: unexpected key {key!r} "
                                  "(expected state.<param id>.<name>)")
        out.setdefault(int(parts[1]), {})[parts[2]] = value
    return out


def _rng_state(path: Path) -> dict[str, torch.Tensor]:
    rng = read_tensors(path / "rng.safetensors")
    want = torch.get_rng_state()
    got = rng.get("torch_cpu")
    if got is None or got.dtype != want.dtype or got.shape != want.shape:
        raise CheckpointError(f"{path}/rng.safetensors: torch_cpu must be a {want.dtype} tensor of shape "
                              f"{tuple(want.shape)}, got "
                              f"{'nothing' if got is None else f'{got.dtype} {tuple(got.shape)}'}")
    if "torch_cuda" in rng and rng["torch_cuda"].dtype != torch.uint8:
        raise CheckpointError(f"{path}/rng.safetensors: torch_cuda must be a uint8 tensor")
    return rng


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a whole training checkpoint: every file present and
    readable, the trainer state, optimizer keys and RNG state well formed. Checks what can be checked
    without the model (its fit is checked by :func:`load_training_state`)."""
    path = Path(path)
    verify_folder(path)
    missing = [f for f in TRAINING_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path} is not a whole training checkpoint: missing {', '.join(missing)}")
    _trainer_state(path)
    _optimizer_state(path, "cpu")
    _rng_state(path)


def load_training_state(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        device) -> dict:
    """Restore weights, optimizer state and the torch RNG from checkpoint ``path``; returns the trainer
    state (``iteration``, ``skipped_steps``). Everything is read and checked before anything is changed."""
    path = Path(path)
    state = _trainer_state(path)
    weights = read_tensors(path / "model.safetensors", device=device)
    if (path / "adapters.safetensors").is_file():   # LoRA adapters, kept apart from the base weights
        weights.update(read_tensors(path / "adapters.safetensors", device=device))
    own = model.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != v.shape for k, v in own.items()):
        raise CheckpointError(f"{path}/model.safetensors: the weights do not fit this run's policy")
    opt_state = _optimizer_state(path, device)
    groups = state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: optimizer has {len(groups)} parameter groups, expected "
                              f"{len(optimizer.param_groups)}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, entries in opt_state.items():
        if pid >= len(params):
            raise CheckpointError(f"{path}/optimizer.safetensors: state for parameter {pid}, the policy has "
                                  f"{len(params)}")
        for name, value in entries.items():
            if name in ("exp_avg", "exp_avg_sq") and value.shape != params[pid].shape:
                raise CheckpointError(f"{path}/optimizer.safetensors: state.{pid}.{name} has shape "
                                      f"{tuple(value.shape)}, its parameter {tuple(params[pid].shape)}")
    rng = _rng_state(path)
    model.load_state_dict(weights)
    try:
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: optimizer state does not fit: {e}") from None
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    return {"iteration": int(state["iteration"]), "skipped_steps": int(state.get("skipped_steps", 0))}


def resume_candidates(run_dir: str | Path, log=print) -> list[Path]:
    """The run's checkpoints to resume from, newest first, after tidying what an interrupted save left
    behind (:func:`~vla_rl.checkpoint.clean_stale_temp`). Raises if there are none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"no checkpoints to resume from: there is no run folder at {run_dir}")
    for note in clean_stale_temp(checkpoint_dir(run_dir)):
        log(f"{checkpoint_dir(run_dir)}: {note}")
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise CheckpointError(f"no checkpoints under {checkpoint_dir(run_dir)} to resume from")
    return ckpts[::-1]


def latest_checkpoint(run_dir: str | Path, log=print) -> Path:
    """The newest intact training checkpoint of ``run_dir`` (newer unreadable ones are reported via ``log``
    and passed over)."""
    problems = []
    for ckpt in resume_candidates(run_dir, log=log):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            problems.append(f"{ckpt.name}: {e}")
            log(f"checkpoint {ckpt} is unusable ({e}); trying the one before it")
            continue
        return ckpt
    raise CheckpointError(f"no intact checkpoint under {checkpoint_dir(run_dir)}: " + "; ".join(problems))
