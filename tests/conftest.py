"""Fixtures shared by several test modules (plain helpers are in helpers.py)."""

from __future__ import annotations

import pytest
from helpers import SMALL, sft_policy


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A policy folder: the SMALL tiny policy after 20 SFT steps on 4 built-in expert demos."""
    return sft_policy(tmp_path_factory.mktemp("sft") / "policy", SMALL, steps=20)
