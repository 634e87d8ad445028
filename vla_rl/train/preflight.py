"""Warnings about a training config that runs, but not as its author likely meant; checked when a run is built
(before any work), since the episode limit is known only once the env exists (ManiSkill: the task's own limit)."""

from __future__ import annotations

import math

from vla_rl.envs.registry import ENV_KINDS, same_family


def recorded_limit(init_env: dict | None, kind: str, task: str | None = None) -> int | None:
    """The episode limit the init policy's dataset recorded (its ``env_config``) for an env of ``kind`` (and,
    for a kind whose settings name a task, as ManiSkill's do, ``task``); None where it recorded none or was made
    for another env."""
    if not init_env or init_env.get("kind") != kind or kind not in ENV_KINDS:
        return None
    section = init_env.get(kind) or {}
    key = ENV_KINDS[kind].task_key
    if task is not None and key is not None and section.get(key) not in (None, task):
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


def image_warnings(init_env: dict | None, kind: str, env_section: dict) -> list[str]:
    """Where the training env (``env_section``: its ``env.<kind>`` settings) renders images otherwise than the
    init policy's dataset did (its ``env_config``, of the same kind or family): the policy would act on pictures it
    never saw. The settings that matter are the kind's ``image_keys`` (LIBERO's orientation and reflections)."""
    if not init_env or not same_family(kind, init_env.get("kind")) or not ENV_KINDS[kind].image_keys:
        return []
    recorded = init_env.get(init_env["kind"]) or {}
    if not recorded.get("cameras"):
        return []
    out = []
    for key, old_default in ENV_KINDS[kind].image_keys.items():
        if key not in env_section:
            continue
        was = recorded.get(key, old_default)
        if was is not None and was != env_section[key]:
            out.append(f"the init policy's demos were recorded with {key}={was}, this run's env renders with "
                       f"{key}={env_section[key]}: the policy would see images unlike its training data; set "
                       f"env.{kind}.{key}={was} unless that is meant")
    return out
