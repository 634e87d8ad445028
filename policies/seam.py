"""The policy seam: what a flow-VLA architecture gives the rest of vla-rl.

Everything outside ``policies/`` talks to a policy through :class:`FlowVLA` (and builds one with
:func:`~vla_rl.policies.architectures.make_policy`, the one place a model class is named). An architecture is a
prefix encoder whose output is cached once per observation (:meth:`FlowVLA.encode_prefix`) and an action expert
that predicts the flow velocity of an action chunk from it (:meth:`FlowVLA.expert`), with the Flow-Noise std head
and the value head on the same pass. The samplers, likelihoods and flow-matching losses of
:mod:`vla_rl.policies.flow` read the expert through :meth:`FlowVLA.field` / :meth:`FlowVLA.velocity_field`, so an
architecture gets Flow-Noise, Flow-SDE, FPO and the rest by providing these methods.

:meth:`FlowVLA.layer_groups` is how the training machinery finds the repeated blocks without knowing the model's
attribute names: LoRA adapts the linear layers of a part's blocks, activation recompute wraps each block's
methods, FSDP makes each block a unit, and the memory plan sizes the gathered units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

Part = Literal["prefix", "expert"]


@dataclass(frozen=True)
class LayerGroup:
    """Blocks of one kind in one part of the network (the vision encoder's blocks, the prefix backbone's layers,
    the expert's layers). ``methods``: the methods the model calls on each block (``forward``, or a stream layer's
    halves around a joint attention): activation recompute wraps them, FSDP registers them as forward methods."""

    part: Part
    modules: tuple[nn.Module, ...]
    methods: tuple[str, ...] = ("forward",)


@runtime_checkable
class FlowVLA(Protocol):
    """A flow-matching VLA as vla-rl uses it (an ``nn.Module``). ``cfg`` is its
    :class:`~vla_rl.policies.policy_config.PolicyConfig`; ``FORWARD_METHODS`` are the methods callers enter the
    model by (FSDP gathers the root's weights around them)."""

    cfg: Any
    text_tokenizer: Any
    FORWARD_METHODS: tuple[str, ...]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's linear weights (what it computes in)."""

    def set_tokenizer(self, tokenizer) -> None: ...

    def prepare(self, obs: dict) -> dict:
        """Check a raw observation (``images``, ``state``, ``instruction`` or ``tokens``) and tokenize it."""

    def encode_prefix(self, obs: dict, *, hidden: bool = True, prepared: bool = False) -> Any:
        """Run the prefix once; the result (keys / values per layer, mask, ...) feeds every denoising step."""

    def expert(self, prefix, x_t: Tensor, t: Tensor) -> Any:
        """One expert pass: an ``ExpertOutput`` (velocity, noise std, value, features)."""

    def velocity_field(self, prefix): ...

    def sampling_context(self, prefix, *, buffers: bool = True, rope_mask=None) -> Any: ...

    def sampling_velocity(self, prefix, ctx, x_t: Tensor, t: Tensor) -> Tensor: ...

    def field(self, prefix): ...

    def value(self, prefix, x_t: Tensor | None = None, t: Tensor | None = None) -> Tensor: ...

    def parameter_groups(self) -> dict[str, dict[str, nn.Parameter]]:
        """``{"prefix" | "expert" | "value": {name: parameter}}``, every parameter in exactly one group."""

    def layer_groups(self) -> list[LayerGroup]: ...

    def idle_parameters(self, *, noise_head: bool) -> set[str]:
        """Parameters an update's loss never reaches (no gradient, no optimizer state); ``noise_head``: whether
        the loss reads the Flow-Noise std head."""
