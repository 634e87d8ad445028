"""What every flow-VLA architecture shares: the cached prefix, the expert's heads, the sampling fast path.

:class:`FlowVLABase` holds the parts of a :class:`~vla_rl.policies.seam.FlowVLA` that do not depend on how the
prefix is encoded or how the expert attends to it: checking and tokenizing observations (:meth:`prepare`), the
action tokens with their time conditioning, the velocity / Flow-Noise std / value heads on one expert pass
(:meth:`expert`), the sampling fast path (:meth:`velocity_field`, :meth:`sampling_context`: per-layer key / value
buffers written once per prefix) and the parameter groups. An architecture subclasses it and provides
``__init__`` (its modules, then :meth:`_build_heads`), ``_embed_prefix``, :meth:`encode_prefix`,
``_expert_context``, ``_expert_features``, ``layer_groups`` and ``idle_parameters``
(:class:`~vla_rl.policies.model.FlowPolicy`: π0 / π0.5; :class:`~vla_rl.policies.smolvla.SmolVLA`).

Glossary: N batch, P prefix tokens, S suffix tokens, H actions per chunk, A action dims, We / Wp the expert's and
the prefix's widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vla_rl.core.shapes import Bool, Float
from vla_rl.policies.layers import attention, sincos_time_embedding
from vla_rl.policies.tokenizer import (
    FILE_TOKENIZERS,
    clean_task,
    discretize_state,
    pi0_prompt,
    pi05_prompt,
    tokenize,
)


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



class FlowVLABase(nn.Module):
    """The shared half of a flow VLA (module docstring). Subclasses set ``cfg``, ``text_tokenizer``,
    ``PREFIX_MODULES`` and the modules the methods here read: ``action_in``, ``action_time_mlp`` (or π0.5's
    ``time_mlp``), the heads."""

    FORWARD_METHODS = ("encode_prefix", "expert", "value")
    PREFIX_MODULES: tuple[str, ...] = ()
    VALUE_MODULES = ("value_head",)

    @property
    def device(self) -> torch.device:
        return self.action_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.action_in.weight.dtype

    def _run_prefix_layers(self, h: Tensor, rope: tuple[Tensor, Tensor], attn_mask: Tensor,
                           hidden: bool) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
        """The prefix backbone over embedded tokens ``h`` ``[N, P, Wp]``: every layer's keys / values (kept for
        the denoising steps) and the last hidden state (None with ``hidden=False``, when the last layer computes
        its keys and values only: its attention output and MLP feed nothing but a prefix-sourced value head).
        A layer's ``project`` returns q, k, v and whatever its ``finish`` takes after the attention output
        (π0.5's adaRMS gate)."""
        keys, values = [], []
        last = len(self.prefix_layers) - 1
        for i, layer in enumerate(self.prefix_layers):
            if i == last and not hidden:
                k, v = layer.keys_values(h, rope)
                keys.append(k)
                values.append(v)
                return keys, values, None
            q, k, v, *extra = layer.project(h, rope)
            keys.append(k)
            values.append(v)
            h = layer.finish(h, attention(q, k, v, attn_mask), *extra)
        return keys, values, h

    def set_tokenizer(self, tokenizer) -> None:
        """Attach the file tokenizer (:data:`~vla_rl.policies.tokenizer.FILE_TOKENIZERS`: SentencePiece, a Hugging
        Face tokenizer.json) a ``tokenizer: sentencepiece`` / ``hf`` policy encodes prompts with."""
        if tokenizer is not None and tokenizer.vocab_size > self.cfg.vocab_size:
            raise ValueError(f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size} pieces, more than the "
                             f"policy's {self.cfg.vocab_size} text embeddings")
        self.text_tokenizer = tokenizer

    def prompts(self, instructions: list[str], state: Tensor) -> list[str]:
        """The text each instruction becomes: π0.5's prompt with the discretised (normalised) state
        ``[N, S]``, "task\\n" (π0's and SmolVLA's newline step) for a policy with a file tokenizer, the instruction
        itself otherwise."""
        if self.cfg.state_input == "prompt":
            if self.cfg.state_prompt_dims:
                state = state[:, : self.cfg.state_prompt_dims]
            bins = discretize_state(state, self.cfg.state_bins).tolist()
            return [pi05_prompt(text, row) for text, row in zip(instructions, bins)]
        if self.cfg.tokenizer in FILE_TOKENIZERS:
            if self.cfg.clean_prompt:
                instructions = [clean_task(text) for text in instructions]
            return [pi0_prompt(text) for text in instructions]
        return list(instructions)

    def tokenize(self, instructions: list[str], state: Tensor) -> tuple[Tensor, Tensor]:
        """``tokens`` / ``token_mask`` ``[N, max_text_tokens]`` of the instructions (and, for π0.5, the state)."""
        cfg = self.cfg
        texts = self.prompts(instructions, state)
        if cfg.tokenizer in FILE_TOKENIZERS:
            if self.text_tokenizer is None:
                raise RuntimeError(f"this policy tokenizes with {cfg.tokenizer} ({cfg.tokenizer_file}) but no "
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
        masked). Images of another size are resized to the encoder's (``image_resize``); cameras of different sizes
        come as a list of ``[N, Hi, Wi, 3]`` tensors, one per camera. Returns the same keys with ``image_mask``
        ``[N, num_cameras]`` (and the cameras of a list as one tensor at the encoder's size).
        """
        cfg = self.cfg
        for key in ("images", "state"):
            if key not in obs:
                raise KeyError(f"observation is missing {key!r} (has {sorted(obs)})")
        images, state = obs["images"], obs["state"]
        if isinstance(images, (list, tuple)):
            images = self._stack_cameras(list(images))
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

    def embed_prefix(self, obs: dict) -> tuple[Tensor, Tensor]:
        """Prefix tokens ``[N, P, Wp]`` and their validity mask ``[N, P]``."""
        return self._embed_prefix(self.prepare(obs))

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

    def parameter_groups(self) -> dict[str, dict[str, nn.Parameter]]:
        """The parameters by the part of the network they belong to, each ``{name: parameter}`` in
        :meth:`named_parameters` order: ``prefix`` (the vision / text / state backbone that
        :meth:`encode_prefix` runs), ``value`` (the value head) and ``expert`` (the action expert with its
        velocity and noise heads). Every parameter is in exactly one group."""
        prefix = self._prefix_modules()
        groups: dict[str, dict[str, nn.Parameter]] = {"prefix": {}, "expert": {}, "value": {}}
        for name, p in self.named_parameters():
            top = name.split(".", 1)[0]
            part = "prefix" if top in prefix else "value" if top in self.VALUE_MODULES else "expert"
            groups[part][name] = p
        return groups

    def _prefix_modules(self) -> set[str]:
        """The top-level submodules :meth:`encode_prefix` runs (``PREFIX_MODULES`` by default)."""
        return set(self.PREFIX_MODULES)

    def _stack_cameras(self, cameras: list[Tensor]) -> Tensor:
        """Cameras of different sizes (``[N, Hi, Wi, 3]`` each) as one ``[N, c, s, s, 3]`` tensor in [-1, 1] at the
        encoder's size ``s``, each resized as the architecture resizes (:meth:`_pixels`)."""
        if not cameras or any(not isinstance(c, Tensor) or c.dim() != 4 or c.shape[-1] != 3 for c in cameras):
            raise ValueError("images given per camera must be a non-empty list of [N, H, W, 3] tensors, got "
                             f"{[tuple(c.shape) if isinstance(c, Tensor) else type(c).__name__ for c in cameras]}")
        if len({c.shape[0] for c in cameras}) != 1:
            raise ValueError(f"the cameras hold different batch sizes: {[c.shape[0] for c in cameras]}")
        if not cameras[0].shape[0]:
            return cameras[0].new_zeros(0, len(cameras), self.cfg.vision.image_size, self.cfg.vision.image_size, 3,
                                        dtype=torch.float32)
        return torch.stack([self._pixels(c).permute(0, 2, 3, 1) for c in cameras], dim=1)

    def _suffix_length(self, prefix: Prefix) -> int:
        """Suffix tokens an expert pass runs: the actions (π0 adds its state token)."""
        return self.cfg.action_horizon

    def _build_heads(self) -> None:
        """The velocity head, the Flow-Noise std head and the value head (reading the expert's or the prefix's
        width, ``value_source``), made last in ``__init__``."""
        cfg = self.cfg
        we, wp = cfg.expert.width, cfg.prefix.width
        self.velocity_head = nn.Linear(we, cfg.action_dim)
        self.noise_head = nn.Linear(we, cfg.action_dim)
        value_in = we if cfg.value_source == "expert" else wp
        self.value_head = nn.Sequential(nn.Linear(value_in, cfg.value_hidden), nn.GELU(),
                                        nn.Linear(cfg.value_hidden, 1))

    def field(self, prefix: Prefix):
        """Adapter to the flow-math protocol: ``f(x_t, t) -> (velocity, noise_std)``."""

        def f(x_t: Float[Tensor, "n h a"], t: Float[Tensor, " n"]
              ) -> tuple[Float[Tensor, "n h a"], Float[Tensor, "n h a"]]:
            out = self.expert(prefix, x_t, t)
            return out.velocity, out.noise_std

        return f
