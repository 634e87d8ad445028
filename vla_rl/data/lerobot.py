"""Demonstrations on disk in LeRobot's dataset format, read and written with pyarrow and PyAV alone.

``lerobot`` itself is not a dependency (its releases pin an older torch), so this module implements the
part of the format a :class:`~vla_rl.data.dataset.DemoDataset` needs. It writes v3.0::

    DATASET/
      meta/info.json                             codebase_version "v3.0", fps, features, paths, counts
      meta/stats.json                            per feature min / max / mean / std / count / q01..q99
      meta/tasks.parquet                         task string (pandas index) -> task_index
      meta/episodes/chunk-000/file-000.parquet   one row per episode: length, tasks, frame range, data file
      data/chunk-000/file-000.parquet            one row per frame
      videos/<camera feature>/chunk-000/file-000.mp4   video features only (see :mod:`vla_rl.data.lerobot_video`)

and reads v3.0 and v2.0 / v2.1 (``data/chunk-000/episode_000000.parquet`` and
``videos/chunk-000/<camera feature>/episode_000000.mp4`` per episode, ``meta/episodes.jsonl``,
``meta/tasks.jsonl``; the paths come from info.json's ``data_path`` / ``video_path`` templates).

Camera images are either ``"dtype": "image"`` features, PNG bytes inside the data parquet (a struct
``{"bytes", "path"}``, as Hugging Face ``datasets`` stores images), or ``"dtype": "video"`` features, the
frames of many episodes back to back in one MP4 file per camera (v3.0; v2.x: one per episode), located
through the episode table's ``videos/<key>/{chunk_index, file_index, from_timestamp, to_timestamp}``
columns (LeRobot's default for recorded datasets). Both are read; ``write_lerobot_dataset(video=True)``
writes the second. Other codebase versions are rejected with a clear error. Nothing is ever unpickled:
parquet, JSON and MP4 only.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.data.dataset import DemoDataset
from vla_rl.data.lerobot_video import DEFAULT_CODEC, PIX_FMT, VideoError, VideoWriter, codec_name, read_frames

CODEBASE_VERSION = "v3.0"    # what is written
# What is read. v2.x (LeRobot until mid-2025; many hub datasets, openpi's LIBERO data) keeps one parquet
# (and one MP4 per camera) per episode, and its episode and task tables as JSON lines; v2.0 and v2.1
# differ only in their statistics files, which reading does not use (SFT computes its own).
READ_VERSIONS = ("v2.0", "v2.1", "v3.0")
CHUNKS_SIZE = 1000            # files per chunk folder (LeRobot's default)
DATA_FILES_SIZE_MB = 100      # a data file is closed at the first episode boundary past this size
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
VIDEO_FILES_SIZE_MB = 200     # a video file is closed at the first episode boundary past this size
IMAGE_PREFIX = "observation.images."


class LeRobotDatasetError(ValueError):
    """A dataset folder is missing, corrupt, of an unsupported version or inconsistent with its info.json."""


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------
def _png(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


# The quantiles current LeRobot stores beside min / max / mean / std (π0.5's normaliser needs q01 / q99).
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_KEYS = tuple(f"q{round(q * 100):02d}" for q in QUANTILES)


def _stats(x: np.ndarray) -> dict:
    """LeRobot's per-feature statistics of ``x`` ``[M, ...]`` over the frame axis (exact quantiles, numpy's
    linear interpolation; LeRobot estimates them from histograms)."""
    x = x.astype(np.float64)
    out = {"min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(),
           "std": x.std(0).tolist(), "count": [int(x.shape[0])]}
    for key, q in zip(QUANTILE_KEYS, np.quantile(x, QUANTILES, axis=0)):
        out[key] = q.tolist()
    return out


def _sorted_at(counts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The values at 0-based ``ranks`` of the sorted sample whose histogram over 0..len-1 is ``counts``."""
    return np.searchsorted(np.cumsum(counts), ranks, side="right").astype(np.float64)


def _image_stats(images: np.ndarray) -> dict:
    """Per-channel statistics of uint8 images ``[M, H, W, 3]``, scaled to [0, 1] and shaped ``[3, 1, 1]``
    as LeRobot stores them (it normalises images channel-wise after dividing by 255). Computed from each
    channel's 256-bin histogram: exact, in constant memory however many frames there are."""
    if images.dtype != np.uint8:
        raise TypeError(f"camera images must be uint8, got {images.dtype}")
    values = np.arange(256, dtype=np.float64)
    cols: dict[str, list[float]] = {k: [] for k in ("min", "max", "mean", "std", *QUANTILE_KEYS)}
    for c in range(images.shape[-1]):
        counts = np.bincount(images[..., c].reshape(-1), minlength=256).astype(np.float64)
        n = counts.sum()
        mean = (counts * values).sum() / n
        seen = np.flatnonzero(counts)
        cols["min"].append(seen[0])
        cols["max"].append(seen[-1])
        cols["mean"].append(mean)
        cols["std"].append(np.sqrt((counts * (values - mean) ** 2).sum() / n))
        for key, q in zip(QUANTILE_KEYS, QUANTILES):
            h = (n - 1) * q   # numpy's linear interpolation between the two neighbouring order statistics
            lo, hi = _sorted_at(counts, np.array([np.floor(h), np.ceil(h)]))
            cols[key].append(lo + (h - np.floor(h)) * (hi - lo))
    out = {k: (np.asarray(v, dtype=np.float64) / 255.0).reshape(3, 1, 1).tolist() for k, v in cols.items()}
    out["count"] = [int(images.shape[0])]
    return out


def _vector_feature(dim: int, dtype: str = "float32") -> dict:
    return {"dtype": dtype, "shape": [dim], "names": None}


def _episode_ranges(episode_index: np.ndarray) -> list[tuple[int, int, int]]:
    """``(episode, from, to)`` of each run of equal episode indices, in order; episodes must be contiguous."""
    if episode_index.size == 0:
        return []
    cuts = np.flatnonzero(episode_index[1:] != episode_index[:-1]) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [episode_index.size]])
    ranges = [(int(episode_index[s]), int(s), int(e)) for s, e in zip(starts, ends)]
    eps = [r[0] for r in ranges]
    if len(set(eps)) != len(eps):
        raise ValueError("the frames of each episode must be contiguous (an episode index appears twice)")
    return ranges


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _tasks_table(tasks: list[str]) -> pa.Table:
    """meta/tasks.parquet: LeRobot writes a pandas frame indexed by the task string; the pandas metadata
    written here makes ``pandas.read_parquet`` restore that index, while pyarrow sees a plain column."""
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    pandas_meta = {
        "index_columns": ["task"], "column_indexes": [],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": "task", "field_name": "task", "pandas_type": "unicode",
                     "numpy_type": "object", "metadata": None}],
        "creator": {"library": "vla_rl"}, "pandas_version": "2.2.0"}
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})


@dataclass
class _Frames:
    """The columns of a dataset to write, as numpy arrays over its ``M`` frames."""

    images: np.ndarray          # [M, C, H, W, 3] uint8
    image_keys: list[str]       # the C cameras' features
    state: np.ndarray           # [M, S] float32
    action: np.ndarray          # [M, A] float32
    timestamp: np.ndarray       # [M] float32: frame_index / fps within each episode (LeRobot's)
    frame_index: np.ndarray     # [M] int64
    episode_index: np.ndarray   # [M] int64
    task_index: np.ndarray      # [M] int64
    tasks: list[str]
    ranges: list[tuple[int, int, int]]   # (episode, first frame, end frame) of each episode
    fps: int


def write_lerobot_dataset(path: str | Path, data: DemoDataset, *, fps: int, camera_names: list[str] | tuple[str, ...],
                          robot_type: str | None = None, extra_info: dict | None = None, video: bool = False,
                          video_codec: str = DEFAULT_CODEC) -> Path:
    """Write ``data`` as a LeRobot v3.0 dataset folder at ``path`` (replacing one that is there).

    ``camera_names`` names the C cameras (features ``observation.images.<name>``); with ``video`` they
    are stored as MP4 files (``video_codec``, LeRobot's AV1 by default; lossy) instead of PNG bytes in the
    parquet. ``extra_info`` is merged into info.json (``vla_rl`` records the env a dataset came from
    there). The folder is built
    in a temporary sibling and renamed into place, so a crash never leaves a half-written dataset and
    never destroys the previous one.
    """
    path = Path(path)
    frames = _frames_to_write(data, fps=fps, camera_names=camera_names)
    _, num_cams, h, w, _ = frames.images.shape
    if video and num_cams and (h % 2 or w % 2):
        raise ValueError(f"video=True needs even image sizes (yuv420p), got {h}x{w}")
    video = video and num_cams > 0
    features = _features(frames, video=video, video_codec=video_codec)
    with atomic_folder(path) as tmp:
        episode_rows = _write_frames(tmp, frames, video=video, video_codec=video_codec)
        _write_episodes(tmp, episode_rows, frames.tasks)
        _write_info(tmp, frames, features, robot_type=robot_type, extra_info=extra_info, video=video)
    return path


def _frames_to_write(data: DemoDataset, *, fps: int, camera_names) -> _Frames:
    """``data``'s columns, checked."""
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    images = data.images.numpy()
    if images.dtype != np.uint8 or images.ndim != 5 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [M, C, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    m, num_cams = images.shape[:2]
    if len(camera_names) != num_cams:
        raise ValueError(f"{len(camera_names)} camera names for {num_cams} cameras")
    if m == 0:
        raise ValueError("cannot write an empty dataset")
    frame_index = data.frame_index.long().numpy()
    episode_index = data.episode_index.long().numpy()
    return _Frames(images=images, image_keys=[IMAGE_PREFIX + c for c in camera_names],
                   state=data.state.float().numpy(), action=data.action.float().numpy(),
                   timestamp=(frame_index / fps).astype(np.float32), frame_index=frame_index,
                   episode_index=episode_index, task_index=data.task_index.long().numpy(), tasks=list(data.tasks),
                   ranges=_episode_ranges(episode_index), fps=fps)


def _features(f: _Frames, *, video: bool, video_codec: str) -> dict[str, dict]:
    """info.json's ``features``: each camera (an image, or a video with its encoding), then the vectors."""
    _, _, h, w, _ = f.images.shape
    video_info = {"video.height": h, "video.width": w, "video.codec": codec_name(video_codec),
                  "video.pix_fmt": PIX_FMT, "video.is_depth_map": False, "video.fps": f.fps, "video.channels": 3,
                  "has_audio": False}
    features: dict[str, dict] = {
        key: {"dtype": "video" if video else "image", "shape": [h, w, 3], "names": ["height", "width", "channel"],
              **({"info": video_info} if video else {})} for key in f.image_keys}
    features.update({
        "observation.state": _vector_feature(f.state.shape[1]), "action": _vector_feature(f.action.shape[1]),
        "timestamp": _vector_feature(1), "frame_index": _vector_feature(1, "int64"),
        "episode_index": _vector_feature(1, "int64"), "index": _vector_feature(1, "int64"),
        "task_index": _vector_feature(1, "int64")})
    return features


def _frames_table(f: _Frames, lo: int, hi: int, pngs: dict[str, list[bytes]], *, video: bool) -> pa.Table:
    """One data file: frames ``lo:hi`` (the cameras' PNG bytes unless they are in videos)."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cols = {} if video else {key: pa.array([{"bytes": b, "path": None} for b in pngs[key]], image_type)
                             for key in f.image_keys}
    cols.update({
        "observation.state": pa.array(list(f.state[lo:hi]), pa.list_(pa.float32())),
        "action": pa.array(list(f.action[lo:hi]), pa.list_(pa.float32())),
        "timestamp": pa.array(f.timestamp[lo:hi], pa.float32()),
        "frame_index": pa.array(f.frame_index[lo:hi], pa.int64()),
        "episode_index": pa.array(f.episode_index[lo:hi], pa.int64()),
        "index": pa.array(np.arange(lo, hi), pa.int64()),
        "task_index": pa.array(f.task_index[lo:hi], pa.int64())})
    return pa.table(cols)


def _write_frames(tmp: Path, f: _Frames, *, video: bool, video_codec: str) -> list[dict]:
    """The data files (whole episodes, a new file once the current one passes DATA_FILES_SIZE_MB) and, with
    ``video``, one video file per camera (whole episodes, a new one past VIDEO_FILES_SIZE_MB); returns each
    episode's row of the episodes table (where its frames are)."""
    m, _, h, w, _ = f.images.shape
    episode_rows: list[dict] = []
    file_no, file_start, file_bytes = 0, f.ranges[0][1], 0
    pngs: dict[str, list[bytes]] = {k: [] for k in f.image_keys}

    def flush(end: int) -> None:
        nonlocal file_no, file_start, file_bytes, pngs
        chunk, fidx = divmod(file_no, CHUNKS_SIZE)
        _write_parquet(_frames_table(f, file_start, end, pngs, video=video),
                       tmp / DATA_PATH.format(chunk_index=chunk, file_index=fidx))
        file_no, file_start, file_bytes = file_no + 1, end, 0
        pngs = {k: [] for k in f.image_keys}

    writers: dict[str, VideoWriter] = {}
    video_files = {key: -1 for key in f.image_keys}

    def video_writer(key: str) -> tuple[VideoWriter, int]:
        w_ = writers.get(key)
        if w_ is None or w_.size_bytes() >= VIDEO_FILES_SIZE_MB * 1024 * 1024:
            if w_ is not None:
                w_.close()
            video_files[key] += 1
            chunk_, fidx_ = divmod(video_files[key], CHUNKS_SIZE)
            w_ = writers[key] = VideoWriter(
                tmp / VIDEO_PATH.format(video_key=key, chunk_index=chunk_, file_index=fidx_),
                fps=f.fps, height=h, width=w, codec=video_codec)
        return w_, video_files[key]

    try:
        for ep, lo, hi in f.ranges:
            chunk, fidx = divmod(file_no, CHUNKS_SIZE)
            row = {"episode_index": ep}
            for c, key in enumerate(f.image_keys):
                if video:
                    writer, vfile = video_writer(key)
                    start, end = writer.add(f.images[lo:hi, c])
                    vchunk, vfidx = divmod(vfile, CHUNKS_SIZE)
                    row.update({f"videos/{key}/chunk_index": vchunk, f"videos/{key}/file_index": vfidx,
                                f"videos/{key}/from_timestamp": start, f"videos/{key}/to_timestamp": end})
                    continue
                encoded = [_png(f.images[i, c]) for i in range(lo, hi)]
                pngs[key].extend(encoded)
                file_bytes += sum(len(b) for b in encoded)
            file_bytes += (hi - lo) * 4 * (f.state.shape[1] + f.action.shape[1] + 10)
            tasks = sorted({f.tasks[t] for t in f.task_index[lo:hi].tolist()})
            row.update({"tasks": tasks, "length": hi - lo, "data/chunk_index": chunk, "data/file_index": fidx,
                        "dataset_from_index": lo, "dataset_to_index": hi,
                        "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
            episode_rows.append(row)
            if file_bytes >= DATA_FILES_SIZE_MB * 1024 * 1024:
                flush(hi)
        if file_start < m:
            flush(m)
    finally:
        for writer in writers.values():
            writer.close()
    return episode_rows


def _write_episodes(tmp: Path, episode_rows: list[dict], tasks: list[str]) -> None:
    """The episodes table (one row per episode: its tasks, length and files) and the tasks table."""
    episodes = pa.table({
        "episode_index": pa.array([r["episode_index"] for r in episode_rows], pa.int64()),
        "tasks": pa.array([r["tasks"] for r in episode_rows], pa.list_(pa.string())),
        "length": pa.array([r["length"] for r in episode_rows], pa.int64()),
        **{k: pa.array([r[k] for r in episode_rows], pa.int64()) for k in (
            "data/chunk_index", "data/file_index", "dataset_from_index", "dataset_to_index",
            "meta/episodes/chunk_index", "meta/episodes/file_index")},
        **{k: pa.array([r[k] for r in episode_rows], pa.float64() if k.endswith("timestamp") else pa.int64())
           for k in episode_rows[0] if k.startswith("videos/")}})
    _write_parquet(episodes, tmp / EPISODES_PATH.format(chunk_index=0, file_index=0))
    _write_parquet(_tasks_table(tasks), tmp / "meta" / "tasks.parquet")


def _write_info(tmp: Path, f: _Frames, features: dict, *, robot_type: str | None, extra_info: dict | None,
                video: bool) -> None:
    """meta/info.json (sizes, layout, features, ``extra_info``) and meta/stats.json (every feature's statistics)."""
    m = len(f.images)
    stats = {key: _image_stats(f.images[:, c]) for c, key in enumerate(f.image_keys)}
    stats.update({"observation.state": _stats(f.state), "action": _stats(f.action),
                  "timestamp": _stats(f.timestamp[:, None]), "frame_index": _stats(f.frame_index[:, None]),
                  "episode_index": _stats(f.episode_index[:, None]), "index": _stats(np.arange(m)[:, None]),
                  "task_index": _stats(f.task_index[:, None])})
    info = {
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type,
        "total_episodes": len(f.ranges), "total_frames": m, "total_tasks": len(f.tasks),
        "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILES_SIZE_MB,
        "video_files_size_in_mb": VIDEO_FILES_SIZE_MB, "fps": f.fps, "splits": {"train": f"0:{len(f.ranges)}"},
        "data_path": DATA_PATH, "video_path": VIDEO_PATH if video else None, "features": features,
        **(extra_info or {})}
    (tmp / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    (tmp / "meta" / "stats.json").write_text(json.dumps(stats, indent=2))


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------
def read_lerobot_info(path: str | Path) -> dict:
    """meta/info.json of a dataset folder, checked for the supported codebase version."""
    path = Path(path)
    if not path.is_dir():
        raise LeRobotDatasetError(f"no dataset folder at {path}")
    info_path = path / "meta" / "info.json"
    if not info_path.is_file():
        raise LeRobotDatasetError(f"{path} is not a LeRobot dataset: missing meta/info.json")
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LeRobotDatasetError(f"corrupt JSON in {info_path}: {e}") from None
    if not isinstance(info, dict):
        raise LeRobotDatasetError(f"{info_path} must hold a JSON object")
    version = info.get("codebase_version")
    if version not in READ_VERSIONS:
        raise LeRobotDatasetError(f"{path}: LeRobot dataset codebase_version {version!r} is not supported "
                                  f"(only {', '.join(READ_VERSIONS)}; convert others with LeRobot's converters)")
    for key in ("features", "data_path", "fps"):
        if key not in info:
            raise LeRobotDatasetError(f"{info_path} has no {key!r}")
    return info


def _read_parquet(path: Path) -> pa.Table:
    if not path.is_file():
        raise LeRobotDatasetError(f"dataset file missing: {path}")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise LeRobotDatasetError(f"corrupt parquet file {path}: {e}") from None


def _column(table: pa.Table, name: str, where: Path) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise LeRobotDatasetError(f"{where} has no column {name!r} (columns: {table.column_names})")
    return table.column(name)


def _vectors(col: pa.ChunkedArray, name: str, dim: int, where: Path) -> np.ndarray:
    """A list / fixed-size-list column of numbers -> ``[M, dim]`` float32, checked against info.json."""
    arr = col.combine_chunks()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        lengths = np.asarray(arr.value_lengths().fill_null(-1))
        bad = np.flatnonzero(lengths != dim)
        if bad.size:
            raise LeRobotDatasetError(f"{where}: {name!r} has {lengths[bad[0]]} values in row {bad[0]}, "
                                      f"info.json says shape [{dim}]")
        values = arr.flatten().to_numpy(zero_copy_only=False)
        return values.astype(np.float32).reshape(len(arr), dim)
    if dim == 1 and (pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type)):
        return arr.to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, 1)
    raise LeRobotDatasetError(f"{where}: column {name!r} has type {arr.type}, expected a list of numbers")


def _integers(col: pa.ChunkedArray, name: str, where: Path) -> np.ndarray:
    arr = col.combine_chunks()
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type):
        arr = arr.flatten()  # some writers store scalars as length-1 lists
    if not pa.types.is_integer(arr.type) or arr.null_count:
        raise LeRobotDatasetError(f"{where}: column {name!r} must hold integers, has {arr.type}")
    return arr.to_numpy().astype(np.int64)


def _decode_images(col: pa.ChunkedArray, key: str, shape: tuple[int, ...], root: Path, where: Path) -> np.ndarray:
    """An image column (structs of encoded bytes / a path) -> uint8 ``[M, H, W, 3]``."""
    arr = col.combine_chunks()
    if not pa.types.is_struct(arr.type) or arr.type.get_field_index("bytes") < 0:
        raise LeRobotDatasetError(f"{where}: image column {key!r} has type {arr.type}, expected struct<bytes, path>")
    blobs = arr.field("bytes").to_pylist()
    paths = arr.field("path").to_pylist() if arr.type.get_field_index("path") >= 0 else [None] * len(blobs)
    out = np.empty((len(blobs), *shape), dtype=np.uint8)
    for i, (blob, rel) in enumerate(zip(blobs, paths)):
        if blob is None:
            if not rel or not (root / rel).is_file():
                raise LeRobotDatasetError(f"{where}: {key!r} row {i} has neither image bytes nor a readable path")
            blob = (root / rel).read_bytes()
        try:
            img = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        except OSError as e:
            raise LeRobotDatasetError(f"{where}: {key!r} row {i} is not a readable image: {e}") from None
        if img.shape != shape:
            raise LeRobotDatasetError(f"{where}: {key!r} row {i} has shape {list(img.shape)}, "
                                      f"info.json says {list(shape)}")
        out[i] = img
    return out


def _is_v2(info: dict) -> bool:
    return str(info.get("codebase_version", "")).startswith("v2")


def _read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines table of a v2.x dataset (meta/episodes.jsonl, meta/tasks.jsonl)."""
    if not path.is_file():
        raise LeRobotDatasetError(f"dataset file missing: {path}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LeRobotDatasetError(f"corrupt JSON in {path} line {n}: {e}") from None
        if not isinstance(row, dict):
            raise LeRobotDatasetError(f"{path} line {n} must hold a JSON object")
        rows.append(row)
    return rows


def _v2_episodes(root: Path) -> list[int]:
    where = root / "meta" / "episodes.jsonl"
    eps = []
    for n, row in enumerate(_read_jsonl(where), 1):
        if not isinstance(row.get("episode_index"), int):
            raise LeRobotDatasetError(f"{where}: entry {n} has no integer 'episode_index'")
        eps.append(row["episode_index"])
    if not eps:
        raise LeRobotDatasetError(f"{where} lists no episodes")
    return sorted(eps)


def _format_path(root: Path, info: dict, name: str, **fields) -> Path:
    try:
        return root / info[name].format(**fields)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise LeRobotDatasetError(f"{root}: bad {name} {info.get(name)!r} in info.json: {e!r}") from None


def _v2_chunk(info: dict, episode: int) -> int:
    return episode // int(info.get("chunks_size") or CHUNKS_SIZE)


def _video_locations(root: Path, info: dict, key: str, episodes: list[int]) -> dict[int, tuple[Path, float]]:
    """Episode -> ``(video file, from_timestamp)`` of video feature ``key``: from the episode tables (v3.0),
    or one file per episode starting at 0 (v2.x)."""
    if _is_v2(info):
        return {e: (_format_path(root, info, "video_path", video_key=key, episode_chunk=_v2_chunk(info, e),
                                 episode_index=e), 0.0) for e in episodes}
    out: dict[int, tuple[Path, float]] = {}
    for f in sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
        table = _read_parquet(f)
        eps = _integers(_column(table, "episode_index", f), "episode_index", f)
        chunks = _integers(_column(table, f"videos/{key}/chunk_index", f), f"videos/{key}/chunk_index", f)
        files = _integers(_column(table, f"videos/{key}/file_index", f), f"videos/{key}/file_index", f)
        starts = _vectors(_column(table, f"videos/{key}/from_timestamp", f), f"videos/{key}/from_timestamp", 1, f)
        for e, c, i, t in zip(eps.tolist(), chunks.tolist(), files.tolist(), starts[:, 0].astype(np.float64)):
            out[e] = (_format_path(root, info, "video_path", video_key=key, chunk_index=c, file_index=i), float(t))
    return out


def _decode_video(root: Path, info: dict, key: str, shape: tuple[int, ...], episode_index: np.ndarray,
                  timestamp: np.ndarray) -> np.ndarray:
    """The frames of video feature ``key`` for rows ``(episode_index, timestamp)``: uint8 ``[M, H, W, 3]``.

    A row's frame is the one shown at its episode's ``from_timestamp`` plus its own ``timestamp``, within
    0.4 frame periods (LeRobot checks the same with a fixed 1e-4 s)."""
    if not isinstance(info.get("video_path"), str):
        raise LeRobotDatasetError(f"{root}/meta/info.json: feature {key!r} is a video but 'video_path' is "
                                  f"{info.get('video_path')!r}")
    episodes = np.unique(episode_index).tolist()
    locations = _video_locations(root, info, key, episodes)
    missing = sorted(set(episodes) - set(locations))
    if missing:
        raise LeRobotDatasetError(f"{root}: the episode tables give no video of {key!r} for episode {missing[0]}")
    files = sorted({locations[e][0] for e in episodes})
    file_of = {f: i for i, f in enumerate(files)}
    row_file = np.array([file_of[locations[e][0]] for e in episode_index.tolist()], dtype=np.int64)
    start = np.array([locations[e][1] for e in episode_index.tolist()], dtype=np.float64)
    out = np.empty((len(episode_index), *shape), dtype=np.uint8)
    for i, path in enumerate(files):
        rows = np.flatnonzero(row_file == i)
        try:
            out[rows] = read_frames(path, start[rows] + timestamp[rows], shape=shape,
                                    tolerance=0.4 / float(info["fps"]))
        except VideoError as e:
            raise LeRobotDatasetError(f"{root}: feature {key!r}: {e}") from None
    return out


def _read_tasks(root: Path, info: dict) -> list[str]:
    if _is_v2(info):
        where = root / "meta" / "tasks.jsonl"
        rows = _read_jsonl(where)
        if not all(isinstance(r.get("task_index"), int) and isinstance(r.get("task"), str) for r in rows):
            raise LeRobotDatasetError(f"{where}: every line needs an integer 'task_index' and a string 'task'")
        tasks, index = [r["task"] for r in rows], [r["task_index"] for r in rows]
    else:
        where = root / "meta" / "tasks.parquet"
        table = _read_parquet(where)
        names = [c for c in ("task", "__index_level_0__") if c in table.column_names]
        if not names:
            raise LeRobotDatasetError(f"{where} has no task strings (no 'task' column or pandas index)")
        tasks = _column(table, names[0], where).to_pylist()
        index = _integers(_column(table, "task_index", where), "task_index", where).tolist()
    if sorted(index) != list(range(len(index))):
        raise LeRobotDatasetError(f"{where}: task_index must be 0..{len(index) - 1}, got {sorted(index)}")
    ordered = [""] * len(index)
    for i, t in zip(index, tasks):
        ordered[i] = t
    return ordered


def _data_files(root: Path, info: dict, max_episodes: int | None = None) -> list[Path]:
    """The data files the episode tables point at, in order. v2.x: one per episode, and with
    ``max_episodes`` only the first ones (by episode index)."""
    if _is_v2(info):
        return [_format_path(root, info, "data_path", episode_chunk=_v2_chunk(info, e), episode_index=e)
                for e in _v2_episodes(root)[:max_episodes]]
    ep_files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not ep_files:
        raise LeRobotDatasetError(f"{root}: no episode tables under meta/episodes/")
    pairs: set[tuple[int, int]] = set()
    for f in ep_files:
        table = _read_parquet(f)
        chunks = _integers(_column(table, "data/chunk_index", f), "data/chunk_index", f)
        files = _integers(_column(table, "data/file_index", f), "data/file_index", f)
        pairs.update(zip(chunks.tolist(), files.tolist()))
    try:
        return [root / info["data_path"].format(chunk_index=c, file_index=i) for c, i in sorted(pairs)]
    except (KeyError, IndexError, ValueError) as e:
        raise LeRobotDatasetError(f"{root}: bad data_path {info['data_path']!r} in info.json: {e}") from None


# Feature names tried, in order, when the caller does not name the state / action feature: LeRobot's own
# (``observation.state``, ``action``), then the LIBERO layout of openpi's community datasets
# (physical-intelligence/libero: ``image``, ``wrist_image``, ``state``, ``actions``).
STATE_KEYS = ("observation.state", "state")
ACTION_KEYS = ("action", "actions")


def detect_keys(features: dict, state_key: str | None = None, action_key: str | None = None) -> tuple[str, str]:
    """The state and action feature names of a dataset: the given ones, else the first of
    :data:`STATE_KEYS` / :data:`ACTION_KEYS` present in ``features`` (else LeRobot's names, which the
    caller then reports as missing)."""
    def pick(given, names):
        return given if given is not None else next((k for k in names if k in features), names[0])
    return pick(state_key, STATE_KEYS), pick(action_key, ACTION_KEYS)


def read_lerobot_dataset(path: str | Path, *, image_keys: list[str] | None = None,
                         state_key: str | None = None, action_key: str | None = None,
                         max_episodes: int | None = None) -> DemoDataset:
    """Read a LeRobot dataset folder (v3.0, or v2.0 / v2.1) into a :class:`DemoDataset`.

    ``image_keys`` picks the camera features (default: every ``image`` / ``video`` feature, in
    info.json's order); all must have the same size. ``max_episodes`` keeps the first episodes (in
    ``index`` order) and decodes only their video frames. ``state_key`` / ``action_key`` default to
    LeRobot's ``observation.state`` / ``action``, or, when a dataset has those missing, the LIBERO
    layout's ``state`` / ``actions`` (see :func:`detect_keys`). Frames come back sorted by the global
    ``index``.
    """
    root = Path(path)
    info = read_lerobot_info(root)
    features = info["features"]
    if not isinstance(features, dict):
        raise LeRobotDatasetError(f"{root}/meta/info.json: 'features' must be a mapping")
    state_key, action_key = detect_keys(features, state_key, action_key)
    if image_keys is None:
        image_keys = [k for k, f in features.items() if isinstance(f, dict) and f.get("dtype") in ("image", "video")]
    for key in [*image_keys, state_key, action_key]:
        if key not in features:
            raise LeRobotDatasetError(f"{root}/meta/info.json has no feature {key!r} "
                                      f"(features: {sorted(features)})")
    for key in image_keys:
        dtype = features[key].get("dtype")
        if dtype not in ("image", "video"):
            raise LeRobotDatasetError(f"{root}: feature {key!r} has dtype {dtype!r}, expected 'image' or 'video'")
    is_video = [features[k].get("dtype") == "video" for k in image_keys]
    # No camera features: a state-only dataset (ManiSkill state observations); images come back [M, 0, 1, 1, 3].
    shapes = {tuple(features[k].get("shape", ())) for k in image_keys} or {(1, 1, 3)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[2] != 3:
        raise LeRobotDatasetError(f"{root}: image features must all be [H, W, 3] of one size, got {sorted(shapes)}")
    img_shape = next(iter(shapes))
    dims = {}
    for key in (state_key, action_key):
        shape = features[key].get("shape")
        if not isinstance(shape, list) or len(shape) != 1:
            raise LeRobotDatasetError(f"{root}: feature {key!r} must have a 1-D shape, got {shape!r}")
        dims[key] = int(shape[0])

    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("images", "state", "action", "episode_index",
                                                          "frame_index", "task_index", "index", "timestamp")}
    for f in _data_files(root, info, max_episodes):
        table = _read_parquet(f)
        # video frames are filled in below, once the rows (and so the episodes asked for) are known
        parts["images"].append(np.stack([np.zeros((table.num_rows, *img_shape), np.uint8) if video
                                         else _decode_images(_column(table, k, f), k, img_shape, root, f)
                                         for k, video in zip(image_keys, is_video)], axis=1) if image_keys
                               else np.zeros((table.num_rows, 0, *img_shape), np.uint8))
        if any(is_video):
            parts["timestamp"].append(_vectors(_column(table, "timestamp", f), "timestamp", 1, f)[:, 0])
        parts["state"].append(_vectors(_column(table, state_key, f), state_key, dims[state_key], f))
        parts["action"].append(_vectors(_column(table, action_key, f), action_key, dims[action_key], f))
        for name in ("episode_index", "frame_index", "task_index", "index"):
            parts[name].append(_integers(_column(table, name, f), name, f))
    cols = {k: np.concatenate(v) for k, v in parts.items() if v}
    if "index" not in cols or not len(cols["index"]):
        raise LeRobotDatasetError(f"{root} holds no frames (0 episodes in its data files)")
    order = np.argsort(cols["index"], kind="stable")
    cols = {k: v[order] for k, v in cols.items()}
    total = info.get("total_frames")
    if total is not None and total != len(order) and not (_is_v2(info) and max_episodes is not None):
        raise LeRobotDatasetError(f"{root}: info.json says total_frames={total}, the data files hold {len(order)}")
    if max_episodes is not None:
        eps = cols["episode_index"]
        firsts = eps[np.sort(np.unique(eps, return_index=True)[1])][:max_episodes]
        keep = np.isin(eps, firsts)
        cols = {k: v[keep] for k, v in cols.items()}
    for c, key in enumerate(image_keys):
        if is_video[c]:
            cols["images"][:, c] = _decode_video(root, info, key, img_shape, cols["episode_index"],
                                                 cols["timestamp"].astype(np.float64))
    tasks = _read_tasks(root, info)
    if cols["task_index"].size and (cols["task_index"].min() < 0 or cols["task_index"].max() >= len(tasks)):
        raise LeRobotDatasetError(f"{root}: task_index {int(cols['task_index'].max())} is not in meta/tasks.parquet "
                                  f"({len(tasks)} tasks)")
    if not np.isfinite(cols["state"]).all() or not np.isfinite(cols["action"]).all():
        raise LeRobotDatasetError(f"{root}: state or action holds NaN / inf")
    return DemoDataset(
        images=torch.from_numpy(cols["images"]), state=torch.from_numpy(cols["state"]),
        action=torch.from_numpy(cols["action"]), episode_index=torch.from_numpy(cols["episode_index"]),
        frame_index=torch.from_numpy(cols["frame_index"]), task_index=torch.from_numpy(cols["task_index"]),
        tasks=tasks)

