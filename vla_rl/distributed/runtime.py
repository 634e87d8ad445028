"""Where a run's pieces execute: :class:`LocalRuntime` (everything in the trainer's process and its env worker
processes) or :class:`RayRuntime` (env actors and learner actors on a Ray cluster). The trainer asks its runtime
for remote envs and the learner and runs the same loop either way.

Placement (``ray.placement``):
- colocated: one placement group holding every env actor's and learner's bundle, STRICT_PACK by default,
  targeted at the trainer's node: the pieces share that machine (and its GPUs, with fractional
  ``learner_gpus``). For one GPU node; GPU simulators stay in the trainer process on the policy's device.
- disaggregated: the env actors' bundles in one group (SPREAD: over the CPU nodes), the learners' in another
  (PACK: few GPU nodes, so their all-reduce stays inside a node when it can).
The placement groups reserve everything at start (all or nothing), so a run never begins with half its actors.
"""

from __future__ import annotations

import os

import torch

from vla_rl.core.paths import checkout_root
from vla_rl.core.ranges import ConfigError
from vla_rl.distributed.learners import RayLearners
from vla_rl.distributed.ray_config import RayConfig
from vla_rl.envs.ray_workers import RayVectorEnv
from vla_rl.envs.registry import EnvConfig, single_env_factory


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the run (unreachable, or too few resources for the placement groups)."""


class LocalRuntime:
    """Everything in this process (and its env worker processes): a run without Ray. The trainer builds its
    envs with :func:`vla_rl.envs.registry.make_env` whenever ``remote_envs`` is False."""

    remote_envs = False

    def learner(self, local):
        return local

    def close(self) -> None:
        pass


def init_kwargs(cfg: RayConfig) -> dict:
    """The arguments of ``ray.init`` for ``cfg``."""
    kwargs: dict = {"address": cfg.address, "include_dashboard": False, "log_to_driver": True}
    if cfg.address is None:
        kwargs.update(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
    root = checkout_root()
    if root is not None:
        path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
    return kwargs


def connect(cfg: RayConfig) -> bool:
    """Connect to (or start) Ray as ``cfg`` says; True when this call did it (and :class:`RayRuntime` will
    shut it down), False when the process was already connected (a caller's ``ray.init``)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("runtime: ray needs Ray: pip install 'vla-rl[ray]'") from None
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # no usage reports from a training run
    if cfg.address is None:
        # Ray starts its workers 15 nice levels below the driver. A private instance's actors do the run's work,
        # as local worker processes would: on cores kept busy by other jobs they would otherwise get less CPU
        # than local workers get.
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(**init_kwargs(cfg))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot connect to Ray at {cfg.address or 'a new local instance'}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    return True


class RayRuntime:
    """Env actors and learners on Ray, placed as ``cfg.placement`` says; the trainer (rollout, evaluation,
    checkpoints) stays in this process."""

    def __init__(self, cfg: RayConfig, *, log=print):
        self.cfg, self.log = cfg, log
        self.started = connect(cfg)
        self.groups: dict[str, tuple[object, int]] = {}   # "env" / "learner" -> (placement group, first bundle)
        self._pgs: list = []
        try:
            self._place()
        except BaseException:
            self.close()
            raise

    @property
    def remote_envs(self) -> bool:
        return self.cfg.env_actors > 0

    # ------------------------------------------------------------------------------------------------
    def _bundles(self, kind: str) -> list[dict[str, float]]:
        cfg = self.cfg
        count, cpus, gpus = ((cfg.env_actors, cfg.env_actor_cpus, cfg.env_actor_gpus) if kind == "env"
                             else (cfg.learners, cfg.learner_cpus, cfg.learner_gpus))
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}
        return [dict(bundle) for _ in range(count)]

    def _place(self) -> None:
        import ray
        from ray.util import placement_group

        env, learner = self._bundles("env"), self._bundles("learner")
        if self.cfg.placement == "colocated":
            strategy = self.cfg.strategy_for("all")
            here = ray.get_runtime_context().get_node_id() if strategy == "STRICT_PACK" else None
            pg = placement_group(env + learner, strategy=strategy, _soft_target_node_id=here)
            self._pgs.append(pg)
            self.groups = {"env": (pg, 0), "learner": (pg, len(env))}
            self._wait(pg, env + learner, strategy)
        else:
            for kind, bundles in (("env", env), ("learner", learner)):
                if bundles:
                    strategy = self.cfg.strategy_for(kind)
                    pg = placement_group(bundles, strategy=strategy)
                    self._pgs.append(pg)
                    self.groups[kind] = (pg, 0)
                    self._wait(pg, bundles, strategy)

    def _wait(self, pg, bundles: list[dict], strategy: str) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(pg.ready(), timeout=self.cfg.timeout_s)
        except GetTimeoutError:
            total: dict[str, float] = {}
            for b in bundles:
                for k, v in b.items():
                    total[k] = total.get(k, 0.0) + v
            raise ClusterError(f"Ray could not place {len(bundles)} bundle(s) ({_resources(total)} in all, "
                               f"{strategy}) within {self.cfg.timeout_s:.0f} s; the cluster has "
                               f"{_resources(ray.cluster_resources())} (available now: "
                               f"{_resources(ray.available_resources())}). Lower ray.env_actors / ray.learners "
                               "or their resources, or add nodes") from None

    def options(self, kind: str, index: int) -> dict:
        """Ray actor options of env actor / learner ``index``: its resources and its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, first = self.groups[kind]
        cpus, gpus = ((self.cfg.env_actor_cpus, self.cfg.env_actor_gpus) if kind == "env"
                      else (self.cfg.learner_cpus, self.cfg.learner_gpus))
        return {"num_cpus": cpus, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + index)}

    # ------------------------------------------------------------------------------------------------
    def make_env(self, cfg: EnvConfig, *, num_envs: int, device: torch.device, seed: int, log=None):
        """``num_envs`` envs of ``cfg`` over the env actors (with ``env_actors`` > 0: ``remote_envs``)."""
        factory, name = single_env_factory(cfg, device)
        env = RayVectorEnv(factory, num_envs, num_actors=self.cfg.env_actors, seed=seed,
                           actor_options=lambda w: self.options("env", w), timeout=self.cfg.timeout_s,
                           name=name, max_restarts=cfg.restart_dead_workers, log=log)
        self.log(f"ray: {env.num_workers} env actor(s) with {num_envs} {name} envs on "
                 f"{len({node for node, _ in env.where()})} node(s) ({self.cfg.placement})")
        return env

    def learner(self, local):
        """Learner replicas of ``local`` on Ray, or (``learners`` 0) ``local`` itself."""
        if self.cfg.learners == 0:
            return local
        cfg = self.cfg
        threads = cfg.learner_threads or max(1, int(cfg.learner_cpus))
        learners = RayLearners(local, count=cfg.learners, options=lambda r: self.options("learner", r),
                               gpu=cfg.learner_gpus > 0, backend=cfg.dist_backend, threads=threads,
                               timeout_s=cfg.timeout_s, sharded=cfg.sharding == "fsdp")
        backend = f", {cfg.dist_backend}" if cfg.learners > 1 else ""
        backend += ", sharded (fsdp)" if cfg.sharding == "fsdp" else ""
        self.log(f"ray: {cfg.learners} learner(s) on {len({node for node, _ in learners.where()})} node(s)"
                 f"{backend} ({cfg.placement})")
        return learners

    def close(self) -> None:
        """Release the placement groups, and shut Ray down if this runtime started it."""
        try:
            import ray
            from ray.util import remove_placement_group
        except ImportError:
            return
        if ray.is_initialized():
            for pg in self._pgs:
                try:
                    remove_placement_group(pg)
                except Exception:
                    pass
            self._pgs = []
            if self.started:
                ray.shutdown()
                self.started = False


def _resources(res: dict) -> str:
    keys = [k for k in ("CPU", "GPU") if k in res] or sorted(k for k in res if not k.startswith("node:"))[:3]
    return ", ".join(f"{res[k]:g} {k}" for k in keys) or "nothing"


def make_runtime(runtime: str, cfg: RayConfig, *, log=print) -> LocalRuntime | RayRuntime:
    if runtime == "local":
        return LocalRuntime()
    if runtime == "ray":
        return RayRuntime(cfg, log=log)
    raise ConfigError(f"runtime: {runtime!r} is not one of ['local', 'ray']")
