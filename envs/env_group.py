"""What one env worker runs: a group of single envs built by one ``factory()``, stepped one after another.

The same code runs in a worker process (:mod:`envs.workers`) and in a Ray env actor (:mod:`envs.ray_workers`);
only how the observations travel differs (shared memory there, the reply itself here).

The single-env protocol (what a ``factory()`` must return)::

    spec: EnvSpec                                   # num_envs = 1
    reset(seed: int | None) -> obs                  # {"images": uint8 [C, S, S, 3], "state": float32 [D],
                                                    #  "instruction": str}   (numpy)
    step(action: float32 [A]) -> (obs, reward: float, terminated: bool, truncated: bool, success: bool)
    render_frame() -> uint8 [H, W, 3]              # also of an ended episode's last state, before its reset
    close() -> None
    forget_history() -> None                        # optional: the next reset starts as a newly built env
                                                    # would (simulators whose physics carries state across
                                                    # episodes); without it, an env has no such state

Glossary: N envs, H actions per chunk, A action dims, C cameras, S image size, D state dims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from vla_rl.envs.base import EnvSpec


class ChunkReply(NamedTuple):
    """One env's part of a chunk step, without its observation arrays (those travel separately)."""

    rewards: np.ndarray            # [H] float32, 0 after the episode ended
    successes: np.ndarray          # [H] bool
    steps: int                     # sub-steps executed
    terminated: bool
    truncated: bool
    success: bool                  # at the last executed sub-step
    instruction: str               # of the observation after the chunk
    final_instruction: str | None  # of the episode that ended in the chunk, None if none did
    final_frame: np.ndarray | None = None  # render_frame() of the ended episode's last state, if asked for


def obs_layout(num_envs: int, spec: EnvSpec) -> dict[str, tuple[tuple[int, ...], type]]:
    """Shape and dtype of the batched observation arrays: the current and the final observation of each env."""
    images = (num_envs, spec.num_cameras, spec.image_size, spec.image_size, 3)
    return {"images": (images, np.uint8), "state": ((num_envs, spec.state_dim), np.float32),
            "final_images": (images, np.uint8), "final_state": ((num_envs, spec.state_dim), np.float32)}


def write_obs(arrays: dict[str, np.ndarray], index: int, obs: dict, final: bool) -> str:
    """Put one env's observation in row ``index`` of the batched arrays; returns its instruction."""
    prefix = "final_" if final else ""
    arrays[prefix + "images"][index] = obs["images"]
    arrays[prefix + "state"][index] = obs["state"]
    return obs["instruction"]


def land_reset(arrays: dict[str, np.ndarray], first: int, observations: list[dict]) -> list[str]:
    """Write a group's reset observations (its envs are rows ``first ...``); returns their instructions."""
    return [write_obs(arrays, first + j, obs, final=False) for j, obs in enumerate(observations)]


def land_step(arrays: dict[str, np.ndarray], first: int,
              results: list[tuple[ChunkReply, dict, dict | None]]) -> list[ChunkReply]:
    """Write what :meth:`EnvGroup.step` returned (observations, final ones) into rows ``first ...``; returns
    the replies."""
    for j, (_, obs, final) in enumerate(results):
        if final is not None:
            write_obs(arrays, first + j, final, final=True)
        write_obs(arrays, first + j, obs, final=False)
    return [reply for reply, _, _ in results]


class EnvGroup:
    """``count`` single envs from ``factory()`` (all with the same spec), run one after another."""

    def __init__(self, factory: Callable[[], object], count: int):
        self.envs = []
        try:
            for _ in range(count):
                self.envs.append(factory())
            if any(e.spec != self.envs[0].spec for e in self.envs):
                raise RuntimeError(f"the factory built envs with different specs: {[e.spec for e in self.envs]}")
        except BaseException:
            self.close()
            raise
        self.spec: EnvSpec = self.envs[0].spec
        self.final_frames: set[int] = set()   # positions whose ended episodes are rendered before the reset

    def set_final_frames(self, local: list[int]) -> None:
        """Render the last state of every episode that ends in envs ``local`` (positions in the group; the
        reset that follows at once would leave nothing to render), until called again."""
        self.final_frames = {int(j) for j in local}

    def reset(self, seeds: list[int | None]) -> list[dict]:
        """Reset env ``j`` with ``seeds[j]``; returns their observations."""
        return [env.reset(s) for env, s in zip(self.envs, seeds)]

    def forget_history(self) -> None:
        """Make each env's next reset start as in a newly built env (see the single-env protocol)."""
        for env in self.envs:
            if hasattr(env, "forget_history"):
                env.forget_history()

    def step(self, actions: np.ndarray) -> list[tuple[ChunkReply, dict, dict | None]]:
        """Run env ``j`` through the chunk ``actions[j]`` ``[H, A]``, stopping where its episode ends (the next
        one starts at once); returns, per env, the reply, the observation after the chunk and the final
        observation of the ended episode (None if it goes on)."""
        return [_step_env(env, a, j in self.final_frames) for j, (env, a) in enumerate(zip(self.envs, actions))]

    def render(self, local: list[int]) -> list[np.ndarray]:
        """One RGB frame per env of the group, by position in the group."""
        return [self.envs[j].render_frame() for j in local]

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def _step_env(env, actions: np.ndarray, render_final: bool = False) -> tuple[ChunkReply, dict, dict | None]:
    horizon = actions.shape[0]
    rewards = np.zeros(horizon, np.float32)
    successes = np.zeros(horizon, bool)
    term = trunc = succ = False
    steps = 0
    for h in range(horizon):
        obs, r, term, trunc, succ = env.step(actions[h])
        rewards[h], successes[h] = r, succ
        steps += 1
        if term or trunc:
            break
    final = frame = None
    if term or trunc:
        frame = env.render_frame() if render_final else None
        final, obs = obs, env.reset(None)
    reply = ChunkReply(rewards, successes, steps, bool(term), bool(trunc), bool(succ), obs["instruction"],
                       None if final is None else final["instruction"], frame)
    return reply, obs, final
