"""``vla-rl eval CHECKPOINT --libero SUITES``: the official LIBERO protocol for a policy folder.

Every task of each suite (or ``task_ids``), its first ``init_states`` fixed initial states (50 is the
official protocol), the deterministic ODE sampler; writes ``results.json`` (overall, per-suite and
per-task success with episode counts, and every episode), ``results.md`` (the markdown table) and
``videos/`` into ``out``.

The checkpoint must fit LIBERO: state D = 8, action A = 7 (or a model padded wider, with no env dims
recorded), one camera (``agentview``) or two (``agentview``, ``wrist``), and the images are rendered at
the model's image size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from vla_rl.checkpoint import CheckpointError
from vla_rl.config import ConfigError, check_ranges, from_dict, nonneg, ranged, to_dict
from vla_rl.env_factory import EnvConfig
from vla_rl.envs.libero import ACTION_DIM, STATE_DIM, SUITE_MAX_STEPS, LiberoConfig, LiberoProtocolResult
from vla_rl.rl.actor import Actor, SamplerConfig

OFFICIAL_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
CAMERA_SETS = {1: ("agentview",), 2: ("agentview", "wrist")}   # model cameras -> LIBERO cameras
# Orientation of the images in openpi's LIBERO datasets (and of vla_rl.data.libero_demos recordings).
DATASET_ORIENTATION = "rot180"


@dataclass(frozen=True)
class LiberoEvalConfig:
    """``vla-rl eval CHECKPOINT --libero SUITES`` settings (overrides ``key=value``)."""

    suites: list[str] = field(default_factory=lambda: list(OFFICIAL_SUITES))
    task_ids: list[int] | None = None      # None: every task of each suite (official)
    init_states: int = ranged(50, 1)       # first N fixed init states per task (50: official)
    num_envs: int = ranged(1, 1)           # envs stepped in lock-step (one process, one after another)
    execute: int | None = ranged(None, 1)  # actions run per chunk; None: the whole chunk
    num_steps: int = ranged(4, 1)          # ODE denoising steps
    seed: int = nonneg(0)                  # seeds the sampler's initial noise
    device: str = "cpu"
    out: str = "runs/eval_libero"
    videos_per_task: int = nonneg(1)       # videos of the first N init states of each task; 0: none
    video_format: Literal["mp4", "gif"] = "mp4"
    progress: bool = True
    env: dict[str, Any] = field(default_factory=dict)  # LiberoConfig fields (image_orientation, ...)

    def __post_init__(self):
        check_ranges(self)
        if isinstance(self.suites, str):
            object.__setattr__(self, "suites", [s for s in self.suites.split(",") if s])
        bad = [s for s in self.suites if s not in SUITE_MAX_STEPS]
        if bad or not self.suites:
            raise ConfigError(f"unknown LIBERO suite(s) {bad or self.suites}; valid: {', '.join(SUITE_MAX_STEPS)}")
        if self.task_ids is not None and (not self.task_ids or min(self.task_ids) < 0):
            raise ConfigError(f"task_ids must be null or a non-empty list of ids >= 0, got {self.task_ids}")
        for key in ("suite", "task_ids", "init_state_ids"):
            if key in self.env:
                raise ConfigError(f"env.{key} is set by the protocol; use suites= / task_ids= / init_states=")


def libero_env_config(config: dict, model_cfg, cfg: LiberoEvalConfig, train_env: dict | None = None) -> LiberoConfig:
    """The LIBERO env config for a checkpoint: the ``env.libero`` settings of the LIBERO env it was trained on
    (``train_env``, else the checkpoint's ``env_config``), else the datasets' orientation ``rot180``;
    then ``cfg.env``; checked against the model's inputs. The protocol's own keys (suite, tasks, init
    states) and the step limit (official unless ``cfg.env`` sets one) are not taken over.

    Raises :class:`CheckpointError` when the checkpoint cannot act in LIBERO (state / action dims,
    number of cameras, image size).
    """
    env_meta = config.get("env") if isinstance(config.get("env"), dict) else {}
    name = env_meta.get("name") or env_meta.get("kind") or "unknown env"
    dims = env_meta.get("state_dim"), env_meta.get("action_dim")
    if dims != (None, None) and dims != (STATE_DIM, ACTION_DIM):
        raise CheckpointError(f"checkpoint was trained for state {dims[0]} / action {dims[1]} ({name}); LIBERO "
                              f"needs state {STATE_DIM} / action {ACTION_DIM}")
    if model_cfg.state_dim < STATE_DIM or model_cfg.action_dim < ACTION_DIM:
        raise CheckpointError(f"the model has state/action dims {model_cfg.state_dim}/{model_cfg.action_dim}; "
                              f"LIBERO needs at least {STATE_DIM}/{ACTION_DIM}")
    base: dict = {"image_orientation": DATASET_ORIENTATION}
    train_env = train_env or config.get("env_config")
    if isinstance(train_env, dict) and train_env.get("kind") == "libero":
        base = {k: v for k, v in (EnvConfig.upgrade(train_env).get("libero") or {}).items()
                if k not in ("suite", "task_ids", "init_state_ids", "max_episode_steps")}
    opts = {**base, **cfg.env}
    n_cams = model_cfg.num_cameras
    if "cameras" not in opts:
        if n_cams not in CAMERA_SETS:
            raise CheckpointError(f"the model takes {n_cams} camera(s); LIBERO has 1 (agentview) or 2 "
                                  "(agentview, wrist)")
        opts["cameras"] = list(CAMERA_SETS[n_cams])
    elif len(opts["cameras"]) != n_cams:
        raise CheckpointError(f"env.cameras={list(opts['cameras'])} gives {len(opts['cameras'])} camera(s), the "
                              f"model takes {n_cams}")
    size = model_cfg.vision.image_size
    if opts.setdefault("image_size", size) != size:
        raise CheckpointError(f"env.image_size={opts['image_size']}, but the model takes {size}px images")
    try:
        return from_dict(LiberoConfig, opts, prefix="env")
    except ValueError as e:   # LiberoConfig's own validation
        raise ConfigError(str(e)) from None


def summarize(result: LiberoProtocolResult) -> dict:
    """Overall, per-suite and per-task success with episode counts, and every episode."""
    per_task = []
    for (suite, task), rate in result.per_task().items():
        eps = [e for e in result.episodes if (e.suite, e.task_id) == (suite, task)]
        per_task.append({"suite": suite, "task_id": task, "instruction": result.instructions.get((suite, task), ""),
                         "success_rate": rate, "successes": sum(e.success for e in eps), "episodes": len(eps)})
    per_suite = {}
    for suite, rate in result.per_suite().items():
        eps = [e for e in result.episodes if e.suite == suite]
        per_suite[suite] = {"success_rate": rate, "successes": sum(e.success for e in eps), "episodes": len(eps),
                            "tasks": sum(t["suite"] == suite for t in per_task)}
    return {
        "success_rate": result.success_rate,   # mean over suites, as the papers average
        "successes": sum(e.success for e in result.episodes), "episodes": len(result.episodes),
        "per_suite": per_suite, "per_task": per_task,
        "episode_list": [{"suite": e.suite, "task_id": e.task_id, "init_state_id": e.init_state_id,
                          "success": e.success, "length": e.length,
                          "video": None if e.video is None else Path(e.video).name} for e in result.episodes],
        "seconds": result.seconds,
    }


def evaluate_libero_checkpoint(path: str | Path, cfg: LiberoEvalConfig, *, overwrite: bool = False) -> dict:
    """Run the LIBERO protocol for the policy folder ``path``; writes ``results.json``, ``results.md`` and
    ``videos/`` into ``cfg.out`` and returns the results (``summarize`` plus the settings and ``table``).
    A ``cfg.out`` that holds anything is refused before any work unless ``overwrite`` (then emptied when the
    evaluation starts)."""
    from vla_rl.checkpoint import load_policy, read_yaml_file
    from vla_rl.config import resolve_device
    from vla_rl.envs.libero import evaluate_libero_protocol
    from vla_rl.eval.evaluate import resolve_checkpoint
    from vla_rl.outputs import check_output, clear_output

    check_output(cfg.out, overwrite=overwrite, what="results folder")
    path = resolve_checkpoint(path)
    model, norm, config = load_policy(path, device=resolve_device(cfg.device))
    train_env = None
    if (path / "train_config.yaml").is_file():
        train_env = read_yaml_file(path / "train_config.yaml").get("env")
    env_cfg = libero_env_config(config, model.cfg, cfg, train_env)
    actor = Actor(model, norm, env_state_dim=STATE_DIM, env_action_dim=ACTION_DIM)
    sampler = SamplerConfig(cfg.num_steps, "ode")
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed)

    @torch.inference_mode()
    def act(obs: dict) -> torch.Tensor:
        return actor.act(obs, sampler, generator=gen).actions

    out = Path(cfg.out)
    videos = out / "videos"
    if overwrite:
        clear_output(out)   # an earlier evaluation's videos would mix with this one's
    out.mkdir(parents=True, exist_ok=True)
    result = evaluate_libero_protocol(
        act, suites=cfg.suites, task_ids=cfg.task_ids, num_init_states=cfg.init_states, num_envs=cfg.num_envs,
        execute=cfg.execute, config=env_cfg, video_dir=videos if cfg.videos_per_task else None,
        video_format=cfg.video_format, videos_per_task=cfg.videos_per_task, progress=cfg.progress)
    summary = {"checkpoint": str(path), "protocol": {**to_dict(replace(cfg, env={})), "env": to_dict(env_cfg)},
               **summarize(result)}
    table = result.table()
    summary["table"] = table
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    n_init = f"first {cfg.init_states} init states" + (" (official)" if cfg.init_states == 50 else "")
    head = (f"# LIBERO evaluation of `{path}`\n\n{', '.join(cfg.suites)}; "
            f"{'all tasks' if cfg.task_ids is None else f'tasks {cfg.task_ids}'}, {n_init}; "
            f"ODE sampler, {cfg.num_steps} steps, execute {cfg.execute or 'whole chunk'}; "
            f"{summary['episodes']} episodes in {result.seconds:.0f} s. Average success (mean over suites): "
            f"**{100 * summary['success_rate']:.1f} %**\n\n")
    (out / "results.md").write_text(head + table + "\n")
    return summary
