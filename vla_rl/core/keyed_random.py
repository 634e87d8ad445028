"""Counter-based random numbers: every number is a hash of integer keys and its index, so a row's numbers
depend on its keys alone, not on the batch it is drawn in, its position there or a generator's state.

Why: an evaluation episode is named by its seed. Its initial state (the built-in task) and its sampler noise
must be the same whether it runs in a round of 10 envs or of 40, as env 3 or env 33; a ``torch.Generator``
gives one stream per batch, so a row's draws would depend on everything drawn before it. Here each number is
computed elementwise with integer operations on ``int64`` tensors (kept below 2**49, so nothing overflows),
vectorised over the batch: as cheap as a few elementwise ops per number, on any device.

The hash is Chris Wellons' ``triple32`` (a bijection of 32-bit integers with good avalanche); keys of up to 64
bits are folded into a 32-bit state one half at a time, starting from a per-``domain`` constant so that two
uses of the same keys (an env's reset, the policy's noise) draw independent numbers.

Glossary: N rows (envs), M numbers per row.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_TWO_32 = float(2**32)


def _mul32_(x: Tensor, m: int) -> Tensor:
    """``x = (x * m) mod 2**32`` in place, for ``x`` in ``[0, 2**32)``, without int64 overflow: the 16-bit halves
    of ``x`` are multiplied separately (each product < 2**48)."""
    hi = x >> 16
    x.bitwise_and_(0xFFFF).mul_(m)
    hi.mul_(m).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.add_(hi).bitwise_and_(_MASK32)


def triple32(x: Tensor) -> Tensor:
    """Wellons' ``triple32`` hash of ``int64`` values in ``[0, 2**32)``, elementwise (a bijection); ``x`` is not
    changed."""
    x = x.clone()
    x ^= x >> 17
    _mul32_(x, 0xED5AD4BB)
    x ^= x >> 11
    _mul32_(x, 0xAC4C1B51)
    x ^= x >> 15
    _mul32_(x, 0x31848BAB)
    x ^= x >> 14
    return x


def _fold(state: Tensor, key: Tensor) -> Tensor:
    """Mix a 64-bit key into a 32-bit state, low half then high half."""
    state = triple32(state ^ (key & _MASK32))
    return triple32(state ^ ((key >> 32) & _MASK32))


def keyed_bits(keys: list[Tensor | int], count: int, *, domain: str, device=None) -> Tensor:
    """``[N, count]`` int64 values in ``[0, 2**32)``: number ``j`` of row ``i`` is a hash of ``(domain,
    keys[0][i], keys[1][i], ..., j)``. ``keys``: non-negative ints or ``[N]`` integer tensors (broadcast)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    tensors = [k for k in keys if isinstance(k, Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    n = max((k.numel() for k in tensors), default=1)
    state = torch.full((n,), zlib.crc32(domain.encode()) & _MASK32, dtype=torch.int64, device=device)
    for k in keys:
        k = torch.as_tensor(k, dtype=torch.int64, device=device).reshape(-1)
        if k.numel() not in (1, n):
            raise ValueError(f"keys have {k.numel()} rows, expected 1 or {n}")
        if bool((k < 0).any()):
            raise ValueError("keys must be non-negative")
        state = _fold(state, k.expand(n))
    j = torch.arange(count, dtype=torch.int64, device=device)
    return triple32((state[:, None] + j[None, :] * _GOLDEN) & _MASK32)


def keyed_uniform(keys: list[Tensor | int], shape: tuple[int, ...], *, domain: str, device=None) -> Tensor:
    """``[N, *shape]`` float32 uniform in ``(0, 1)``, keyed as :func:`keyed_bits`."""
    bits = keyed_bits(keys, math.prod(shape), domain=domain, device=device)
    return ((bits.double() + 0.5) / _TWO_32).float().reshape(bits.shape[0], *shape)


def keyed_normal(keys: list[Tensor | int], shape: tuple[int, ...], *, domain: str, device=None) -> Tensor:
    """``[N, *shape]`` float32 standard normal (Box-Muller on two keyed uniforms per number, in float64)."""
    m = math.prod(shape)
    bits = keyed_bits(keys, 2 * m, domain=domain, device=device).double()
    u1, u2 = (bits[:, :m] + 0.5) / _TWO_32, (bits[:, m:] + 0.5) / _TWO_32
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return z.float().reshape(bits.shape[0], *shape)
