"""A run's metrics: one JSON object per iteration in ``metrics.jsonl``, TensorBoard scalars, and the
one-line summary printed per iteration.

``metrics.jsonl`` is appended to line by line, so a run killed mid-write can leave a torn last line; reading
tolerates exactly that (the line is dropped and recomputed on resume), and anything else unreadable is an
error naming the line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from vla_rl.core.errors import CheckpointError

SUMMARY_KEYS = [("rollout/success_once", "succ"), ("rollout/success_first", "succ1"), ("rollout/return", "ret"),
                ("eval/success_once", "EVAL"), ("losses/policy", "pg"), ("losses/value", "vf"),
                ("losses/approx_kl", "kl"), ("losses/clipfrac", "clip"), ("time/env_steps_per_s", "sps"),
                ("time/peak_memory_mb", "MB")]


def read_metrics(path: str | Path, log=print) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none if it does not exist). A torn last line (a kill while it
    was written) is dropped with a note; any other line that is not a JSON object with an ``iteration`` is
    a :class:`~vla_rl.checkpoint.CheckpointError` naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    out = []
    for k, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
                raise ValueError("not a record with an integer iteration")
        except ValueError as e:
            if k == len(numbered) - 1:
                log(f"{path}: dropped its torn last line {lineno} (a write was interrupted)")
                break
            raise CheckpointError(f"{path} line {lineno} is not a metrics record ({e}); fix or delete that "
                                  "line") from None
        out.append(record)
    return out


def write_metrics(path: str | Path, records: list[dict]) -> None:
    """Replace ``path`` with ``records`` atomically (a kill leaves the old file or the new one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in records))
    os.replace(tmp, path)


def summary_line(m: dict) -> str:
    """``iter   12 | succ 0.5 | ... | MB 812`` for the keys present."""
    parts = [f"iter {m['iteration']:>4}"]
    for key, label in SUMMARY_KEYS:
        if key in m and m[key] is not None:
            parts.append(f"{label} {m[key]:.3g}")
    return " | ".join(parts)


class MetricsLog:
    """Appends each iteration's metrics to ``<run_dir>/metrics.jsonl`` and, if ``tensorboard``, to
    TensorBoard (``<run_dir>/tensorboard``, x axis: ``time/env_steps``)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool, log=print):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard, self.log = tensorboard, log
        self._tb = None

    def record(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if not self.tensorboard:
            return
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                self.log("tensorboard is not installed; logging to metrics.jsonl only")
                self._tb = False
        if self._tb:
            step = int(metrics.get("time/env_steps", 0))
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and "/" in k and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def truncate(self, last_iteration: int) -> list[dict]:
        """Keep the records up to ``last_iteration`` (a resume recomputes the later ones); returns them."""
        kept = [m for m in read_metrics(self.path, log=self.log) if m["iteration"] <= last_iteration]
        if self.path.exists():
            write_metrics(self.path, kept)
        return kept

    def close(self) -> None:
        if self._tb:
            self._tb.close()
        self._tb = None
