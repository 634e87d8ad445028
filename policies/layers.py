"""Transformer building blocks in the style of π0's Gemma backbone and action expert.

RMSNorm with a (1 + weight) scale (Gemma's parametrisation, so Gemma weights map one to one), an
adaptive RMSNorm variant (π0.5's time conditioning), rotary positions, grouped-query attention
(π0's expert uses one KV head), a gated-GELU MLP, and a small pre-norm ViT block for images.

Glossary: N batch, L tokens, D head size, W stream width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w); w starts at 0. Computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive RMSNorm: scale, shift and a residual gate predicted from a conditioning vector.

    The modulation is zero-initialised, so at init the norm is a plain RMS normalisation and the gate is
    0 (each residual branch starts as identity, as in adaLN-Zero).
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.modulation = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)
        self.eps = eps

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``[N, L, W]``, ``cond`` ``[N, C]`` -> (normalised x, gate ``[N, 1, W]``)."""
        scale, shift, gate = self.modulation(cond)[:, None, :].chunk(3, dim=-1)
        y = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)
        return (y * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate


def rotary_tables(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin ``[N, 1, L, D/2]`` of rotary angles at ``positions`` ``[N, L]``. They depend on the
    positions only, so a forward computes them once and every layer's queries and keys share them."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None, :, None] * inv_freq                                # [N,1,L,D/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate ``x`` ``[N, heads, L, D]`` by the tables of :func:`rotary_tables` (rotate-half convention)."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate ``x`` ``[N, heads, L, D]`` by ``positions`` ``[N, L]`` (rotate-half convention)."""
    return apply_rotary(x, rotary_tables(positions, x.shape[-1], base))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention. ``q`` ``[N, Hq, Lq, D]``, ``k``/``v`` ``[N, Hkv, Lk, D]``,
    ``mask`` ``[N, 1, Lq or 1, Lk]`` bool (True = may attend). Returns ``[N, Hq, Lq, D]``."""
    n, hq, lq, d = q.shape
    hkv = k.shape[1]
    if hq != hkv and mask.shape[2] == 1:
        # The Hq / Hkv query heads that share a key/value head become one head of Hq / Hkv * Lq queries
        # (a view): one larger attention per key/value head instead of several small ones, same results.
        out = F.scaled_dot_product_attention(q.reshape(n, hkv, hq // hkv * lq, d), k, v, attn_mask=mask)
        return out.view(n, hq, lq, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)


def residual(h: Tensor, out: Tensor, gate: Tensor | None = None) -> Tensor:
    """``h + out`` (``h + out * gate`` with a gate). Without autograd the sum is written into ``out``'s
    buffer (same values: float addition commutes), sparing a fresh activation-sized tensor."""
    if torch.is_grad_enabled() and (h.requires_grad or out.requires_grad or
                                     (gate is not None and gate.requires_grad)):
        return h + (out if gate is None else out * gate)
    return (out if gate is None else out.mul_(gate)).add_(h)


class GatedMLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), with Gemma's tanh-approximated GELU (``activation="gelu_tanh"``) or
    Llama's SiLU (``"silu"``, SwiGLU)."""

    def __init__(self, width: int, hidden: int, activation: str = "gelu_tanh"):
        super().__init__()
        if activation not in ("gelu_tanh", "silu"):
            raise ValueError(f"activation must be gelu_tanh or silu, got {activation!r}")
        self.activation = activation
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        silu = self.activation == "silu"
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj((F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up)
        # Without autograd the gate's buffer takes the activation and the product (same values): the two
        # largest intermediate tensors of the layer are not allocated again.
        act = F.silu(gate, inplace=True) if silu else torch.ops.aten.gelu_(gate, approximate="tanh")
        return self.down_proj(act.mul_(up))


class StreamLayer(nn.Module):
    """One layer of one stream (prefix backbone or action expert).

    The attention itself is joint across streams, so the layer is split in two halves: :meth:`project`
    (norm + q/k/v with rotary positions) and :meth:`finish` (output projection, residual, MLP). Whoever
    owns both streams concatenates their keys/values in between.
    """

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_base: float, cond_dim: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_base = (
            num_heads, num_kv_heads, head_dim, rope_base)
        self.adaptive = cond_dim is not None
        norm = (lambda: AdaRMSNorm(width, cond_dim)) if self.adaptive else (lambda: RMSNorm(width))
        self.input_norm, self.post_attention_norm = norm(), norm()
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)
        self.mlp = GatedMLP(width, mlp_dim)

    def _norm(self, norm: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return norm(x, cond) if self.adaptive else (norm(x), None)

    def project(self, h: Tensor, rope: tuple[Tensor, Tensor], cond: Tensor | None = None):
        """``h`` ``[N, L, W]`` -> q ``[N, Hq, L, D]``, k, v ``[N, Hkv, L, D]``, attention gate. ``rope``: the
        rotary tables of the tokens' positions (:func:`rotary_tables`)."""
        n, length, _ = h.shape
        x, gate = self._norm(self.input_norm, h, cond)
        q = self.q_proj(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self._keys_values(x)
        return apply_rotary(q, rope), apply_rotary(k, rope), v, gate

    def keys_values(self, h: Tensor, rope: tuple[Tensor, Tensor], cond: Tensor | None = None):
        """Rotated keys and values ``[N, Hkv, L, D]`` alone: what a layer whose outputs nobody reads still
        hands to the layer's other stream."""
        x, _ = self._norm(self.input_norm, h, cond)
        k, v = self._keys_values(x)
        return apply_rotary(k, rope), v

    def _keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n, length, _ = x.shape
        k = self.k_proj(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def finish(self, h: Tensor, attn: Tensor, attn_gate: Tensor | None, cond: Tensor | None = None) -> Tensor:
        """Residual update of ``h`` given this stream's attention output ``attn`` ``[N, Hq, L, D]``."""
        n, _, length, _ = attn.shape
        h = residual(h, self.o_proj(attn.transpose(1, 2).reshape(n, length, -1)), attn_gate)
        x, mlp_gate = self._norm(self.post_attention_norm, h, cond)
        return residual(h, self.mlp(x), mlp_gate)


class ViTBlock(nn.Module):
    """Pre-LayerNorm ViT block with full attention and a GELU MLP (SigLIP-like)."""

    def __init__(self, width: int, num_heads: int, mlp_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, mlp_dim), nn.Linear(mlp_dim, width)

    def forward(self, x: Tensor) -> Tensor:
        n, length, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, w)
        x = residual(x, self.proj(a))
        hidden = self.fc1(self.norm2(x))
        if torch.is_grad_enabled() and hidden.requires_grad:
            return x + self.fc2(F.gelu(hidden, approximate="tanh"))
        return residual(x, self.fc2(torch.ops.aten.gelu_(hidden, approximate="tanh")))


def sincos_time_embedding(t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0,
                          precision: torch.dtype = torch.float32) -> Tensor:
    """π0's sine-cosine embedding of flow time ``t`` ``[N]`` in [0, 1] -> ``[N, dim]`` float32.

    Periods are spaced geometrically between ``min_period`` and ``max_period`` so that the whole unit
    interval is resolved (the usual 10000-base embedding is built for integer positions). The angles reach
    2π / min_period (≈ 1571 rad): in float32 they are off by ~1e-4 rad, so π0 / π0.5 checkpoints (trained with
    float64 angles, as LeRobot and openpi compute them) want ``precision=torch.float64``.
    """
    if dim % 2:
        raise ValueError(f"time embedding dim must be even, got {dim}")
    if t.device.type == "mps":   # no float64 there
        precision = torch.float32
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=precision)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.to(precision)[:, None] * (2.0 * math.pi / period)[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1).float()


def resize_with_pad(x: Tensor, size: int, antialias: bool = True) -> Tensor:
    """Images ``[M, 3, H, W]`` in [-1, 1] -> ``[M, 3, size, size]`` keeping the aspect ratio: bilinear resize
    (``antialias``: antialiased when shrinking, as JAX's and PIL's resize; without, as openpi's and LeRobot's
    ``resize_with_pad_torch``) so the longer side is ``size``, then centred black padding (-1), as openpi's
    ``resize_with_pad`` prepares π0's images."""
    h, w = x.shape[-2:]
    ratio = max(h / size, w / size)
    rh, rw = max(1, int(h / ratio)), max(1, int(w / ratio))
    y = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=antialias).clamp(-1.0, 1.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(y, (left, size - rw - left, top, size - rh - top), value=-1.0)


def sincos_2d_positions(grid: int, dim: int) -> Tensor:
    """Fixed 2-D sine-cosine position embedding ``[grid*grid, dim]`` (half the dims encode the row, half
    the column), as in MAE / SigLIP-style ViTs: patches know where they are from the first step on."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs dim divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                            indexing="ij")
    out = []
    for coord in (ys.flatten(), xs.flatten()):
        angle = coord[:, None] * omega[None, :]
        out += [torch.sin(angle), torch.cos(angle)]
    return torch.cat(out, dim=1)
