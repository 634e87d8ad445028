"""`vla-rl bench --suite libero_*` (the official protocol, reduced: one task, two init states) and the LIBERO
dataset layout (record a few random-policy episodes, read them back, SFT on them).

The real-LIBERO tests share one recorded dataset and one SFT policy (module fixtures); they need LIBERO
like tests/envs/libero/test_libero.py and are skipped with ``VLA_RL_SKIP_SIMULATORS=1``. Images are 32 px and
episodes 12 steps, so the module takes well under a minute of simulation on a CPU.
"""

import json

import numpy as np
import pytest
import torch
from helpers import SKIP_SIMULATORS as SKIP

from vla_rl.checkpoint.policy import save_policy
from vla_rl.cli import main
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.data.lerobot import detect_keys, read_lerobot_dataset, read_lerobot_info
from vla_rl.envs.libero.settings import libero_env_config
from vla_rl.eval.bench import BenchConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset

needs_libero = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
SMALL = {"depth": 1, "vision": {"depth": 1, "image_size": 32}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}}
STEPS = 12   # max_episode_steps of the recorded and evaluated episodes


def tiny_checkpoint(path, *, meta_dims=(8, 7), **policy):
    cfg = policy_preset("tiny", {**SMALL, **policy})
    norm = NormStats(Stats.of(torch.randn(16, cfg.state_dim)), Stats.of(torch.randn(16, cfg.action_dim)))
    meta = {"env": {"name": "test", "state_dim": meta_dims[0], "action_dim": meta_dims[1]}} if meta_dims else None
    return save_policy(path, FlowPolicy(cfg), norm, meta=meta)


# ---------------------------------------------------------------------------------------------- pure
def test_detect_keys_prefers_lerobot_names_then_libero_layout():
    assert detect_keys({"observation.state": {}, "action": {}}) == ("observation.state", "action")
    assert detect_keys({"state": {}, "actions": {}, "image": {}}) == ("state", "actions")
    assert detect_keys({"observation.state": {}, "state": {}, "actions": {}}) == ("observation.state", "actions")
    assert detect_keys({}) == ("observation.state", "action")           # reported as missing by the reader
    assert detect_keys({"state": {}}, state_key="x", action_key="y") == ("x", "y")


def test_config_rejects_unknown_suites_and_protocol_keys():
    assert from_dict(BenchConfig, {}).suite == "libero_4" and from_dict(BenchConfig, {}).episodes_per_task == 50
    with pytest.raises(ConfigError, match="unknown suite 'libero_100'.*libero_spatial"):
        from_dict(BenchConfig, {"suite": "libero_100"})
    with pytest.raises(ConfigError, match="episodes = 0 is outside"):
        from_dict(BenchConfig, {"episodes": 0})
    one = policy_preset("tiny", {**SMALL, "action_dim": 7})
    with pytest.raises(ConfigError, match="env.init_state_ids is set by the protocol"):
        libero_env_config({}, one, {"init_state_ids": [3]})


def test_cli_reports_bad_suite_and_wrong_dims(tmp_path, capsys):
    ok = tiny_checkpoint(tmp_path / "ok", num_cameras=2, action_dim=7)
    assert main(["bench", str(ok), "--suite", "libero_100"]) == 2
    assert "unknown suite 'libero_100'" in capsys.readouterr().err
    assert main(["eval", str(ok), "--libero", "libero_spatial"]) == 2          # moved: says where
    assert f"vla-rl bench {ok} --suite libero_spatial" in capsys.readouterr().err
    builtin = tiny_checkpoint(tmp_path / "builtin", meta_dims=(4, 2))
    assert main(["bench", str(builtin), "--suite", "libero_spatial", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "trained for state 4 / action 2 (test); LIBERO needs state 8 / action 7" in err, err
    assert not (tmp_path / "out").exists()   # failed before any simulation or output


def test_env_config_follows_the_model_and_rejects_misfits(tmp_path):
    two = policy_preset("tiny", {**SMALL, "num_cameras": 2, "action_dim": 7})
    env = libero_env_config({"env": {"state_dim": 8, "action_dim": 7}}, two)
    assert env.cameras == ("agentview", "wrist") and env.image_size == 32 and env.image_orientation == "rot180"
    one = policy_preset("tiny", {**SMALL, "action_dim": 7})
    assert libero_env_config({}, one, {"image_orientation": "upright"}).cameras == ("agentview",)
    # A training run on LIBERO: its env settings (here the orientation) are the default; the older `options`
    # spelling of run folders is read too.
    for train_env in ({"kind": "libero", "libero": {"image_orientation": "upright", "suite": "libero_goal",
                                                    "max_episode_steps": 9}},
                      {"kind": "libero", "options": {"image_orientation": "upright", "max_episode_steps": 9}}):
        env = libero_env_config({}, one, {}, train_env)
        assert env.image_orientation == "upright" and env.max_episode_steps is None   # official limits
        assert libero_env_config({"env_config": train_env}, one).image_orientation == "upright"
    with pytest.raises(CheckpointError, match="model has state/action dims 8/4; LIBERO needs at least 8/7"):
        libero_env_config({}, policy_preset("tiny", SMALL))
    with pytest.raises(CheckpointError, match="takes 3 camera"):
        libero_env_config({}, policy_preset("tiny", {**SMALL, "num_cameras": 3, "action_dim": 7}))
    with pytest.raises(CheckpointError, match="env.image_size=64, but the model takes 32px"):
        libero_env_config({}, one, {"image_size": 64})
    with pytest.raises(CheckpointError, match="gives 2 camera"):
        libero_env_config({}, one, {"cameras": ["agentview", "wrist"]})
    with pytest.raises(ConfigError, match="image_orientation"):
        libero_env_config({}, one, {"image_orientation": "sideways"})


# ---------------------------------------------------------------------------------------------- real
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from vla_rl.data.libero_demos import LiberoRecordConfig, record_libero_episodes, recording_info, write_libero_layout

    cfg = LiberoRecordConfig(task_ids=[0], episodes_per_task=2, max_episode_steps=STEPS, image_size=32, seed=0)
    data = record_libero_episodes(cfg, progress=False)
    path = write_libero_layout(tmp_path_factory.mktemp("libero") / "dataset", data, fps=cfg.fps,
                               extra_info=recording_info(cfg))
    return data, path


@needs_libero
def test_recorded_dataset_has_the_libero_layout_and_round_trips(recorded):
    data, path = recorded
    assert data.images.shape == (2 * STEPS, 2, 32, 32, 3) and data.state.shape == (2 * STEPS, 8)
    assert data.action.shape == (2 * STEPS, 7) and data.action.abs().max() <= 1
    info = read_lerobot_info(path)
    assert [k for k in info["features"] if k not in ("timestamp", "frame_index", "episode_index", "index",
                                                     "task_index")] == ["image", "wrist_image", "state", "actions"]
    assert info["features"]["image"]["shape"] == [32, 32, 3] and info["robot_type"] == "panda"
    assert info["vla_rl"]["env"] == "libero" and info["vla_rl"]["env_config"]["image_orientation"] == "rot180"
    collect = info["vla_rl"]["collect"]
    assert collect["kind"] == "libero" and collect["episodes_per_task"] == 2 and collect["max_episode_steps"] == STEPS
    assert set(json.loads((path / "meta" / "stats.json").read_text())) >= {"image", "wrist_image", "state", "actions"}
    back = read_lerobot_dataset(path)   # auto-detected: state / actions, cameras image, wrist_image
    for name in ("images", "state", "action", "episode_index", "frame_index", "task_index"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    assert back.tasks == data.tasks == ["pick up the black bowl between the plate and the ramekin and place it "
                                        "on the plate"]
    assert np.unique(back.episode_index.numpy()).tolist() == [0, 1]


@pytest.fixture(scope="module")
def sft_policy(recorded, tmp_path_factory):
    from vla_rl.train.sft import SFTRunConfig, run_sft

    _, path = recorded
    out = tmp_path_factory.mktemp("sft") / "policy"
    cfg = SFTRunConfig(model="tiny", policy={**SMALL, "num_cameras": 2, "action_dim": 7}, steps=4, batch_size=8,
                       warmup_steps=1, out=str(out), eval_episodes=0)
    return run_sft(path, cfg, progress=False), out


@needs_libero
def test_sft_trains_on_the_libero_layout(sft_policy):
    from vla_rl.checkpoint.policy import load_policy

    res, out = sft_policy
    assert all(np.isfinite(e["losses/flow_matching"]) for e in res["sft_log"]) and res["sft_log"][-1]["step"] == 4
    model, norm, config = load_policy(out)
    assert (config["env"]["state_dim"], config["env"]["action_dim"]) == (8, 7)
    assert (model.cfg.num_cameras, model.cfg.vision.image_size, model.cfg.action_dim) == (2, 32, 7)
    assert norm.state.mean.shape == (8,) and norm.action.mean.shape == (7,)


@needs_libero
def test_cli_bench_runs_the_reduced_protocol_and_resumes(sft_policy, tmp_path, capsys):
    _, ckpt = sft_policy
    out = tmp_path / "bench"
    args = ["bench", str(ckpt), "--suite", "libero_spatial", "tasks=[0]", "episodes=2", "execute=4", "workers=2",
            f"env.max_episode_steps={STEPS}", f"out={out}", "progress=false"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    (task,) = res["tasks"]
    assert (task["suite"], task["task"], task["episodes"]) == ("libero_spatial", "0", 2)
    assert task["instruction"].startswith("pick up the black bowl")
    doc = json.loads((out / "tasks" / "libero_spatial" / "0.json").read_text())
    # episode k of the task is its fixed init state k, whatever the number of workers
    assert [(r["task_id"], r["init_state_id"]) for r in doc["records"]] == [(0, 0), (0, 1)]
    for r in doc["records"]:   # an untrained policy: success is whatever it is, lengths are bounded
        assert 1 <= r["length"] <= STEPS and (r["success_once"] or r["length"] == STEPS)
    assert task["successes"] == sum(r["success_once"] for r in doc["records"])
    suite = res["suites"]["libero_spatial"]
    assert suite["success_rate"] == task["success_rate"] == res["average"] and suite["episodes"] == 2
    first = doc["records"][0]
    assert first["video"] == f"videos/libero_spatial_0_ep00000_{'success' if first['success_once'] else 'failure'}.mp4"
    assert (out / first["video"]).stat().st_size > 0 and "video" not in doc["records"][1]   # videos=1 per task
    assert res["weights_sha256"] and "vla-rl bench" in res["command"]
    assert "| libero_spatial | 0 | pick up the black bowl" in printed and "**libero_spatial**" in printed
    # Resume: the finished task is kept, not re-run (its file stays byte-identical).
    before = (out / "tasks" / "libero_spatial" / "0.json").read_bytes()
    assert main(args) == 0
    assert "done earlier, kept" in capsys.readouterr().out
    assert (out / "tasks" / "libero_spatial" / "0.json").read_bytes() == before
    # Other settings into the same folder are refused before any work.
    assert main([*args[:-1], "sampler.num_steps=2", "progress=false"]) == 2
    assert "made with other settings (num_steps)" in capsys.readouterr().err


class StateTrace:
    """An env wrapper that records each env's state after every chunk of its first episode of a round, by
    episode seed (the round's reset seed + env index)."""

    def __init__(self, env):
        self.env, self.spec, self.num_envs = env, env.spec, env.num_envs
        self.trace: dict[int, list] = {}

    def reset(self, seed=None, **kw):
        obs = self.env.reset(seed=seed, **kw)
        self.seeds, self.alive = [seed + i for i in range(self.num_envs)], [True] * self.num_envs
        for i, s in enumerate(self.seeds):
            self.trace[s] = [obs["state"][i].clone()]
        return obs

    def step(self, chunk):
        out = self.env.step(chunk)
        for i, s in enumerate(self.seeds):
            if self.alive[i]:
                done = bool(out.done[i])
                self.trace[s].append((out.final_obs if done else out.obs)["state"][i].clone())
                self.alive[i] = not done
        return out


@needs_libero
@pytest.mark.slow
def test_eval_gives_the_same_episodes_with_few_or_many_envs(sft_policy):
    """Episodes are named by their seeds on LIBERO too: 4 episodes on 1 env (four rounds, so every episode after the
    first runs in an env that played others before) and on 2 envs in 2 workers give the same per-episode results
    and the same states after every chunk. (Few envs: a LIBERO env with its renderer takes ~1 GB.)"""
    from vla_rl.eval.evaluate import checkpoint_env_config, evaluate_episodes, open_checkpoint
    from vla_rl.rl.actor import SamplerConfig

    _, ckpt = sft_policy
    env_cfg = checkpoint_env_config(ckpt, {"libero": {"max_episode_steps": STEPS}})
    runs, traces = {}, {}
    for n in (1, 2):
        actor, env = open_checkpoint(ckpt, env_config=env_cfg, num_envs=n, device=torch.device("cpu"), seed=0)
        traced = StateTrace(env)
        try:
            recs = evaluate_episodes(actor, traced, num_episodes=4, sampler=SamplerConfig(4, "noise"), execute=4,
                                     seed=10_000)
        finally:
            env.close()
        runs[n], traces[n] = {r["episode_seed"]: r for r in recs}, traced.trace
    assert sorted(runs[1]) == sorted(runs[2]) == list(range(10_000, 10_004))
    for s, a in runs[1].items():
        assert {k: a[k] for k in ("success_once", "length", "return")} == \
               {k: runs[2][s][k] for k in ("success_once", "length", "return")}, s
        assert len(traces[1][s]) == len(traces[2][s]) == 1 + STEPS // 4
        for x, y in zip(traces[1][s], traces[2][s]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    last = [traces[2][s][-1] for s in sorted(traces[2])]
    assert len({tuple(x.tolist()) for x in last}) == 4          # the episodes differ from each other


@needs_libero
def test_an_imported_openpi_libero_policy_is_benched_as_openpi_runs_it(tmp_path, capsys):
    """openpi's tiny pi0_libero twin, imported: LIBERO runs it on rot180 frames at 256 px, 5 actions a chunk and 10
    denoising steps (its folder says so), its arm actions made absolute from the state; no setting given."""
    from pathlib import Path

    from vla_rl.checkpoint.openpi import import_openpi

    twin = Path(__file__).resolve().parents[2] / "fixtures" / "openpi_tiny"
    import_openpi(twin / "pi0" / "jax", tmp_path / "pi0_libero", tokenizer=twin / "tokenizer.model")
    out = tmp_path / "bench"
    assert main(["bench", str(tmp_path / "pi0_libero"), "--suite", "libero_spatial", "tasks=[0]", "episodes=1",
                 "env.max_episode_steps=10", "videos=0", f"out={out}", "progress=false"]) == 0
    printed = capsys.readouterr().out
    assert "execute=5" in printed and "sampler.num_steps=10" in printed
    doc = json.loads((out / "tasks" / "libero_spatial" / "0.json").read_text())
    assert (doc["identity"]["execute"], doc["identity"]["num_steps"]) == (5, 10)
    assert 1 <= doc["records"][0]["length"] <= 10
