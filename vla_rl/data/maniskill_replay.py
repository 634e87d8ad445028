"""ManiSkill's trajectory converter (``mani_skill.trajectory.replay_trajectory``), with a failed replay
discarded before the next episode starts recording.

Why: ManiSkill 3.0.1's converter records with ``RecordEpisode(save_on_reset=False)`` and flushes only the
replays that succeed. A failed replay's frames stay in the recording buffer, and the next reset only replaces
its last row, so the next saved episode begins with the failed replay's frames (its first observation is then
another seed's, which :func:`vla_rl.data.maniskill_demos.reobserve_first_frames` finds). Discarding whatever
is unflushed at each reset keeps every saved episode whole.

Run as ``python -m vla_rl.data.maniskill_replay <replay_trajectory arguments>`` (what
:func:`vla_rl.data.maniskill_demos.convert_demos` does).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import sys


def discarding_unflushed(reset):
    """``RecordEpisode.reset`` that first drops the episode recorded since the last flush, if any (a no-op
    after a flush: ManiSkill skips flushing a buffer that holds only the reset row)."""

    @functools.wraps(reset)
    def wrapped(self, *args, **kwargs):
        if not self.save_on_reset and getattr(self, "_trajectory_buffer", None) is not None:
            self.flush_trajectory(save=False)
        return reset(self, *args, **kwargs)

    wrapped.discards_unflushed = True
    return wrapped


def install() -> None:
    from mani_skill.utils.wrappers.record import RecordEpisode

    if not getattr(RecordEpisode.reset, "discards_unflushed", False):
        RecordEpisode.reset = discarding_unflushed(RecordEpisode.reset)


def main(argv: list[str]) -> None:
    from mani_skill.trajectory import replay_trajectory

    install()
    mp.set_start_method("spawn")   # as the converter's own entry point does
    replay_trajectory.main(replay_trajectory.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
