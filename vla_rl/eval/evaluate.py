"""Policy evaluation on a batched env: each env's first episode counts, on fixed seeds."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from vla_rl.checkpoint.folders import read_yaml_file
from vla_rl.checkpoint.policy import foreign_kind, load_any_policy
from vla_rl.checkpoint.training import checkpoint_dir, latest_checkpoint
from vla_rl.core.outputs import EVAL_FILE, check_output
from vla_rl.core.progress import progress
from vla_rl.core.ranges import check_ranges, nonneg, ranged, setting
from vla_rl.core.schema import from_dict
from vla_rl.core.threads import policy_threads, threads_setting, torch_threads
from vla_rl.envs.base import EPISODE_METRICS
from vla_rl.envs.registry import EnvConfig, env_identity, make_env
from vla_rl.envs.video import VIEW_MIN_SECONDS, VIEW_MIN_SIZE, VideoRecorder, record_video
from vla_rl.envs.workers import local_worker_processes
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.inference import cast_weights
from vla_rl.presets import merge, resolve_device


@torch.inference_mode()
def first_episodes(actor: Actor, env, *, seed: int, count: int, sampler: SamplerConfig, execute: int | None,
                   group_size: int = 1, recorder=None, on_episodes=None) -> dict[str, torch.Tensor]:
    """One round: reset ``env`` with ``seed`` and step until envs ``0 .. count - 1`` have each ended an episode.

    Env ``i``'s episode is named by its seed ``seed + i // group_size`` (``group_size`` > 1: groups of envs share
    an initial state): every env kind resets env ``i`` with that seed, and the sampler noise of its chunk ``t``
    is drawn from (that seed, ``t``, and its place in its group) alone (:meth:`Actor.draw_keyed`), so an
    episode plays the same whatever ``num_envs``, the worker count or which round it falls in.

    Returns each of those envs' *first* episode's metrics (:data:`EPISODE_METRICS`), ``[count]`` tensors
    indexed by env; episodes that start after an env's first one ends are ignored. ``recorder`` (a
    :class:`~vla_rl.envs.video.VideoRecorder`, ``first_episode_only``) gets every observation of the round;
    ``on_episodes(k)`` is called after each chunk in which ``k`` > 0 of those first episodes ended."""
    n = env.num_envs
    obs = env.reset(seed=seed) if group_size == 1 else env.reset(seed=seed, group_size=group_size)
    if recorder is not None:
        recorder.add(obs)
    rows = torch.arange(n)
    keys: list = [seed + rows // group_size]
    out_metrics = {k: torch.zeros(count, dtype=torch.float64) for k in EPISODE_METRICS}
    pending = rows < count
    t = 0
    while pending.any():
        draws = actor.draw_keyed([*keys, t] + ([rows % group_size] if group_size > 1 else []), sampler)
        chunk = actor.chunk(obs, sampler, draws=draws)
        t += 1
        out = env.step(chunk[:, :execute] if execute else chunk)
        obs = out.obs
        if recorder is not None:
            recorder.add(out)
        if out.episodes:
            ended = 0
            for j, i in enumerate(out.episodes["env_index"].tolist()):
                if pending[i]:
                    pending[i] = False
                    ended += 1
                    for k in out_metrics:
                        out_metrics[k][i] = float(out.episodes[k][j])
            if ended and on_episodes is not None:
                on_episodes(ended)
    return out_metrics


@torch.inference_mode()
def evaluate_episodes(actor: Actor, env, *, num_episodes: int, sampler: SamplerConfig | None = None,
                      execute: int | None = None, seed: int = 1000, videos: int = 0, video_fps: int = 10,
                      progress=None) -> list[dict[str, Any]]:
    """Each of ``num_episodes`` episodes' metrics, with its name: ``episode_seed`` (``seed``, ``seed + 1``, ...),
    which fixes its initial state and its sampler noise on every env kind (:func:`first_episodes`), so the
    same seeds give the same episodes whatever ``env.num_envs`` and two policies' records pair by it
    (:mod:`vla_rl.eval.paired`). Also recorded: ``reset_seed`` (its round's reset seed) and ``env_index``.
    The model computes a batch at once, so actions agree across batch sizes to float rounding (~1e-7), not bit
    for bit; an outcome can differ only where an episode ends within that of a success boundary.

    ``videos`` > 0: the first ``videos`` episodes (envs ``0 .. videos - 1`` of the first round) are recorded,
    one frame per chunk, and their records carry ``frames`` (uint8 ``[H, W, 3]`` list; write them with
    :func:`~vla_rl.envs.video.record_video`). ``progress(done, total)`` is called whenever episodes end (a
    round's envs end their episodes at different chunks), with the number of episodes done so far.

    Round ``r`` of ``env.num_envs`` episodes resets with seed ``seed + r * num_envs``, and env ``i`` of it
    plays episode seed ``seed + r * num_envs + i``; ``execute`` actions of each chunk are run (default: the
    whole chunk)."""
    sampler = sampler or SamplerConfig()
    n = env.num_envs
    records: list[dict[str, Any]] = []
    done = [0]

    def ended(k: int) -> None:
        done[0] += k
        if progress is not None:
            progress(done[0], num_episodes)

    for r in range(math.ceil(num_episodes / n)):
        round_seed, count = seed + r * n, min(n, num_episodes - r * n)
        recorder = None
        if r == 0 and videos > 0:
            recorder = VideoRecorder(env, range(min(videos, count)), fps=video_fps, first_episode_only=True)
        ep = first_episodes(actor, env, seed=round_seed, count=count, sampler=sampler, execute=execute,
                            recorder=recorder, on_episodes=ended)
        for i in range(count):
            rec: dict[str, Any] = {"reset_seed": round_seed, "env_index": i, "episode_seed": round_seed + i,
                                   **{k: float(ep[k][i]) for k in EPISODE_METRICS}}
            if recorder is not None and i in recorder.frames:
                rec["frames"] = recorder.frames[i]
            records.append(rec)
    return records


def summarize(records: list[dict], prefix: str = "eval") -> dict[str, float]:
    """Means of :data:`EPISODE_METRICS` over ``records`` and their count, as ``{prefix}/{metric}``."""
    if not records:
        raise ValueError("no episodes to summarize")
    metrics = {f"{prefix}/{k}": sum(r[k] for r in records) / len(records) for k in EPISODE_METRICS}
    metrics[f"{prefix}/episodes"] = float(len(records))
    return metrics


@torch.inference_mode()
def evaluate(actor: Actor, env, *, num_episodes: int, sampler: SamplerConfig | None = None,
             execute: int | None = None, seed: int = 1000, prefix: str = "eval",
             progress: bool = False, desc: str = "eval") -> dict[str, float]:
    """Success rate and returns over ``num_episodes`` episodes (:func:`evaluate_episodes`, averaged);
    ``progress``: show the episodes done (:func:`vla_rl.core.progress.progress`, named ``desc``).

    Counting only each env's first episode (rather than whatever ends first) keeps short, successful
    episodes from being over-represented."""
    with episode_progress(num_episodes, enabled=progress, desc=desc) as report:
        records = evaluate_episodes(actor, env, num_episodes=num_episodes, sampler=sampler, execute=execute,
                                    seed=seed, progress=report)
    return summarize(records, prefix)


@contextlib.contextmanager
def episode_progress(total: int, *, enabled: bool, desc: str = "eval"):
    """A ``progress(done, total)`` callback for :func:`evaluate_episodes` that moves a progress indicator
    (:func:`vla_rl.core.progress.progress`: a bar on a terminal, a line every few seconds in a log)."""
    with progress(total=total, desc=desc, unit="episodes", enabled=enabled) as bar:
        yield lambda done, _total: bar.update(done - bar.n)


@dataclass(frozen=True)
class EvalConfig:
    """``vla-rl eval`` settings; the env comes from the checkpoint unless ``env`` overrides fields."""

    MOVED = {k: f"sampler.{k}" for k in ("num_steps", "method", "noise_level", "sde_mode")}

    episodes: int = ranged(100, 1, doc="episodes to evaluate (each env's first episode counts)")
    seed: int = nonneg(10_000, doc="reset seed of the first round (round r: seed + r x num_envs)")
    sampler: SamplerConfig = setting(
        default_factory=SamplerConfig,
        doc="how chunks are drawn: the deterministic ODE sampler by default, or the stochastic policy RL trained "
            "(method=sde or noise), which an RL update can improve before its ODE counterpart (docs/notes.md)")
    execute: int = ranged(8, 1, doc="actions executed of each chunk")
    num_envs: int = ranged(100, 1, doc="envs stepped together (at most episodes)")
    device: str = setting("cpu", doc="cpu, cuda or cuda:<index>")
    dtype: Literal["fp32", "bf16"] = setting("fp32", doc="the policy's weights (docs/speed.md)")
    compile: Literal["none", "compile", "cudagraph"] = setting(
        "none", doc="how the ODE sampler's loop runs; a mode that cannot run here falls back to the eager loop with "
                    "a warning (docs/speed.md)")
    env: dict[str, Any] = setting(default_factory=dict, doc="fields of the checkpoint's env config to override")
    out: str | None = setting(
        None, doc="a JSON file for the per-episode results (seeds, env index, success, return, length) and the "
                  "summary; `vla-rl compare` pairs two such files episode by episode")
    videos: int = nonneg(0, doc="videos of the first `videos` episodes (one frame per chunk; camera images, or a "
                               "rendering for state-only envs), named by episode seed and outcome")
    video_dir: str | None = setting(None, doc="where videos go (default: beside out, else runs/eval_videos)")
    video_format: Literal["mp4", "gif"] = "mp4"
    progress: bool = setting(True, doc="show the episodes done")
    threads: int | Literal["auto"] = threads_setting()

    def __post_init__(self):
        check_ranges(self)


def open_checkpoint(path: str | Path, *, env_config, num_envs: int, device: torch.device,
                    seed: int, dtype: str = "fp32", compile: str = "none") -> tuple[Actor, Any]:
    """A policy or training checkpoint folder's policy as an :class:`Actor` on ``device`` (weights in ``dtype``,
    the denoising loop run as ``compile`` says), and ``num_envs`` of the env ``env_config`` (an
    :class:`~vla_rl.envs.registry.EnvConfig`, usually :func:`checkpoint_env_config` of the same folder)."""
    model, norm, _ = load_any_policy(Path(path))
    env = make_env(env_config, num_envs=num_envs, device=device, seed=seed)
    try:
        actor = Actor.for_env(cast_weights(model.to(device), dtype), norm, env.spec, compile=compile)
    except BaseException:   # e.g. a policy made for another env's state size: no worker left behind
        env.close()
        raise
    return actor, env


def checkpoint_env_config(path: str | Path, env_overrides: dict):
    """The env a checkpoint folder was made for: a training checkpoint's ``train_config.yaml``, else the one
    an SFT policy was trained for (its saved config), with ``env_overrides`` on top."""
    path = Path(path)
    if (path / "train_config.yaml").is_file():
        env_dict = read_yaml_file(path / "train_config.yaml").get("env", {})
    elif foreign_kind(path) is not None:   # another framework's checkpoint names no env of ours: overrides say
        env_dict = {}
    else:
        env_dict = dict(read_yaml_file(path / "config.yaml").get("env_config") or {})
    return from_dict(EnvConfig, merge(env_dict, env_overrides), prefix="env")


def resolve_checkpoint(path: str | Path, log=print) -> Path:
    """``path`` itself if it is a policy or training checkpoint folder; for a training run folder, its newest
    intact checkpoint (said through ``log``)."""
    path = Path(path)
    if path.is_dir() and not (path / "model.safetensors").is_file() and checkpoint_dir(path).is_dir():
        ckpt = latest_checkpoint(path, log=log)
        log(f"{path} is a run folder: evaluating its newest checkpoint {ckpt}")
        return ckpt
    return path


def evaluate_checkpoint(path: str | Path, overrides: dict | None = None, *, overwrite: bool = False,
                        log=print) -> dict[str, float]:
    """Evaluate a policy or training checkpoint folder, or a run folder's newest checkpoint (the ODE sampler
    unless ``sampler.method`` says otherwise); with ``out`` set, also write the per-episode results there
    (:func:`write_episode_file`; an existing file is refused before any work unless ``overwrite``)."""
    cfg = from_dict(EvalConfig, dict(overrides or {}))
    if cfg.out:
        check_output(cfg.out, overwrite=overwrite, kind=EVAL_FILE, inputs={"checkpoint": path})

    path = resolve_checkpoint(path, log=log)
    num_envs = min(cfg.num_envs, cfg.episodes)
    env_cfg = checkpoint_env_config(path, cfg.env)
    actor, env = open_checkpoint(path, env_config=env_cfg, num_envs=num_envs, device=resolve_device(cfg.device),
                                 seed=cfg.seed, dtype=cfg.dtype, compile=cfg.compile)

    try:
        threads = policy_threads(cfg.threads, worker_processes=local_worker_processes([env]))
        with torch_threads(threads), episode_progress(cfg.episodes, enabled=cfg.progress) as report:
            records = evaluate_episodes(actor, env, num_episodes=cfg.episodes, sampler=cfg.sampler,
                                        execute=cfg.execute, seed=cfg.seed, videos=cfg.videos, progress=report)
    finally:
        env.close()
    if cfg.videos:
        video_dir = Path(cfg.video_dir or (Path(cfg.out).with_suffix("") if cfg.out else "runs/eval_videos"))
        for r in records:
            frames = r.pop("frames", None)
            if frames:
                tag = "success" if r["success_once"] else "failure"
                r["video"] = str(record_video(frames, video_dir / f"ep{r['episode_seed']}_{tag}.{cfg.video_format}",
                                              fps=4, min_size=VIEW_MIN_SIZE, min_seconds=VIEW_MIN_SECONDS))
    metrics = summarize(records)
    if cfg.out:
        write_episode_file(cfg.out, checkpoint=str(path), config=asdict(cfg) | {"num_envs": num_envs},
                           env=env_identity(env_cfg), summary=metrics, records=records)
    return metrics


# /2: episodes are named by their seed (initial state and sampler noise); /1 files paired by (round seed, env index)
EPISODE_FILE_FORMAT = "vla-rl-eval-episodes/2"


def write_episode_file(out: str | Path, *, checkpoint: str, config: dict, env: dict, summary: dict,
                       records: list[dict]) -> Path:
    """Write an evaluation's per-episode records as JSON, atomically (a temporary file, then a rename): an
    earlier file at ``out`` stays whole until the new one is complete."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": EPISODE_FILE_FORMAT, "checkpoint": checkpoint, "config": config, "env": env,
           "summary": summary, "episodes": records}
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)   # gone after the rename; after a failure, no stray half-file is left
    return out
