"""In-memory demonstration datasets and their action-chunk targets.

Columns follow LeRobot's naming (``observation.images.<cam>``, ``observation.state``, ``action``,
``episode_index``, ``frame_index``, ``task_index`` + a task list), so on-disk LeRobot datasets map onto
it one to one.

Glossary: M frames, H actions per chunk, A action dims, C cameras.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DemoDataset:
    """Frames of demonstration episodes, stored flat and in episode order.

    images ``[M, C, S, S, 3]`` uint8, state ``[M, D]``, action ``[M, A]``, episode_index ``[M]``,
    frame_index ``[M]``, task_index ``[M]`` into ``tasks`` (the instructions).
    """

    images: Tensor
    state: Tensor
    action: Tensor
    episode_index: Tensor
    frame_index: Tensor
    task_index: Tensor
    tasks: list[str]

    def __post_init__(self):
        m = self.images.shape[0]
        for name in ("state", "action", "episode_index", "frame_index", "task_index"):
            if getattr(self, name).shape[0] != m:
                raise ValueError(f"dataset column {name!r} has {getattr(self, name).shape[0]} rows, "
                                 f"images have {m}")
        if m and int(self.task_index.max()) >= len(self.tasks):
            raise ValueError("task_index refers past the task list")

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def num_episodes(self) -> int:
        return int(self.episode_index.unique().numel())

    def instructions(self, idx: Tensor) -> list[str]:
        return [self.tasks[i] for i in self.task_index[idx].tolist()]

    def action_chunks(self, horizon: int) -> tuple[Tensor, Tensor]:
        """Targets for every frame: the next ``horizon`` actions of its episode ``[M, H, A]`` and a mask
        ``[M, H]`` that is False past the episode's end (those positions repeat the last action)."""
        m = len(self)
        offs = torch.arange(horizon)
        idx = torch.arange(m)[:, None] + offs[None, :]                       # [M, H]
        idx_c = idx.clamp(max=m - 1)
        same = self.episode_index[idx_c] == self.episode_index[:, None]
        valid = (idx < m) & same
        # Past the end, point at the episode's last frame (a padded, masked target).
        last = torch.zeros(m, dtype=torch.long)
        ends = torch.cat([(self.episode_index[1:] != self.episode_index[:-1]).nonzero().flatten(),
                          torch.tensor([m - 1])]) if m > 1 else torch.tensor([0])
        start = 0
        for e in ends.tolist():
            last[start: e + 1] = e
            start = e + 1
        idx_final = torch.where(valid, idx_c, last[:, None])
        return self.action[idx_final], valid


def idle_frames(action: Tensor, episode_index: Tensor, threshold: float) -> Tensor:
    """``[M]`` True on the frames whose arm command is idle: every action dim but the last (the gripper, as in
    ManiSkill's and LIBERO's end-effector control) below ``threshold`` in magnitude, with the gripper command
    unchanged from the episode's previous frame (so the frame that opens or closes the gripper is kept).

    Why: a motion planner pauses between segments (ManiSkill's PickCube demos hold still for ~7 steps after
    the grasp). Those pauses are states the policy cannot tell from the start of the next move, so a cloned
    policy that lands in one keeps commanding ~0 and stalls there (measured: grasped, never lifted).
    OpenVLA filters LIBERO's no-op actions for the same reason."""
    arm = action[:, :-1].abs().amax(dim=1) < threshold
    grip = action[:, -1]
    same_episode = torch.zeros_like(arm)
    same_episode[1:] = episode_index[1:] == episode_index[:-1]
    grip_unchanged = torch.ones_like(arm)
    grip_unchanged[1:] = (grip[1:] - grip[:-1]).abs() < 1e-6
    return arm & (grip_unchanged | ~same_episode)


def drop_idle_frames(data: DemoDataset, threshold: float) -> DemoDataset:
    """``data`` without its idle frames (:func:`idle_frames`); the remaining frames of each episode are
    renumbered 0, 1, ... so action chunks run over the moving frames only."""
    keep = ~idle_frames(data.action, data.episode_index, threshold)
    episode = data.episode_index[keep]
    starts = torch.ones_like(episode, dtype=torch.bool)
    starts[1:] = episode[1:] != episode[:-1]
    pos = torch.arange(len(episode))
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=0).values
    return DemoDataset(images=data.images[keep], state=data.state[keep], action=data.action[keep],
                       episode_index=episode, frame_index=pos - first, task_index=data.task_index[keep],
                       tasks=list(data.tasks))


def select_episodes(data: DemoDataset, episodes: list[int]) -> DemoDataset:
    """The frames of the episodes whose ``episode_index`` is in ``episodes``, in dataset order, renumbered
    0, 1, ... (the task list is kept)."""
    keep = torch.isin(data.episode_index, torch.as_tensor(list(episodes), dtype=data.episode_index.dtype))
    old = data.episode_index[keep]
    _, renumbered = torch.unique_consecutive(old, return_inverse=True)
    return DemoDataset(images=data.images[keep], state=data.state[keep], action=data.action[keep],
                       episode_index=renumbered, frame_index=data.frame_index[keep],
                       task_index=data.task_index[keep], tasks=list(data.tasks))


def take_episodes(data: DemoDataset, n: int) -> DemoDataset:
    """The frames of the first ``n`` episodes (in dataset order), episode indices kept; the task list is cut to
    the tasks they use (renumbered in order)."""
    keep = torch.unique_consecutive(data.episode_index)[:n]
    mask = torch.isin(data.episode_index, keep)
    used = sorted(set(data.task_index[mask].tolist()))
    remap = torch.full((len(data.tasks),), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    return DemoDataset(images=data.images[mask], state=data.state[mask], action=data.action[mask],
                       episode_index=data.episode_index[mask], frame_index=data.frame_index[mask],
                       task_index=remap[data.task_index[mask]], tasks=[data.tasks[t] for t in used])


def concat_episodes(parts: list[DemoDataset]) -> DemoDataset:
    """The episodes of ``parts`` one after another, renumbered 0, 1, ...; task lists are merged."""
    if not parts:
        raise ValueError("no datasets to concatenate")
    tasks: list[str] = []
    for p in parts:
        tasks += [t for t in p.tasks if t not in tasks]
    offset, episode_index, task_index = 0, [], []
    for p in parts:
        _, local = torch.unique_consecutive(p.episode_index, return_inverse=True)
        episode_index.append(local + offset)
        offset += int(local.max()) + 1 if len(local) else 0
        remap = torch.tensor([tasks.index(t) for t in p.tasks], dtype=torch.long)
        task_index.append(remap[p.task_index] if len(p.task_index) else p.task_index)
    return DemoDataset(images=torch.cat([p.images for p in parts]), state=torch.cat([p.state for p in parts]),
                       action=torch.cat([p.action for p in parts]), episode_index=torch.cat(episode_index),
                       frame_index=torch.cat([p.frame_index for p in parts]), task_index=torch.cat(task_index),
                       tasks=tasks)
