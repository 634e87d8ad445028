"""Built-in vectorised task, written in torch: language-conditioned colour reaching ("ColorReach").

A 2-D workspace [-1, 1]^2 holds three coloured squares (red, green, blue), one in each of three
quadrants, and the agent (a white dot) starts in the fourth. The instruction names one colour; the
agent must move onto that square. The state holds only the agent's own position and last action, so
the policy has to find the goal in the camera image and pick it by the instruction.

Default level (``layout="fixed"``, ``control="target"``): colour c sits in quadrant c, jittered by up to
``jitter`` (0.25, more than the squares' half-size 0.16), and an action is the position to head for. The
instruction gives the rough goal, the image its exact place. A few-shot SFT policy of the ``tiny`` preset
is clearly imperfect (about 55 % success from 10 demos: it must localise the square to within about 2.5
pixels of a 32x32 image), and PPO raises that within minutes on 2 CPU cores (benchmarks/RESULTS.md). Harder
levels:
``layout="shuffled"`` (the squares' quadrants are drawn anew each episode, so colour and place must be
bound) and ``control="delta"`` (actions are displacements, so a demo's actions depend on the exact goal only
near it).

Why it is a good CI workhorse: thousands of envs step in microseconds on CPU or GPU; a scripted expert
gives demonstrations; success is exact and cheap to evaluate.

Glossary: N envs, H actions per chunk, A = 2 action dims (in [-1, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from vla_rl.core.keyed_random import keyed_uniform
from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged, setting
from vla_rl.envs.base import ChunkBook, ChunkStep, EnvSpec, EpisodeTracker, check_action_chunk

COLORS = ("red", "green", "blue")
RGB = torch.tensor([[220, 40, 40], [40, 190, 60], [50, 90, 235]], dtype=torch.uint8)
TEMPLATES = ("move to the {} square", "reach the {} target")
QUADRANTS = torch.tensor([[-0.45, -0.45], [0.45, -0.45], [-0.45, 0.45], [0.45, 0.45]])


@dataclass(frozen=True)
class ColorReachConfig:
    image_size: int = ranged(32, 4)
    max_episode_steps: int = ranged(32, 1)
    step_size: float = positive(0.08, doc="largest displacement per step and axis")
    control: Literal["delta", "target"] = setting(
        "target", doc='"delta": an action is a displacement (a full-scale action moves step_size); "target": an '
                      "action is the position to head for (moved towards at step_size per step), like end-effector "
                      "target-pose control. With \"target\" the expert's action is the goal itself at every step, so "
                      "every frame of a demo ties the image to the goal's exact place; with \"delta\" the expert's "
                      "actions saturate far from the goal and only the last steps depend on where exactly it is.")
    target_half_size: float = positive(0.16, doc="success: the agent's centre is on the goal square (5 px of 32)")
    jitter: float = nonneg(0.25, doc="how far objects move around their quadrant centre")
    layout: Literal["shuffled", "fixed"] = setting(
        "fixed", doc='"shuffled": the quadrants of the three squares and the agent are drawn anew every episode, so '
                     "the policy must bind the instruction's colour to a place in the image (hard for few-shot SFT). "
                     '"fixed": colour c always sits in quadrant c (jittered) and the agent starts in the last one, so '
                     "the instruction alone gives the rough goal and the image the exact one (the CI / demo level).")
    reward: Literal["dense", "sparse"] = "dense"
    success_bonus: float = nonneg(1.0)
    progress_scale: float = nonneg(0.1, doc="dense reward: this much for a full step of progress")

    def __post_init__(self):
        check_ranges(self)


class ColorReachEnv:
    """``num_envs`` ColorReach envs stepping in lockstep on ``device``."""

    def __init__(self, num_envs: int, *, config: ColorReachConfig | None = None, device="cpu", seed: int = 0):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.cfg = config or ColorReachConfig()
        if self.cfg.layout not in ("shuffled", "fixed"):
            raise ValueError(f"ColorReachConfig.layout must be 'shuffled' or 'fixed', got {self.cfg.layout!r}")
        if self.cfg.control not in ("delta", "target"):
            raise ValueError(f"ColorReachConfig.control must be 'delta' or 'target', got {self.cfg.control!r}")
        self.device = torch.device(device)
        self.spec = EnvSpec(num_envs=num_envs, action_dim=2, state_dim=4, num_cameras=1,
                            image_size=self.cfg.image_size, max_episode_steps=self.cfg.max_episode_steps)
        n = num_envs
        self.gen = torch.Generator(device=self.device).manual_seed(seed)   # the expert's action noise only
        # Env i's episodes are named by (its seed, its episode count): each initial state is drawn from those
        # two numbers alone (counter-based, vla_rl/core/keyed_random.py), so an episode seed gives the same
        # episode whatever the number of envs or the env's place among them.
        self.seeds = seed + torch.arange(n, dtype=torch.long, device=self.device)
        self.episode = torch.full((n,), -1, dtype=torch.long, device=self.device)
        self.targets = torch.zeros(n, 3, 2, device=self.device)
        self.pos = torch.zeros(n, 2, device=self.device)
        self.last_action = torch.zeros(n, 2, device=self.device)
        self.goal = torch.zeros(n, dtype=torch.long, device=self.device)
        self.template = torch.zeros(n, dtype=torch.long, device=self.device)
        self.t = torch.zeros(n, dtype=torch.long, device=self.device)
        self.tracker = EpisodeTracker(n, self.device)
        coords = (torch.arange(self.cfg.image_size, device=self.device) + 0.5) / self.cfg.image_size * 2 - 1
        self._px = coords[None, None, :]            # x grows with column
        self._py = coords.flip(0)[None, :, None]    # y grows upwards (row 0 is the top)
        self._rgb = RGB.to(self.device)

    @property
    def num_envs(self) -> int:
        return self.spec.num_envs

    # ------------------------------------------------------------------------------------------------
    def _randomize(self, idx: Tensor) -> None:
        """Start the next episode of envs ``idx``, drawn from each env's (seed, episode count)."""
        m = idx.numel()
        if m == 0:
            return
        dev, j = self.device, self.cfg.jitter
        self.episode[idx] += 1
        # 4 numbers for the quadrant order, 8 for the jitter of 4 objects, 1 goal, 1 instruction template
        u = keyed_uniform([self.seeds[idx], self.episode[idx]], (14,), domain="builtin/color_reach", device=dev)
        if self.cfg.layout == "shuffled":
            quad = torch.argsort(u[:, :4], dim=1)                                   # random quadrants
        else:
            quad = torch.arange(4, device=dev).expand(m, 4)
        centers = QUADRANTS.to(dev)[quad]                                           # [m, 4, 2]
        jit = (u[:, 4:12].reshape(m, 4, 2) * 2 - 1) * j
        placed = centers + jit
        self.targets[idx] = placed[:, :3]
        self.pos[idx] = placed[:, 3]
        self.goal[idx] = (u[:, 12] * 3).long().clamp_(max=2)
        self.template[idx] = (u[:, 13] * len(TEMPLATES)).long().clamp_(max=len(TEMPLATES) - 1)
        self.last_action[idx] = 0.0
        self.t[idx] = 0

    @torch.inference_mode()
    def reset(self, seed: int | None = None, *, group_size: int = 1) -> dict:
        """Reset every env: with ``seed``, env ``i`` starts the episode of seed ``seed + i // group_size`` (the
        same seed, the same episode, whatever the number of envs; ``group_size`` g > 1 gives consecutive groups
        of g envs the same initial state, GRPO's groups); without, every env starts its next episode."""
        if seed is not None:
            self.seeds = seed + torch.arange(self.num_envs, device=self.device) // group_size
            self.episode.fill_(-1)
        self._randomize(torch.arange(self.num_envs, device=self.device))
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self.observe()

    # ------------------------------------------------------------------------------------------------
    def instructions(self) -> list[str]:
        goals, templates = self.goal.tolist(), self.template.tolist()
        return [TEMPLATES[k].format(COLORS[c]) for c, k in zip(goals, templates)]

    def close(self) -> None:
        """Part of the batched-env interface (worker envs end their processes here); this env holds
        nothing but tensors, so there is nothing to release."""

    def render(self) -> Tensor:
        """Camera images ``[N, 1, S, S, 3]`` uint8."""
        n, s = self.num_envs, self.cfg.image_size
        img = torch.full((n, s, s, 3), 30, dtype=torch.uint8, device=self.device)
        r = self.cfg.target_half_size
        for c in range(3):
            tx, ty = self.targets[:, c, 0, None, None], self.targets[:, c, 1, None, None]
            inside = ((self._px - tx).abs() <= r) & ((self._py - ty).abs() <= r)
            img[inside] = self._rgb[c]
        ax, ay = self.pos[:, 0, None, None], self.pos[:, 1, None, None]
        agent = ((self._px - ax).pow(2) + (self._py - ay).pow(2)) <= (0.06**2)
        img[agent] = 255
        return img[:, None]

    def state(self) -> Tensor:
        return torch.cat([self.pos, self.last_action], dim=1)

    def observe(self) -> dict:
        return {"images": self.render(), "state": self.state(), "instruction": self.instructions()}

    def goal_position(self) -> Tensor:
        return self.targets[torch.arange(self.num_envs, device=self.device), self.goal]

    def success(self) -> Tensor:
        return self._on_goal(self.pos)

    def _on_goal(self, pos: Tensor) -> Tensor:
        return ((pos - self.goal_position()).abs() < self.cfg.target_half_size).all(dim=1)

    # ------------------------------------------------------------------------------------------------
    def expert_action(self, noise: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        """Scripted expert ``[N, 2]``: head straight for the goal (delta: at most one full step; target:
        the goal's position)."""
        if self.cfg.control == "target":
            a = self.goal_position().clone()
        else:
            a = ((self.goal_position() - self.pos) / self.cfg.step_size).clamp(-1, 1)
        if noise > 0:
            eps = torch.randn(a.shape, generator=generator or self.gen, device=self.device)
            a = (a + noise * eps).clamp(-1, 1)
        return a

    @torch.inference_mode()
    def step(self, chunk: Tensor) -> ChunkStep:
        """Execute up to H actions of ``chunk`` ``[N, H, 2]`` per env (see :mod:`envs.base`)."""
        chunk = check_action_chunk(chunk, self.spec, device=self.device)
        n, horizon = chunk.shape[:2]
        cfg = self.cfg
        book = ChunkBook(n, horizon, self.device)
        for h in range(horizon):
            a = chunk[:, h]
            goal = self.goal_position()
            prev_dist = (self.pos - goal).norm(dim=1)
            if cfg.control == "target":
                moved = self.pos + (a - self.pos).clamp(-cfg.step_size, cfg.step_size)
            else:
                moved = (self.pos + cfg.step_size * a).clamp(-1, 1)
            act = book.active[:, None]
            self.pos = torch.where(act, moved, self.pos)
            self.last_action = torch.where(act, a, self.last_action)
            dist = (self.pos - goal).norm(dim=1)
            succ = self._on_goal(self.pos)
            if cfg.reward == "dense":
                r = cfg.progress_scale * (prev_dist - dist) / cfg.step_size + cfg.success_bonus * succ
            else:
                r = succ.float()
            book.book(h, r, succ, succ, self.t, cfg.max_episode_steps, self.tracker)
        done = book.done
        final_obs, episodes = None, {}
        if bool(done.any()):
            final_obs = self.observe()
            episodes = self.tracker.finish(done, book.success)
            self._randomize(done.nonzero(as_tuple=True)[0])
        return book.result(self.observe(), final_obs=final_obs, episodes=episodes)


class ColorReachSingleEnv:
    """One ColorReach env behind the single-env worker protocol (numpy in and out; see
    :mod:`envs.workers`). Used to test the worker pool without a simulator installed."""

    def __init__(self, config: ColorReachConfig | None = None, seed: int = 0):
        self.env = ColorReachEnv(1, config=config, seed=seed)
        self.spec = replace(self.env.spec)
        self._last_image = None   # camera image of an ended episode, until reset (the batched env moved on)

    @staticmethod
    def _np(obs: dict) -> dict:
        return {"images": obs["images"][0].numpy(), "state": obs["state"][0].numpy(),
                "instruction": obs["instruction"][0]}

    def reset(self, seed: int | None) -> dict:
        self._last_image = None
        return self._np(self.env.reset(seed))

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, bool]:
        out = self.env.step(torch.as_tensor(action, dtype=torch.float32).reshape(1, 1, -1))
        obs = out.final_obs if out.final_obs is not None else out.obs
        if out.final_obs is not None:   # the batched env has already started its next episode
            self._last_image = out.final_obs["images"][0, 0].numpy()
        return (self._np(obs), float(out.rewards[0, 0]), bool(out.terminated[0]), bool(out.truncated[0]),
                bool(out.success[0]))

    def render_frame(self) -> np.ndarray:
        """The camera image of the current state; after an episode ended, of its last state (until reset)."""
        if self._last_image is not None:
            return self._last_image
        return self.env.render()[0, 0].numpy()

    def close(self) -> None:
        pass


def describe_robot(task: ColorReachConfig, *, state_dim: int, action_dim: int) -> dict:
    """What the task's state and actions mean, for an exported policy's spec (names, units, bounds, camera)."""
    unit = "workspace [-1, 1]"
    actions = (["target_x", "target_y"], [unit] * 2) if task.control == "target" else \
        (["dx", "dy"], [f"step fraction (1 = {task.step_size} workspace units)"] * 2)
    return {"control_mode": f"builtin:{task.control}", "action_low": -1.0, "action_high": 1.0,
            "state_names": ["agent_x", "agent_y", "last_action_x", "last_action_y"], "state_units": [unit] * 4,
            "action_names": actions[0], "action_units": actions[1],
            "cameras": [{"name": "image", "height": task.image_size, "width": task.image_size}]}
