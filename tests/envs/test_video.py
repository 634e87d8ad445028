"""Videos: record_video's formats and errors, VideoRecorder on the built-in task and on camera-less envs."""

import functools
from dataclasses import replace

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from inline_pool import InProcessPool

from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv, ColorReachSingleEnv
from vla_rl.envs.video import VideoRecorder, record_video
from vla_rl.envs.workers import WorkerVectorEnv


def _record_colorreach(chunks: int, indices=(0, 2), scale: int = 1) -> tuple[VideoRecorder, ColorReachEnv]:
    # delta control: a small action keeps the agent moving, so no two frames are equal (a GIF writer
    # merges equal consecutive frames, which would change the frame count this test reads back)
    env = ColorReachEnv(4, config=ColorReachConfig(max_episode_steps=200, control="delta"), seed=0)
    rec = VideoRecorder(env, indices, fps=5, scale=scale)
    rec.add(env.reset())
    for _ in range(chunks):
        chunk = (0.3 * env.expert_action())[:, None].expand(4, 2, 2).contiguous()   # slow: no episode ends
        out = env.step(chunk)
        assert not bool(out.done.any())
        rec.add(out)
    return rec, env


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_colorreach_video_round_trip(tmp_path, suffix):
    rec, _ = _record_colorreach(chunks=5, scale=2)
    assert [len(rec.frames[i]) for i in (0, 2)] == [6, 6]
    paths = rec.save(tmp_path / "videos" / f"env{{index}}{suffix}")
    assert [p.name for p in paths] == [f"env0{suffix}", f"env2{suffix}"]
    for p in paths:
        frames = imageio.mimread(p)
        assert len(frames) == 6
        assert np.asarray(frames[0]).shape[:2] == (64, 64)        # 32x32 images, scale 2


def _seconds(path) -> float:
    """How long a video plays: an mp4's frames over its rate; a GIF's frame durations (equal consecutive frames
    are merged into one longer frame by the writer)."""
    if path.suffix == ".gif":
        from PIL import Image, ImageSequence

        with Image.open(path) as im:
            return sum(f.info["duration"] for f in ImageSequence.Iterator(im)) / 1000
    with imageio.get_reader(path) as r:
        return r.count_frames() / r.get_meta_data()["fps"]


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_short_small_videos_are_enlarged_and_held_for_viewing(tmp_path, suffix):
    """ColorReach's 32 px, 5-frame episode: nearest-neighbour to >= 256 px, each frame held so that it lasts
    >= 2 s at 4 fps (what eval and bench write); long or large videos are left as they are."""
    frames = [np.full((32, 32, 3), 40 * k, np.uint8) for k in range(5)]
    frames[0][3, 5] = 255
    path = record_video(frames, tmp_path / f"short{suffix}", fps=4, min_size=256, min_seconds=2.0)
    back = [np.asarray(f)[..., :3] for f in imageio.mimread(path)]
    assert back[0].shape == (256, 256, 3) and _seconds(path) == pytest.approx(2.5)   # 5 frames x 2 at 4 fps
    if suffix == ".gif":   # lossless: the enlarged pixel is an exact 8 x 8 block
        assert (back[0][24:32, 40:48] == 255).all() and (back[0][32:40, 40:48] == 0).all()
    long = [np.full((300, 400, 3), k, np.uint8) for k in range(12)]
    path = record_video(long, tmp_path / f"long{suffix}", fps=4, min_size=256, min_seconds=2.0)
    assert imageio.mimread(path)[0].shape[:2] == (300, 400) and _seconds(path) == pytest.approx(3.0)


def test_frames_turned_for_the_policy_are_turned_back_for_a_person():
    """An env whose images are rotated 180 degrees (LIBERO's rot180) records upright frames, camera by camera."""
    env = ColorReachEnv(2, seed=0)
    plain = VideoRecorder(env, [1])
    env.spec.images_rot180 = True
    turned = VideoRecorder(env, [1])
    obs = env.reset()
    plain.add(obs)
    turned.add(obs)
    assert not np.array_equal(plain.frames[1][0], turned.frames[1][0])
    assert np.array_equal(turned.frames[1][0], plain.frames[1][0][::-1, ::-1])   # one camera: the frame turned


def test_mp4_pads_odd_sizes(tmp_path):
    frames = [np.full((15, 21, 3), 10 * k, np.uint8) for k in range(4)]
    path = record_video(frames, tmp_path / "odd.mp4", fps=4)
    back = imageio.mimread(path)
    assert len(back) == 4 and back[0].shape == (16, 22, 3)


def test_episode_end_adds_the_final_frame():
    env = ColorReachEnv(2, config=ColorReachConfig(max_episode_steps=3), seed=0)
    rec = VideoRecorder(env, [1])
    rec.add(env.reset())
    out = env.step(torch.zeros(2, 4, 2))                       # truncated after 3 of the 4 actions
    assert bool(out.done[1])
    rec.add(out)
    assert len(rec.frames[1]) == 3                              # reset, final frame, next episode's first
    assert np.array_equal(rec.frames[1][1], out.final_obs["images"][1, 0].numpy())
    assert np.array_equal(rec.frames[1][2], out.obs["images"][1, 0].numpy())


def test_bad_suffix_and_bad_frames(tmp_path):
    frames = [np.zeros((8, 8, 3), np.uint8)] * 2
    with pytest.raises(ValueError, match=r"unsupported video format '\.avi'.*\.mp4, \.gif"):
        record_video(frames, tmp_path / "clip.avi")
    with pytest.raises(ValueError, match="no suffix"):
        record_video(frames, tmp_path / "clip")
    with pytest.raises(ValueError, match="uint8"):
        record_video([np.zeros((8, 8, 3), np.float32)], tmp_path / "clip.gif")
    with pytest.raises(ValueError, match="same shape"):
        record_video([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 6, 3), np.uint8)], tmp_path / "clip.gif")
    with pytest.raises(ValueError, match="no frames"):
        record_video([], tmp_path / "clip.mp4")
    assert not list(tmp_path.iterdir())


def test_several_envs_need_an_index_placeholder(tmp_path):
    rec, _ = _record_colorreach(chunks=1)
    with pytest.raises(ValueError, match="index"):
        rec.save(tmp_path / "clip.mp4")
    with pytest.raises(ValueError, match="out of range"):
        VideoRecorder(ColorReachEnv(2), [2])


class _StateOnlyEnv:
    """A camera-less batched env (like ManiSkill obs_mode='state'), optionally with render_frames."""

    num_envs = 2

    def obs(self) -> dict:
        return {"images": torch.zeros(2, 0, 64, 64, 3, dtype=torch.uint8), "state": torch.zeros(2, 5),
                "instruction": ["a", "b"]}


class _RenderingStateOnlyEnv(_StateOnlyEnv):
    def render_frames(self, indices):
        return [np.full((10, 12, 3), i, np.uint8) for i in indices]


def test_camera_less_envs_render_or_fail_clearly():
    env = _RenderingStateOnlyEnv()
    rec = VideoRecorder(env, [1])
    rec.add(env.obs())
    assert rec.frames[1][0].shape == (10, 12, 3) and rec.frames[1][0][0, 0, 0] == 1
    with pytest.raises(ValueError, match="no camera images.*render_frames"):
        VideoRecorder(_StateOnlyEnv(), [0]).add(_StateOnlyEnv().obs())


class _CameraLessColorReach(ColorReachSingleEnv):
    """ColorReach observed by its state only (like ManiSkill obs_mode='state'); render_frame still shows it."""

    def __init__(self, config=None, seed: int = 0):
        super().__init__(config, seed)
        self.spec = replace(self.spec, num_cameras=0)

    def _np(self, obs: dict) -> dict:
        out = super()._np(obs)
        return {**out, "images": out["images"][:0]}


@pytest.mark.parametrize("pool_kind", ["in_process", "worker_processes"])
def test_a_camera_less_video_ends_with_the_episodes_last_state_rendered_before_its_reset(pool_kind):
    """Known answer: the camera images of the same env (with its camera) stepped alone with the same seed and
    actions, one after each chunk; the last one is the ended episode's final observation."""
    factory = functools.partial(_CameraLessColorReach, ColorReachConfig(max_episode_steps=6))
    pool = (InProcessPool(factory, 2, envs_per_worker=1) if pool_kind == "in_process"
            else WorkerVectorEnv(factory, 2, envs_per_worker=1, name="stateonly"))
    try:
        rec = VideoRecorder(pool, [0], first_episode_only=True)
        rec.add(pool.reset(seed=5))
        alone = ColorReachSingleEnv(ColorReachConfig(max_episode_steps=6))
        expected = [alone.reset(5)["images"][0]]
        gen = torch.Generator().manual_seed(0)
        chunks = []
        while True:
            chunks.append(torch.rand(2, 4, 2, generator=gen) * 2 - 1)
            out = pool.step(chunks[-1])
            rec.add(out)
            for a in chunks[-1][0].numpy():
                obs, _, term, trunc, _ = alone.step(a)
                if term or trunc:
                    break
            expected.append(obs["images"][0])
            if out.done[0]:
                break
        assert len(rec.frames[0]) == len(expected) == len(chunks) + 1
        assert all((f == e).all() for f, e in zip(rec.frames[0], expected))
        assert len({f.tobytes() for f in rec.frames[0]}) > 1   # the frames do follow the episode
        # The recording is over (first episode only): ended episodes are no longer rendered.
        for _ in range(3):
            assert pool.step(torch.rand(2, 4, 2, generator=gen) * 2 - 1).final_frames is None
        with pytest.raises(IndexError, match="env index 2 out of range for 2 envs"):
            pool.set_final_frames([2])
    finally:
        pool.close()
