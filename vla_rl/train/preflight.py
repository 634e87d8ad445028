"""Warnings about a training config that runs, but not as its author likely meant; checked when a run is built
(before any work), since the episode limit is known only once the env exists (ManiSkill: the task's own limit)."""

from __future__ import annotations

import math


def recorded_limit(init_env: dict | None, kind: str, task: str | None = None) -> int | None:
    """The episode limit the init policy's dataset recorded (its ``env_config``) for an env of ``kind`` (and,
    for ManiSkill, ``task``); None where it recorded none or was made for another env."""
    if not init_env or init_env.get("kind") != kind:
        return None
    section = init_env.get(kind) or {}
    if task is not None and section.get("task") not in (None, task):
        return None
    limit = section.get("max_episode_steps")
    return int(limit) if limit is not None else None


def rollout_warnings(*, rollout_chunks: int, execute: int, episode_limit: int, dataset_limit: int | None = None,
                     limit_key: str = "max_episode_steps") -> list[str]:
    """What is off with the rollout length and the episode limit (docs/new_task.md, section 2); ``limit_key``
    names the env's limit setting in the advice."""
    out = []
    steps = rollout_chunks * execute
    if steps < episode_limit:
        out.append(f"rollout_chunks x execute = {rollout_chunks} x {execute} = {steps} actions per rollout, below "
                   f"the episode limit {episode_limit}: a longer episode is cut off unscored, so rollouts see few "
                   f"successes and rollout/success_first favours quick ones; set "
                   f"rollout_chunks={math.ceil(episode_limit / execute)} (docs/new_task.md)")
    if dataset_limit is not None and dataset_limit != episode_limit:
        why = (f"demos longer than {episode_limit} steps time out" if episode_limit < dataset_limit else
               "episodes may run longer than in the SFT evaluation")
        out.append(f"the episode limit {episode_limit} differs from the {dataset_limit} the init policy's dataset "
                   f"recorded ({why}); set {limit_key}={dataset_limit} unless that is meant (docs/new_task.md)")
    return out
