"""The learner's optimizer, with the memory-lean options of ``learner.param_dtype`` and
``learner.optimizer_state_dtype``.

Bytes per trained parameter (weights + gradient + optimizer state):

| param_dtype | optimizer_state_dtype | weights | gradient | fp32 master | Adam moments | total |
|---|---|---|---|---|---|---|
| fp32 | fp32 | 4 | 4 | - | 8 | 16 |
| fp32 | bf16 | 4 | 4 | - | 4 | 12 |
| bf16 | fp32 | 2 | 2 | 4 | 8 | 16 |
| bf16 | bf16 | 2 | 2 | 4 | 4 | 12 |

``bf16`` weights also halve every *frozen* parameter (a frozen prefix, LoRA's base weights) and spare the bf16 copy
of each weight that autocast makes in every forward; the trained ones keep an fp32 master copy in the optimizer
state, which takes the steps (so small updates are not rounded away), and the bf16 weight is the master rounded.

The default (both fp32) is ``torch.optim.AdamW``. Otherwise :class:`LeanAdamW` runs the same AdamW arithmetic in
fp32 and stores the moments in ``state_dtype``, rounding them stochastically (:func:`stochastic_round`): with
round-to-nearest, ``0.999 * v`` rounds back to ``v`` in bf16 (8 mantissa bits) and the second moment would stop
decaying. The rounding noise is drawn from a generator seeded with (parameter index, step), so a resumed run
repeats it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
StateDtype = Literal["fp32", "bf16"]


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """``x`` (float32) rounded to ``dtype``: to bf16 up or down at random, with the probability of rounding up
    equal to the distance from the lower neighbour (unbiased: E[round(x)] = x); to float32 unchanged.
    ``generator`` lives on ``x``'s device."""
    if dtype == torch.float32:
        return x.clone()
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding to {dtype} is not supported (bf16 or fp32)")
    # bf16 is float32 with the low 16 bits cut off: add uniform noise in those bits, then truncate.
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    # Inf and NaN keep their bit patterns (the noise could turn a NaN's payload or overflow a large finite value).
    rounded = torch.where(torch.isfinite(x), rounded, x)
    return rounded.to(torch.bfloat16)


class LeanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction: the arithmetic of ``torch.optim.AdamW``) that keeps its
    moments in ``state_dtype`` and, for parameters that are not float32, an fp32 ``master`` copy in its state.
    State per parameter: ``step`` (float32 scalar), ``exp_avg``, ``exp_avg_sq``, and ``master`` where needed."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, state_dtype: StateDtype = "fp32"):
        if state_dtype not in DTYPES:
            raise ValueError(f"state_dtype must be one of {list(DTYPES)}, got {state_dtype!r}")
        self.state_dtype = DTYPES[state_dtype]
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LeanAdamW takes no closure")
        index = 0
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                    if p.dtype != torch.float32:
                        state["master"] = p.detach().float().clone()
                state["step"] += 1
                step = int(state["step"].item())
                master = state.get("master", p)
                grad = p.grad.float()
                m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                master.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                master.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
                gen = torch.Generator(device=p.device).manual_seed(index * 1_000_003 + step)
                state["exp_avg"] = stochastic_round(m, self.state_dtype, gen)
                state["exp_avg_sq"] = stochastic_round(v, self.state_dtype, gen)
                if master is not p:
                    p.copy_(master)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state tensor to its parameter's dtype on loading: that would round the fp32
        # master to bf16 and widen bf16 moments. Put the saved tensors back in their own dtypes.
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, entries in state_dict["state"].items():
            for key, value in entries.items():
                if key != "step" and torch.is_tensor(value):
                    self.state[params[int(pid)]][key] = value.to(device=params[int(pid)].device)


def make_optimizer(groups: list[dict], *, weight_decay: float, param_dtype: str = "fp32",
                   state_dtype: StateDtype = "fp32") -> torch.optim.Optimizer:
    """AdamW over ``groups`` (torch's for fp32 weights and moments, :class:`LeanAdamW` otherwise)."""
    if param_dtype == "fp32" and state_dtype == "fp32":
        return torch.optim.AdamW(groups, weight_decay=weight_decay)
    return LeanAdamW(groups, weight_decay=weight_decay, state_dtype=state_dtype)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer``'s state (moments, masters, step counters)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))
