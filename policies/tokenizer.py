"""Offline instruction tokenizers (no hub download).

- ``words``: lower-cased words (punctuation split off) hashed (FNV-1a) into ``vocab_size - 3`` buckets.
  Short sequences (one token per word), which keeps the CPU-sized prefix cheap; collisions are
  negligible for the few hundred words of robot instructions.
- ``bytes``: UTF-8 bytes, exact and collision-free, but one token per character.
Ids 0, 1, 2 are PAD, BOS, EOS. A real PaliGemma vocabulary would come with imported weights.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
KINDS = ("words", "bytes")
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def _fnv1a(word: str) -> int:
    h = 0x811C9DC5
    for b in word.encode("utf-8"):
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


@lru_cache(maxsize=65536)
def encode(text: str, kind: str, vocab_size: int) -> tuple[int, ...]:
    """Token ids of one instruction, without BOS/EOS (cached: instructions repeat every step)."""
    text = text.strip().lower()
    if kind == "words":
        return tuple(NUM_SPECIAL + _fnv1a(w) % (vocab_size - NUM_SPECIAL) for w in _WORD.findall(text))
    if kind == "bytes":
        if vocab_size < NUM_SPECIAL + 256:
            raise ValueError(f"the bytes tokenizer needs vocab_size >= {NUM_SPECIAL + 256}, got {vocab_size}")
        return tuple(NUM_SPECIAL + b for b in text.encode("utf-8"))
    raise ValueError(f"unknown tokenizer {kind!r}; expected one of {KINDS}")


def tokenize(texts: list[str], max_len: int, *, kind: str = "words", vocab_size: int = 1024,
             device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode instructions to ``tokens`` ``[N, L]`` long and ``mask`` ``[N, L]`` bool.

    Too long texts are truncated, keeping BOS and EOS.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("instructions must be a list of strings")
    if max_len < 3:
        raise ValueError(f"max_len must be >= 3, got {max_len}")
    tokens = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    mask = torch.zeros((len(texts), max_len), dtype=torch.bool)
    for i, text in enumerate(texts):
        ids = (BOS, *encode(text, kind, vocab_size)[: max_len - 2], EOS)
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = True
    return tokens.to(device), mask.to(device)
