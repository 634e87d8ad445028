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
:meth:`FlowPolicy.field` adapts the model to their ``field(x_t, t)`` protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vla_rl.core.shapes import Bool, Float
from vla_rl.policies.layers import (
    AdaRMSNorm,
    RMSNorm,
    StreamLayer,
    ViTBlock,
    attention,
    resize_with_pad,
    rotary_tables,
    sincos_2d_positions,
    sincos_time_embedding,
)
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.seam import LayerGroup
from vla_rl.policies.tokenizer import SentencePieceTokenizer, discretize_state, pi0_prompt, pi05_prompt, tokenize


@dataclass
class Prefix:
    """Cached prefix of a batch of observations.

    keys / values  L x ``[N, Hkv, P, D]``  per-layer keys (rotated) and values
    mask           ``[N, P]`` bool          valid prefix tokens
    hidden         ``[N, P, Wp]`` or None   final-normed prefix output (read by a prefix value head; None
                                            when encoded for sampling only, ``encode_prefix(hidden=False)``)
    state_token    ``[N, 1, We]`` or None   π0's projected state, the first suffix token of every expert pass
    """

    keys: list[Float[Tensor, "n hkv p d"]]
    values: list[Float[Tensor, "n hkv p d"]]
    mask: Bool[Tensor, "n p"]
    hidden: Float[Tensor, "n p wp"] | None
    state_token: Float[Tensor, "n 1 we"] | None = None

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def repeat(self, times: int) -> Prefix:
        """Each observation ``times`` times in a row (e.g. several chunks sampled per observation)."""
        rep = lambda x: x.repeat_interleave(times, dim=0)  # noqa: E731
        return Prefix([rep(k) for k in self.keys], [rep(v) for v in self.values], rep(self.mask),
                      None if self.hidden is None else rep(self.hidden),
                      None if self.state_token is None else rep(self.state_token))


@dataclass
class ExpertOutput:
    """velocity ``[N, H, A]``, noise_std ``[N, H, A]`` (Flow-Noise head), value ``[N]``, features
    ``[N, H, We]``. All heads come out of one expert pass, in float32."""

    velocity: Float[Tensor, "n h a"]
    noise_std: Float[Tensor, "n h a"]
    value: Float[Tensor, " n"]
    features: Float[Tensor, "n h we"]


@dataclass
class ExpertContext:
    """Per-prefix state of the denoising steps: the suffix tokens' rotary tables, the attention mask
    ``[N, 1, 1 or S, P + S]``, and (sampling without gradients) per-layer key/value buffers ``[N, Hkv, P + S, D]``."""

    rope: tuple[Tensor, Tensor]
    attn_mask: Tensor
    keys: list[Tensor] | None = None
    values: list[Tensor] | None = None


STREAM_METHODS = ("project", "keys_values", "finish")   # a stream layer's halves around the joint attention


class FlowPolicy(nn.Module):
    """π0 / π0.5 (``policy.arch``: ``pi0``, ``pi05``): a :class:`~vla_rl.policies.seam.FlowVLA`."""

    FORWARD_METHODS = ("encode_prefix", "expert", "value")

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
        # --- heads
        self.velocity_head = nn.Linear(we, cfg.action_dim)
        self.noise_head = nn.Linear(we, cfg.action_dim)
        value_in = we if cfg.value_source == "expert" else wp
        self.value_head = nn.Sequential(nn.Linear(value_in, cfg.value_hidden), nn.GELU(),
                                        nn.Linear(cfg.value_hidden, 1))

    # ------------------------------------------------------------------------------------------------
    # Inputs
    # ------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.action_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.action_in.weight.dtype

    def set_tokenizer(self, tokenizer: SentencePieceTokenizer | None) -> None:
        """Attach the SentencePiece tokenizer a ``tokenizer: sentencepiece`` policy encodes prompts with."""
        if tokenizer is not None and tokenizer.vocab_size > self.cfg.vocab_size:
            raise ValueError(f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size} pieces, more than the "
                             f"policy's {self.cfg.vocab_size} text embeddings")
        self.text_tokenizer = tokenizer

    def prompts(self, instructions: list[str], state: Tensor) -> list[str]:
        """The text each instruction becomes: π0.5's prompt with the discretised (normalised) state
        ``[N, S]``, π0's "task\\n" for a SentencePiece policy, the instruction itself otherwise."""
        if self.cfg.state_input == "prompt":
            bins = discretize_state(state, self.cfg.state_bins).tolist()
            return [pi05_prompt(text, row) for text, row in zip(instructions, bins)]
        if self.cfg.tokenizer == "sentencepiece":
            return [pi0_prompt(text) for text in instructions]
        return list(instructions)

    def tokenize(self, instructions: list[str], state: Tensor) -> tuple[Tensor, Tensor]:
        """``tokens`` / ``token_mask`` ``[N, max_text_tokens]`` of the instructions (and, for π0.5, the state)."""
        cfg = self.cfg
        texts = self.prompts(instructions, state)
        if cfg.tokenizer == "sentencepiece":
            if self.text_tokenizer is None:
                raise RuntimeError(f"this policy tokenizes with SentencePiece ({cfg.tokenizer_file}) but no "
                                   "tokenizer is attached: load it with vla_rl.checkpoint.load_policy, or call "
                                   "set_tokenizer")
            return self.text_tokenizer(texts, cfg.max_text_tokens, device=state.device)
        return tokenize(texts, cfg.max_text_tokens, kind=cfg.tokenizer, vocab_size=cfg.vocab_size,
                        device=state.device)

    def prepare(self, obs: dict) -> dict:
        """Validate a raw observation dict and tokenize its instruction.

        ``obs``: ``images`` ``[N, c, Hi, Wi, 3]``, uint8 (0..255) or floating point already scaled to [-1, 1];
        ``state`` float ``[N, S]`` (normalised); ``instruction`` (list of N strings) or already-made ``tokens`` /
        ``token_mask`` ``[N, T]``; optionally ``image_mask`` ``[N, c]`` bool (False: that camera is left out).
        ``c`` is ``num_cameras``, or fewer when ``missing_cameras: mask`` (the first slots are filled, the rest
        masked). Images of another size are resized to the encoder's (``image_resize``). Returns the same keys
        with ``image_mask`` ``[N, num_cameras]``.
        """
        cfg = self.cfg
        for key in ("images", "state"):
            if key not in obs:
                raise KeyError(f"observation is missing {key!r} (has {sorted(obs)})")
        images, state = obs["images"], obs["state"]
        if images.dtype != torch.uint8 and not images.is_floating_point():
            raise TypeError(f"images must be uint8 [N, C, H, W, 3] (or floating point in [-1, 1]), got {images.dtype}")
        cams = cfg.num_cameras
        expected = f"[N, {cams}, H, W, 3]" if cfg.missing_cameras == "error" or not cams else \
            f"[N, 1..{cams}, H, W, 3]"
        if (images.dim() != 5 or images.shape[-1] != 3 or images.shape[1] > cams
                or (images.shape[1] < cams and (cfg.missing_cameras == "error" or images.shape[1] == 0))):
            raise ValueError(f"images must have shape {expected}, got {tuple(images.shape)}")
        if images.is_floating_point() and images.device.type != "meta" and images.numel() and \
                not bool(((images >= -1) & (images <= 1)).all()):
            raise ValueError("floating-point images must be scaled to [-1, 1] (give uint8 images for 0..255 pixels)")
        n = images.shape[0]
        if state.dim() != 2 or state.shape != (n, cfg.state_dim):
            raise ValueError(f"state must have shape [{n}, {cfg.state_dim}], got {tuple(state.shape)}")
        if not state.is_floating_point():
            raise TypeError(f"state must be floating point, got {state.dtype}")
        if state.device.type != "meta" and not torch.isfinite(state).all():
            raise ValueError("state contains NaN or inf")
        image_mask = torch.ones(n, cams, dtype=torch.bool, device=images.device)
        image_mask[:, images.shape[1]:] = False
        if obs.get("image_mask") is not None:
            given = obs["image_mask"]
            if given.dtype != torch.bool or given.shape[0] != n or given.shape[1] not in (images.shape[1], cams):
                raise ValueError(f"image_mask must be bool [{n}, {images.shape[1]}], got {given.dtype} "
                                 f"{tuple(given.shape)}")
            image_mask[:, : given.shape[1]] &= given.to(images.device)
        if "tokens" in obs:
            tokens, token_mask = obs["tokens"], obs["token_mask"]
        elif "instruction" in obs:
            instr = obs["instruction"]
            if isinstance(instr, str) or len(instr) != n:
                raise ValueError(f"got {1 if isinstance(instr, str) else len(instr)} instructions for {n} "
                                 "observations")
            tokens, token_mask = self.tokenize(list(instr), state)
            tokens, token_mask = tokens.to(images.device), token_mask.to(images.device)
        else:
            raise KeyError("observation needs 'instruction' (list of str) or 'tokens' + 'token_mask'")
        if tokens.shape != (n, cfg.max_text_tokens):
            raise ValueError(f"tokens must have shape [{n}, {cfg.max_text_tokens}], "
                             f"got {tuple(tokens.shape)}")
        return {"images": images, "image_mask": image_mask, "state": state, "tokens": tokens,
                "token_mask": token_mask}

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

    def embed_prefix(self, obs: dict) -> tuple[Tensor, Tensor]:
        """Prefix tokens ``[N, P, Wp]`` and their validity mask ``[N, P]``."""
        return self._embed_prefix(self.prepare(obs))

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

    def _embed_actions(self, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
        """Action tokens ``[N, H, We]`` and the adaRMS conditioning ``[N, We]`` (None for π0 style)."""
        cfg = self.cfg
        if x_t.dim() != 3 or x_t.shape[1:] != (cfg.action_horizon, cfg.action_dim):
            raise ValueError(f"x_t must have shape [N, {cfg.action_horizon}, {cfg.action_dim}], "
                             f"got {tuple(x_t.shape)}")
        if t.dim() != 1 or t.shape[0] != x_t.shape[0]:
            raise ValueError(f"t must have shape [{x_t.shape[0]}], got {tuple(t.shape)}")
        we = cfg.expert.width
        dtype = self.action_in.weight.dtype
        tokens = self.action_in(x_t.to(dtype))
        temb = sincos_time_embedding(t, we, cfg.time_min_period, cfg.time_max_period,
                                     getattr(torch, cfg.time_embedding_precision)).to(dtype)
        if cfg.time_conditioning == "adarms":
            return tokens, self.time_mlp(temb)
        temb = temb[:, None, :].expand(-1, tokens.shape[1], -1)
        return self.action_time_mlp(torch.cat([tokens, temb], dim=-1)), None

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
        attn_mask = mask[:, None, None, :]
        keys, values = [], []
        last = len(self.prefix_layers) - 1
        for i, layer in enumerate(self.prefix_layers):
            if i == last and not hidden:
                k, v = layer.keys_values(h, rope)
                keys.append(k)
                values.append(v)
                break
            q, k, v, gate = layer.project(h, rope)
            keys.append(k)
            values.append(v)
            h = layer.finish(h, attention(q, k, v, attn_mask), gate)
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

    def expert(self, prefix: Prefix, x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]) -> ExpertOutput:
        """One expert pass at ``x_t`` ``[N, H, A]``, times ``t`` ``[N]``: velocity, noise std, value."""
        return self._heads(self._expert_features(prefix, x_t, t, self._expert_context(prefix)), prefix)

    def velocity_field(self, prefix: Prefix):
        """``f(x_t, t) -> velocity`` for sampling without gradients (deployment, evaluation): equal to
        ``expert(prefix, x_t, t).velocity`` bit for bit, at less cost per denoising step. The suffix tokens'
        rotary tables and mask are made once per prefix; each layer's keys/values live in one buffer that
        holds the prefix's part from the first call on, so a step writes the suffix part instead of
        concatenating the whole; the std and value heads do not run. Under autograd it falls back to
        concatenation (a buffer rewritten in place cannot be differentiated through)."""
        ctx = self.sampling_context(prefix, buffers=False)
        buffered: dict[bool, ExpertContext] = {}

        def f(x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]) -> Float[Tensor, "n h a"]:
            if torch.is_grad_enabled():
                return self.sampling_velocity(prefix, ctx, x_t, t)
            mode = torch.is_inference_mode_enabled()   # inference tensors cannot be written outside the mode
            if mode not in buffered:
                buffered[mode] = self.sampling_context(prefix, rope_mask=ctx)
            return self.sampling_velocity(prefix, buffered[mode], x_t, t)

        return f

    def sampling_context(self, prefix: Prefix, *, buffers: bool = True,
                         rope_mask: ExpertContext | None = None) -> ExpertContext:
        """What every denoising step of ``prefix`` shares (:meth:`sampling_velocity` reads it): the suffix
        tokens' rotary tables and attention mask (taken from ``rope_mask`` if given) and, with ``buffers``,
        per-layer key/value buffers ``[N, Hkv, P + S, D]`` holding the prefix's part, whose suffix part each
        step overwrites (so only for steps without autograd)."""
        ctx = rope_mask if rope_mask is not None else self._expert_context(prefix)
        if not buffers:
            return ExpertContext(ctx.rope, ctx.attn_mask)
        p, length = prefix.mask.shape[1], self._suffix_length(prefix)

        def buffer(x: Tensor) -> Tensor:
            out = x.new_empty(*x.shape[:2], p + length, x.shape[3])
            out[:, :, :p] = x
            return out

        return ExpertContext(ctx.rope, ctx.attn_mask, [buffer(k) for k in prefix.keys],
                              [buffer(v) for v in prefix.values])

    def sampling_velocity(self, prefix: Prefix, ctx: ExpertContext, x_t: Float[Tensor, "n h a"],
                          t: Float[Tensor, " n"]) -> Float[Tensor, "n h a"]:
        """The velocity ``[N, H, A]`` (float32) at ``x_t``, ``t`` of one denoising step in the context
        ``ctx`` of :meth:`sampling_context`: the velocity head alone, no std or value head."""
        return self.velocity_head(self._expert_features(prefix, x_t, t, ctx)).float()

    def _heads(self, features: Tensor, prefix: Prefix) -> ExpertOutput:
        cfg = self.cfg
        velocity = self.velocity_head(features).float()
        # Bounded std: tanh maps onto log-variance in [2 log std_min, 2 log std_max].
        lo, hi = 2 * math.log(cfg.noise_std_min), 2 * math.log(cfg.noise_std_max)
        log_var = lo + (hi - lo) * 0.5 * (torch.tanh(self.noise_head(features).float()) + 1.0)
        std = torch.exp(0.5 * log_var)
        return ExpertOutput(velocity=velocity, noise_std=std, value=self._value(features, prefix),
                            features=features)

    def _value(self, features: Tensor | None, prefix: Prefix) -> Tensor:
        if self.cfg.value_source == "expert":
            pooled = features.mean(dim=1)
        else:
            if prefix.hidden is None:
                raise ValueError("a prefix-sourced value needs the prefix's hidden states; this prefix was "
                                 "encoded for sampling only (encode_prefix(hidden=False))")
            w = prefix.mask.to(prefix.hidden.dtype)[..., None]
            pooled = (prefix.hidden * w).sum(1) / w.sum(1)
        if self.cfg.value_detach:
            pooled = pooled.detach()
        return self.value_head(pooled).float().squeeze(-1)

    def velocity(self, prefix: Prefix, x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]) -> Float[Tensor, "n h a"]:
        return self.expert(prefix, x_t, t).velocity

    def noise_std(self, prefix: Prefix, x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]
                  ) -> Float[Tensor, "n h a"]:
        return self.expert(prefix, x_t, t).noise_std

    def value(self, prefix: Prefix, x_t: Float[Tensor, "n h a"] | None = None, t: Float[Tensor, " n"] | None = None
              ) -> Float[Tensor, " n"]:
        """State value ``[N]``. A prefix-sourced head needs only the prefix; an expert-sourced head
        reads the expert at (x_t, t), by default at the pure-noise end (x = 0, t = 1)."""
        if self.cfg.value_source == "prefix":
            return self._value(None, prefix)
        n = prefix.batch_size
        if x_t is None:
            x_t = torch.zeros(n, self.cfg.action_horizon, self.cfg.action_dim, device=prefix.mask.device)
        if t is None:
            t = torch.ones(n, device=prefix.mask.device)
        return self.expert(prefix, x_t, t).value

    # Which submodules make the prefix (everything :meth:`encode_prefix` runs) and the value estimate. The
    # state projection feeds the prefix, except with π0's state token in the suffix (state_input "suffix").
    PREFIX_MODULES = ("patch_embed", "vision_pos", "vision_blocks", "vision_norm", "vision_proj", "text_embed",
                      "state_proj", "state_embed", "state_dim_embed", "prefix_layers", "prefix_norm")
    VALUE_MODULES = ("value_head",)

    def parameter_groups(self) -> dict[str, dict[str, nn.Parameter]]:
        """The parameters by the part of the network they belong to, each ``{name: parameter}`` in
        :meth:`named_parameters` order: ``prefix`` (the vision / text / state backbone that
        :meth:`encode_prefix` runs), ``value`` (the value head) and ``expert`` (the action expert with its
        velocity and noise heads). Every parameter is in exactly one group."""
        prefix = set(self.PREFIX_MODULES) - ({"state_proj"} if self.cfg.state_input == "suffix" else set())
        groups: dict[str, dict[str, nn.Parameter]] = {"prefix": {}, "expert": {}, "value": {}}
        for name, p in self.named_parameters():
            top = name.split(".", 1)[0]
            part = "prefix" if top in prefix else "value" if top in self.VALUE_MODULES else "expert"
            groups[part][name] = p
        return groups

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

    def field(self, prefix: Prefix):
        """Adapter to the flow-math protocol: ``f(x_t, t) -> (velocity, noise_std)``."""

        def f(x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]
              ) -> tuple[Float[Tensor, "n h a"], Float[Tensor, "n h a"]]:
            out = self.expert(prefix, x_t, t)
            return out.velocity, out.noise_std

        return f

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
