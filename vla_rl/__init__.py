"""vla-rl: online RL fine-tuning of flow-matching VLA policies."""

__version__ = "0.1.0"
