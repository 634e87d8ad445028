"""LoRA (low-rank adaptation) of a flow policy's linear layers: train ``r (in + out)`` numbers per adapted
``[out, in]`` weight instead of ``in * out``.

An adapted layer computes ``W x + b + s B A dropout(x)`` with ``A`` ``[r, in]``, ``B`` ``[out, r]`` and
``s = alpha / r``; ``B`` starts at zero, so a freshly adapted model computes exactly what the base model did.
:class:`LoRALinear` *is* an ``nn.Linear`` (its base weight keeps the name ``weight``), so a LoRA model's
state dict is the base model's plus ``<layer>.lora_A`` / ``<layer>.lora_B``: :func:`split_state` separates
the two for a checkpoint (``model.safetensors`` keeps the exact base keys, ``adapters.safetensors`` the
adapters), and :func:`merge_state` folds adapters into base weights (``W + s B A``) for evaluation and export.

Glossary: r rank, s scaling (alpha / r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vla_rl.core.ranges import ConfigError, check_ranges, fraction, nonneg, positive, setting

# Linear layers by name: the transformer streams' attention and MLP projections, the ViT blocks' ones.
STREAM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION_TARGETS = ("qkv", "proj", "fc1", "fc2")
PARTS = ("prefix", "expert")
PART_TARGETS = {"prefix": VISION_TARGETS + STREAM_TARGETS, "expert": STREAM_TARGETS}   # what each part's layers are
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True)
class LoRAConfig:
    """``rank`` 0: no LoRA. ``parts``: which streams get adapters: ``prefix`` (the vision blocks and the prefix
    backbone, π0's PaliGemma) and/or ``expert``. A part with adapters trains its adapters only (its other
    weights are frozen); a part without them is trained in full (the expert, by default) or frozen
    (``learner.freeze_prefix``). The Flow-Noise, velocity and value heads are always trained in full."""

    rank: int = nonneg(0, doc="the adapters' rank r; 0: no LoRA")
    alpha: float = positive(16.0, doc="scaling alpha: an adapter adds (alpha / r) B A to its weight")
    dropout: float = fraction(0.0, doc="dropout on the adapters' input (below 1)")
    targets: tuple[str, ...] = setting(STREAM_TARGETS + VISION_TARGETS, doc="the linear layers that get adapters")
    parts: tuple[str, ...] = setting(("prefix",), doc="prefix (vision and the prefix backbone) and / or expert")

    def __post_init__(self):
        check_ranges(self)
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts or len(set(self.parts)) != len(self.parts):
            raise ConfigError(f"lora.parts must be a non-empty list of distinct parts from {list(PARTS)}, got "
                              f"{list(self.parts)}")
        unknown = [t for t in self.targets if t not in STREAM_TARGETS + VISION_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"lora.targets: {unknown or '[]'} not among the policy's linear layers "
                              f"{list(STREAM_TARGETS + VISION_TARGETS)}")
        if self.dropout >= 1:
            raise ConfigError("lora.dropout must be < 1")
        if self.enabled:   # a part none of whose layers is a target would get no adapter and train as if no LoRA
            for part in self.parts:
                if not set(self.targets) & set(PART_TARGETS[part]):
                    raise ConfigError(f"lora.targets {list(self.targets)} select no layer of the {part}: its layers "
                                      f"are {list(PART_TARGETS[part])}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update ``s B A``; the base ``weight`` / ``bias`` keep their names."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0, *,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))

    @staticmethod
    def adapt(base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator) -> LoRALinear:
        """A LoRA layer sharing ``base``'s weight and bias tensors; ``A`` drawn as torch draws a Linear's
        weight (Kaiming-uniform, a = sqrt(5)) from ``generator``, ``B`` zero."""
        w = base.weight
        layer = LoRALinear(base.in_features, base.out_features, rank, alpha, dropout, bias=base.bias is not None,
                           device="meta")
        layer.weight = base.weight
        layer.bias = base.bias
        bound = 1.0 / math.sqrt(base.in_features)   # kaiming_uniform_(a=sqrt(5)) on [r, in]
        a = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        layer.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        layer.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        return layer

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def _part_modules(model: nn.Module, part: str) -> list[nn.Module]:
    """The blocks of ``part`` (the model's :meth:`~vla_rl.policies.seam.FlowVLA.layer_groups`), in order."""
    return [block for group in model.layer_groups() if group.part == part for block in group.modules]


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, seed: int = 0) -> list[str]:
    """Replace ``cfg.targets`` linear layers of ``cfg.parts`` of ``model`` (a FlowVLA) by :class:`LoRALinear`
    in place; returns the adapted layers' names. Idempotent: layers already adapted are left as they are. The
    adapters' ``A`` come from a generator seeded with ``seed`` (the global RNG is not touched)."""
    if not cfg.enabled:
        return []
    gen = torch.Generator().manual_seed(seed)
    names = {id(m): n for n, m in model.named_modules()}
    adapted = []
    for part in cfg.parts:
        for block in _part_modules(model, part):
            for child_name, child in list(_linear_children(block)):
                parent, attr = child_name
                if attr not in cfg.targets:
                    continue
                if not isinstance(child, LoRALinear):
                    layer = LoRALinear.adapt(child, cfg.rank, cfg.alpha, cfg.dropout, gen)
                    setattr(parent, attr, layer.train(child.training))   # no dropout in an eval-mode model
                adapted.append(f"{names[id(parent)]}.{attr}")
    return adapted


def _linear_children(block: nn.Module):
    """((parent, attribute), Linear) for every Linear under ``block``."""
    for parent in block.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear):
                yield (parent, attr), child


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def frozen_by_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Names of the parameters LoRA freezes: every non-adapter parameter of an adapted part (the prefix part:
    every prefix parameter, embeddings and norms included; the expert part: the expert layers' parameters)."""
    if not cfg.enabled:
        return []
    groups = model.parameter_groups()
    out = []
    if "prefix" in cfg.parts:
        out += [n for n in groups["prefix"] if not is_adapter(n)]
    if "expert" in cfg.parts:   # the expert's layers (its embeddings and heads stay trained)
        layers = {id(p) for block in _part_modules(model, "expert") for p in block.parameters()}
        out += [n for n, p in groups["expert"].items() if id(p) in layers and not is_adapter(n)]
    return out


def split_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A LoRA model's state dict -> (base weights under the base model's keys, adapters)."""
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    return base, {k: v for k, v in state.items() if is_adapter(k)}


def merge_state(base: dict[str, Tensor], adapters: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """Base weights with the adapters folded in: ``W + scaling B A`` (computed in float32, stored in ``W``'s
    dtype) for every adapted layer; the other tensors as they are. Checks that the adapters come in pairs
    that fit their layers."""
    out = dict(base)
    layers = sorted({k.rsplit(".", 1)[0] for k in adapters})
    for layer in layers:
        a, b, w = adapters.get(f"{layer}.lora_A"), adapters.get(f"{layer}.lora_B"), base.get(f"{layer}.weight")
        if a is None or b is None or w is None:
            raise ValueError(f"adapter {layer}: needs lora_A, lora_B and the base weight {layer}.weight")
        if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"adapter {layer}: B {tuple(b.shape)} A {tuple(a.shape)} do not fit the weight "
                             f"{tuple(w.shape)}")
        out[f"{layer}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every :class:`LoRALinear` of ``model`` back into a plain ``nn.Linear`` (in place; returns it)."""
    for name, layer in list(lora_layers(model).items()):
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        with torch.no_grad():
            merged = layer.weight.float() + layer.scaling * (layer.lora_B.float() @ layer.lora_A.float())
        plain.weight = nn.Parameter(merged.to(layer.weight.dtype), requires_grad=layer.weight.requires_grad)
        plain.bias = layer.bias
        setattr(parent, name.rsplit(".", 1)[-1], plain)
    return model


def lora_meta(model: nn.Module) -> dict | None:
    """What a checkpoint's ``config.yaml`` records of the adapters of ``model`` (``lora:``; None without any):
    the rank, the scaling :func:`merge_state` needs, and the adapted layers."""
    layers = lora_layers(model)
    if not layers:
        return None
    scalings = {m.scaling for m in layers.values()}
    if len(scalings) != 1:
        raise ValueError(f"the adapters of this model have different scalings {sorted(scalings)}")
    first = next(iter(layers.values()))
    return {"rank": first.rank, "scaling": float(first.scaling), "layers": sorted(layers)}
