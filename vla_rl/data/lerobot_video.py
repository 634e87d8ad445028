"""MP4 camera streams of LeRobot datasets, encoded and decoded with PyAV (FFmpeg's libraries).

LeRobot v3.0 stores a ``"dtype": "video"`` feature as one MP4 file per camera holding many episodes
back to back (v2.x: one file per episode, starting at 0): episode ``e`` occupies ``[from_timestamp,
to_timestamp)`` of its file (recorded in the episode table), and the frame of a data row is the one
shown at ``from_timestamp + timestamp``. LeRobot's encoder defaults are AV1 (``libsvtav1``), ``yuv420p``,
a key frame every 2 frames and CRF 30; :class:`VideoWriter` uses the same so the files look like
LeRobot's own. Decoding is lossy: it returns what any player shows, not the frames that were encoded.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np

DEFAULT_CODEC = "libsvtav1"   # LeRobot's default encoder (AV1)
PIX_FMT = "yuv420p"
GOP = 2                       # a key frame every 2 frames: cheap random access (LeRobot's choice)
CRF = 30


class VideoError(ValueError):
    """A video file is missing, unreadable, or lacks a frame the dataset asks for."""


def _av():
    try:
        import av
    except ImportError:  # a core dependency; this only happens in a broken environment
        raise VideoError("video-backed LeRobot datasets need PyAV: pip install av") from None
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration per file otherwise
    return av


def codec_name(codec: str) -> str:
    """The format an encoder writes, as info.json records it (``libsvtav1`` -> ``av1``)."""
    return {"libsvtav1": "av1", "libaom-av1": "av1", "libx264": "h264", "libx265": "hevc",
            "libvpx-vp9": "vp9"}.get(codec, codec)


class VideoWriter:
    """Frames of one camera, appended episode by episode, into one MP4 file at ``fps``.

    ``add(frames)`` returns the episode's ``(from_timestamp, to_timestamp)`` in the file; frame ``k`` of
    the file is shown at ``k / fps`` exactly (time base ``1 / fps``)."""

    def __init__(self, path: Path, *, fps: int, height: int, width: int, codec: str = DEFAULT_CODEC):
        av = _av()
        if height % 2 or width % 2:
            raise VideoError(f"{PIX_FMT} video needs even frame sizes, got {height}x{width}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.fps, self.frames = path, fps, 0
        self._container = av.open(str(path), "w")
        try:
            self._stream = self._container.add_stream(codec, rate=fps)
        except Exception as e:  # noqa: BLE001
            self._container.close()
            raise VideoError(f"cannot encode with video codec {codec!r}: {e}") from None
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, PIX_FMT
        self._stream.time_base = Fraction(1, fps)
        self._stream.options = {"g": str(GOP), "crf": str(CRF)}
        self._av = av

    def add(self, frames: np.ndarray) -> tuple[float, float]:
        """Append uint8 frames ``[T, H, W, 3]``; returns their ``(from, to)`` timestamps in seconds."""
        start = self.frames
        for f in frames:
            frame = self._av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            frame.pts = self.frames
            frame.time_base = Fraction(1, self.fps)
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
            self.frames += 1
        return start / self.fps, self.frames / self.fps

    def size_bytes(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0

    def close(self) -> None:
        for packet in self._stream.encode():  # flush the encoder's delayed frames
            self._container.mux(packet)
        self._container.close()


def read_frames(path: Path, times: np.ndarray, *, shape: tuple[int, int, int], tolerance: float) -> np.ndarray:
    """The frames of ``path`` shown at ``times`` (seconds), uint8 ``[len(times), H, W, 3]``.

    One pass over the file in presentation order; each time takes the frame nearest to it, which must
    lie within ``tolerance`` (else a frame is missing or the timestamps are off: an error, never a
    neighbouring frame passed off as the right one). Decoding stops after the last time asked for."""
    av = _av()
    if not path.is_file():
        raise VideoError(f"video file missing: {path}")
    times = np.asarray(times, dtype=np.float64)
    out = np.empty((len(times), *shape), dtype=np.uint8)
    if len(times) == 0:
        return out
    order = np.argsort(times, kind="stable")
    nearest_t = np.full(len(times), np.inf)
    j, last = 0, times[order[-1]]
    prev: tuple[float, np.ndarray] | None = None

    def assign(k: int, t: float, img: np.ndarray) -> None:
        out[k], nearest_t[k] = img, t

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"{path} has no video stream")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * stream.time_base)
                img = frame.to_ndarray(format="rgb24")
                if img.shape != shape:
                    raise VideoError(f"{path}: frames are {list(img.shape)}, info.json says {list(shape)}")
                # every time closer to the previous frame than to this one takes the previous frame
                while prev is not None and j < len(order) and times[order[j]] <= (prev[0] + t) / 2:
                    assign(order[j], *prev)
                    j += 1
                prev = (t, img)
                if t > last + tolerance:
                    break
    except VideoError:
        raise
    except Exception as e:  # noqa: BLE001 - av.error.* (InvalidDataError, ...) for a corrupt file
        raise VideoError(f"unreadable video file {path}: {e}") from None
    if prev is None:
        raise VideoError(f"{path} holds no frames")
    while j < len(order):
        assign(order[j], *prev)
        j += 1
    off = np.abs(nearest_t - times)
    bad = int(np.argmax(off))
    if off[bad] > tolerance:
        raise VideoError(f"{path}: no frame within {tolerance:.4f} s of t = {times[bad]:.4f} s (the nearest is "
                         f"{off[bad]:.4f} s away): the file lacks frames the dataset indexes")
    return out
