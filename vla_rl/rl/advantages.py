"""Advantage estimators over chunk steps (pure functions).

Glossary: T chunk steps per rollout, N envs, E episodes, G groups.
One RL step is one action chunk: its reward is the sum of the sub-step rewards the env executed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vla_rl.core.shapes import Bool, Float, Int


def gae(
    *,
    rewards: Float[Tensor, "t n"],
    values: Float[Tensor, "t n"],
    terminated: Bool[Tensor, "t n"],
    truncated: Bool[Tensor, "t n"],
    final_values: Float[Tensor, "t n"],
    last_values: Float[Tensor, " n"],
    gamma: float,
    lam: float,
) -> tuple[Float[Tensor, "t n"], Float[Tensor, "t n"]]:
    """Generalised advantage estimation over chunk steps.

    rewards, values, terminated, truncated, final_values: ``[T, N]``; last_values ``[N]`` (value of the
    observation after the last chunk). ``final_values[t]`` is the value of the final observation of an
    episode that was *truncated* at chunk ``t``: time-limit ends bootstrap from it, terminations do not.
    Returns ``(advantages, returns)`` ``[T, N]`` with ``returns = advantages + values``.
    """
    t_len = rewards.shape[0]
    for name, x in (("values", values), ("terminated", terminated), ("truncated", truncated),
                    ("final_values", final_values)):
        if x.shape != rewards.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, rewards {tuple(rewards.shape)}")
    term, trunc = terminated.float(), truncated.float()
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(last_values)
    for t in reversed(range(t_len)):
        next_v = last_values if t == t_len - 1 else values[t + 1]
        # After a truncation the next row belongs to a new episode: bootstrap from the final obs instead.
        next_v = torch.where(trunc[t] > 0, final_values[t], next_v)
        delta = rewards[t] + gamma * (1.0 - term[t]) * next_v - values[t]
        done = torch.clamp(term[t] + trunc[t], max=1.0)
        running = delta + gamma * lam * (1.0 - done) * running
        adv[t] = running
    return adv, adv + values


def normalize(adv: Float[Tensor, "*s"], mask: Bool[Tensor, "*s"] | None = None, eps: float = 1e-8
              ) -> Float[Tensor, "*s"]:
    """Zero-mean, unit-std advantages (statistics over ``mask`` entries only, if given)."""
    x = adv if mask is None else adv[mask]
    if x.numel() < 2:
        return adv - (x.mean() if x.numel() else 0.0)
    return (adv - x.mean()) / (x.std() + eps)


def grpo(
    *,
    returns: Float[Tensor, " e"],
    groups: Int[Tensor, " e"],
    success: Bool[Tensor, " e"] | None = None,
    filter_degenerate: bool = True,
    eps: float = 1e-6,
) -> tuple[Float[Tensor, " e"], Bool[Tensor, " e"]]:
    """GRPO: episode returns ``[E]`` normalised within their group ``groups`` ``[E]`` (episodes that
    share an initial state). Returns ``(advantages [E], keep [E] bool)``.

    With ``filter_degenerate``, groups whose episodes all succeeded or all failed (``success`` ``[E]``)
    carry no learning signal and are dropped (keep = False), as in πRL.
    """
    if returns.shape != groups.shape:
        raise ValueError(f"returns {tuple(returns.shape)} and groups {tuple(groups.shape)} differ in shape")
    uniq, inv = torch.unique(groups, return_inverse=True)
    g = uniq.numel()
    count = torch.zeros(g, device=returns.device).index_add_(0, inv, torch.ones_like(returns))
    mean = torch.zeros(g, device=returns.device).index_add_(0, inv, returns) / count
    var = torch.zeros(g, device=returns.device).index_add_(0, inv, (returns - mean[inv]) ** 2) / count
    adv = (returns - mean[inv]) / (var[inv].sqrt() + eps)
    keep = count[inv] > 1
    if filter_degenerate and success is not None:
        rate = torch.zeros(g, device=returns.device).index_add_(0, inv, success.float()) / count
        keep &= (rate[inv] > 0) & (rate[inv] < 1)
    return adv, keep
