"""Fixtures shared by several test modules (plain helpers are in helpers.py)."""

from __future__ import annotations

import pytest
from helpers import SMALL, SMALL_SMOLVLA, sft_policy


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A policy folder: the SMALL tiny policy after 20 SFT steps on 4 built-in expert demos."""
    return sft_policy(tmp_path_factory.mktemp("sft") / "policy", SMALL, steps=20)


@pytest.fixture(scope="module")
def smolvla_checkpoint(tmp_path_factory):
    """A policy folder: a narrow tiny SmolVLA after 20 SFT steps on the same demos."""
    return sft_policy(tmp_path_factory.mktemp("sft_smolvla") / "policy", SMALL_SMOLVLA, steps=20, preset="tiny_smolvla")
