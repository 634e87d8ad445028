"""The Ray section of a training config (``runtime: ray``): where the cluster is, how many env actors and
learners, their resources, and how they are placed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, positive, ranged, setting

STRATEGIES = ("auto", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """Read only when ``runtime: ray``. The trainer process (the run's only loop) samples the rollouts itself,
    on ``device``: start it on the node whose GPU the policy should use."""

    address: str | None = setting(
        None, doc='None: start a private Ray instance on this machine for the run. "auto": join the cluster this '
                  'machine belongs to (`ray start` ran here). "HOST:PORT": the cluster whose head listens there.')
    num_cpus: int | None = positive(
        None, doc="A private instance only: the CPUs / GPUs it may hand out (None: the machine's).")
    num_gpus: int | None = nonneg(None)
    placement: Literal["colocated", "disaggregated"] = setting(
        "colocated", doc="\"colocated\": env actors and learners share the trainer's node (and its GPUs, with "
                         'fractional learner_gpus); "disaggregated": env actors spread over CPU nodes, learners '
                         "packed on GPU nodes.")
    env_actors: int = nonneg(
        0, doc="Env actors run blocks of single envs (ManiSkill's CPU simulator, LIBERO, the built-in task's single "
               "env), `env.num_envs` split evenly over them. 0: the envs stay in the trainer process, as in a local "
               "run (the batched built-in task, ManiSkill's GPU simulator on the policy's device; worker envs in "
               "local processes).")
    env_actor_cpus: float = positive(1.0)
    env_actor_gpus: float = nonneg(0.0)
    learners: int = nonneg(
        1, doc="Data-parallel learners (torch.distributed: gloo on CPU, NCCL on GPU); each trains on its share of "
               "every minibatch. 0: the update runs in the trainer process, as in a local run.")
    learner_cpus: float = positive(1.0)
    learner_gpus: float = nonneg(0.0)
    sharding: Literal["none", "fsdp"] = setting(
        "none", doc="\"fsdp\": the learners shard every trained tensor (weights, gradients, Adam's moments) among "
                    "themselves (FSDP2, vla_rl/distributed/fsdp.py) instead of each holding a replica; the same "
                    "steps, 1/learners of the memory. Checkpoints stay whole (gathered), so they load anywhere.")
    learner_threads: int | None = positive(
        None, doc="torch threads of a learner; None: its CPUs rounded down (at least 1)")
    strategy: Literal["auto", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = setting(
        "auto", doc="Placement group strategy of every group; auto: STRICT_PACK colocated, and disaggregated SPREAD "
                    "for the env actors' group and PACK for the learners'.")
    backend: Literal["auto", "gloo", "nccl"] = setting(
        "auto", doc="auto: nccl when every learner holds whole GPUs, else gloo (NCCL refuses two ranks on one GPU, "
                    "which fractional learner_gpus allow; gloo all-reduces CUDA tensors through the host).")
    timeout_s: float = ranged(
        600.0, 1, doc="Longest wait for the placement groups and actors to start, an env actor's reply, and a "
                      "learner's update.")

    def __post_init__(self):
        check_ranges(self)
        if self.placement not in ("colocated", "disaggregated"):
            raise ConfigError(f"placement: {self.placement!r} is not one of ['colocated', 'disaggregated']")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: {self.strategy!r} is not one of {list(STRATEGIES)}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend: {self.backend!r} is not one of ['auto', 'gloo', 'nccl']")
        if self.backend == "nccl" and self.learners and self.learner_gpus == 0:
            raise ConfigError("backend: nccl needs GPU learners (set learner_gpus > 0) or use gloo")
        if self.backend == "nccl" and self.learners > 1 and self.learner_gpus < 1:
            raise ConfigError(f"backend: nccl with learner_gpus = {self.learner_gpus:g}: learners sharing a GPU "
                              "cannot form an NCCL group (give each learner_gpus >= 1, or use gloo)")
        if self.address is not None and (self.num_cpus is not None or self.num_gpus is not None):
            raise ConfigError("num_cpus / num_gpus size a private Ray instance (address: null); a cluster "
                              f"({self.address!r}) has the resources its nodes were started with")
        if self.sharding not in ("none", "fsdp"):
            raise ConfigError(f"sharding: {self.sharding!r} is not one of ['none', 'fsdp']")
        if self.sharding == "fsdp" and self.learners < 2:
            raise ConfigError(f"sharding: fsdp splits the learners' tensors among several learners; learners = "
                              f"{self.learners} (set ray.learners >= 2)")
        if self.env_actors == 0 and self.learners == 0:
            raise ConfigError("env_actors and learners are both 0: nothing would run on Ray (use runtime: local)")

    @property
    def dist_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.learner_gpus >= 1 else "gloo"

    def strategy_for(self, group: Literal["env", "learner", "all"]) -> str:
        """The placement group strategy of ``group`` ("all": the one group of colocated placement)."""
        if self.strategy != "auto":
            return self.strategy
        if self.placement == "colocated":
            return "STRICT_PACK"
        return "SPREAD" if group == "env" else "PACK"
