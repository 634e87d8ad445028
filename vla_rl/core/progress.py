"""Progress of long work (training iterations, SFT steps, evaluation episodes, demo collection) for a person
watching it: a tqdm bar on a terminal, and a plain line every :data:`LOG_INTERVAL_S` seconds when the output is
a file or a pipe.

Why not tqdm everywhere: tqdm redraws its bar with carriage returns up to ten times a second, which in a log
file (``vla-rl train ... > run.log 2>&1``, a cluster job's output) is one endless line of redraws per bar.
The plain lines say the same (count, rate, time left, the bar's postfix), can be read with ``tail``, and
cost a few lines a minute.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

LOG_INTERVAL_S = 10.0   # seconds between two lines when the output is not a terminal


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes and streams without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):   # no isatty, or a closed stream
        return False


def progress(iterable: Iterable | None = None, *, total: int | None = None, initial: int = 0, desc: str = "",
             unit: str = "it", enabled: bool = True, file: TextIO | None = None, interval: float | None = None,
             leave: bool = False):
    """A progress indicator with tqdm's core interface (iterate over it, or ``update(n)``; ``n``,
    ``set_postfix``, ``close``, use as a context manager): a tqdm bar when ``file`` (default ``sys.stderr``) is
    a terminal, else a :class:`LineProgress` that writes a line every ``interval`` seconds (default
    :data:`LOG_INTERVAL_S`). ``initial``: the count done before (a resumed run); ``enabled=False`` shows
    nothing."""
    file = sys.stderr if file is None else file
    if enabled and is_terminal(file):
        from tqdm import tqdm

        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, file=file, leave=leave,
                    dynamic_ncols=True)
    return LineProgress(iterable, total=total, initial=initial, desc=desc, unit=unit, enabled=enabled, file=file,
                        interval=LOG_INTERVAL_S if interval is None else interval)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class LineProgress:
    """Progress as plain lines: ``desc: 30/200 it (15%), 0.52 it/s, 57s elapsed, ~5m27s left, loss=0.12``.

    A line is written at the first update after ``interval`` seconds since the start or the last line, and, when
    any line was written, one more at :meth:`close` with the final count (short work writes nothing)."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, initial: int = 0,
                 desc: str = "", unit: str = "it", enabled: bool = True, file: TextIO | None = None,
                 interval: float = LOG_INTERVAL_S, clock=time.monotonic):
        if interval < 0:
            raise ValueError(f"interval must be >= 0 seconds, got {interval}")
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.enabled, self.file, self.interval, self.clock = enabled, file, interval, clock
        self.n = self.initial = initial
        self.postfix = ""
        self.start = self.last = clock()
        self.lines = 0
        self.written_n = initial   # the count of the last line written
        self.closed = False

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("this progress has no iterable: call update(n) instead")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self) -> str:
        """The current state as one line (what is written)."""
        elapsed = self.clock() - self.start
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        parts = [f"{count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        done = self.n - self.initial   # in this process: the rate and the time left come from these
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            one = self.unit[:-1] if self.unit.endswith("s") and len(self.unit) > 2 else self.unit  # per episode
            parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{one}")
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.total and done > 0 and self.n < self.total:
            parts.append(f"~{_duration(elapsed / done * (self.total - self.n))} left")
        if self.postfix:
            parts.append(self.postfix)
        return f"{self.desc}: {', '.join(parts)}" if self.desc else ", ".join(parts)

    def _write(self) -> None:
        self.last = self.clock()
        self.lines += 1
        self.written_n = self.n
        self.file.write(self.line() + "\n")
        self.file.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled and not self.closed and self.clock() - self.last >= self.interval:
            self._write()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def write(self, s: str) -> None:
        if self.enabled:
            self.file.write(s + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.enabled and self.lines and self.n != self.written_n:
            self._write()
