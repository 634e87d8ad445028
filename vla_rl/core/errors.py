"""Errors every floor raises and the command line reports in one line (:class:`~vla_rl.core.ranges.ConfigError`, a
setting out of its range, lives beside the ranges)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, corrupt or does not match what is asked of it."""
