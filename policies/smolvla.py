"""SmolVLA (LeRobot's 450M-parameter flow-matching VLA) as a :class:`~vla_rl.policies.seam.FlowVLA`.

The prefix is SmolVLM2 cut to its first ``depth`` layers: a SigLIP encoder per camera, a pixel-shuffle connector
(``smolvla.pixel_shuffle`` x ``smolvla.pixel_shuffle`` patches become one token, projected to the text width),
SmolLM2's token embeddings, and one projected state token; image and text tokens attend to each other
bidirectionally, the state token (its own block) sees them all and they do not see it. The action expert is a
SmolLM2-shaped stream at its own width whose layers take turns: every ``smolvla.self_attn_every``-th layer attends
jointly to the prefix layer's keys / values and to the action tokens (as π0's expert does), the others cross-attend
to that layer's keys / values, projected by the expert's own ``k_proj`` / ``v_proj`` (so those project the
prefix's key width, not the expert's). Action tokens attend causally among themselves. Time enters as π0's: a
sine-cosine embedding concatenated with the action token and an MLP. RoPE uses base ``rope_base`` (10,000: LeRobot's
own rotation, whatever the text config says), positions count the valid prefix tokens, the expert's queries in a
cross-attention layer count from 0.

Glossary as in :mod:`vla_rl.policies.model`. The numbers reproduce LeRobot's ``SmolVLAPolicy`` (0.6):
tests/checkpoint/test_lerobot_smolvla.py compares with fixtures LeRobot itself wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vla_rl.policies.base import ExpertContext, FlowVLABase, Prefix
from vla_rl.policies.layers import (
    GatedMLP,
    ViTBlock,
    apply_rotary,
    attention,
    residual,
    rotary_tables,
    sincos_2d_positions,
)
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import LayerGroup

STREAM_METHODS = ("project", "keys_values", "query", "cross_keys_values", "finish")


class LlamaRMSNorm(nn.Module):
    """y = w * x / rms(x), w starting at 1 (Llama's parametrisation, so SmolLM2 weights map one to one)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


class LlamaLayer(nn.Module):
    """One layer of a Llama stream, split around its attention like :class:`~vla_rl.policies.layers.StreamLayer`.
    ``kv_width``: the width ``k_proj`` / ``v_proj`` read (a cross-attention layer of the expert reads the prefix's
    keys / values, ``num_kv_heads * head_dim`` wide; default the layer's own width)."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 kv_width: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.input_norm = LlamaRMSNorm(width, eps)
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_width or width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_width or width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)
        self.post_attention_norm = LlamaRMSNorm(width, eps)
        self.mlp = GatedMLP(width, mlp_dim, activation="silu")   # SwiGLU

    def _heads(self, x: Tensor, count: int) -> Tensor:
        n, length, _ = x.shape
        return x.view(n, length, count, self.head_dim).transpose(1, 2)

    def project(self, h: Tensor, rope: tuple[Tensor, Tensor]):
        """Self-attention: ``h`` ``[N, L, W]`` -> rotated q ``[N, Hq, L, D]``, rotated k and v ``[N, Hkv, L, D]``."""
        x = self.input_norm(h)
        q = self._heads(self.q_proj(x), self.num_heads)
        k, v = self._heads(self.k_proj(x), self.num_kv_heads), self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rotary(q, rope), apply_rotary(k, rope), v

    def keys_values(self, h: Tensor, rope: tuple[Tensor, Tensor]):
        x = self.input_norm(h)
        k, v = self._heads(self.k_proj(x), self.num_kv_heads), self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rotary(k, rope), v

    def query(self, h: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Cross-attention: the rotated queries ``[N, Hq, L, D]`` alone."""
        return apply_rotary(self._heads(self.q_proj(self.input_norm(h)), self.num_heads), rope)

    def cross_keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The prefix layer's (rotated) keys and values ``[N, Hkv, P, D]`` through this layer's ``k_proj`` /
        ``v_proj`` (no further rotation), as LeRobot's cross-attention layers read them."""
        n, hkv, p, d = keys.shape
        flat = lambda x: x.transpose(1, 2).reshape(n, p, hkv * d).to(self.k_proj.weight.dtype)  # noqa: E731
        return self._heads(self.k_proj(flat(keys)), self.num_kv_heads), \
            self._heads(self.v_proj(flat(values)), self.num_kv_heads)

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:
        n, _, length, _ = attn.shape
        h = residual(h, self.o_proj(attn.transpose(1, 2).reshape(n, length, -1)))
        return residual(h, self.mlp(self.post_attention_norm(h)))


def pixel_shuffle(x: Tensor, factor: int) -> Tensor:
    """``[M, g * g, W]`` patch features -> ``[M, (g / f)^2, W f^2]``: each f x f block of patches one token, its
    features in SmolVLM's order (the connector's weights expect it)."""
    m, seq, w = x.shape
    g = math.isqrt(seq)
    x = x.reshape(m, g, g // factor, w * factor).permute(0, 2, 1, 3)
    x = x.reshape(m, g // factor, g // factor, w * factor * factor).permute(0, 2, 1, 3)
    return x.reshape(m, seq // (factor * factor), w * factor * factor)


def resize_with_pad_top_left(x: Tensor, size: int) -> Tensor:
    """``[M, 3, H, W]`` in [0, 1] -> ``[M, 3, size, size]``: bilinear (no antialias) so the longer side is ``size``,
    black padding on the left and top (SmolVLA's resize), no clipping."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    y = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(y, (max(0, size - rw), 0, max(0, size - rh), 0), value=0.0)


@dataclass
class SmolVLAContext(ExpertContext):
    """:class:`~vla_rl.policies.base.ExpertContext` plus what the cross-attention layers share: the queries'
    rotary tables (positions from 0), the mask over the prefix ``[N, 1, 1, P]`` and, for sampling, the prefix's
    keys / values through each cross layer's projections (``None`` entries for self-attention layers)."""

    cross_rope: tuple[Tensor, Tensor] | None = None
    cross_mask: Tensor | None = None
    cross_kv: list[tuple[Tensor, Tensor] | None] | None = None


class SmolVLA(FlowVLABase):
    """SmolVLA (``policy.arch: smolvla``): the module docstring."""

    PREFIX_MODULES = ("patch_embed", "vision_pos", "vision_blocks", "vision_norm", "connector", "text_embed",
                      "state_proj", "prefix_layers", "prefix_norm")

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        v, wp, we, opt = cfg.vision, cfg.prefix.width, cfg.expert.width, cfg.smolvla
        self.text_tokenizer = None
        # --- prefix: SigLIP per camera, pixel shuffle, SmolLM2 cut to `depth` layers
        self.patch_embed = nn.Conv2d(3, v.width, kernel_size=v.patch_size, stride=v.patch_size)
        self.vision_pos = nn.Parameter(sincos_2d_positions(v.image_size // v.patch_size, v.width))
        self.vision_blocks = nn.ModuleList(ViTBlock(v.width, v.num_heads, v.mlp_dim) for _ in range(v.depth))
        self.vision_norm = nn.LayerNorm(v.width, eps=1e-6)
        self.connector = nn.Linear(v.width * opt.pixel_shuffle ** 2, wp, bias=False)
        self.text_embed = nn.Embedding(cfg.vocab_size, wp)
        nn.init.normal_(self.text_embed.weight, std=1.0 / math.sqrt(wp))
        self.state_proj = nn.Linear(cfg.state_dim, wp)
        attn = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    eps=opt.norm_eps)
        self.prefix_layers = nn.ModuleList(LlamaLayer(wp, cfg.prefix.mlp_dim, **attn) for _ in range(cfg.depth))
        self.prefix_norm = LlamaRMSNorm(wp, opt.norm_eps)
        # --- the expert: self-attention every `self_attn_every` layers, cross-attention in between
        kv_width = cfg.num_kv_heads * cfg.head_dim
        self.expert_layers = nn.ModuleList(
            LlamaLayer(we, cfg.expert.mlp_dim, kv_width=None if opt.self_attention(i) else kv_width, **attn)
            for i in range(opt.expert_count(cfg.depth)))
        self.expert_norm = LlamaRMSNorm(we, opt.norm_eps)
        self.action_in = nn.Linear(cfg.action_dim, we)
        self.action_time_mlp = nn.Sequential(nn.Linear(2 * we, we), nn.SiLU(), nn.Linear(we, we))
        self._build_heads()
        # prefix layer i -> the expert layer that runs beside it (None: none does)
        every = cfg.depth // opt.expert_count(cfg.depth)
        self.expert_at = [i // every if i % every == 0 else None for i in range(cfg.depth)]

    # ------------------------------------------------------------------------------------------------ prefix
    def _pixels(self, images: Tensor) -> Tensor:
        """``[M, Hi, Wi, 3]`` uint8 or [-1, 1] -> ``[M, 3, s, s]`` in [-1, 1]: SmolVLA resizes in [0, 1] with black
        padding on the left and top, then maps to [-1, 1]."""
        dtype = self.vision_pos.dtype
        x = images.permute(0, 3, 1, 2)
        x = x.to(dtype) / 255.0 if images.dtype == torch.uint8 else (x.to(dtype) + 1.0) / 2.0
        return resize_with_pad_top_left(x, self.cfg.vision.image_size) * 2.0 - 1.0

    def _embed_images(self, images: Tensor, image_mask: Tensor) -> tuple[Tensor, Tensor]:
        n, c = images.shape[:2]
        cams, wp = self.cfg.num_cameras, self.cfg.prefix.width
        if cams == 0:
            empty = self.connector.weight.new_zeros(n, 0, wp)
            return empty, torch.zeros(n, 0, dtype=torch.bool, device=empty.device)
        x = self._pixels(images.reshape(n * c, *images.shape[2:]))
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.vision_pos
        for block in self.vision_blocks:
            x = block(x)
        x = self.connector(pixel_shuffle(self.vision_norm(x), self.cfg.smolvla.pixel_shuffle))
        x = (x * torch.tensor(wp ** 0.5, dtype=x.dtype, device=x.device)).reshape(n, c, -1, wp)
        if c < cams:
            x = torch.cat([x, x.new_zeros(n, cams - c, x.shape[2], wp)], dim=1)
        valid = image_mask[:, :, None].expand(n, cams, x.shape[2]).reshape(n, -1)
        return x.reshape(n, -1, wp), valid

    def _embed_prefix(self, obs: dict) -> tuple[Tensor, Tensor]:
        img, img_valid = self._embed_images(obs["images"], obs["image_mask"])
        txt = self.text_embed(obs["tokens"]) * math.sqrt(self.cfg.prefix.width)
        state = self.state_proj(obs["state"].to(self.state_proj.weight.dtype))[:, None, :]
        ones = torch.ones(state.shape[:2], dtype=torch.bool, device=img.device)
        return (torch.cat([img, txt.to(img.dtype), state.to(img.dtype)], dim=1),
                torch.cat([img_valid, obs["token_mask"].bool(), ones], dim=1))

    def encode_prefix(self, obs: dict, *, hidden: bool = True, prepared: bool = False) -> Prefix:
        obs = obs if prepared else self.prepare(obs)
        h, mask = self._embed_prefix(obs)
        p = mask.shape[1]
        rope = rotary_tables(mask.long().cumsum(dim=1) - 1, self.cfg.head_dim, self.cfg.rope_base)
        # images and text see each other (valid ones), the state token (the last, its own block) sees everything
        block = (torch.arange(p, device=mask.device) == p - 1).long()
        attn_mask = (block[None, :] <= block[:, None])[None, None] & mask[:, None, None, :]
        keys, values, h = self._run_prefix_layers(h, rope, attn_mask, hidden)
        return Prefix(keys, values, mask, self.prefix_norm(h) if hidden else None)

    # ------------------------------------------------------------------------------------------------ expert
    def _expert_context(self, prefix: Prefix) -> SmolVLAContext:
        mask, h = prefix.mask, self.cfg.action_horizon
        n = mask.shape[0]
        start = mask.long().sum(dim=1, keepdim=True)
        steps = torch.arange(h, device=mask.device)[None, :]
        rope = rotary_tables(start + steps, self.cfg.head_dim, self.cfg.rope_base)
        causal = (steps <= steps.T)[None].expand(n, h, h)   # action i sees actions j <= i
        attn_mask = torch.cat([mask[:, None, :].expand(n, h, -1), causal], dim=2)[:, None]
        cross_rope = rotary_tables(steps.expand(n, h), self.cfg.head_dim, self.cfg.rope_base)
        return SmolVLAContext(rope, attn_mask, cross_rope=cross_rope, cross_mask=mask[:, None, None, :])

    def _cross_kv(self, prefix: Prefix) -> list[tuple[Tensor, Tensor] | None]:
        return [None if e is None or self.cfg.smolvla.self_attention(i) else
                self.expert_layers[e].cross_keys_values(prefix.keys[i], prefix.values[i])
                for i, e in enumerate(self.expert_at)]

    def _expert_features(self, prefix: Prefix, x_t: Tensor, t: Tensor, ctx: SmolVLAContext) -> Tensor:
        if x_t.shape[0] != prefix.batch_size:
            raise ValueError(f"x_t has batch {x_t.shape[0]} but the prefix has {prefix.batch_size}")
        h, _ = self._embed_actions(x_t, t)   # π0's concatenated time embedding (no adaRMS conditioning)
        p = prefix.mask.shape[1]
        for i, e in enumerate(self.expert_at):
            if e is None:
                continue
            layer = self.expert_layers[e]
            if self.cfg.smolvla.self_attention(i):
                q, k, v = layer.project(h, ctx.rope)
                if ctx.keys is None:
                    keys, values = torch.cat([prefix.keys[i], k], dim=2), torch.cat([prefix.values[i], v], dim=2)
                else:   # sampling: the prefix part of the buffer was written once
                    keys, values = ctx.keys[i], ctx.values[i]
                    keys[:, :, p:].copy_(k)
                    values[:, :, p:].copy_(v)
                out = attention(q, keys, values, ctx.attn_mask)
            else:
                ck, cv = ctx.cross_kv[i] if ctx.cross_kv is not None else \
                    layer.cross_keys_values(prefix.keys[i], prefix.values[i])
                out = attention(layer.query(h, ctx.cross_rope), ck, cv, ctx.cross_mask)
            h = layer.finish(h, out)
        return self.expert_norm(h)

    def sampling_context(self, prefix: Prefix, *, buffers: bool = True,
                         rope_mask: SmolVLAContext | None = None) -> SmolVLAContext:
        """:meth:`~vla_rl.policies.base.FlowVLABase.sampling_context`, plus the cross layers' keys / values of the
        prefix, projected once for all the denoising steps (with ``buffers``, i.e. without autograd)."""
        ctx = rope_mask if rope_mask is not None else self._expert_context(prefix)
        out = SmolVLAContext(ctx.rope, ctx.attn_mask, cross_rope=ctx.cross_rope, cross_mask=ctx.cross_mask)
        if not buffers:
            return out
        p, h = prefix.mask.shape[1], self.cfg.action_horizon

        def buffer(x: Tensor) -> Tensor:
            b = x.new_empty(*x.shape[:2], p + h, x.shape[3])
            b[:, :, :p] = x
            return b

        out.keys, out.values = [buffer(k) for k in prefix.keys], [buffer(v) for v in prefix.values]
        out.cross_kv = self._cross_kv(prefix)
        return out

    # ------------------------------------------------------------------------------------------------ seam
    def layer_groups(self) -> list[LayerGroup]:
        return [LayerGroup("prefix", tuple(self.vision_blocks)),
                LayerGroup("prefix", tuple(self.prefix_layers), STREAM_METHODS),
                LayerGroup("expert", tuple(self.expert_layers), STREAM_METHODS)]

    def idle_parameters(self, *, noise_head: bool) -> set[str]:
        """With an expert-sourced value head, the last prefix layer beyond its keys and values (all of it when no
        expert layer runs beside it) and the prefix's final norm; without ``noise_head``, the std head."""
        names = [n for n, _ in self.named_parameters()]
        out = set()
        if self.cfg.value_source == "expert":
            last = len(self.prefix_layers) - 1
            pre = f"prefix_layers.{last}."
            feeds = () if self.expert_at[last] is None else tuple(pre + f for f in ("input_norm.", "k_proj.",
                                                                                    "v_proj."))
            out |= {n for n in names if (n.startswith(pre) and not n.startswith(feeds)) or
                    n.startswith("prefix_norm.")}
        if not noise_head:
            out |= {n for n in names if n.startswith("noise_head.")}
        return out
