"""Typed configuration of the flow policy. Presets live in ``configs/model/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .ranges import check_ranges, nonneg, positive, ranged


@dataclass(frozen=True)
class VisionConfig:
    """Per-camera image encoder: patch embedding + a small ViT (SigLIP-like)."""

    image_size: int = ranged(32, 1)
    patch_size: int = ranged(8, 1)
    width: int = ranged(64, 1)
    depth: int = nonneg(1)
    num_heads: int = ranged(2, 1)
    mlp_dim: int = ranged(128, 1)

    def __post_init__(self):
        check_ranges(self)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class StreamConfig:
    """Width of one transformer stream (prefix backbone or action expert)."""

    width: int = ranged(64, 1)
    mlp_dim: int = ranged(128, 1)

    def __post_init__(self):
        check_ranges(self)


@dataclass(frozen=True)
class PolicyConfig:
    """π0-style policy. Prefix backbone and action expert share depth, heads and head size (joint
    attention, layer by layer), but have their own widths, as in π0 (Gemma 2B + 300M expert)."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    prefix: StreamConfig = field(default_factory=StreamConfig)
    expert: StreamConfig = field(default_factory=StreamConfig)
    depth: int = ranged(2, 1)
    num_heads: int = ranged(2, 1)
    num_kv_heads: int = ranged(1, 1)
    head_dim: int = ranged(32, 2)
    rope_base: float = positive(10000.0)
    tokenizer: Literal["words", "bytes"] = "words"
    vocab_size: int = ranged(1024, 4)   # 3 special tokens (BOS, EOS, PAD) and at least one word
    max_text_tokens: int = ranged(16, 1)
    num_cameras: int = nonneg(1)        # 0: a state-only policy (ManiSkill state observations)
    state_dim: int = ranged(8, 1)
    action_dim: int = ranged(4, 1)
    action_horizon: int = ranged(8, 1)
    # "concat": π0 (sin-cos time embedding concatenated with the action token, then an MLP);
    # "adarms": π0.5 (a time MLP drives adaptive RMSNorm in every expert layer).
    time_conditioning: Literal["concat", "adarms"] = "concat"
    # "token": π0 (one projected state token); "discrete": π0.5 (state binned into tokens).
    state_input: Literal["token", "discrete"] = "token"
    state_bins: int = ranged(256, 2)
    # "expert": value read from the action expert's output (π0 style); "prefix": from the prefix (π0.5).
    value_source: Literal["expert", "prefix"] = "expert"
    value_detach: bool = False
    value_hidden: int = ranged(64, 1)
    noise_std_min: float = positive(0.08)
    noise_std_max: float = positive(0.16)

    def __post_init__(self):
        check_ranges(self)
        problems = []
        if self.vision.image_size % self.vision.patch_size:
            problems.append("vision.image_size must be a multiple of vision.patch_size")
        if self.num_heads % self.num_kv_heads:
            problems.append("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            problems.append("head_dim must be even (rotary embedding)")
        if self.vision.width % self.vision.num_heads:
            problems.append("vision.width must be a multiple of vision.num_heads")
        if not 0 < self.noise_std_min < self.noise_std_max:
            problems.append("need 0 < noise_std_min < noise_std_max")
        if self.tokenizer == "bytes" and self.vocab_size < 259:
            problems.append("the bytes tokenizer needs vocab_size >= 259")
        if problems:
            raise ValueError("invalid PolicyConfig: " + "; ".join(problems))

    @property
    def num_prefix_tokens(self) -> int:
        """Prefix length: image patches of every camera, text tokens, state token(s)."""
        state_tokens = 1 if self.state_input == "token" else self.state_dim
        return self.num_cameras * self.vision.num_patches + self.max_text_tokens + state_tokens

