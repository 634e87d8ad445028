"""One batched, chunk-stepping environment interface.

Glossary: N envs, H actions per chunk, A action dims, C cameras, S state dims.

Observations are dicts of tensors on the env's device:
  ``images`` uint8 ``[N, C, Hi, Wi, 3]``, ``state`` float32 ``[N, S]``,
  and ``instruction``: a list of N strings (the language instruction of each env).

``step(chunk)`` executes up to H actions per env. An env whose episode ends inside the chunk stops
there (its remaining actions are ignored and earn 0 reward), its final observation is reported, and it
is reset in place (partial reset); the others are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

EPISODE_METRICS = ("success_once", "success_at_end", "return", "length")
# Names of a 7-d delta end-effector pose action (ManiSkill's pd_ee_delta_pose, LIBERO's OSC_POSE), for export specs.
DELTA_POSE_ACTIONS = ["dx", "dy", "dz", "drx", "dry", "drz", "gripper"]


class SimulatorUnavailable(RuntimeError):
    """A simulator (or a package, driver or asset it needs) is missing on this machine: the message says what to
    install. The CLI reports it as an env error; resuming a run would not help."""


@dataclass
class EnvSpec:
    """What a policy needs to know about an environment."""

    num_envs: int
    action_dim: int
    state_dim: int
    num_cameras: int
    image_size: int
    max_episode_steps: int
    action_low: float = -1.0
    action_high: float = 1.0
    # The camera images are turned 180 degrees from what the camera sees (LIBERO's "rot180", as in openpi's
    # datasets): the policy gets them so, videos turn them back for a person.
    images_rot180: bool = False


@dataclass
class ChunkStep:
    """Result of one chunk step.

    obs          observation after the chunk (for ended envs: the first observation of the new episode)
    rewards      ``[N, H]`` per sub-step rewards (0 after an env ended inside the chunk)
    terminated   ``[N]`` bool  episode ended by the task (success or failure)
    truncated    ``[N]`` bool  episode ended by the time limit
    success      ``[N]`` bool  task solved at the last executed sub-step
    steps        ``[N]`` long  sub-steps actually executed in this chunk
    final_obs    observation at the end of the ended episodes (all N rows; meaningful where ``done``)
    episodes     per-episode metrics of the envs that ended in this chunk: dict of ``[M]`` tensors
                 (``success_once``, ``success_at_end``, ``return``, ``length``, ``env_index``)
    lost         ``[N]`` bool or None: envs whose episode was lost in this chunk (their worker process died and
                 was restarted); their obs is the first of a new episode, their chunk ran no step
    final_frames {row: uint8 ``[H, W, 3]``} or None: a rendering of the last state of each ended episode, for the
                 envs asked for with the env's ``set_final_frames`` (videos of camera-less envs); None if none
    """

    obs: dict
    rewards: Tensor
    terminated: Tensor
    truncated: Tensor
    success: Tensor
    steps: Tensor
    final_obs: dict | None
    episodes: dict[str, Tensor] = field(default_factory=dict)
    lost: Tensor | None = None
    final_frames: dict[int, np.ndarray] | None = None

    @property
    def done(self) -> Tensor:
        return self.terminated | self.truncated


def check_env_indices(indices, num_envs: int) -> list[int]:
    """``indices`` as ints, in the order given; an IndexError names the first one outside ``[0, num_envs)``."""
    out = [int(i) for i in indices]
    for i in out:
        if not 0 <= i < num_envs:
            raise IndexError(f"env index {i} out of range for {num_envs} envs")
    return out


def check_action_chunk(chunk: Tensor, spec: EnvSpec, *, max_horizon: int | None = None,
                       device: torch.device | None = None) -> Tensor:
    """Validate an action chunk ``[N, H, A]``; returns it as float32 on ``device``."""
    if not isinstance(chunk, Tensor):
        raise TypeError(f"action chunk must be a torch.Tensor, got {type(chunk).__name__}")
    if not chunk.is_floating_point():
        raise TypeError(f"action chunk must be floating point, got {chunk.dtype}")
    if chunk.dim() != 3 or chunk.shape[0] != spec.num_envs or chunk.shape[2] != spec.action_dim:
        raise ValueError(f"action chunk must have shape [{spec.num_envs}, H, {spec.action_dim}], "
                         f"got {tuple(chunk.shape)}")
    if chunk.shape[1] < 1 or (max_horizon is not None and chunk.shape[1] > max_horizon):
        raise ValueError(f"action chunk length must be in [1, {max_horizon}], got {chunk.shape[1]}")
    if not torch.isfinite(chunk).all():
        raise ValueError("action chunk contains NaN or inf")
    tol = 1e-4
    if (chunk < spec.action_low - tol).any() or (chunk > spec.action_high + tol).any():
        raise ValueError(f"actions out of range [{spec.action_low}, {spec.action_high}]: "
                         f"min {chunk.min().item():.3f}, max {chunk.max().item():.3f} "
                         "(clip the policy's output before stepping)")
    return chunk.to(device=device, dtype=torch.float32)


class ChunkBook:
    """The bookkeeping each batched env's ``step`` does per action of a chunk: which envs still act, their
    rewards, and whether and how each episode ended inside the chunk (the ``ChunkStep`` fields other than the
    observations)."""

    def __init__(self, n: int, horizon: int, device):
        self.rewards = torch.zeros(n, horizon, device=device)
        self.active = torch.ones(n, dtype=torch.bool, device=device)
        self.terminated = torch.zeros(n, dtype=torch.bool, device=device)
        self.truncated = torch.zeros_like(self.terminated)
        self.success = torch.zeros_like(self.terminated)
        self.steps = torch.zeros(n, dtype=torch.long, device=device)

    def book(self, h: int, reward: Tensor, success: Tensor, terminal: Tensor, t: Tensor, max_steps: int,
             tracker: EpisodeTracker) -> Tensor:
        """Record action ``h`` for the envs still acting: ``t`` (each env's step in its episode) counts it, in
        place; an env's episode ends when ``terminal`` or when ``t`` reaches ``max_steps`` (a truncation). Returns
        the envs whose episode ended at this action; from here on they do not act."""
        a = self.active
        t += a.long()
        self.rewards[:, h] = reward * a
        tracker.update(reward, success, a)
        self.steps += a.long()
        self.success = torch.where(a, success, self.success)
        new_term = terminal & a
        new_trunc = (t >= max_steps) & a & ~terminal
        self.terminated |= new_term
        self.truncated |= new_trunc
        ended = new_term | new_trunc
        self.active = a & ~ended
        return ended

    @property
    def done(self) -> Tensor:
        return self.terminated | self.truncated

    def result(self, obs: dict, **rest) -> ChunkStep:
        return ChunkStep(obs=obs, rewards=self.rewards, terminated=self.terminated, truncated=self.truncated,
                         success=self.success, steps=self.steps, **rest)


class EpisodeTracker:
    """Running per-env episode statistics (success_once, return, length), vectorised.

    ``rows`` (a range of env indices, default all): the arguments are those envs' rows only, for an env
    that steps its envs in groups."""

    def __init__(self, num_envs: int, device):
        self.ret = torch.zeros(num_envs, device=device)
        self.length = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.success_once = torch.zeros(num_envs, dtype=torch.bool, device=device)

    def update(self, reward: Tensor, success: Tensor, active: Tensor, rows: range | None = None) -> None:
        sl = slice(None) if rows is None else slice(rows.start, rows.stop)
        self.ret[sl] += reward * active
        self.length[sl] += active.long()
        self.success_once[sl] |= success & active

    def finish(self, ended: Tensor, success_at_end: Tensor, rows: range | None = None) -> dict[str, Tensor]:
        local = ended.nonzero(as_tuple=True)[0]
        idx = local if rows is None else local + rows.start
        out = {
            "env_index": idx,
            "success_once": self.success_once[idx].clone(),
            "success_at_end": success_at_end[local].clone(),
            "return": self.ret[idx].clone(),
            "length": self.length[idx].clone(),
        }
        self.ret[idx] = 0.0
        self.length[idx] = 0
        self.success_once[idx] = False
        return out
