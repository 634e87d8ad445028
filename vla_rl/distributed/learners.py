"""Learners as Ray actors, training data-parallel with torch.distributed (gloo on CPU, NCCL on GPU).

:class:`RayLearners` stands where the trainer's :class:`~vla_rl.rl.learner.Learner` stands (``update``,
``optimizer``, ``skipped_steps``, ``applied_steps``). It starts ``count`` replicas of the trainer's learner
(same weights, optimizer state and settings); each update sends them the rollout once (Ray's object store: one
copy per node), every replica trains on its share of each minibatch and sums gradients with the others
(:mod:`vla_rl.distributed.gradsync`), so all replicas take the same steps; then learner 0's weights are copied
into the trainer's model, which samples the next rollout (weight sync learner -> rollout after every update).

A learner that dies or fails mid-update leaves the replicas out of step: every learner is stopped and
:class:`LearnerError` raised; the trainer ends the run with the newest checkpoint intact for ``--resume``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta

import torch
from torch import Tensor

from vla_rl.distributed.fsdp import full_optimizer_state, full_weights, metrics_sync, shard_learner
from vla_rl.distributed.gradsync import sum_over_learners
from vla_rl.policies.actor import Actor
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.lora import apply_lora
from vla_rl.policies.normalize import NormStats
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.rl.algorithms.seam import Algorithm
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import Rollout


class LearnerError(RuntimeError):
    """A learner actor failed, died or did not answer; the learners were stopped and the run cannot go on."""


@dataclass
class LearnerSpec:
    """Everything a learner replica is built from (CPU tensors only, so it can travel to any node)."""

    policy: PolicyConfig
    weights: dict[str, Tensor]
    norm: dict[str, Tensor]
    norm_mode: str
    hidden_state: tuple[int, ...]
    relative_actions: tuple[int, ...]
    env_state_dim: int
    env_action_dim: int
    action_low: float
    action_high: float
    learner: LearnerConfig
    algorithm: Algorithm
    bf16: bool
    total_iterations: int | None
    optimizer: dict
    skipped_steps: int

    @staticmethod
    def of(learner: Learner) -> LearnerSpec:
        actor, model = learner.actor, learner.actor.model
        return LearnerSpec(
            policy=model.cfg, weights={k: v.detach().cpu() for k, v in model.state_dict().items()},
            norm={k: v.cpu() for k, v in actor.norm.to_tensors().items()}, norm_mode=actor.norm.mode,
            hidden_state=tuple(actor.norm.hidden_state), relative_actions=tuple(actor.norm.relative_actions),
            env_state_dim=actor.env_state_dim,
            env_action_dim=actor.env_action_dim, action_low=actor.action_low, action_high=actor.action_high,
            learner=learner.cfg, algorithm=learner.algorithm, bf16=learner.bf16,
            total_iterations=learner.total_iterations,
            optimizer=to_cpu(learner.optimizer.state_dict()), skipped_steps=learner.skipped_steps)


def to_cpu(tree):
    """``tree`` (dicts, lists, tuples) with every tensor moved to the CPU."""
    if isinstance(tree, Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def rollout_to(ro: Rollout, device: torch.device | str) -> Rollout:
    """The rollout with its tensors on ``device`` (the episode lists stay as they are)."""
    move = lambda x: x.to(device) if isinstance(x, Tensor) else x  # noqa: E731
    return replace(ro, **{f.name: ({k: move(v) for k, v in getattr(ro, f.name).items()}
                                   if f.name in ("obs", "extras") else move(getattr(ro, f.name)))
                          for f in fields(ro) if f.name != "episodes"})


def trainable_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The parameters an update can change (frozen ones never do), on the CPU."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def load_weights(model: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise LearnerError(f"the learner sent weights the model does not have: {unknown[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


class LearnerWorker:
    """One learner replica (the body of a Ray actor): rank ``rank`` of ``world``."""

    def __init__(self, rank: int, world: int, spec: LearnerSpec, *, device: str, threads: int,
                 sharded: bool = False):
        torch.set_num_threads(threads)
        self.rank, self.world, self.sharded = rank, world, sharded
        self.device = torch.device(device)
        model = make_policy(spec.policy)
        apply_lora(model, spec.learner.lora)   # the trainer's learner sends its adapters with the weights
        model.load_state_dict(spec.weights)
        # a sharded learner's whole model stays on the CPU: sharding moves each learner's shards to its device
        model = model.to("cpu" if sharded else self.device).eval()
        norm = NormStats.from_tensors(spec.norm, spec.norm_mode, spec.hidden_state, spec.relative_actions)
        actor = Actor(model, norm, env_state_dim=spec.env_state_dim, env_action_dim=spec.env_action_dim,
                      action_low=spec.action_low, action_high=spec.action_high)
        sync = None
        if world > 1:
            import torch.distributed as dist

            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
            reduce = lambda t, op: dist.all_reduce(t, op=ops[op])  # noqa: E731
            sync = lambda params, metrics: sum_over_learners(params, metrics, reduce)  # noqa: E731
            if sharded:   # FSDP sums the gradients itself; only the metrics are combined
                sync = metrics_sync(reduce, self.device)
        self.learner = Learner(actor, spec.learner, spec.algorithm, bf16=spec.bf16,
                               total_iterations=spec.total_iterations,
                               shard=(rank, world), sync=sync)
        self.learner.optimizer.load_state_dict(spec.optimizer)
        self.learner.skipped_steps = spec.skipped_steps

    def address(self) -> tuple[str, int]:
        """A free TCP port on this node, for the process group's rendezvous (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            shard_learner(self.learner, init_device_mesh(self.device.type, (self.world,)))

    def update(self, rollout: Rollout, iteration: int, send_weights: bool) -> tuple:
        ro = rollout_to(rollout, self.device)
        metrics = self.learner.update(ro, iteration=iteration)
        if self.sharded:   # gathering the shards is a collective: every learner takes part
            weights = full_weights(self.learner.actor.model, trainable_only=True)
            weights = weights if send_weights else None
        else:
            weights = trainable_weights(self.learner.actor.model) if send_weights else None
        return metrics, self.learner.skipped_steps, self.learner.applied_steps, weights

    def optimizer_state(self) -> dict:
        if self.sharded:   # a collective: every learner is asked (RayLearners.optimizer)
            return full_optimizer_state(self.learner.optimizer)
        return to_cpu(self.learner.optimizer.state_dict())

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RayLearners:
    """``count`` learner replicas of ``local`` (the trainer's learner, whose model samples the rollouts) as Ray
    actors; ``options(rank)`` gives each actor's Ray options (resources, placement group bundle)."""

    def __init__(self, local: Learner, *, count: int, options: Callable[[int], dict], gpu: bool, backend: str,
                 threads: int, timeout_s: float, sharded: bool = False):
        import ray

        self.local, self.timeout_s, self.sharded = local, timeout_s, sharded
        self.skipped_steps, self.applied_steps = local.skipped_steps, 0
        spec = ray.put(LearnerSpec.of(local))
        cls = ray.remote(max_restarts=0)(LearnerWorker)
        self.actors = [cls.options(**options(r)).remote(r, count, spec, device="cuda" if gpu else "cpu",
                                                        threads=threads, sharded=sharded) for r in range(count)]
        try:
            if count > 1:
                host, port = self._gather([self.actors[0].address.remote()], "start")[0]
                self._gather([a.join.remote(host, port, backend, timeout_s) for a in self.actors], "start")
            else:
                self._gather([self.actors[0].where.remote()], "start")
        except BaseException:
            self.close()
            raise

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The trainer's optimizer, refreshed from learner 0 (what a checkpoint saves)."""
        actors = self._live() if self.sharded else self._live()[:1]
        state = self._gather([a.optimizer_state.remote() for a in actors], "reading the optimizer")[0]
        self.local.optimizer.load_state_dict(state)
        return self.local.optimizer

    def update(self, ro: Rollout, *, iteration: int) -> dict[str, float]:
        import ray

        actors = self._live()
        ref = ray.put(rollout_to(ro, "cpu"))
        replies = self._gather([a.update.remote(ref, iteration, r == 0) for r, a in enumerate(actors)],
                               f"the update of iteration {iteration + 1}")   # numbered as the metrics are
        metrics, self.skipped_steps, self.applied_steps, weights = replies[0]
        load_weights(self.local.actor.model, weights)
        return metrics

    def where(self) -> list[tuple[str, int]]:
        """(Ray node id, process id) of each learner."""
        return self._gather([a.where.remote() for a in self._live()], "a query")

    def _live(self) -> list:
        if not self.actors:
            raise LearnerError("the learners were stopped (an earlier failure, or close())")
        return self.actors

    def _gather(self, refs: list, doing: str) -> list:
        """Every reply, in order; the first failure (an exception, a dead actor, no reply within ``timeout_s``)
        stops all learners (the others may wait on it in a collective) and raises :class:`LearnerError`."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: i for i, ref in enumerate(refs)}
        out: dict[int, object] = {}
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise LearnerError(f"learner(s) {sorted(index[r] for r in pending)} did not answer within "
                                   f"{self.timeout_s:.0f} s during {doing} (ray.timeout_s); all learners were stopped")
            ref = ready[0]
            try:
                out[index[ref]] = ray.get(ref)
            except (RayActorError, RayTaskError) as e:
                self.close()
                what = "died" if isinstance(e, RayActorError) else "failed"
                raise LearnerError(f"learner {index[ref]} {what} during {doing}: {str(e).strip()}; all learners "
                                   "were stopped") from None
        return [out[i] for i in range(len(refs))]

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
        self.actors = []
