"""Videos of any env behind the batched interface: write frames to mp4 / gif, and collect frames of
chosen envs from their observations.

Every adapter returns camera images (``obs["images"]`` uint8 ``[N, C, S, S, 3]``), so a frame is env
``i``'s cameras side by side (``[S, C * S, 3]``). Envs without cameras (``C = 0``, e.g. ManiSkill's
``obs_mode="state"``) are rendered with ``env.render_frames(indices)`` where the env has it (the worker
pool does: ManiSkill's human-view camera, LIBERO's agentview).

The interface steps whole chunks, so the recorder gets one frame per chunk step (plus the final frame of
an episode that ended inside the chunk: from ``final_obs``, or for envs without cameras rendered by the env
before its reset, ``ChunkStep.final_frames``), not one per action.

Glossary: N envs, C cameras, S image size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vla_rl.envs.base import ChunkStep

VIDEO_SUFFIXES = (".mp4", ".gif")
# Episode videos (eval, bench) for a person: frames enlarged to at least this many pixels on their short side
# (ColorReach's 32 px by 8), each frame held so that a short episode (ColorReach: 4-5 chunks) lasts this long.
VIEW_MIN_SIZE = 256
VIEW_MIN_SECONDS = 2.0


def _as_frame(frame) -> np.ndarray:
    if isinstance(frame, torch.Tensor):
        frame = frame.detach().cpu().numpy()
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8 [H, W, 3], got {frame.dtype} {list(frame.shape)}")
    return frame


def record_video(frames: Sequence[np.ndarray], path: str | Path, fps: int = 10, *, scale: int = 1,
                 min_size: int = 0, min_seconds: float = 0.0) -> Path:
    """Write ``frames`` (uint8 ``[H, W, 3]`` each, all the same size) to ``path``; returns the path.

    The format comes from the suffix: ``.mp4`` (H.264 via imageio-ffmpeg; odd sizes are padded with one
    black row / column, since H.264's yuv420p needs even sizes) or ``.gif`` (Pillow). ``scale`` enlarges
    each frame by pixel repetition (small images such as ColorReach's 32x32 stay sharp); ``min_size`` raises
    it until the short side has at least that many pixels. ``min_seconds``: each frame is repeated so that
    the video lasts at least that long at ``fps``.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(f"unsupported video format {path.suffix or '(no suffix)'!r} for {str(path)!r}: "
                         f"use one of {', '.join(VIDEO_SUFFIXES)}")
    if fps <= 0 or scale < 1:
        raise ValueError(f"fps must be > 0 and scale >= 1, got fps={fps}, scale={scale}")
    frames = [_as_frame(f) for f in frames]
    if not frames:
        raise ValueError(f"no frames to write to {str(path)!r}")
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise ValueError(f"all frames must have the same shape, got {sorted(shapes)}")
    scale = max(scale, math.ceil(min_size / min(frames[0].shape[:2])))
    if scale > 1:
        frames = [f.repeat(scale, axis=0).repeat(scale, axis=1) for f in frames]
    hold = max(1, math.ceil(min_seconds * fps / len(frames)))
    if hold > 1:
        frames = [f for f in frames for _ in range(hold)]
    import imageio.v2 as imageio

    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".gif":
        imageio.mimsave(path, frames, duration=1000 / fps, loop=0)   # Pillow: duration in ms per frame
    else:
        h, w = frames[0].shape[:2]
        if h % 2 or w % 2:
            frames = [np.pad(f, ((0, h % 2), (0, w % 2), (0, 0))) for f in frames]
        # macro_block_size=1: keep the size instead of resizing to a multiple of 16 (with a warning).
        imageio.mimsave(path, frames, fps=fps, macro_block_size=1)
    return path


class VideoRecorder:
    """Collect frames of envs ``indices`` of a batched ``env`` and write one video per env.

    ::

        rec = VideoRecorder(env, indices=[0, 3])
        obs = env.reset(); rec.add(obs)
        for _ in range(T):
            out = env.step(chunk); rec.add(out)         # a ChunkStep or an observation dict
        rec.save("runs/videos/env{index}.mp4")          # -> [Path, Path]

    An env that ended inside a chunk contributes its final frame, then the first frame of its next
    episode (the video runs on across episodes). Frames are the env's camera images side by side; for
    envs without cameras ``env.render_frames(indices)`` is used, and the final frame of an ended episode comes
    from the env's ``set_final_frames`` (the worker pool and ManiSkill's GPU env render it before the reset;
    :meth:`stop` ends that). With ``first_episode_only`` an env's video ends with its first episode
    (evaluations score each env's first episode only).
    """

    def __init__(self, env, indices: Sequence[int] = (0,), *, fps: int = 10, scale: int = 1,
                 first_episode_only: bool = False):
        self.env = env
        self.indices = [int(i) for i in indices]
        num_envs = getattr(env, "num_envs", None)
        if not self.indices:
            raise ValueError("VideoRecorder needs at least one env index")
        if num_envs is not None and any(not 0 <= i < num_envs for i in self.indices):
            raise ValueError(f"env indices {self.indices} out of range for {num_envs} envs")
        self.fps, self.scale = fps, scale
        spec = getattr(env, "spec", None)
        self._upright = bool(getattr(spec, "images_rot180", False))   # turn LIBERO's rot180 images back
        self.first_episode_only = first_episode_only
        self.frames: dict[int, list[np.ndarray]] = {i: [] for i in self.indices}
        self.ended: set[int] = set()   # envs whose recording is over (first_episode_only)
        self._renders_final = False
        self._request_final_frames()

    def _request_final_frames(self) -> None:
        spec = getattr(self.env, "spec", None)
        if spec is not None and spec.num_cameras == 0 and hasattr(self.env, "set_final_frames"):
            self.env.set_final_frames(self.indices)
            self._renders_final = True

    def stop(self) -> None:
        """Stop the env rendering ended episodes for this recorder (each costs a render in the env's worker)."""
        if self._renders_final:
            self.env.set_final_frames([])
            self._renders_final = False

    def _view(self, frame: np.ndarray) -> np.ndarray:
        """A frame as a person sees the scene (the env's images may be turned for the policy)."""
        return np.ascontiguousarray(frame[::-1, ::-1]) if self._upright else frame

    def _frames(self, obs: dict) -> list[np.ndarray]:
        images = obs["images"]
        if images.shape[1] > 0:
            if self._upright:   # each camera turned on its own, then side by side in their order
                return [np.concatenate([self._view(c) for c in _images_np(images[i])], axis=1)
                        for i in self.indices]
            return [np.concatenate(list(_images_np(images[i])), axis=1) for i in self.indices]
        render = getattr(self.env, "render_frames", None)
        if render is None:
            raise ValueError(f"{type(self.env).__name__} observations have no camera images (C = 0) and the env "
                             "has no render_frames(indices); use an observation mode with cameras "
                             "(e.g. ManiSkill obs_mode='rgb') or the worker pool, which renders")
        return [self._view(_as_frame(f)) for f in render(self.indices)]

    def add(self, step: ChunkStep | dict) -> None:
        """Add the frames of one observation dict (after ``reset``) or of one :class:`ChunkStep`."""
        live = [i for i in self.indices if i not in self.ended]
        if not live:
            return
        if isinstance(step, ChunkStep):
            done = step.done
            if step.final_obs is not None and step.final_obs["images"].shape[1] > 0:
                for i, frame in zip(self.indices, self._frames(step.final_obs)):
                    if bool(done[i]) and i not in self.ended:
                        self.frames[i].append(frame)
            elif step.final_frames:
                for i in self.indices:
                    if bool(done[i]) and i not in self.ended and i in step.final_frames:
                        self.frames[i].append(self._view(_as_frame(step.final_frames[i])))
            if self.first_episode_only:
                self.ended.update(i for i in live if bool(done[i]))
                if len(self.ended) == len(self.indices):
                    self.stop()
            obs = step.obs
        else:
            obs = step
        for i, frame in zip(self.indices, self._frames(obs)):
            if i not in self.ended:
                self.frames[i].append(frame)

    def save(self, path: str | Path) -> list[Path]:
        """Write one video per recorded env; ``path`` may contain ``{index}`` (needed for several envs)."""
        path = str(path)
        if len(self.indices) > 1 and "{index}" not in path:
            raise ValueError(f"recording {len(self.indices)} envs: put '{{index}}' in the path, got {path!r}")
        return [record_video(self.frames[i], path.replace("{index}", str(i)), self.fps, scale=self.scale)
                for i in self.indices]

    def clear(self) -> None:
        self.frames = {i: [] for i in self.indices}
        self.ended = set()
        if not self._renders_final:
            self._request_final_frames()


def _images_np(images) -> np.ndarray:
    """One env's camera images ``[C, S, S, 3]`` as a uint8 numpy array (from CPU or GPU tensors)."""
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    return np.asarray(images, dtype=np.uint8)
