"""The one env factory: a typed config per simulator, chosen by ``kind``, and :func:`make_env`.

Training, SFT evaluation, ``vla-rl eval`` and the benchmarks all build their envs here, so none of them
imports another to get an env. The adapters' configs are imported from :mod:`vla_rl.envs` (they do not
import their simulators until an env is made).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch

from vla_rl.config import ConfigError, check_ranges, nonneg, positive, setting
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv, ColorReachSingleEnv
from vla_rl.envs.libero import LiberoConfig, LiberoSingleEnv
from vla_rl.envs.libero_warp import LiberoWarpConfig, LiberoWarpEnv
from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv, _base_name, make_maniskill_env
from vla_rl.envs.workers import WorkerVectorEnv

KINDS = ("builtin", "maniskill", "libero", "libero_warp")
BATCHED_KINDS = ("builtin", "libero_warp")   # one in-process batch on the policy's device: no worker processes


@dataclass(frozen=True)
class EnvConfig:
    """Which simulator (``kind``), how many envs, and that simulator's own settings. Only the section named
    by ``kind`` is read; setting another section is an error (it would silently do nothing)."""

    kind: Literal["builtin", "maniskill", "libero", "libero_warp"] = setting("builtin", doc="which simulator")
    num_envs: int = positive(64, doc="envs stepped together")
    envs_per_worker: int | None = positive(
        None, doc="Worker envs (ManiSkill on CPU, LIBERO): envs per worker process. None: one worker per CPU core.")
    restart_dead_workers: int = nonneg(
        0, doc="Restart a worker process that died (simulator crash, OOM kill) up to this many times per run; its "
               "envs are reset and their unfinished episodes dropped from the batch. 0: a dead worker stops the run.")
    builtin: ColorReachConfig = setting(default_factory=ColorReachConfig, doc="kind builtin: the ColorReach task")
    maniskill: ManiSkillConfig = setting(default_factory=ManiSkillConfig, doc="kind maniskill: the ManiSkill3 task")
    libero: LiberoConfig = setting(default_factory=LiberoConfig, doc="kind libero: the LIBERO suite and tasks")
    libero_warp: LiberoWarpConfig = setting(default_factory=LiberoWarpConfig,
                                            doc="kind libero_warp: LIBERO tasks batched on MuJoCo Warp")

    def __post_init__(self):
        check_ranges(self)
        if self.kind not in KINDS:
            raise ConfigError(f"kind: {self.kind!r} is not one of {list(KINDS)}")
        defaults = EnvConfig.__dataclass_fields__
        for other in KINDS:
            if other != self.kind and getattr(self, other) != defaults[other].default_factory():
                raise ConfigError(f"{other} is set but kind is {self.kind!r}: set kind={other} "
                                  f"or move those settings to the {self.kind} section")
        if self.kind in BATCHED_KINDS and self.envs_per_worker not in (None, 1):
            raise ConfigError(f"envs_per_worker is for worker envs (maniskill on CPU, libero); the {self.kind} "
                              "env runs in-process as one batch")

    @property
    def task(self) -> ColorReachConfig | ManiSkillConfig | LiberoConfig | LiberoWarpConfig:
        """The typed settings of the chosen simulator."""
        return getattr(self, self.kind)

    @staticmethod
    def upgrade(data: dict) -> dict:
        """Read an env section written before the per-simulator sections: ``options`` becomes the section of
        its ``kind`` (run folders and SFT policies written in that format keep loading)."""
        if isinstance(data, dict) and "options" in data:
            data = dict(data)
            options = data.pop("options") or {}
            kind = data.get("kind", "builtin")
            if options and kind != "builtin":
                data[kind] = {**options, **(data.get(kind) or {})}
        return data


def make_env(cfg: EnvConfig, *, num_envs: int, device: torch.device | str, seed: int, log=None):
    """Build ``num_envs`` envs of ``cfg`` on ``device`` (callers never import a simulator themselves).
    Worker envs restart up to ``cfg.restart_dead_workers`` dead workers, reporting each through ``log``."""
    device = torch.device(device)
    if cfg.kind == "builtin":
        return ColorReachEnv(num_envs, config=cfg.builtin, device=device, seed=seed)
    if cfg.kind == "maniskill":
        return make_maniskill_env(cfg.maniskill, num_envs, device=device, seed=seed,
                                  envs_per_worker=cfg.envs_per_worker, max_restarts=cfg.restart_dead_workers,
                                  log=log)
    if cfg.kind == "libero":
        return WorkerVectorEnv(functools.partial(LiberoSingleEnv, cfg.libero), num_envs, seed=seed,
                               name="libero", envs_per_worker=cfg.envs_per_worker,
                               max_restarts=cfg.restart_dead_workers, log=log)
    if cfg.kind == "libero_warp":
        return LiberoWarpEnv(cfg.libero_warp, num_envs, device=device, seed=seed)
    raise ConfigError(f"unknown env.kind {cfg.kind!r}")


def single_env_factory(cfg: EnvConfig, device: torch.device | str = "cpu") -> tuple[Callable[[], object], str]:
    """``(factory, name)``: a factory of one env of ``cfg`` behind the single-env protocol of
    :mod:`vla_rl.envs.env_group`, for env workers elsewhere (Ray env actors). The built-in task's single env
    seeds env ``i`` of a pool with ``seed + i``, so its episodes differ from the in-process batch's."""
    if cfg.kind == "builtin":
        return functools.partial(ColorReachSingleEnv, cfg.builtin), "builtin"
    if cfg.kind == "maniskill":
        backend = cfg.maniskill.sim_backend
        if backend == "gpu" or (backend == "auto" and torch.device(device).type == "cuda"):
            raise ConfigError("ManiSkill's GPU simulator runs all envs as one batch on the policy's device; it "
                              "cannot be split over env actors (use ray.env_actors=0, or maniskill.sim_backend=cpu)")
        return functools.partial(ManiSkillSingleEnv, cfg.maniskill), f"maniskill-{_base_name(cfg.maniskill.task)}"
    if cfg.kind == "libero":
        return functools.partial(LiberoSingleEnv, cfg.libero), "libero"
    if cfg.kind == "libero_warp":
        raise ConfigError("libero_warp runs all envs as one batch on the policy's device; it cannot be split over "
                          "env actors (use ray.env_actors=0)")
    raise ConfigError(f"unknown env.kind {cfg.kind!r}")


def env_identity(cfg: EnvConfig) -> dict:
    """What fixes an evaluation's episodes besides the seeds: the kind and the simulator's settings with every
    default filled in, without the process layout (``num_envs``, ``envs_per_worker``). The ``options`` key
    for ManiSkill / LIBERO is the format of evaluation files (``vla-rl compare`` reads older ones too)."""
    return {"kind": cfg.kind, "builtin" if cfg.kind == "builtin" else "options": asdict(cfg.task)}


def env_fields(cfg: EnvConfig) -> list[str]:
    """Names of the settings of ``cfg``'s simulator (for error messages and docs)."""
    return [f.name for f in fields(cfg.task)]
