"""Episode and rollout lengths that follow the task, not a number fitted to one task.

A recipe that moves from one task to another (LIBERO-Spatial task 0 to a LIBERO-Goal or LIBERO-10 task) must not
carry the first task's episode cap: a cap shorter than the new task's episodes makes every rollout fail and every
evaluation read 0. Two settings of :class:`~vla_rl.train.trainer.TrainConfig` take the lengths from the task:

- ``episode_limit: demos``: the env's ``max_episode_steps`` becomes the init policy's longest SFT demo
  (``sft.longest_episode`` in its ``config.yaml``) times :data:`DEMO_MARGIN` (room for a policy slower than its
  expert), rounded up to whole chunks of ``execute`` actions, and never above the task's official limit
  (LIBERO: its suite's). ``env`` (default) keeps the env section's own.
- ``rollout_chunks: auto``: a rollout as long as one episode, ``ceil(limit / execute)`` chunks, so every episode
  ends, and is scored, inside its rollout.

Both are resolved once, when a run starts; the run folder's ``config.yaml`` records the numbers, so a resume
(and anyone reading the run) sees them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from vla_rl.checkpoint.folders import read_yaml_file
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.envs.registry import official_episode_steps

DEMO_MARGIN = 1.25


def demo_episode_limit(longest: int, execute: int, official: int | None) -> int:
    """``longest`` demo steps x :data:`DEMO_MARGIN`, rounded up to a multiple of ``execute``, at most ``official``.

    >>> demo_episode_limit(125, 8, 220)   # 157 -> whole chunks of 8
    160
    """
    steps = math.ceil(math.ceil(longest * DEMO_MARGIN) / execute) * execute
    return min(steps, official) if official else steps


def episode_limit_of(env) -> int | None:
    """The episode step limit an env config gives (its ``max_episode_steps``, else the task's official one), or
    None where neither is known before the env is built (a ManiSkill task's own default)."""
    own = getattr(env.task, "max_episode_steps", None)
    return int(own) if own is not None else official_episode_steps(env)


def init_longest_episode(init: str | None) -> int:
    """The longest demo the init policy was trained on (its ``config.yaml``'s ``sft.longest_episode``)."""
    why = "episode_limit=demos takes the episode limit from the init policy's SFT demos"
    if not init:
        raise ConfigError(f"{why}, and no init policy is given: set init=... or env.<kind>.max_episode_steps")
    path = Path(init) / "config.yaml"
    try:
        config = read_yaml_file(path) if path.is_file() else {}
    except CheckpointError:
        config = {}
    longest = (config.get("sft") or {}).get("longest_episode") if isinstance(config, dict) else None
    if not isinstance(longest, int) or longest < 1:
        raise ConfigError(f"{why}; {init} records none (a policy made by `vla-rl sft` does): set "
                          "env.<kind>.max_episode_steps instead")
    return longest


def resolve_lengths(cfg):
    """``cfg`` with ``episode_limit: demos`` and ``rollout_chunks: auto`` turned into numbers, and one line per
    number set (for the run's log). Other configs come back as they are."""
    notes = []
    if cfg.episode_limit == "demos":
        section = cfg.env.task
        if not hasattr(section, "max_episode_steps"):
            raise ConfigError(f"episode_limit=demos: env kind {cfg.env.kind!r} has no max_episode_steps to set")
        longest = init_longest_episode(cfg.init)
        official = official_episode_steps(cfg.env)
        limit = demo_episode_limit(longest, cfg.execute, official)
        env = replace(cfg.env, **{cfg.env.kind: replace(section, max_episode_steps=limit)})
        cfg = replace(cfg, env=env, episode_limit="env")
        capped = f", capped at the task's official {official}" if official is not None and limit == official else ""
        notes.append(f"episode limit {limit} steps (episode_limit=demos: the init policy's longest demo, {longest} "
                     f"steps, x {DEMO_MARGIN} in whole chunks of {cfg.execute}{capped})")
    if cfg.rollout_chunks == "auto":
        limit = episode_limit_of(cfg.env)
        if limit is None:
            raise ConfigError(f"rollout_chunks=auto needs the episode limit, which env kind {cfg.env.kind!r} does "
                              f"not know before it starts: set env.{cfg.env.kind}.max_episode_steps or rollout_chunks")
        cfg = replace(cfg, rollout_chunks=math.ceil(limit / cfg.execute))
        notes.append(f"rollout_chunks {cfg.rollout_chunks} (auto: {cfg.rollout_chunks} x {cfg.execute} actions "
                     f"cover the {limit}-step episode)")
    return cfg, notes
