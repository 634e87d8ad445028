"""Summing gradients and metrics over data-parallel learners: pure functions of the parameters and an
``all_reduce`` callable (an in-place sum over the learners), so they are tested without any cluster.

Why a sum, not DDP's mean: every learner weights its share of a minibatch by ``share / minibatch`` before
``backward`` (see :class:`vla_rl.rl.learner.Learner`), so the sum over learners is exactly the gradient of the
whole minibatch, even when the shares differ in size (a minibatch of 5 samples on 2 learners).

Metrics named ``*_max`` (a maximum over samples) are maximised instead. Which parameters had a gradient is
summed too: a parameter that no learner's loss reached keeps ``grad =
None`` (AdamW then leaves it untouched, as one learner would), while one reached anywhere gets the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def pack_gradients(params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(flat, present)``: every gradient in one flat buffer (zeros where ``grad`` is None) and a ``[P]``
    float64 vector, 1 where a parameter has a gradient."""
    if not params:
        raise ValueError("no parameters to pack")
    ref = params[0]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=ref.device)
    return flat, present


def unpack_gradients(params: Sequence[Tensor], flat: Tensor, present: Tensor) -> None:
    """Write ``flat`` back as the parameters' gradients; those with ``present == 0`` get ``grad = None``."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total or present.numel() != len(params):
        raise ValueError(f"buffers of {flat.numel()} values / {present.numel()} flags for {len(params)} "
                         f"parameters of {total} values")
    offset = 0
    for p, has in zip(params, present.tolist()):
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone() if has > 0 else None
        offset += n


def sum_over_learners(params: Sequence[Tensor], metrics: dict[str, float],
                      all_reduce: Callable[[Tensor, str], None]) -> dict[str, float]:
    """Replace every parameter's gradient by its sum over the learners and return the combined ``metrics``
    (each learner passes its share-weighted metrics under the same names): summed, except maxima (names
    ending in ``_max``), which are maximised. ``all_reduce(tensor, op)`` reduces ``tensor`` in place over the
    learners with ``op`` "sum" or "max"; the gradients go in their own dtype, the flags and metrics in float64."""
    flat, present = pack_gradients(params)
    maxima = sorted(k for k in metrics if k.endswith("_max"))
    sums = sorted(k for k in metrics if not k.endswith("_max"))
    as_tensor = lambda keys: torch.tensor([metrics[k] for k in keys], dtype=torch.float64,  # noqa: E731
                                          device=present.device)
    small = torch.cat([present, as_tensor(sums)])
    all_reduce(flat, "sum")
    all_reduce(small, "sum")
    out = dict(zip(sums, small[len(params):].tolist()))
    if maxima:
        top = as_tensor(maxima)
        all_reduce(top, "max")
        out.update(zip(maxima, top.tolist()))
    unpack_gradients(params, flat, small[:len(params)])
    return out
