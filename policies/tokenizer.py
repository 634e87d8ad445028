"""Offline byte-level tokenizer for task instructions (no hub download).

Ids 0..255 are UTF-8 bytes; then PAD, BOS, EOS. Real PaliGemma vocabularies can be mapped in later by
an importer; for training from scratch a byte vocabulary is small, exact and needs no files.
"""

from __future__ import annotations

import torch

PAD, BOS, EOS = 256, 257, 258
VOCAB_SIZE = 259


def tokenize(texts: list[str], max_len: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode instructions to ``tokens`` ``[N, L]`` long and ``mask`` ``[N, L]`` bool.

    Text is lower-cased and stripped (instructions differ in case across suites); too long texts are
    truncated, keeping BOS and EOS.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("instructions must be a list of strings")
    if max_len < 3:
        raise ValueError(f"max_len must be >= 3, got {max_len}")
    tokens = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    mask = torch.zeros((len(texts), max_len), dtype=torch.bool)
    for i, text in enumerate(texts):
        ids = [BOS, *list(text.strip().lower().encode("utf-8"))[: max_len - 2], EOS]
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = True
    return tokens.to(device), mask.to(device)
