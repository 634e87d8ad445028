"""The env kinds: one registry (kind -> settings, factory, single env, description, what the rest of the framework
asks of a kind), the typed :class:`EnvConfig` that picks one, and :func:`make_env`.

Training, SFT evaluation, ``vla-rl eval``, export and the benchmarks all build their envs and ask about a kind
here, so no kind's name stands as a string anywhere else. Adding a simulator: its adapter module, one
:class:`EnvKind` entry below, and its section in :class:`EnvConfig`. The adapters' settings are imported here; they
import their simulators only when an env is made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch

from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, positive, setting
from vla_rl.core.schema import check_one_section
from vla_rl.envs import builtin, maniskill
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv, ColorReachSingleEnv
from vla_rl.envs.libero import robosuite_env
from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv
from vla_rl.envs.libero.warp_env import LiberoWarpConfig, LiberoWarpEnv
from vla_rl.envs.maniskill import ManiSkillConfig, ManiSkillSingleEnv, make_maniskill_env
from vla_rl.envs.workers import WorkerVectorEnv

# The kinds' names, for code that must name one (a dataset's provenance, a bench of LIBERO suites).
BUILTIN, MANISKILL, LIBERO, LIBERO_WARP = "builtin", "maniskill", "libero", "libero_warp"


@dataclass(frozen=True)
class EnvKind:
    """One simulator behind the env interface, and what the framework asks of it.

    ``make(settings, env_config, num_envs, device, seed, log)``: ``num_envs`` batched envs.
    ``single(settings, device)``: ``(factory, name)`` of one env behind the single-env protocol of
    :mod:`vla_rl.envs.env_group`, for env workers elsewhere (Ray env actors); raises :class:`ConfigError` where the
    kind cannot be split. ``describe(settings, state_dim=, action_dim=)``: what its state, actions and cameras mean
    (an exported policy's spec fields)."""

    name: str
    settings: type                # the kind's typed settings: the EnvConfig section of the same name
    description: str
    make: Callable[..., Any]
    single: Callable[..., tuple[Callable[[], object], str]]
    describe: Callable[..., dict]
    batched: bool = False         # one in-process batch on the policy's device: no worker processes
    family: str = ""              # kinds of one family share robot, controller and observations (policies move)
    task_key: str | None = None   # the setting that names the task (a dataset's episode limit is its task's)
    # Settings that change what the cameras show -> the value a recording made before the key existed had
    # (None: always recorded); a policy trained on images of other settings is warned about.
    image_keys: dict[str, Any] = field(default_factory=dict)
    sft_eval: bool = False        # SFT on a dataset of this kind evaluates the policy on it afterwards by default
    eval_envs: int = 2            # envs an SFT evaluation runs (a batched kind: at most this many, one per episode)
    label: Callable[[dict], str] | None = None   # a policy folder's env name from the kind's settings (as a dict)
    # The task's own episode step limit (LIBERO: its suite's official one), for saying when a run's cap is shorter
    official_steps: Callable[[Any], int | None] | None = None


def _make_builtin(s, cfg, num_envs, device, seed, log):
    return ColorReachEnv(num_envs, config=s, device=device, seed=seed)


def _make_maniskill(s, cfg, num_envs, device, seed, log):
    return make_maniskill_env(s, num_envs, device=device, seed=seed, envs_per_worker=cfg.envs_per_worker,
                              max_restarts=cfg.restart_dead_workers, log=log)


def _make_libero(s, cfg, num_envs, device, seed, log):
    return WorkerVectorEnv(functools.partial(LiberoSingleEnv, s), num_envs, seed=seed, name=LIBERO,
                           envs_per_worker=cfg.envs_per_worker, max_restarts=cfg.restart_dead_workers, log=log)


def _make_libero_warp(s, cfg, num_envs, device, seed, log):
    return LiberoWarpEnv(s, num_envs, device=device, seed=seed)


def _single_maniskill(s, device):
    if s.sim_backend == "gpu" or (s.sim_backend == "auto" and torch.device(device).type == "cuda"):
        raise ConfigError("ManiSkill's GPU simulator runs all envs as one batch on the policy's device; it "
                          "cannot be split over env actors (use ray.env_actors=0, or maniskill.sim_backend=cpu)")
    return functools.partial(ManiSkillSingleEnv, s), f"{MANISKILL}-{maniskill.task_base_name(s.task)}"


def _single_libero_warp(s, device):
    raise ConfigError(f"{LIBERO_WARP} runs all envs as one batch on the policy's device; it cannot be split over "
                      "env actors (use ray.env_actors=0)")


LIBERO_IMAGE_KEYS = {"image_orientation": None, "reflections": True}
ENV_KINDS: dict[str, EnvKind] = {k.name: k for k in (
    EnvKind(BUILTIN, ColorReachConfig, "the built-in ColorReach task: a point reaches the target colour, batched "
            "in torch on the policy's device", _make_builtin,
            lambda s, device: (functools.partial(ColorReachSingleEnv, s), BUILTIN), builtin.describe_robot,
            batched=True, sft_eval=True, eval_envs=100, label=lambda s: f"{BUILTIN}/color_reach"),
    EnvKind(MANISKILL, ManiSkillConfig, "a ManiSkill3 task: CPU simulator in worker processes, or the GPU "
            "simulator batched on the policy's device", _make_maniskill, _single_maniskill, maniskill.describe_robot,
            task_key="task", sft_eval=True, label=lambda s: f"{MANISKILL}/{s.get('task')}"),
    EnvKind(LIBERO, LiberoConfig, "LIBERO suites on robosuite / MuJoCo, in worker processes", _make_libero,
            lambda s, device: (functools.partial(LiberoSingleEnv, s), LIBERO), robosuite_env.describe_robot,
            family=LIBERO, image_keys=LIBERO_IMAGE_KEYS,
            official_steps=lambda s: robosuite_env.SUITE_MAX_STEPS.get(s.suite)),
    EnvKind(LIBERO_WARP, LiberoWarpConfig, "LIBERO tasks batched on MuJoCo Warp on the policy's device",
            _make_libero_warp, _single_libero_warp, robosuite_env.describe_robot, batched=True, family=LIBERO,
            image_keys=LIBERO_IMAGE_KEYS, official_steps=lambda s: robosuite_env.SUITE_MAX_STEPS.get(s.suite)),
)}
KINDS = tuple(ENV_KINDS)


@dataclass(frozen=True)
class EnvConfig:
    """Which simulator (``kind``), how many envs, and that simulator's own settings. Only the section named
    by ``kind`` is read; setting another section is an error (it would silently do nothing)."""

    kind: Literal["builtin", "maniskill", "libero", "libero_warp"] = setting(BUILTIN, doc="which simulator")
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
        check_one_section(self, self.kind, KINDS, "kind")
        if self.info.batched and self.envs_per_worker not in (None, 1):
            raise ConfigError(f"envs_per_worker is for worker envs (maniskill on CPU, libero); the {self.kind} "
                              "env runs in-process as one batch")

    @property
    def info(self) -> EnvKind:
        """The registry's entry of the chosen kind."""
        return ENV_KINDS[self.kind]

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
            kind = data.get("kind", BUILTIN)
            if options and kind != BUILTIN:
                data[kind] = {**options, **(data.get(kind) or {})}
        return data


def same_family(a: str | None, b: str | None) -> bool:
    """Whether env kinds ``a`` and ``b`` (either may be None or unknown) show a policy the same robot and
    observations: the same kind, or two kinds of one family."""
    if a not in ENV_KINDS or b not in ENV_KINDS:
        return False
    return a == b or (ENV_KINDS[a].family != "" and ENV_KINDS[a].family == ENV_KINDS[b].family)


def make_env(cfg: EnvConfig, *, num_envs: int, device: torch.device | str, seed: int, log=None):
    """Build ``num_envs`` envs of ``cfg`` on ``device`` (callers never import a simulator themselves).
    Worker envs restart up to ``cfg.restart_dead_workers`` dead workers, reporting each through ``log``."""
    return cfg.info.make(cfg.task, cfg, num_envs, torch.device(device), seed, log)


def single_env_factory(cfg: EnvConfig, device: torch.device | str = "cpu") -> tuple[Callable[[], object], str]:
    """``(factory, name)``: a factory of one env of ``cfg`` behind the single-env protocol of
    :mod:`vla_rl.envs.env_group`, for env workers elsewhere (Ray env actors). The built-in task's single env
    seeds env ``i`` of a pool with ``seed + i``, so its episodes differ from the in-process batch's."""
    return cfg.info.single(cfg.task, device)


def env_identity(cfg: EnvConfig) -> dict:
    """What fixes an evaluation's episodes besides the seeds: the kind and the simulator's settings with every
    default filled in, without the process layout (``num_envs``, ``envs_per_worker``). The ``options`` key
    for ManiSkill / LIBERO is the format of evaluation files (``vla-rl compare`` reads older ones too)."""
    return {"kind": cfg.kind, BUILTIN if cfg.kind == BUILTIN else "options": asdict(cfg.task)}


def official_episode_steps(cfg: EnvConfig) -> int | None:
    """The task's own episode step limit (LIBERO: its suite's official one), or None where the kind has none."""
    return cfg.info.official_steps(cfg.task) if cfg.info.official_steps is not None else None


def env_fields(cfg: EnvConfig) -> list[str]:
    """Names of the settings of ``cfg``'s simulator (for error messages and docs)."""
    return [f.name for f in fields(cfg.task)]
