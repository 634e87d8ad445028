"""Typed configuration of the flow policy. Presets live in ``configs/model/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged, setting


@dataclass(frozen=True)
class VisionConfig:
    """Per-camera image encoder: patch embedding + a small ViT (SigLIP-like)."""

    image_size: int = ranged(32, 1, doc="S: images reach the encoder at S x S pixels")
    patch_size: int = ranged(8, 1, doc="pixels per patch side (S must be a multiple)")
    width: int = ranged(64, 1, doc="the encoder's width")
    depth: int = nonneg(1, doc="transformer blocks of the encoder")
    num_heads: int = ranged(2, 1, doc="attention heads of the encoder")
    mlp_dim: int = ranged(128, 1, doc="hidden width of the encoder's MLPs")

    def __post_init__(self):
        check_ranges(self)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class StreamConfig:
    """Width of one transformer stream (prefix backbone or action expert)."""

    width: int = ranged(64, 1, doc="the stream's width")
    mlp_dim: int = ranged(128, 1, doc="hidden width of the stream's MLPs")

    def __post_init__(self):
        check_ranges(self)


ARCHS = ("pi0", "pi05", "smolvla")


@dataclass(frozen=True)
class SmolVLAOptions:
    """What SmolVLA (``arch: smolvla``) adds to the shared settings; other architectures leave it at its
    defaults. ``depth`` counts SmolVLM2's text layers kept (SmolVLA: the first 16 of 32)."""

    pixel_shuffle: int = ranged(4, 1, doc="the connector merges f x f SigLIP patches into one token (SmolVLM2: 4)")
    self_attn_every: int = nonneg(
        2, doc="expert layer i attends jointly to the prefix's keys / values and the action tokens when i is a "
               "multiple of this, else it cross-attends to the prefix alone (0: every layer cross-attends)")
    expert_depth: int = nonneg(0, doc="expert layers (0: as many as depth; fewer run beside every "
                                      "depth / expert_depth-th prefix layer)")
    norm_eps: float = positive(1e-5, doc="epsilon of the streams' RMSNorms (SmolLM2: 1e-5)")

    def __post_init__(self):
        check_ranges(self)

    def self_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (an expert layer's index when it is built, a prefix layer's when it runs) attends
        jointly to the prefix and the actions, as LeRobot decides it."""
        return self.self_attn_every > 0 and layer % self.self_attn_every == 0

    def expert_count(self, depth: int) -> int:
        return self.expert_depth or depth


@dataclass(frozen=True)
class PolicyConfig:
    """A flow-VLA's settings. π0-style: the prefix backbone and the action expert share depth, heads and head size
    (joint attention, layer by layer), but have their own widths, as in π0 (Gemma 2B + 300M expert)."""

    arch: Literal["pi0", "pi05", "smolvla"] = setting(
        "pi0", doc="the architecture (vla_rl.policies.architectures): pi0 and pi05 are one model class whose "
                   "options below cover both; smolvla is SmolVLA (its own settings: the smolvla section)")
    vision: VisionConfig = field(default_factory=VisionConfig)
    prefix: StreamConfig = field(default_factory=StreamConfig)
    expert: StreamConfig = field(default_factory=StreamConfig)
    depth: int = ranged(2, 1, doc="transformer layers (both streams)")
    num_heads: int = ranged(2, 1, doc="query heads (both streams)")
    num_kv_heads: int = ranged(1, 1, doc="key / value heads (grouped-query attention)")
    head_dim: int = ranged(32, 2, doc="width of one head (even: rotary embedding)")
    rope_base: float = positive(10000.0, doc="base of the rotary position embedding")
    tokenizer: Literal["words", "bytes", "sentencepiece", "hf"] = setting(
        "words", doc='"words" / "bytes": offline tokenizers (policies/tokenizer.py). "sentencepiece": a SentencePiece '
                     "model file (PaliGemma's tokenizer.model for imported π0 / π0.5) named by ``tokenizer_file``, "
                     "relative to the policy folder; prompts follow LeRobot's processors (π0: \"<task>\\n\"; π0.5: see "
                     "``state_input``). \"hf\": a Hugging Face tokenizer.json (SmolVLM2's for an imported SmolVLA), "
                     "the prompt \"<task>\\n\".")
    tokenizer_file: str = setting("", doc="the tokenizer's file in the policy folder (tokenizer sentencepiece or hf)")
    vocab_size: int = ranged(1024, 4, doc="3 special tokens (BOS, EOS, PAD) and at least one word")
    max_text_tokens: int = ranged(16, 1, doc="prompt tokens (padded or cut to this many)")
    num_cameras: int = nonneg(1, doc="0: a state-only policy (ManiSkill state observations)")
    camera_names: tuple[str, ...] = setting(
        (), doc="Names of the camera slots (a LeRobot checkpoint's image features, in order); informational.")
    missing_cameras: Literal["error", "mask"] = setting(
        "error", doc='"error": observations must bring every camera. "mask": an observation with fewer cameras fills '
                     "the first slots, and the missing slots are masked out of attention (π0's empty cameras).")
    image_resize: Literal["stretch", "pad"] = setting(
        "stretch", doc='How images of another size reach ``vision.image_size``: "stretch" (bilinear, antialiased) or '
                       "\"pad\" (π0 / openpi's resize-with-pad: keep the aspect ratio, pad with black).")
    image_antialias: bool = setting(
        True, doc="Antialias the bilinear resize when it shrinks (PIL and JAX do). False: plain bilinear "
                  "interpolation, as LeRobot's and openpi's PyTorch resize_with_pad_torch do (imported LeRobot "
                  "π0 / π0.5).")
    state_dim: int = ranged(8, 1, doc="the model's state width (an env's state is zero-padded to it)")
    action_dim: int = ranged(4, 1, doc="the model's action width (an env's actions are its first dims)")
    action_horizon: int = ranged(8, 1, doc="H: actions per chunk")
    time_conditioning: Literal["concat", "adarms"] = setting(
        "concat", doc='"concat": π0 (sin-cos time embedding concatenated with the action token, then an MLP); '
                      '"adarms": π0.5 (a time MLP drives adaptive RMSNorm in every expert layer).')
    adarms_final_norm: bool = setting(
        False, doc="Also make the expert's final norm adaptive (π0.5's checkpoints have it); needs \"adarms\".")
    time_min_period: float = positive(4e-3, doc="shortest period of the sine-cosine flow-time embedding (π0: 4e-3)")
    time_max_period: float = positive(4.0, doc="longest period of the sine-cosine flow-time embedding (π0: 4.0)")
    time_embedding_precision: Literal["float32", "float64"] = setting(
        "float32", doc="Precision of the time embedding's angles (up to 2π / time_min_period rad): π0 / π0.5 "
                       "checkpoints were trained with float64 angles; float32 moves their actions by ~3e-5.")
    state_input: Literal["token", "discrete", "suffix", "prompt", "none"] = setting(
        "token", doc='Where the (normalised) state enters: "token": one projected state token at the end of the '
                     'prefix; "discrete": each state dim binned into ``state_bins`` learned tokens at the end of the '
                     "prefix; \"suffix\": π0 — one projected state token leading the expert's suffix (it sees the "
                     'prefix and itself, the action tokens see it); "prompt": π0.5 — each state dim binned into '
                     '``state_bins`` and written into the text prompt ("Task: ..., State: 12 200 ...;\\nAction: "), no '
                     "state weights; \"none\": the policy does not see the state (openpi's pi05_libero: "
                     "discrete_state_input false).")
    state_bins: int = ranged(256, 2, doc="bins per state dim (state_input discrete or prompt)")
    clean_prompt: bool = setting(False, doc="π0's prompt (a file tokenizer, state not in the prompt): strip the task "
                                            "and turn '_' and newlines into spaces before the closing newline, as "
                                            "openpi's PaligemmaTokenizer does (LeRobot's π0 only appends the newline)")
    state_prompt_dims: int = nonneg(0, doc="state_input prompt: how many leading (normalised) state dims the prompt "
                                           "writes; 0: all state_dim of them, zero padding included (LeRobot's "
                                           "pi05); openpi writes the robot's own dims only (8 on LIBERO / DROID)")
    value_source: Literal["expert", "prefix"] = setting(
        "expert", doc="\"expert\": value read from the action expert's output (π0 style); \"prefix\": from the prefix "
                      "(π0.5).")
    value_detach: bool = setting(False, doc="the value head's gradient does not reach the streams")
    value_hidden: int = ranged(64, 1, doc="hidden width of the value head")
    noise_std_min: float = positive(0.08, doc="Flow-Noise: the learned noise std's lower bound")
    noise_std_max: float = positive(0.16, doc="Flow-Noise: the learned noise std's upper bound")
    smolvla: SmolVLAOptions | None = setting(
        None, doc="SmolVLA's own settings (arch smolvla only; left out: the defaults, SmolVLA's released ones)")

    @staticmethod
    def upgrade(data: dict) -> dict:
        """A policy folder written before ``arch`` existed: π0.5 if it has π0.5's time conditioning, else π0."""
        if isinstance(data, dict) and "arch" not in data:
            return {"arch": "pi05" if data.get("time_conditioning") == "adarms" else "pi0", **data}
        return data

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
        if (self.tokenizer in ("sentencepiece", "hf")) != bool(self.tokenizer_file):
            problems.append("tokenizer_file names the tokenizer's file, and only the sentencepiece and hf "
                            "tokenizers take one")
        if self.adarms_final_norm and self.time_conditioning != "adarms":
            problems.append("adarms_final_norm needs time_conditioning: adarms")
        if not self.time_min_period < self.time_max_period:
            problems.append("need time_min_period < time_max_period")
        if self.camera_names and len(self.camera_names) != self.num_cameras:
            problems.append(f"camera_names names {len(self.camera_names)} cameras, num_cameras is {self.num_cameras}")
        problems += self._arch_problems()
        if problems:
            raise ValueError("invalid PolicyConfig: " + "; ".join(problems))

    def _arch_problems(self) -> list[str]:
        if self.arch != "smolvla":
            return [] if self.smolvla is None else [f"the smolvla section is for arch smolvla, not {self.arch}"]
        if self.smolvla is None:   # frozen: set once, here, so every reader sees SmolVLA's settings
            object.__setattr__(self, "smolvla", SmolVLAOptions())
        opt, out = self.smolvla, []
        if self.time_conditioning != "concat" or self.state_input != "token":
            out.append("SmolVLA conditions on time by concatenation and reads the state as one prefix token "
                       "(time_conditioning: concat, state_input: token)")
        grid = self.vision.image_size // self.vision.patch_size
        if grid % opt.pixel_shuffle:
            out.append(f"smolvla.pixel_shuffle {opt.pixel_shuffle} must divide the {grid} patches a side")
        layers = opt.expert_count(self.depth)
        if self.depth % layers:
            out.append(f"smolvla.expert_depth {layers} must divide depth {self.depth}")
        else:   # LeRobot decides a layer's kind by the expert's index when building, by the prefix's when running
            every = self.depth // layers
            clash = [i for i in range(0, self.depth, every) if opt.self_attention(i) != opt.self_attention(i // every)]
            if clash:
                out.append(f"with depth {self.depth}, smolvla.expert_depth {layers} and self_attn_every "
                           f"{opt.self_attn_every}, prefix layers {clash} would run an expert layer built for the "
                           "other kind of attention")
        return out

    @property
    def num_prefix_tokens(self) -> int:
        """Prefix length: image tokens of every camera, text tokens, state token(s)."""
        state_tokens = {"token": 1, "discrete": self.state_dim}.get(self.state_input, 0)
        per_camera = self.vision.num_patches // (self.smolvla.pixel_shuffle ** 2 if self.arch == "smolvla" else 1)
        return self.num_cameras * per_camera + self.max_text_tokens + state_tokens

