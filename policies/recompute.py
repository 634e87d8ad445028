"""Activation checkpointing (recomputation) of a flow policy's layers for training at π0 scale.

Backpropagation keeps every layer's intermediate activations; at the ``pi0`` preset's sizes (Gemma-2B prefix
with an MLP 16384 wide over 3 x 256 image tokens + 48 text tokens) they, not the weights, decide whether a
minibatch of 64 fits one GPU. With checkpointing a layer keeps its inputs only and recomputes its insides
during the backward pass: about one more forward pass of the checkpointed layers, for activations that no
longer grow with the MLP's width.

Parts: ``prefix`` (the blocks of the model's prefix layer groups: π0's vision blocks and prefix backbone layers),
``expert`` (the action expert's layers; with Flow-Noise the expert runs K times per sample, so its activations grow
with K) or ``all``. Each block's methods named by its :class:`~vla_rl.policies.seam.LayerGroup` are checkpointed on
their own: π0's joint attention splits each stream layer into
:meth:`~vla_rl.policies.layers.StreamLayer.project` and :meth:`~vla_rl.policies.layers.StreamLayer.finish` (the
attention between them keeps its inputs). Outside autograd (sampling) the layers run as they are. Recomputation
repeats the same operations on the same inputs, so values and gradients are those of the plain model
(tests/test_gpu_path.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vla_rl.policies.seam import FlowVLA

Parts = Literal["none", "prefix", "expert", "all"]
PARTS = ("none", "prefix", "expert", "all")


def _recomputed(module: nn.Module, name: str):
    method = getattr(type(module), name)

    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(method, module, *args, use_reentrant=False, **kwargs)
        return method(module, *args, **kwargs)

    return run


def _targets(model: FlowVLA, parts: str) -> list[tuple[nn.Module, tuple[str, ...]]]:
    if parts not in PARTS:
        raise ValueError(f"activation checkpointing parts must be one of {list(PARTS)}, got {parts!r}")
    wanted = {"none": (), "prefix": ("prefix",), "expert": ("expert",), "all": ("prefix", "expert")}[parts]
    return [(block, group.methods) for group in model.layer_groups() if group.part in wanted
            for block in group.modules]


def checkpoint_layers(model: FlowVLA, parts: Parts) -> Callable[[], None]:
    """Make the layers of ``parts`` of ``model`` recompute their activations in the backward pass, until the
    returned function is called (which restores them). A sharded learner keeps them on for its whole life, so
    that FSDP's hooks wrap the recomputed methods (vla_rl/distributed/fsdp.py)."""
    targets = _targets(model, parts)
    for module, names in targets:
        for name in names:
            if name in module.__dict__:
                raise RuntimeError(f"{type(module).__name__}.{name} is already checkpointed (nested blocks?)")
            module.__dict__[name] = _recomputed(module, name)

    def undo() -> None:
        for module, names in targets:
            for name in names:
                module.__dict__.pop(name, None)

    return undo


@contextlib.contextmanager
def activation_checkpointing(model: FlowVLA, parts: Parts) -> Iterator[FlowVLA]:
    """Within the block, the layers of ``parts`` of ``model`` recompute their activations in the backward pass
    (``none``: nothing changes). The model is restored when the block ends, so nothing of it is saved,
    copied or sent elsewhere (checkpoints, Ray actors) while it is on."""
    undo = checkpoint_layers(model, parts)
    try:
        yield model
    finally:
        undo()
