"""The π0-style flow policy: a prefix backbone over (images, instruction, state) and an action expert
that predicts the flow velocity of an action chunk, plus a Flow-Noise std head and a value head.

Glossary: N batch, P prefix tokens, H actions per chunk, A action dims, C cameras, L layers.

Attention is π0's blockwise-causal joint attention: prefix tokens attend among themselves only;
action tokens attend to the prefix and to each other. Expert layer ``l`` reads layer ``l``'s prefix
keys/values, so the prefix is encoded once per observation (:meth:`FlowPolicy.encode_prefix`) and every
denoising step only runs the expert (:meth:`FlowPolicy.expert`). :meth:`FlowPolicy.forward_joint` is
the uncached reference (both streams in one pass), used to test the cache.

The model knows no algorithm: samplers and likelihoods live in :mod:`vla_rl.policies.flow`, and
:meth:`FlowPolicy.field` adapts the model to their ``field(x_t, t)`` protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import PolicyConfig
from .layers import (
    RMSNorm,
    StreamLayer,
    ViTBlock,
    attention,
    rotary_tables,
    sincos_2d_positions,
    sincos_time_embedding,
)
from .tokenizer import tokenize


@dataclass
class Prefix:
    """Cached prefix of a batch of observations.

    keys / values  L x ``[N, Hkv, P, D]``  per-layer keys (rotated) and values
    mask           ``[N, P]`` bool          valid prefix tokens
    hidden         ``[N, P, Wp]`` or None   final-normed prefix output (read by a prefix value head; None
                                            when encoded for sampling only, ``encode_prefix(hidden=False)``)
    """

    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor
    hidden: Tensor | None

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def repeat(self, times: int) -> Prefix:
        """Each observation ``times`` times in a row (e.g. several chunks sampled per observation)."""
        rep = lambda x: x.repeat_interleave(times, dim=0)  # noqa: E731
        return Prefix([rep(k) for k in self.keys], [rep(v) for v in self.values], rep(self.mask),
                      None if self.hidden is None else rep(self.hidden))


@dataclass
class ExpertOutput:
    """velocity ``[N, H, A]``, noise_std ``[N, H, A]`` (Flow-Noise head), value ``[N]``, features
    ``[N, H, We]``. All heads come out of one expert pass, in float32."""

    velocity: Tensor
    noise_std: Tensor
    value: Tensor
    features: Tensor


@dataclass
class _ExpertContext:
    """Per-prefix state of the denoising steps: the action tokens' rotary tables, the attention mask
    ``[N, 1, 1, P + H]``, and (sampling without gradients) per-layer key/value buffers ``[N, Hkv, P + H, D]``."""

    rope: tuple[Tensor, Tensor]
    attn_mask: Tensor
    keys: list[Tensor] | None = None
    values: list[Tensor] | None = None


class FlowPolicy(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        v, wp, we = cfg.vision, cfg.prefix.width, cfg.expert.width
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
        else:
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
        self.expert_norm = RMSNorm(we)
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

    def prepare(self, obs: dict) -> dict:
        """Validate a raw observation dict and tokenize its instruction.

        ``obs``: ``images`` uint8 ``[N, C, Hi, Wi, 3]``, ``state`` float ``[N, S]`` (normalised), and
        ``instruction`` (list of N strings) or already-made ``tokens`` / ``token_mask`` ``[N, T]``.
        Images of another size are resized (bilinear) to the encoder's size.
        """
        cfg = self.cfg
        for key in ("images", "state"):
            if key not in obs:
                raise KeyError(f"observation is missing {key!r} (has {sorted(obs)})")
        images, state = obs["images"], obs["state"]
        if images.dtype != torch.uint8:
            raise TypeError(f"images must be uint8 [N, C, H, W, 3], got {images.dtype}")
        if images.dim() != 5 or images.shape[1] != cfg.num_cameras or images.shape[-1] != 3:
            raise ValueError(f"images must have shape [N, {cfg.num_cameras}, H, W, 3], "
                             f"got {tuple(images.shape)}")
        n = images.shape[0]
        if state.dim() != 2 or state.shape != (n, cfg.state_dim):
            raise ValueError(f"state must have shape [{n}, {cfg.state_dim}], got {tuple(state.shape)}")
        if not state.is_floating_point():
            raise TypeError(f"state must be floating point, got {state.dtype}")
        if state.device.type != "meta" and not torch.isfinite(state).all():
            raise ValueError("state contains NaN or inf")
        if "tokens" in obs:
            tokens, token_mask = obs["tokens"], obs["token_mask"]
        elif "instruction" in obs:
            instr = obs["instruction"]
            if len(instr) != n:
                raise ValueError(f"got {len(instr)} instructions for {n} observations")
            tokens, token_mask = tokenize(list(instr), cfg.max_text_tokens, kind=cfg.tokenizer,
                                          vocab_size=cfg.vocab_size, device=images.device)
        else:
            raise KeyError("observation needs 'instruction' (list of str) or 'tokens' + 'token_mask'")
        if tokens.shape != (n, cfg.max_text_tokens):
            raise ValueError(f"tokens must have shape [{n}, {cfg.max_text_tokens}], "
                             f"got {tuple(tokens.shape)}")
        return {"images": images, "state": state, "tokens": tokens, "token_mask": token_mask}

    def _embed_images(self, images: Tensor) -> Tensor:
        n, c, hi, wi, _ = images.shape
        if c == 0:  # state-only policy: the prefix is text + state
            return self.vision_proj.weight.new_zeros(n, 0, self.cfg.prefix.width)
        size = self.cfg.vision.image_size
        x = images.reshape(n * c, hi, wi, 3).permute(0, 3, 1, 2).to(self.vision_pos.dtype) / 127.5 - 1.0
        if (hi, wi) != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.vision_pos  # [N*C, patches, Wv]
        for block in self.vision_blocks:
            x = block(x)
        x = self.vision_proj(self.vision_norm(x))
        return x.reshape(n, c * x.shape[1], -1)

    def _embed_state(self, state: Tensor) -> Tensor:
        if self.cfg.state_input == "token":
            return self.state_proj(state.to(self.state_proj.weight.dtype))[:, None, :]
        # π0.5: each (normalised, clipped to [-1, 1]) state dim becomes one of ``state_bins`` tokens.
        bins = self.cfg.state_bins
        idx = ((state.float().clamp(-1, 1) + 1) / 2 * bins).long().clamp(0, bins - 1)
        return self.state_embed(idx) + self.state_dim_embed

    def embed_prefix(self, obs: dict) -> tuple[Tensor, Tensor]:
        """Prefix tokens ``[N, P, Wp]`` and their validity mask ``[N, P]``."""
        obs = self.prepare(obs)
        img = self._embed_images(obs["images"])
        txt = self.text_embed(obs["tokens"]) * math.sqrt(self.cfg.prefix.width)
        st = self._embed_state(obs["state"])
        n = img.shape[0]
        mask = torch.cat([torch.ones(n, img.shape[1], dtype=torch.bool, device=img.device),
                          obs["token_mask"].bool(),
                          torch.ones(n, st.shape[1], dtype=torch.bool, device=img.device)], dim=1)
        return torch.cat([img, txt.to(img.dtype), st.to(img.dtype)], dim=1), mask

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
        temb = sincos_time_embedding(t, we).to(dtype)
        if cfg.time_conditioning == "adarms":
            return tokens, self.time_mlp(temb)
        temb = temb[:, None, :].expand(-1, tokens.shape[1], -1)
        return self.action_time_mlp(torch.cat([tokens, temb], dim=-1)), None

    # ------------------------------------------------------------------------------------------------
    # Cached path
    # ------------------------------------------------------------------------------------------------
    def encode_prefix(self, obs: dict, *, hidden: bool = True) -> Prefix:
        """Run the prefix backbone once; keep every layer's keys/values for the denoising steps.

        ``hidden=False`` (sampling for deployment): the last layer computes its keys and values only. Its
        attention output and MLP feed nothing but ``Prefix.hidden`` (a prefix-sourced value head), so they
        are skipped, a quarter of the backbone's work at depth 4; ``hidden`` is then None."""
        h, mask = self.embed_prefix(obs)
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
        return Prefix(keys, values, mask, self.prefix_norm(h) if hidden else None)

    def _action_positions(self, prefix_mask: Tensor) -> Tensor:
        start = prefix_mask.long().sum(dim=1, keepdim=True)
        return start + torch.arange(self.cfg.action_horizon, device=prefix_mask.device)[None, :]

    def _expert_context(self, prefix: Prefix) -> _ExpertContext:
        """What every denoising step of one prefix shares: the action tokens' rotary tables and mask."""
        mask = prefix.mask
        n, horizon = mask.shape[0], self.cfg.action_horizon
        rope = rotary_tables(self._action_positions(mask), self.cfg.head_dim, self.cfg.rope_base)
        attn_mask = torch.cat([mask, torch.ones(n, horizon, dtype=torch.bool, device=mask.device)],
                              dim=1)[:, None, None, :]
        return _ExpertContext(rope, attn_mask)

    def _expert_features(self, prefix: Prefix, x_t: Tensor, t: Tensor, ctx: _ExpertContext) -> Tensor:
        """The expert's final-normed action features ``[N, H, We]``."""
        if x_t.shape[0] != prefix.batch_size:
            raise ValueError(f"x_t has batch {x_t.shape[0]} but the prefix has {prefix.batch_size}")
        h, cond = self._embed_actions(x_t, t)
        p = prefix.mask.shape[1]
        for i, (layer, pk, pv) in enumerate(zip(self.expert_layers, prefix.keys, prefix.values)):
            q, k, v, gate = layer.project(h, ctx.rope, cond)
            if ctx.keys is None:
                keys, values = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
            else:   # the prefix part of the buffers was written once; only the action part changes
                keys, values = ctx.keys[i], ctx.values[i]
                keys[:, :, p:].copy_(k)
                values[:, :, p:].copy_(v)
            h = layer.finish(h, attention(q, keys, values, ctx.attn_mask), gate, cond)
        return self.expert_norm(h)

    def expert(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> ExpertOutput:
        """One expert pass at ``x_t`` ``[N, H, A]``, times ``t`` ``[N]``: velocity, noise std, value."""
        return self._heads(self._expert_features(prefix, x_t, t, self._expert_context(prefix)), prefix)

    def velocity_field(self, prefix: Prefix):
        """``f(x_t, t) -> velocity`` for sampling without gradients (deployment, evaluation): equal to
        ``expert(prefix, x_t, t).velocity`` bit for bit, at less cost per denoising step. The action tokens'
        rotary tables and mask are made once per prefix; each layer's keys/values live in one buffer that
        holds the prefix's part from the first call on, so a step writes the action part instead of
        concatenating the whole; the std and value heads do not run. Under autograd it falls back to
        concatenation (a buffer rewritten in place cannot be differentiated through)."""
        ctx = self._expert_context(prefix)
        buffered: dict[bool, _ExpertContext] = {}

        def f(x_t: Tensor, t: Tensor) -> Tensor:
            if torch.is_grad_enabled():
                return self.velocity_head(self._expert_features(prefix, x_t, t, ctx)).float()
            mode = torch.is_inference_mode_enabled()   # inference tensors cannot be written outside the mode
            if mode not in buffered:
                p, horizon = prefix.mask.shape[1], self.cfg.action_horizon

                def buffer(x: Tensor) -> Tensor:
                    out = x.new_empty(*x.shape[:2], p + horizon, x.shape[3])
                    out[:, :, :p] = x
                    return out

                buffered[mode] = _ExpertContext(ctx.rope, ctx.attn_mask, [buffer(k) for k in prefix.keys],
                                                [buffer(v) for v in prefix.values])
            return self.velocity_head(self._expert_features(prefix, x_t, t, buffered[mode])).float()

        return f

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

    def velocity(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> Tensor:
        return self.expert(prefix, x_t, t).velocity

    def noise_std(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> Tensor:
        return self.expert(prefix, x_t, t).noise_std

    def value(self, prefix: Prefix, x_t: Tensor | None = None, t: Tensor | None = None) -> Tensor:
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

    # Which submodules make the prefix (everything :meth:`encode_prefix` runs) and the value estimate.
    PREFIX_MODULES = ("patch_embed", "vision_pos", "vision_blocks", "vision_norm", "vision_proj", "text_embed",
                      "state_proj", "state_embed", "state_dim_embed", "prefix_layers", "prefix_norm")
    VALUE_MODULES = ("value_head",)

    def parameter_groups(self) -> dict[str, dict[str, nn.Parameter]]:
        """The parameters by the part of the network they belong to, each ``{name: parameter}`` in
        :meth:`named_parameters` order: ``prefix`` (the vision / text / state backbone that
        :meth:`encode_prefix` runs), ``value`` (the value head) and ``expert`` (the action expert with its
        velocity and noise heads). Every parameter is in exactly one group."""
        groups: dict[str, dict[str, nn.Parameter]] = {"prefix": {}, "expert": {}, "value": {}}
        for name, p in self.named_parameters():
            top = name.split(".", 1)[0]
            part = "prefix" if top in self.PREFIX_MODULES else "value" if top in self.VALUE_MODULES else "expert"
            groups[part][name] = p
        return groups

    def field(self, prefix: Prefix):
        """Adapter to the flow-math protocol: ``f(x_t, t) -> (velocity, noise_std)``."""

        def f(x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
            out = self.expert(prefix, x_t, t)
            return out.velocity, out.noise_std

        return f

    # ------------------------------------------------------------------------------------------------
    # Uncached reference
    # ------------------------------------------------------------------------------------------------
    def forward_joint(self, obs: dict, x_t: Tensor, t: Tensor) -> tuple[Tensor, ExpertOutput]:
        """Both streams in one pass with the blockwise-causal mask, no cache.

        Returns the final-normed prefix output ``[N, P, Wp]`` and the expert heads. Equal to
        :meth:`encode_prefix` followed by :meth:`expert`; slower, since the prefix is recomputed.
        """
        hp, pmask = self.embed_prefix(obs)
        ha, cond = self._embed_actions(x_t, t)
        n, p, horizon = hp.shape[0], hp.shape[1], ha.shape[1]
        rope_p = rotary_tables(pmask.long().cumsum(dim=1) - 1, self.cfg.head_dim, self.cfg.rope_base)
        rope_a = rotary_tables(self._action_positions(pmask), self.cfg.head_dim, self.cfg.rope_base)
        keys_valid = torch.cat([pmask, torch.ones(n, horizon, dtype=torch.bool, device=hp.device)], dim=1)
        is_prefix_key = torch.arange(p + horizon, device=hp.device) < p
        # Prefix queries see valid prefix keys only; action queries see valid prefix keys and all actions.
        rows_prefix = (keys_valid & is_prefix_key)[:, None, :].expand(n, p, p + horizon)
        rows_action = keys_valid[:, None, :].expand(n, horizon, p + horizon)
        attn_mask = torch.cat([rows_prefix, rows_action], dim=1)[:, None]
        for pl, el in zip(self.prefix_layers, self.expert_layers):
            qp, kp, vp, gp = pl.project(hp, rope_p)
            qa, ka, va, ga = el.project(ha, rope_a, cond)
            out = attention(torch.cat([qp, qa], 2), torch.cat([kp, ka], 2), torch.cat([vp, va], 2), attn_mask)
            hp = pl.finish(hp, out[:, :, :p], gp)
            ha = el.finish(ha, out[:, :, p:], ga, cond)
        prefix_hidden = self.prefix_norm(hp)
        prefix = Prefix([], [], pmask, prefix_hidden)
        return prefix_hidden, self._heads(self.expert_norm(ha), prefix)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
