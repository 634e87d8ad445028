"""LeRobot v3.0 datasets: round trip, on-disk layout, stats, errors, and `vla-rl collect` -> `vla-rl sft`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from vla_rl.data.collect import collect_builtin_demos
from vla_rl.data.lerobot import LeRobotDatasetError, read_lerobot_dataset, write_lerobot_dataset

COLUMNS = ("images", "state", "action", "episode_index", "frame_index", "task_index")


@pytest.fixture(scope="module")
def demos():
    return collect_builtin_demos(3, seed=0, num_envs=4)


@pytest.fixture()
def dataset(tmp_path, demos):
    return write_lerobot_dataset(tmp_path / "ds", demos, fps=10, camera_names=["top"], robot_type="point",
                                 extra_info={"vla_rl": {"env": "builtin"}})


def test_round_trip(dataset, demos):
    back = read_lerobot_dataset(dataset)
    for name in COLUMNS:
        a, b = getattr(demos, name), getattr(back, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert back.tasks == demos.tasks


def test_layout(dataset, demos):
    info = json.loads((dataset / "meta" / "info.json").read_text())
    for key in ("codebase_version", "robot_type", "total_episodes", "total_frames", "total_tasks", "chunks_size",
                "data_files_size_in_mb", "video_files_size_in_mb", "fps", "splits", "data_path", "video_path",
                "features"):
        assert key in info, key
    m = len(demos)
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["robot_type"] == "point"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, m, len(demos.tasks))
    assert info["splits"] == {"train": "0:3"} and info["vla_rl"] == {"env": "builtin"}
    feats = info["features"]
    assert feats["observation.images.top"] == {"dtype": "image", "shape": [32, 32, 3],
                                               "names": ["height", "width", "channel"]}
    assert feats["observation.state"]["dtype"] == "float32" and feats["observation.state"]["shape"] == [4]
    assert feats["action"]["shape"] == [2]
    for name in ("frame_index", "episode_index", "index", "task_index"):
        assert feats[name]["dtype"] == "int64"

    data = pq.read_table(dataset / info["data_path"].format(chunk_index=0, file_index=0))
    assert set(data.column_names) == set(feats)
    assert data.schema.field("observation.state").type == pa.list_(pa.float32())
    assert data.schema.field("timestamp").type == pa.float32()
    assert data.column("index").to_pylist() == list(range(m))
    assert data.column("observation.images.top")[0].as_py()["bytes"][:8] == b"\x89PNG\r\n\x1a\n"

    episodes = pq.read_table(dataset / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    ep_col = data.column("episode_index").to_numpy()
    assert [e["episode_index"] for e in episodes] == [0, 1, 2]
    assert episodes[0]["dataset_from_index"] == 0 and episodes[-1]["dataset_to_index"] == m
    for e in episodes:
        lo, hi = e["dataset_from_index"], e["dataset_to_index"]
        assert hi - lo == e["length"] and (ep_col[lo:hi] == e["episode_index"]).all()
        assert (e["data/chunk_index"], e["data/file_index"]) == (0, 0)
        tasks = {demos.tasks[t] for t in demos.task_index[lo:hi].tolist()}
        assert e["tasks"] == sorted(tasks)

    tasks = pq.read_table(dataset / "meta" / "tasks.parquet")
    assert tasks.column("task").to_pylist() == demos.tasks
    assert tasks.column("task_index").to_pylist() == list(range(len(demos.tasks)))
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]  # pandas: task is the index


def _quantile(q):
    return lambda x, axis: np.quantile(x, q, axis=axis)


# Every statistic current LeRobot writes (its π0.5 normaliser reads q01 / q99), against numpy's own.
STATS = (("min", np.min), ("max", np.max), ("mean", np.mean), ("std", np.std), ("q01", _quantile(0.01)),
         ("q10", _quantile(0.10)), ("q50", _quantile(0.50)), ("q90", _quantile(0.90)), ("q99", _quantile(0.99)))


def test_stats_match_numpy(dataset, demos):
    stats = json.loads((dataset / "meta" / "stats.json").read_text())
    for key, x in (("observation.state", demos.state.double().numpy()), ("action", demos.action.double().numpy())):
        assert set(stats[key]) == {name for name, _ in STATS} | {"count"}
        for name, fn in STATS:
            np.testing.assert_allclose(stats[key][name], fn(x, axis=0), rtol=1e-6, atol=1e-7)
        assert stats[key]["count"] == [len(demos)]
    img = demos.images[:, 0].double().numpy() / 255.0   # LeRobot: per channel, in [0, 1], shape [3, 1, 1]
    for name, fn in STATS:   # from 256-bin histograms, so a real test of the rank arithmetic
        got = np.asarray(stats["observation.images.top"][name])
        assert got.shape == (3, 1, 1)
        np.testing.assert_allclose(got.ravel(), fn(img, axis=(0, 1, 2)), rtol=1e-9, atol=1e-12)


# Where scripts/fixtures/lerobot_side_env.sh built it: current LeRobot, to load what we write with its own code.
LEROBOT_SIDE = Path(__file__).resolve().parents[2] / ".cache" / "side" / "lerobot-0.6.1" / "bin" / "python"
LEROBOT_CHECK = """
import sys, torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
from lerobot.processor.normalize_processor import NormalizerProcessorStep
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
ds = LeRobotDataset("local/vla_rl", root=sys.argv[1])
frame = ds[0]
feats = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=tuple(frame["observation.state"].shape))}
out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=tuple(frame["action"].shape))}
cfg = PI05Config(input_features=feats, output_features=out, device="cpu")
norm = NormalizerProcessorStep(features={**feats, **out}, norm_map=cfg.normalization_mapping, stats=ds.meta.stats)
batch = norm({"observation": {"observation.state": frame["observation.state"][None]}, "action": frame["action"][None]})
print(len(ds), ds.meta.total_episodes, batch["observation"]["observation.state"].tolist())
"""


@pytest.mark.skipif(not LEROBOT_SIDE.is_file(), reason="needs scripts/fixtures/lerobot_side_env.sh 0.6.1")
def test_current_lerobot_loads_our_dataset_and_normalises_it_with_quantiles(dataset, demos):
    """LeRobot 0.6.1's own LeRobotDataset reads what we write, and π0.5's quantile normaliser accepts its stats
    (before q01 / q99 were written it refused them)."""
    import subprocess
    run = subprocess.run([str(LEROBOT_SIDE), "-c", LEROBOT_CHECK, str(dataset)], capture_output=True, text=True,
                         timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    frames, episodes, state = run.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (int(frames), int(episodes)) == (len(demos), int(demos.episode_index.max()) + 1)
    stats = json.loads((dataset / "meta" / "stats.json").read_text())["observation.state"]
    lo, hi = np.asarray(stats["q01"]), np.asarray(stats["q99"])
    want = (demos.state[0].double().numpy() - lo) / (hi - lo + 1e-8) * 2 - 1
    np.testing.assert_allclose(json.loads(state)[0], want, rtol=1e-5, atol=1e-5)


def _edit_info(dataset, **changes):
    path = dataset / "meta" / "info.json"
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))
    return info


def test_errors_name_the_problem(dataset, tmp_path):
    with pytest.raises(LeRobotDatasetError, match="missing meta/info.json"):
        read_lerobot_dataset(tmp_path)
    info = _edit_info(dataset, codebase_version="v1.6")
    with pytest.raises(LeRobotDatasetError, match="'v1.6' is not supported"):
        read_lerobot_dataset(dataset)
    feats = dict(info["features"], **{"observation.images.top": {"dtype": "video", "shape": [32, 32, 3]}})
    _edit_info(dataset, codebase_version="v3.0", features=feats)
    with pytest.raises(LeRobotDatasetError, match="'observation.images.top' is a video but 'video_path' is None"):
        read_lerobot_dataset(dataset)
    feats = dict(info["features"], action={"dtype": "float32", "shape": [3], "names": None})
    _edit_info(dataset, features=feats)
    with pytest.raises(LeRobotDatasetError, match="'action' has 2 values in row 0, info.json says shape \\[3\\]"):
        read_lerobot_dataset(dataset)
    with pytest.raises(LeRobotDatasetError, match="no feature 'observation.wrist'"):
        read_lerobot_dataset(dataset, state_key="observation.wrist")


def test_missing_column_and_corrupt_file(dataset):
    data_file = dataset / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data_file)
    pq.write_table(table.drop_columns(["action"]), data_file)
    with pytest.raises(LeRobotDatasetError, match="has no column 'action'"):
        read_lerobot_dataset(dataset)
    data_file.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(LeRobotDatasetError, match="corrupt parquet file .*file-000.parquet"):
        read_lerobot_dataset(dataset)


def test_write_is_atomic(dataset, demos, monkeypatch):
    import vla_rl.data.lerobot as lerobot

    before = sorted(p.relative_to(dataset) for p in dataset.rglob("*"))

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(lerobot, "_tasks_table", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_lerobot_dataset(dataset, demos, fps=10, camera_names=["top"])
    assert sorted(p.relative_to(dataset) for p in dataset.rglob("*")) == before   # old dataset untouched
    assert [p.name for p in dataset.parent.iterdir()] == ["ds"]                   # no temporary left behind


def test_cli_collect_then_sft(tmp_path, capsys):
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.cli import main

    ds, out = tmp_path / "demos", tmp_path / "policy"
    # threads= as every command takes it (how fast, not what: info.json does not record it)
    assert main(["collect", "builtin", str(ds), "episodes=3", "num_envs=4", "env.jitter=0.2", "threads=1"]) == 0
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert "threads" not in info["vla_rl"]["collect"]
    assert info["vla_rl"]["env"] == "builtin" and info["vla_rl"]["env_config"]["jitter"] == 0.2
    collect = info["vla_rl"]["collect"]
    assert collect["kind"] == "builtin" and collect["num_envs"] == 4 and collect["fps"] == 10 == info["fps"]
    assert "task" not in collect and "control_mode" not in collect   # ManiSkill's settings are not the builtin's
    assert main(["sft", str(ds), "--no-progress", "steps=3", "batch_size=8", "eval_episodes=4",
                 f"out={out}", "policy.depth=1"]) == 0
    text = capsys.readouterr().out
    assert "success (ODE sampler, 4 episodes" in text
    model, norm, config = load_policy(out)
    assert config["env"] == {"name": "builtin/color_reach", "state_dim": 4, "action_dim": 2}
    assert config["policy"]["depth"] == 1 and len(config["sft"]["tasks"]) >= 1
    assert main(["sft", str(ds), "stepz=3"]) == 2           # unknown keys are errors
    assert main(["collect", "mujoco", str(tmp_path / "x")]) == 2           # unknown kind
    assert main(["collect", "maniskill", str(tmp_path / "x"), "task=NoSuchTask-v1"]) == 2  # no planner for it


def test_collector_settings_are_the_kinds_own():
    """info.json's ``collect`` entry holds what the chosen collector reads (fps and max_tries resolved); a
    setting of the other collector is refused rather than silently ignored."""
    from vla_rl.core.ranges import ConfigError
    from vla_rl.core.schema import from_dict
    from vla_rl.data.collect import CollectConfig, collector_settings

    ms = collector_settings("maniskill", CollectConfig(task="PickCube-v1", episodes=4))
    assert ms == {"kind": "maniskill", "episodes": 4, "seed": 0, "fps": 20, "video": False, "task": "PickCube-v1",
                  "control_mode": "pd_ee_delta_pose", "obs_mode": "state", "image_size": 64,
                  "max_episode_steps": None, "max_tries": 22}
    builtin = collector_settings("builtin", CollectConfig(fps=5))
    assert set(builtin) == {"kind", "episodes", "seed", "fps", "video", "noise", "num_envs", "env"}
    assert builtin["fps"] == 5 and builtin["env"]["layout"] == CollectConfig().env.layout
    with pytest.raises(ConfigError, match=r"collect maniskill does not read noise \(builtin\), env \(builtin\)"):
        collector_settings("maniskill", from_dict(CollectConfig, {"noise": 0.3, "env": {"jitter": 0.2}}))
    with pytest.raises(ConfigError, match=r"does not read task \(maniskill\)"):
        collector_settings("builtin", CollectConfig(task="PickCube-v1"))


# ---------------------------------------------------------------------------------------------------------
# Video-backed camera features (MP4, LeRobot's default for recorded datasets)
# ---------------------------------------------------------------------------------------------------------
LEVELS_STEP = 12  # frame k of camera 0 is a flat grey of 10 + 12 k: a frame off by one is 12 levels off


def level_demos(lengths=(5, 7, 4), size=16):
    from vla_rl.data.dataset import DemoDataset

    m = sum(lengths)
    k = torch.arange(m)
    cam0 = (10 + LEVELS_STEP * k).to(torch.uint8)
    cam1 = (240 - LEVELS_STEP * k).to(torch.uint8)
    images = torch.stack([cam0, cam1], 1)[:, :, None, None, None].expand(m, 2, size, size, 3).contiguous()
    episode_index = torch.cat([torch.full((n,), e) for e, n in enumerate(lengths)])
    frame_index = torch.cat([torch.arange(n) for n in lengths])
    return DemoDataset(images=images, state=torch.randn(m, 3), action=torch.randn(m, 2),
                       episode_index=episode_index, frame_index=frame_index,
                       task_index=torch.zeros(m, dtype=torch.long), tasks=["push the cube"])


@pytest.fixture()
def video_dataset(tmp_path):
    data = level_demos()
    return write_lerobot_dataset(tmp_path / "vds", data, fps=10, camera_names=["top", "wrist"], video=True), data


def test_video_round_trip_layout_and_frame_alignment(video_dataset):
    import av

    path, data = video_dataset
    info = json.loads((path / "meta" / "info.json").read_text())
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    feat = info["features"]["observation.images.wrist"]
    assert feat["dtype"] == "video" and feat["shape"] == [16, 16, 3]
    assert feat["info"]["video.codec"] == "av1" and feat["info"]["video.pix_fmt"] == "yuv420p"
    columns = pq.read_schema(path / "data/chunk-000/file-000.parquet").names
    assert not any(k.startswith("observation.images") for k in columns)  # the frames live in the MP4s only
    eps = pq.read_table(path / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
    # episodes back to back in one file per camera: from = (frames before) / fps
    assert eps["videos/observation.images.top/from_timestamp"] == pytest.approx([0.0, 0.5, 1.2])
    assert eps["videos/observation.images.top/to_timestamp"] == pytest.approx([0.5, 1.2, 1.6])
    assert eps["videos/observation.images.wrist/file_index"] == [0, 0, 0]
    mp4 = path / "videos/observation.images.top/chunk-000/file-000.mp4"
    with av.open(str(mp4)) as c:
        assert c.streams.video[0].frames in (0, 16) and c.streams.video[0].codec_context.name in ("av1", "libdav1d")

    back = read_lerobot_dataset(path)
    for name in ("state", "action", "episode_index", "frame_index", "task_index"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    # lossy, but every frame is its own: within 3 grey levels of what was written (neighbours are 12 away)
    err = (back.images.float() - data.images.float()).abs().amax(dim=(2, 3, 4))
    assert err.max() <= 3, err


def test_video_max_episodes_reads_only_those_episodes(video_dataset):
    path, data = video_dataset
    back = read_lerobot_dataset(path, max_episodes=2)
    assert back.episode_index.unique().tolist() == [0, 1] and len(back) == 12
    assert (back.images.float() - data.images[:12].float()).abs().max() <= 3


def test_video_errors_name_the_problem(video_dataset):
    path, _ = video_dataset
    data_file = path / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data_file)
    # a row whose timestamp points past its episode's frames (here: past the end of the file)
    ts = table.column("timestamp").to_numpy().copy()
    ts[-1] += 1.0
    pq.write_table(table.set_column(table.schema.get_field_index("timestamp"), "timestamp",
                                    pa.array(ts, pa.float32())), data_file)
    with pytest.raises(LeRobotDatasetError, match="no frame within 0.0400 s of t = 2.5000 s"):
        read_lerobot_dataset(path)
    pq.write_table(table, data_file)
    mp4 = path / "videos/observation.images.wrist/chunk-000/file-000.mp4"
    mp4.write_bytes(b"not an mp4 at all")
    with pytest.raises(LeRobotDatasetError, match="'observation.images.wrist': unreadable video file .*file-000.mp4"):
        read_lerobot_dataset(path)
    mp4.unlink()
    with pytest.raises(LeRobotDatasetError, match="video file missing: .*wrist/chunk-000/file-000.mp4"):
        read_lerobot_dataset(path)
    ep_file = path / "meta/episodes/chunk-000/file-000.parquet"
    pq.write_table(pq.read_table(ep_file).drop_columns(["videos/observation.images.top/from_timestamp"]), ep_file)
    with pytest.raises(LeRobotDatasetError, match="has no column 'videos/observation.images.top/from_timestamp'"):
        read_lerobot_dataset(path)


def test_video_needs_even_sizes(tmp_path):
    with pytest.raises(ValueError, match="even image sizes"):
        write_lerobot_dataset(tmp_path / "odd", level_demos(size=15), fps=10, camera_names=["a", "b"], video=True)
    assert not (tmp_path / "odd").exists()


def test_cli_collect_video_then_sft(tmp_path, capsys):
    from vla_rl.cli import main

    ds = tmp_path / "demos"
    assert main(["collect", "builtin", str(ds), "episodes=2", "num_envs=2", "video=true"]) == 0
    assert json.loads((ds / "meta" / "info.json").read_text())["features"]["observation.images.top"]["dtype"] == "video"
    assert main(["sft", str(ds), "--no-progress", "steps=2", "batch_size=8", "eval_episodes=0",
                 f"out={tmp_path / 'policy'}", "policy.depth=1"]) == 0
    assert (tmp_path / "policy" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------
# Reading the v2.0 / v2.1 layout (one parquet / MP4 per episode, JSON-lines tables), written here by hand
# from LeRobot's documented schema, independently of write_lerobot_dataset
# ---------------------------------------------------------------------------------------------------------
def write_v2(path, data, *, fps, cameras, video, version="v2.1"):
    from vla_rl.data.lerobot_video import VideoWriter

    (path / "meta").mkdir(parents=True)
    m, _, h, w, _ = data.images.shape
    keys = [f"observation.images.{c}" for c in cameras]
    features = {k: {"dtype": "video" if video else "image", "shape": [h, w, 3], "names": ["height", "width", "channel"]}
                for k in keys}
    features.update({"observation.state": {"dtype": "float32", "shape": [data.state.shape[1]], "names": None},
                     "action": {"dtype": "float32", "shape": [data.action.shape[1]], "names": None}})
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        features[name] = {"dtype": "float32" if name == "timestamp" else "int64", "shape": [1], "names": None}
    info = {"codebase_version": version, "fps": fps, "total_episodes": int(data.episode_index.max()) + 1,
            "total_frames": m, "chunks_size": 1000, "features": features,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4" if video
            else None}
    (path / "meta" / "info.json").write_text(json.dumps(info))
    (path / "meta" / "tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n"
                                                       for i, t in enumerate(data.tasks)))
    lines = []
    for ep in data.episode_index.unique().tolist():
        rows = (data.episode_index == ep).nonzero()[:, 0]
        lines.append(json.dumps({"episode_index": ep, "tasks": [data.tasks[int(data.task_index[rows[0]])]],
                                 "length": len(rows)}) + "\n")
        cols = {"observation.state": pa.array(list(data.state[rows].numpy()), pa.list_(pa.float32())),
                "action": pa.array(list(data.action[rows].numpy()), pa.list_(pa.float32())),
                "timestamp": pa.array((data.frame_index[rows].numpy() / fps).astype(np.float32)),
                "frame_index": pa.array(data.frame_index[rows].numpy()),
                "episode_index": pa.array(data.episode_index[rows].numpy()),
                "index": pa.array(rows.numpy()), "task_index": pa.array(data.task_index[rows].numpy())}
        for c, key in enumerate(keys):
            frames = data.images[rows, c].numpy()
            if video:
                writer = VideoWriter(path / f"videos/chunk-000/{key}/episode_{ep:06d}.mp4", fps=fps, height=h, width=w)
                writer.add(frames)
                writer.close()
            else:
                from vla_rl.data.lerobot import _png
                cols[key] = pa.array([{"bytes": _png(f), "path": None} for f in frames],
                                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
        (path / "data/chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), path / f"data/chunk-000/episode_{ep:06d}.parquet")
    (path / "meta" / "episodes.jsonl").write_text("".join(lines))
    return path


def test_reads_the_v2_layout_with_png_images(tmp_path, demos):
    path = write_v2(tmp_path / "v21", demos, fps=10, cameras=["top"], video=False)
    back = read_lerobot_dataset(path)
    for name in COLUMNS:
        assert torch.equal(getattr(back, name), getattr(demos, name)), name
    assert back.tasks == demos.tasks


def test_reads_the_v2_layout_with_videos_and_only_the_episodes_asked_for(tmp_path):
    data = level_demos()
    path = write_v2(tmp_path / "v20", data, fps=10, cameras=["top", "wrist"], video=True, version="v2.0")
    back = read_lerobot_dataset(path)
    assert torch.equal(back.state, data.state) and torch.equal(back.episode_index, data.episode_index)
    assert (back.images.float() - data.images.float()).abs().max() <= 3  # each episode's own file, from t = 0
    (path / "data/chunk-000/episode_000002.parquet").unlink()
    (path / "videos/chunk-000/observation.images.top/episode_000002.mp4").unlink()
    first = read_lerobot_dataset(path, max_episodes=2)  # never opens episode 2's files
    assert first.episode_index.unique().tolist() == [0, 1] and torch.equal(first.images, back.images[:12])
    with pytest.raises(LeRobotDatasetError, match="dataset file missing: .*episode_000002.parquet"):
        read_lerobot_dataset(path)


def test_v2_errors_name_the_problem(tmp_path, demos):
    path = write_v2(tmp_path / "v21", demos, fps=10, cameras=["top"], video=False)
    episodes = path / "meta" / "episodes.jsonl"
    lines = episodes.read_text().splitlines()
    episodes.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(LeRobotDatasetError, match="corrupt JSON in .*episodes.jsonl line 2"):
        read_lerobot_dataset(path)
    episodes.write_text("\n".join(lines))
    (path / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0}) + "\n")
    with pytest.raises(LeRobotDatasetError, match="tasks.jsonl: every line needs an integer 'task_index' and a string"):
        read_lerobot_dataset(path)
