"""Typed configuration of the flow policy. Presets live in ``configs/model/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class VisionConfig:
    """Per-camera image encoder: patch embedding + a small ViT (SigLIP-like)."""

    image_size: int = 32
    patch_size: int = 8
    width: int = 64
    depth: int = 1
    num_heads: int = 2
    mlp_dim: int = 128

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class StreamConfig:
    """Width of one transformer stream (prefix backbone or action expert)."""

    width: int = 64
    mlp_dim: int = 128


@dataclass(frozen=True)
class PolicyConfig:
    """π0-style policy. Prefix backbone and action expert share depth, heads and head size (joint
    attention, layer by layer), but have their own widths, as in π0 (Gemma 2B + 300M expert)."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    prefix: StreamConfig = field(default_factory=StreamConfig)
    expert: StreamConfig = field(default_factory=StreamConfig)
    depth: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    rope_base: float = 10000.0
    tokenizer: Literal["words", "bytes"] = "words"
    vocab_size: int = 1024
    max_text_tokens: int = 16
    num_cameras: int = 1
    state_dim: int = 8
    action_dim: int = 4
    action_horizon: int = 8
    # "concat": π0 (sin-cos time embedding concatenated with the action token, then an MLP);
    # "adarms": π0.5 (a time MLP drives adaptive RMSNorm in every expert layer).
    time_conditioning: Literal["concat", "adarms"] = "concat"
    # "token": π0 (one projected state token); "discrete": π0.5 (state binned into tokens).
    state_input: Literal["token", "discrete"] = "token"
    state_bins: int = 256
    # "expert": value read from the action expert's output (π0 style); "prefix": from the prefix (π0.5).
    value_source: Literal["expert", "prefix"] = "expert"
    value_detach: bool = False
    value_hidden: int = 64
    noise_std_min: float = 0.08
    noise_std_max: float = 0.16

    def __post_init__(self):
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
        for name in ("depth", "state_dim", "action_dim", "action_horizon", "max_text_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.num_cameras < 0:  # 0: a state-only policy (ManiSkill state observations); no image tokens
            problems.append("num_cameras must be >= 0")
        if problems:
            raise ValueError("invalid PolicyConfig: " + "; ".join(problems))

    @property
    def num_prefix_tokens(self) -> int:
        """Prefix length: image patches of every camera, text tokens, state token(s)."""
        state_tokens = 1 if self.state_input == "token" else self.state_dim
        return self.num_cameras * self.vision.num_patches + self.max_text_tokens + state_tokens


def policy_preset(name: str, overrides: dict | None = None) -> PolicyConfig:
    """A model preset from ``configs/model/<name>.yaml`` (or a YAML path), with optional overrides."""
    from vla_rl.config import load_preset

    return load_preset(PolicyConfig, "model", name, overrides)
