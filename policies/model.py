"""The π0-style flow policy: a prefix backbone over (images, instruction, state) and an action expert
that predicts the flow velocity of an action chunk, plus a Flow-Noise std head and a value head.

Glossary: N batch, P prefix tokens, S suffix tokens (actions, after π0's state token), H actions per chunk,
A action dims, C cameras, L layers. Signatures on the hot path carry the shapes (jaxtyping), checked at run time by
tests/policies/test_shapes.py.

Attention is π0's blockwise-causal joint attention: prefix tokens attend among themselves only (valid ones:
padded text and masked cameras are never attended to); suffix tokens attend to the prefix and to the suffix
block-causally (π0's state token sees the prefix and itself, the action tokens see everything). Expert layer
``l`` reads layer ``l``'s prefix keys/values, so the prefix is encoded once per observation
(:meth:`FlowPolicy.encode_prefix`) and every denoising step only runs the expert (:meth:`FlowPolicy.expert`).
:meth:`FlowPolicy.forward_joint` is the uncached reference (both streams in one pass), used to test the cache.

The options of :class:`~vla_rl.policies.policy_config.PolicyConfig` cover LeRobot's / openpi's π0 (state token in
the suffix, concat time MLP) and π0.5 (state as text, adaptive RMSNorm throughout the expert), so their
checkpoints load one to one (:mod:`vla_rl.checkpoint.lerobot_pi`).

The model knows no algorithm: samplers and likelihoods live in :mod:`vla_rl.policies.flow`, and
:meth:`~vla_rl.policies.base.FlowVLABase.field` adapts the model to their ``field(x_t, t)`` protocol. What every
architecture shares (observations, action tokens, heads, the sampling fast path) is in :mod:`vla_rl.policies.base`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vla_rl.core.shapes import Float
from vla_rl.policies.base import ExpertContext, ExpertOutput, FlowVLABase, Prefix
from vla_rl.policies.layers import (
    AdaRMSNorm,
    RMSNorm,
    StreamLayer,
    ViTBlock,
    attention,
    resize_with_pad,
    rotary_tables,
    sincos_2d_positions,
)
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import LayerGroup
from vla_rl.policies.tokenizer import SentencePieceTokenizer

STREAM_METHODS = ("project", "keys_values", "finish")   # a stream layer's halves around the joint attention


class FlowPolicy(FlowVLABase):
    """π0 / π0.5 (``policy.arch``: ``pi0``, ``pi05``): a :class:`~vla_rl.policies.seam.FlowVLA`."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        v, wp, we = cfg.vision, cfg.prefix.width, cfg.expert.width
        # The SentencePiece tokenizer of an imported policy is data, not weights: whoever loads the policy
        # folder attaches it (:meth:`set_tokenizer`).
        self.text_tokenizer: SentencePieceTokenizer | None = None
        # --- prefix inputs
        self.patch_embed = nn.Conv2d(3, v.width, kernel_size=v.patch_size, stride=v.patch_size)
        # Learned (so SigLIP weights can be loaded), initialised with fixed 2-D sin-cos positions: a
        # from-scratch ViT with random position embeddings learns to localise far too slowly.
        self.vision_pos = nn.Parameter(sincos_2d_positions(v.image_size // v.patch_size, v.width))
        self.vision_blocks = nn.ModuleList(ViTBlock(v.width, v.num_heads, v.mlp_dim) for _ in range(v.depth))
        self.vision_norm = nn.LayerNorm(v.width, eps=1e-6)
        self.vision_proj = nn.Linear(v.width, wp)
        self.text_embed = nn.Embedding(cfg.vocab_size, wp)
        nn.init.normal_(self.text_embed.weight, std=1.0 / math.sqrt(wp))
        if cfg.state_input == "token":
            self.state_proj = nn.Linear(cfg.state_dim, wp)
        elif cfg.state_input == "suffix":
            self.state_proj = nn.Linear(cfg.state_dim, we)
        elif cfg.state_input == "discrete":
            self.state_embed = nn.Embedding(cfg.state_bins, wp)
            self.state_dim_embed = nn.Parameter(torch.randn(cfg.state_dim, wp) * 0.02)
        # --- the two streams, same depth, joint attention per layer
        attn = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    rope_base=cfg.rope_base)
        adarms = cfg.time_conditioning == "adarms"
        self.prefix_layers = nn.ModuleList(
            StreamLayer(wp, cfg.prefix.mlp_dim, **attn) for _ in range(cfg.depth))
        self.expert_layers = nn.ModuleList(
            StreamLayer(we, cfg.expert.mlp_dim, cond_dim=we if adarms else None, **attn)
            for _ in range(cfg.depth))
        self.prefix_norm = RMSNorm(wp)
        self.expert_norm = AdaRMSNorm(we, we) if cfg.adarms_final_norm else RMSNorm(we)
        # --- action tokens and time conditioning
        self.action_in = nn.Linear(cfg.action_dim, we)
        if adarms:
            self.time_mlp = nn.Sequential(nn.Linear(we, we), nn.SiLU(), nn.Linear(we, we), nn.SiLU())
        else:
            self.action_time_mlp = nn.Sequential(nn.Linear(2 * we, we), nn.SiLU(), nn.Linear(we, we))
        self._build_heads()

    # ------------------------------------------------------------------------------------------------
    # Inputs
    # ------------------------------------------------------------------------------------------------

    def _pixels(self, images: Tensor) -> Tensor:
        """``[M, Hi, Wi, 3]`` uint8 or [-1, 1] -> ``[M, 3, s, s]`` in [-1, 1] at the encoder's size ``s``."""
        size = self.cfg.vision.image_size
        dtype = self.vision_pos.dtype
        x = images.permute(0, 3, 1, 2)
        x = x.to(dtype) / 127.5 - 1.0 if images.dtype == torch.uint8 else x.to(dtype)
        if x.shape[-2:] == (size, size):
            return x
        aa = self.cfg.image_antialias
        if self.cfg.image_resize == "pad":
            return resize_with_pad(x, size, antialias=aa)
        return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=aa)

    def _embed_images(self, images: Tensor, image_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Image tokens ``[N, C * patches, Wp]`` and their validity ``[N, C * patches]``; cameras missing from
        ``images`` ``[N, c, ...]`` (c < C) get zero tokens, masked out."""
        n, c = images.shape[:2]
        cams, wp = self.cfg.num_cameras, self.cfg.prefix.width
        if cams == 0:  # state-only policy: the prefix is text + state
            empty = self.vision_proj.weight.new_zeros(n, 0, wp)
            return empty, torch.zeros(n, 0, dtype=torch.bool, device=empty.device)
        x = self._pixels(images.reshape(n * c, *images.shape[2:]))
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.vision_pos  # [N*c, patches, Wv]
        for block in self.vision_blocks:
            x = block(x)
        x = self.vision_proj(self.vision_norm(x)).reshape(n, c, -1, wp)
        if c < cams:
            x = torch.cat([x, x.new_zeros(n, cams - c, x.shape[2], wp)], dim=1)
        valid = image_mask[:, :, None].expand(n, cams, x.shape[2]).reshape(n, -1)
        return x.reshape(n, -1, wp), valid

    def _embed_state(self, state: Tensor) -> Tensor | None:
        """State tokens at the end of the prefix ``[N, 1 or S, Wp]`` ("token", "discrete"), else None."""
        if self.cfg.state_input == "token":
            return self.state_proj(state.to(self.state_proj.weight.dtype))[:, None, :]
        if self.cfg.state_input == "discrete":
            # Each (normalised, clipped to [-1, 1]) state dim becomes one of ``state_bins`` tokens.
            bins = self.cfg.state_bins
            idx = ((state.float().clamp(-1, 1) + 1) / 2 * bins).long().clamp(0, bins - 1)
            return self.state_embed(idx) + self.state_dim_embed
        return None

    def _state_token(self, state: Tensor) -> Tensor | None:
        """π0's suffix state token ``[N, 1, We]`` (``state_input: suffix``), else None."""
        if self.cfg.state_input != "suffix":
            return None
        return self.state_proj(state.to(self.state_proj.weight.dtype))[:, None, :]

    def _embed_prefix(self, obs: dict) -> tuple[Tensor, Tensor]:
        img, img_valid = self._embed_images(obs["images"], obs["image_mask"])
        # Gemma scales its token embeddings by sqrt(width); image features enter unscaled (as in openpi).
        txt = self.text_embed(obs["tokens"]) * math.sqrt(self.cfg.prefix.width)
        parts, masks = [img, txt.to(img.dtype)], [img_valid, obs["token_mask"].bool()]
        st = self._embed_state(obs["state"])
        if st is not None:
            parts.append(st.to(img.dtype))
            masks.append(torch.ones(st.shape[:2], dtype=torch.bool, device=img.device))
        return torch.cat(parts, dim=1), torch.cat(masks, dim=1)

    def _embed_suffix(self, state_token: Tensor | None, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
        """Suffix tokens ``[N, S, We]`` (π0's state token, then the actions) and the adaRMS conditioning."""
        h, cond = self._embed_actions(x_t, t)
        if state_token is not None:
            h = torch.cat([state_token.to(h.dtype), h], dim=1)
        return h, cond

    def _suffix_blocks(self, length: int, device) -> Tensor:
        """``[S, S]`` bool, True where suffix query i may attend suffix key j: π0's state token (leading the
        suffix) sees itself only, action tokens see the state token and every action token."""
        leading = length - self.cfg.action_horizon   # state tokens before the actions (0 or 1)
        block = torch.arange(length, device=device).clamp(max=leading)
        return block[None, :] <= block[:, None]

    def _final_expert_norm(self, h: Tensor, cond: Tensor | None) -> Tensor:
        return self.expert_norm(h, cond)[0] if self.cfg.adarms_final_norm else self.expert_norm(h)

    # ------------------------------------------------------------------------------------------------
    # Cached path
    # ------------------------------------------------------------------------------------------------
    def encode_prefix(self, obs: dict, *, hidden: bool = True, prepared: bool = False) -> Prefix:
        """Run the prefix backbone once; keep every layer's keys/values for the denoising steps.

        ``hidden=False`` (sampling for deployment): the last layer computes its keys and values only. Its
        attention output and MLP feed nothing but ``Prefix.hidden`` (a prefix-sourced value head), so they
        are skipped, a quarter of the backbone's work at depth 4; ``hidden`` is then None. ``prepared``: ``obs``
        is already :meth:`prepare`'s output (checked and tokenized), which is not redone."""
        obs = obs if prepared else self.prepare(obs)
        h, mask = self._embed_prefix(obs)
        positions = mask.long().cumsum(dim=1) - 1
        rope = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        keys, values, h = self._run_prefix_layers(h, rope, mask[:, None, None, :], hidden)
        return Prefix(keys, values, mask, self.prefix_norm(h) if hidden else None, self._state_token(obs["state"]))

    def _suffix_positions(self, prefix_mask: Tensor, length: int) -> Tensor:
        start = prefix_mask.long().sum(dim=1, keepdim=True)
        return start + torch.arange(length, device=prefix_mask.device)[None, :]

    def _suffix_length(self, prefix: Prefix) -> int:
        return self.cfg.action_horizon + (0 if prefix.state_token is None else prefix.state_token.shape[1])

    def _expert_context(self, prefix: Prefix) -> ExpertContext:
        """What every denoising step of one prefix shares: the suffix tokens' rotary tables and mask."""
        mask = prefix.mask
        n, length = mask.shape[0], self._suffix_length(prefix)
        rope = rotary_tables(self._suffix_positions(mask, length), self.cfg.head_dim, self.cfg.rope_base)
        if length == self.cfg.action_horizon:   # every suffix token sees every other: one mask row for all
            attn_mask = torch.cat([mask, torch.ones(n, length, dtype=torch.bool, device=mask.device)],
                                  dim=1)[:, None, None, :]
        else:
            blocks = self._suffix_blocks(length, mask.device)[None].expand(n, length, length)
            attn_mask = torch.cat([mask[:, None, :].expand(n, length, -1), blocks], dim=2)[:, None]
        return ExpertContext(rope, attn_mask)

    def _expert_features(self, prefix: Prefix, x_t: Tensor, t: Tensor, ctx: ExpertContext) -> Tensor:
        """The expert's final-normed action features ``[N, H, We]``."""
        if x_t.shape[0] != prefix.batch_size:
            raise ValueError(f"x_t has batch {x_t.shape[0]} but the prefix has {prefix.batch_size}")
        h, cond = self._embed_suffix(prefix.state_token, x_t, t)
        p = prefix.mask.shape[1]
        for i, (layer, pk, pv) in enumerate(zip(self.expert_layers, prefix.keys, prefix.values)):
            q, k, v, gate = layer.project(h, ctx.rope, cond)
            if ctx.keys is None:
                keys, values = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
            else:   # the prefix part of the buffers was written once; only the suffix part changes
                keys, values = ctx.keys[i], ctx.values[i]
                keys[:, :, p:].copy_(k)
                values[:, :, p:].copy_(v)
            h = layer.finish(h, attention(q, keys, values, ctx.attn_mask), gate, cond)
        return self._final_expert_norm(h, cond)[:, h.shape[1] - self.cfg.action_horizon:]

    # What encode_prefix runs. The state projection feeds the prefix, except with π0's state token in the suffix.
    PREFIX_MODULES = ("patch_embed", "vision_pos", "vision_blocks", "vision_norm", "vision_proj", "text_embed",
                      "state_proj", "state_embed", "state_dim_embed", "prefix_layers", "prefix_norm")

    def _prefix_modules(self) -> set[str]:
        return set(self.PREFIX_MODULES) - ({"state_proj"} if self.cfg.state_input == "suffix" else set())

    def layer_groups(self) -> list[LayerGroup]:
        """The vision blocks and the prefix layers (part ``prefix``), the expert layers (part ``expert``)."""
        return [LayerGroup("prefix", tuple(self.vision_blocks)),
                LayerGroup("prefix", tuple(self.prefix_layers), STREAM_METHODS),
                LayerGroup("expert", tuple(self.expert_layers), STREAM_METHODS)]

    def idle_parameters(self, *, noise_head: bool) -> set[str]:
        """With an expert-sourced value head, the last prefix layer's query, attention output and MLP and the
        prefix's final norm (only the last layer's keys and values feed the expert); without ``noise_head``, the
        Flow-Noise std head."""
        names = [n for n, _ in self.named_parameters()]
        out = set()
        if self.cfg.value_source == "expert":
            last = f"prefix_layers.{self.cfg.depth - 1}."
            feeds = tuple(last + part for part in ("input_norm.", "k_proj.", "v_proj."))
            out |= {n for n in names if (n.startswith(last) and not n.startswith(feeds)) or
                    n.startswith("prefix_norm.")}
        if not noise_head:
            out |= {n for n in names if n.startswith("noise_head.")}
        return out

    # ------------------------------------------------------------------------------------------------
    # Uncached reference
    # ------------------------------------------------------------------------------------------------
    def forward_joint(self, obs: dict, x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]
                      ) -> tuple[Float[Tensor, "n p wp"], ExpertOutput]:
        """Both streams in one pass with the blockwise-causal mask, no cache.

        Returns the final-normed prefix output ``[N, P, Wp]`` and the expert heads. Equal to
        :meth:`encode_prefix` followed by :meth:`expert`; slower, since the prefix is recomputed.
        """
        obs = self.prepare(obs)
        hp, pmask = self._embed_prefix(obs)
        ha, cond = self._embed_suffix(self._state_token(obs["state"]), x_t, t)
        n, p, length = hp.shape[0], hp.shape[1], ha.shape[1]
        rope_p = rotary_tables(pmask.long().cumsum(dim=1) - 1, self.cfg.head_dim, self.cfg.rope_base)
        rope_a = rotary_tables(self._suffix_positions(pmask, length), self.cfg.head_dim, self.cfg.rope_base)
        # Prefix queries see valid prefix keys only; suffix queries see valid prefix keys and the suffix
        # block-causally.
        rows_prefix = torch.cat([pmask[:, None, :].expand(n, p, p),
                                 torch.zeros(n, p, length, dtype=torch.bool, device=hp.device)], dim=2)
        rows_suffix = torch.cat([pmask[:, None, :].expand(n, length, p),
                                 self._suffix_blocks(length, hp.device)[None].expand(n, length, length)], dim=2)
        attn_mask = torch.cat([rows_prefix, rows_suffix], dim=1)[:, None]
        for pl, el in zip(self.prefix_layers, self.expert_layers):
            qp, kp, vp, gp = pl.project(hp, rope_p)
            qa, ka, va, ga = el.project(ha, rope_a, cond)
            out = attention(torch.cat([qp, qa], 2), torch.cat([kp, ka], 2), torch.cat([vp, va], 2), attn_mask)
            hp = pl.finish(hp, out[:, :, :p], gp)
            ha = el.finish(ha, out[:, :, p:], ga, cond)
        prefix_hidden = self.prefix_norm(hp)
        prefix = Prefix([], [], pmask, prefix_hidden)
        ha = self._final_expert_norm(ha, cond)
        return prefix_hidden, self._heads(ha[:, length - self.cfg.action_horizon:], prefix)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
