"""PPO losses (pure functions returning ``(loss, metrics)``) and how a chunk's log-prob is formed from the
sampler's per-element log-densities (:class:`LogProbConfig`, :func:`aggregate_log_prob`).

Glossary: B samples in a minibatch (chunks); K denoising steps, H actions per chunk, A model action dims; an
optional trailing axis of action dims when the ratio is taken per action dim (``*d`` in the signatures: none, or
the real action dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vla_rl.core.shapes import Bool, Float
from vla_rl.policies import flow


@dataclass(frozen=True)
class LogProbConfig:
    """How per-element log-densities ``[K, H, A]`` become the PPO log-prob of a chunk.

    Default (πRL): mean over the stochastic denoising steps, sum over the executed actions and the real
    action dims. Summing over K as well multiplies the log-ratio by K and blows PPO ratios up.
    ``ratio="dim"`` keeps one ratio per action dim instead of one per chunk.
    """

    steps: str = "mean"
    actions: str = "sum"
    dims: str = "sum"
    ratio: str = "chunk"

    def __post_init__(self):
        for name in ("steps", "actions", "dims"):
            if getattr(self, name) not in ("sum", "mean"):
                raise ValueError(f"log_prob.{name} must be 'sum' or 'mean', got {getattr(self, name)!r}")
        if self.ratio not in ("chunk", "dim"):
            raise ValueError(f"log_prob.ratio must be 'chunk' or 'dim', got {self.ratio!r}")


def scalar(x: Tensor) -> float:
    """A metric's value: ``float(x)``, or NaN for a meta tensor (the memory plan runs the losses on shapes alone)."""
    return float("nan") if x.is_meta else float(x)


def aggregate_log_prob(per_element: Float[Tensor, "b k h a"], stochastic: Bool[Tensor, "b k"], cfg: LogProbConfig,
                       *, executed: int, dim_mask: Bool[Tensor, " a"]) -> Float[Tensor, " b *d"]:
    """``[B, K, H, A]`` -> ``[B]`` (chunk ratio) or ``[B, A_real]`` (per-dim ratio)."""
    dims = "none" if cfg.ratio == "dim" else cfg.dims
    out = flow.aggregate(per_element, stochastic, steps=cfg.steps, actions=cfg.actions, dims=dims,
                         executed=executed, dim_mask=dim_mask)
    return out[:, dim_mask] if cfg.ratio == "dim" else out


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    m = m.expand_as(x)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def ppo_policy_loss(
    *,
    new_log_prob: Float[Tensor, " b *d"],
    old_log_prob: Float[Tensor, " b *d"],
    advantages: Float[Tensor, " b"],
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = 3.0,
    mask: Bool[Tensor, " b"] | None = None,
) -> tuple[Float[Tensor, ""], dict[str, float]]:
    """Clipped surrogate with dual clip.

    ``new_log_prob`` / ``old_log_prob``: ``[B]`` (one ratio per chunk) or ``[B, A]`` (one per action dim);
    ``advantages`` ``[B]`` (broadcast over A). The ratio is clipped to ``[1 - clip, 1 + clip_high]``
    (``clip_high`` None: ``clip``; larger: DAPO's clip-higher, room for unlikely actions to gain). ``dual_clip``
    c bounds the loss of negative-advantage samples at -c*A, so a huge ratio on a bad action cannot dominate
    the update.
    """
    if new_log_prob.shape != old_log_prob.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(new_log_prob.shape)} vs {tuple(old_log_prob.shape)}")
    adv = advantages
    while adv.dim() < new_log_prob.dim():
        adv = adv.unsqueeze(-1)
    log_ratio = new_log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    high = clip if clip_high is None else clip_high
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    pg = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    loss = _masked_mean(pg, mask)
    with torch.no_grad():
        approx_kl = _masked_mean((ratio - 1.0) - log_ratio, mask)  # k3 estimator, >= 0
        clipped = ((ratio - 1.0).abs() > clip) if clip_high is None else (ratio < 1.0 - clip) | (ratio > 1.0 + high)
        clipfrac = _masked_mean(clipped.float(), mask)
        metrics = {"losses/policy": scalar(loss.detach()), "losses/approx_kl": scalar(approx_kl),
                   "losses/clipfrac": scalar(clipfrac), "losses/ratio_max": scalar(ratio.max())}
    return loss, metrics


def value_loss(
    *,
    values: Float[Tensor, " b"],
    old_values: Float[Tensor, " b"],
    returns: Float[Tensor, " b"],
    clip: float | None = 0.2,
    huber_delta: float = 1.0,
    mask: Bool[Tensor, " b"] | None = None,
) -> tuple[Float[Tensor, ""], dict[str, float]]:
    """Clipped Huber value loss: the worse of the unclipped and the clipped (around ``old_values``)
    prediction, so the critic cannot move too far per update either."""
    loss = F.huber_loss(values, returns, reduction="none", delta=huber_delta)
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, F.huber_loss(clipped, returns, reduction="none", delta=huber_delta))
    loss = _masked_mean(loss, mask)
    return loss, {"losses/value": scalar(loss.detach())}


def explained_variance(pred: Float[Tensor, "*s"], target: Float[Tensor, "*s"]) -> float:
    """1 - Var[target - pred] / Var[target] (1 is perfect, <= 0 is no better than a constant)."""
    var = target.var()
    return float("nan") if var == 0 else float(1.0 - (target - pred).var() / var)
