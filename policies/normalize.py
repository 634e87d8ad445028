"""Normalisation statistics for states and actions (computed from data, saved with checkpoints).

Two modes, as in openpi: ``mean_std`` (π0: (x - mean) / std) and ``quantile`` (π0.5: q01..q99 mapped
linearly to [-1, 1]). Dims with (near) zero spread are left centred but unscaled, so a constant
dimension (a padded or unused one) does not blow up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Mode = Literal["mean_std", "quantile"]
_EPS = 1e-6


@dataclass
class Stats:
    """Per-dimension statistics ``[D]`` of one quantity."""

    mean: Tensor
    std: Tensor
    q01: Tensor
    q99: Tensor

    @staticmethod
    def of(x: Tensor) -> Stats:
        """Statistics of samples ``[M, D]`` (any leading shape is flattened)."""
        x = x.reshape(-1, x.shape[-1]).double()
        if x.shape[0] == 0:
            raise ValueError("cannot compute statistics of an empty tensor")
        if not torch.isfinite(x).all():
            raise ValueError("data contains NaN or inf; cannot compute normalisation statistics")
        q = torch.quantile(x, torch.tensor([0.01, 0.99], dtype=x.dtype), dim=0)
        return Stats(x.mean(0).float(), x.std(0, unbiased=False).float(), q[0].float(), q[1].float())

    @staticmethod
    def identity(dim: int) -> Stats:
        """Statistics under which normalising changes nothing (mean 0, std 1, quantiles -1 / 1)."""
        return Stats(torch.zeros(dim), torch.ones(dim), -torch.ones(dim), torch.ones(dim))

    def to_dict(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.{k}": getattr(self, k).contiguous() for k in ("mean", "std", "q01", "q99")}

    @staticmethod
    def from_dict(d: dict[str, Tensor], prefix: str) -> Stats:
        try:
            return Stats(*(d[f"{prefix}.{k}"].float() for k in ("mean", "std", "q01", "q99")))
        except KeyError as e:
            raise ValueError(f"normalisation statistics are missing {e.args[0]!r}") from None

    def _scale_shift(self, mode: Mode) -> tuple[Tensor, Tensor]:
        if mode == "mean_std":
            center, scale = self.mean, self.std
        elif mode == "quantile":
            center, scale = (self.q99 + self.q01) / 2, (self.q99 - self.q01) / 2
        else:
            raise ValueError(f"unknown normalisation mode {mode!r}")
        scale = torch.where(scale > _EPS, scale, torch.ones_like(scale))
        return center, scale

    def normalize(self, x: Tensor, mode: Mode) -> Tensor:
        center, scale = self._scale_shift(mode)
        return (x - center.to(x.device)) / scale.to(x.device)

    def unnormalize(self, x: Tensor, mode: Mode) -> Tensor:
        center, scale = self._scale_shift(mode)
        return x * scale.to(x.device) + center.to(x.device)


@dataclass
class NormStats:
    """Statistics of the state and the action, plus the mode they are applied in."""

    state: Stats
    action: Stats
    mode: Mode = "mean_std"

    def to_tensors(self) -> dict[str, Tensor]:
        return {**self.state.to_dict("state"), **self.action.to_dict("action")}

    @staticmethod
    def from_tensors(d: dict[str, Tensor], mode: Mode) -> NormStats:
        return NormStats(Stats.from_dict(d, "state"), Stats.from_dict(d, "action"), mode)
