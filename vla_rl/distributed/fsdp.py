"""Sharded learners (``ray.sharding: fsdp``): PyTorch's FSDP2 (``fully_shard``) splits every trained tensor (weights,
gradients, Adam's moments) over the learners, so each holds 1/world of them plus one layer's full weights at a
time, instead of a whole replica.

Units: each ViT block, each prefix and expert layer, and the root (embeddings, norms, heads). The model is called
through methods, not ``forward`` (``encode_prefix``, ``expert``, ``value``; a stream layer's ``project`` /
``keys_values`` / ``finish``), so those are registered as forward methods: FSDP gathers a unit's weights before
them and frees them after. Activation checkpointing stays on for the sharded model's life, inside FSDP's hooks
(the layer's weights are gathered once more for the recomputation, as with FSDP's own checkpoint wrapper).

Same step as one learner: every learner weights its share of a minibatch by ``share / minibatch``
(:class:`~vla_rl.rl.learner.Learner`), and the gradient reduce-scatter *sums* (divide factor 1, sum reductions),
so each learner's shard holds the whole minibatch's gradient, as :mod:`vla_rl.distributed.gradsync` gives a
replicated learner. Metrics are summed (maxima maximised) with one small all-reduce.

Checkpoints: :func:`full_weights` and :func:`full_optimizer_state` gather the shards into the ordinary
(unsharded) state dicts, which the trainer saves as always: a sharded run's checkpoint loads in a single-process
run, in ``vla-rl eval`` and in a replicated run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from vla_rl.policies.recompute import checkpoint_layers
from vla_rl.rl.learner import Learner
from vla_rl.rl.optim import LeanAdamW


def is_sharded(t) -> bool:
    return hasattr(t, "full_tensor")


def full(t: Tensor) -> Tensor:
    """The whole tensor of a shard (a collective: every learner must call it, in the same order)."""
    return t.full_tensor() if is_sharded(t) else t


def shard_policy(model: torch.nn.Module, mesh, *, recompute: str = "none") -> None:
    """``fully_shard`` ``model`` (a FlowVLA) in place over ``mesh``: each block of its layer groups a unit (their
    methods registered as forward methods), the root another (around ``model.FORWARD_METHODS``), with the layers of
    ``recompute`` checkpointed inside FSDP's hooks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    # FSDP warns of every view a wrapped method returns (q, k, v are transposed views): an in-place op on one would
    # bypass its backward hook. The model writes in place only without autograd (policies/layers.py: residual).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    checkpoint_layers(model, recompute)
    for group in model.layer_groups():
        for block in group.modules:
            fully_shard(block, mesh=mesh)
            for name in group.methods:
                if name != "forward":
                    register_fsdp_forward_method(block, name)
    fully_shard(model, mesh=mesh)
    for name in model.FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for module in model.modules():
        if isinstance(module, FSDPModule):   # sum the shares' gradients, as the replicated learners do
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def shard_learner(learner: Learner, mesh) -> None:
    """Shard ``learner``'s model over ``mesh`` and rebuild its optimizer on the shards, carrying over its state
    (the learner's settings, frozen parameters, LoRA adapters and dtypes were made before, on the whole model)."""
    from torch.distributed.tensor import distribute_tensor

    model, old = learner.actor.model, learner.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    saved = old.state_dict()
    groups = [[names[id(p)] for p in g["params"]] for g in old.param_groups]
    shard_policy(model, mesh, recompute=learner.recompute)
    learner.recompute = "none"   # built into the sharded model
    params = dict(model.named_parameters())
    new_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in group]}
                  for g, group in zip(old.param_groups, groups)]
    if isinstance(old, LeanAdamW):
        opt = LeanAdamW(new_groups, state_dtype={torch.bfloat16: "bf16"}.get(old.state_dtype, "fp32"))
    else:
        opt = type(old)(new_groups)
    flat = [p for g in opt.param_groups for p in g["params"]]
    for pid, entries in saved["state"].items():
        p = flat[int(pid)]
        opt.state[p] = {k: (distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                            if torch.is_tensor(v) and v.dim() and is_sharded(p) else v)
                        for k, v in entries.items()}
    learner.optimizer = opt
    learner.params = flat
    device = next(iter(params.values())).device
    learner.autocast = learner.bf16 and device.type == "cuda"


def full_weights(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
    """The model's whole parameters on the CPU (all of them, or those an update changes)."""
    return {n: full(p.detach()).cpu() for n, p in model.named_parameters() if p.requires_grad or not trainable_only}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every shard gathered, on the CPU: the state dict of an unsharded learner."""
    sd = optimizer.state_dict()
    state = {pid: {k: full(v).detach().cpu() if torch.is_tensor(v) else v for k, v in entries.items()}
             for pid, entries in sorted(sd["state"].items())}
    return {"state": state, "param_groups": sd["param_groups"]}


def metrics_sync(all_reduce: Callable[[Tensor, str], None], device: torch.device | str = "cpu"):
    """The ``sync`` of a sharded :class:`Learner`: FSDP has already summed the gradients into the shards, so only
    the metrics are combined (summed; ``*_max`` maximised), as a float64 tensor on ``device`` (NCCL's)."""

    def sync(params, metrics: dict[str, float]) -> dict[str, float]:
        sums = sorted(k for k in metrics if not k.endswith("_max"))
        maxima = sorted(k for k in metrics if k.endswith("_max"))
        out = {}
        for keys, op in ((sums, "sum"), (maxima, "max")):
            if keys:
                t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
                all_reduce(t, op)
                out.update(zip(keys, t.tolist()))
        return out

    return sync
