"""SFT on a small generated dataset: the loss goes down and samples move toward the demonstrations."""

import pytest
import torch

from vla_rl.checkpoint.policy import load_policy, save_policy
from vla_rl.core.errors import CheckpointError
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.train.sft import SFTConfig, loss_summary, train_sft

SMALL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 64, "mlp_dim": 128},
         "expert": {"width": 64, "mlp_dim": 128}}


def chunk_error(actor, data, idx):
    chunks, mask = data.action_chunks(actor.model.cfg.action_horizon)
    obs = {"images": data.images[idx], "state": data.state[idx], "instruction": data.instructions(idx)}
    with torch.inference_mode():
        pred = actor.act(actor.observe(obs), SamplerConfig(num_steps=4),
                         generator=torch.Generator().manual_seed(0)).actions
    err = ((pred - chunks[idx]) ** 2).sum(-1)
    return (err * mask[idx]).sum() / mask[idx].sum()


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    data = collect_builtin_demos(6, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(FlowPolicy(policy_preset("tiny", SMALL)), norm)
    idx = torch.arange(0, len(data), 3)
    before = chunk_error(actor, data, idx)
    log = train_sft(actor, data, SFTConfig(steps=200, batch_size=16, lr=2e-3, warmup_steps=20, log_every=50),
                    progress=False)
    return actor, data, idx, before, log


def test_sft_loss_goes_down_and_samples_approach_the_data(trained):
    actor, data, idx, before, log = trained
    first, last = log[0]["losses/flow_matching"], log[-1]["losses/flow_matching"]
    assert last < 0.5 * first, log
    after = chunk_error(actor, data, idx)
    assert after < 0.5 * before, (before, after)


def test_the_loss_line_names_its_windows(trained):
    """The first and the last logged window (each a mean over its steps), so 100 steps logged as one window read
    as one number, not as "0.970 -> 0.970"."""
    *_, log = trained
    assert loss_summary(log) == (f"flow-matching loss {log[0]['losses/flow_matching']:.3f} (steps 1-50) -> "
                                 f"{log[-1]['losses/flow_matching']:.3f} (steps 151-200)")
    assert loss_summary([{"step": 100, "losses/flow_matching": 0.97}]) == "flow-matching loss 0.970 (steps 1-100)"
    assert loss_summary([{"step": 1, "losses/flow_matching": 1.0}, {"step": 2, "losses/flow_matching": 0.5}]) == (
        "flow-matching loss 1.000 (step 1) -> 0.500 (step 2)")


def test_sft_of_100_steps_reports_a_start_and_an_end(tmp_path, capsys):
    from vla_rl.data.collect import CollectConfig, collect_dataset
    from vla_rl.train.sft import SFTRunConfig, run_sft

    demos = collect_dataset("builtin", tmp_path / "demos", CollectConfig(episodes=2, seed=0))
    run_sft(demos, SFTRunConfig(model="tiny", steps=20, batch_size=8, warmup_steps=2, eval_episodes=0, threads=1,
                                out=str(tmp_path / "sft")), progress=False)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("flow-matching loss"))
    assert "(steps 1-2) -> " in line and line.endswith("(steps 19-20)"), line


def test_checkpoint_roundtrip_and_corruption(trained, tmp_path):
    actor, data, idx, _, _ = trained
    path = save_policy(tmp_path / "ckpt", actor.model, actor.norm, meta={"env": {"state_dim": 4}})
    model, norm, config = load_policy(path)
    for k, v in actor.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    assert torch.equal(norm.action.std, actor.norm.action.std) and config["env"]["state_dim"] == 4
    # Overwriting is atomic: the folder is complete afterwards and no temporary folder is left.
    save_policy(path, actor.model, actor.norm)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # Corrupt weights, truncated file, wrong config, missing folder: clear errors.
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        load_policy(path)
    save_policy(path, actor.model, actor.norm)
    cfg_text = (path / "config.yaml").read_text().replace("depth: 2", "depth: 3", 1)
    (path / "config.yaml").write_text(cfg_text)
    with pytest.raises(CheckpointError, match="does not match"):
        load_policy(path)
    (path / "config.yaml").write_text(cfg_text.replace("time_conditioning", "time_conditionin"))
    with pytest.raises(CheckpointError, match="unknown config key"):
        load_policy(path)
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        load_policy(tmp_path / "nothing")


def test_action_chunks_are_masked_past_episode_end(trained):
    _, data, _, _, _ = trained
    chunks, mask = data.action_chunks(8)
    ep = data.episode_index
    last = int((ep == 0).nonzero().max())
    assert mask[last].tolist() == [True] + [False] * 7
    assert torch.equal(chunks[last, 0], data.action[last]) and torch.equal(chunks[last, 5], data.action[last])
    lengths = torch.bincount(ep)
    long_ep = int((lengths >= 8).nonzero()[0])
    first = int((ep == long_ep).nonzero().min())
    assert mask[first].all() and torch.equal(chunks[first], data.action[first: first + 8])


def _toy_demos(actions: list[list[float]], episodes: list[int]):
    from vla_rl.data.dataset import DemoDataset

    m = len(actions)
    frame = [sum(1 for e in episodes[:i] if e == episodes[i]) for i in range(m)]
    return DemoDataset(images=torch.zeros(m, 0, 8, 8, 3, dtype=torch.uint8), state=torch.arange(m).float()[:, None],
                       action=torch.tensor(actions), episode_index=torch.tensor(episodes),
                       frame_index=torch.tensor(frame), task_index=torch.zeros(m, dtype=torch.long), tasks=["t"])


def test_idle_frames_are_pauses_of_the_arm_that_keep_the_gripper_command():
    from vla_rl.data.dataset import drop_idle_frames, idle_frames

    # episode 0: idle start, move, pause, close the gripper (kept though the arm is still), pause, move;
    # episode 1 starts idle with the same gripper value as episode 0's end (a new episode: still idle).
    acts = [[0.0, 0.001, 1], [0.5, 0.0, 1], [0.005, -0.01, 1], [0.0, 0.0, -1], [0.01, 0.0, -1], [0.0, 0.3, -1],
            [0.0, 0.0, -1], [-0.2, 0.0, -1]]
    eps = [0, 0, 0, 0, 0, 0, 1, 1]
    data = _toy_demos(acts, eps)
    assert idle_frames(data.action, data.episode_index, 0.02).tolist() == [
        True, False, True, False, True, False, True, False]
    kept = drop_idle_frames(data, 0.02)
    assert kept.state[:, 0].tolist() == [1, 3, 5, 7]            # which original frames survived
    assert kept.episode_index.tolist() == [0, 0, 0, 1] and kept.frame_index.tolist() == [0, 1, 2, 0]
    chunks, mask = kept.action_chunks(3)                         # chunks run over the kept frames only
    assert torch.equal(chunks[0], torch.tensor([acts[1], acts[3], acts[5]]))
    assert mask[2].tolist() == [True, False, False]
    # a ~0 threshold drops only the frames whose arm command is exactly zero
    assert drop_idle_frames(data, 1e-9).state[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("env, asked, evaluated, says", [
    ("builtin", None, 100, None),                              # cheap: evaluated by default
    ("libero", None, None, "no success figure (libero evaluations are slow: give eval_episodes=N"),
    ("libero", 3, 3, None),                                    # asked for: evaluated
    (None, None, None, "no success figure (the dataset names no env this project runs"),
    ("libero", 0, None, None),                                 # 0 skips it, silently
])
def test_sft_says_why_it_prints_no_success_figure(env, asked, evaluated, says, tmp_path, monkeypatch, capsys):
    """sft prints its success where it evaluates; where it does not by default (LIBERO: slow; a dataset naming no
    env) it says why and how to get one, instead of printing nothing."""
    import json

    import vla_rl.train.sft as sft_mod
    from vla_rl.data.collect import CollectConfig, collect_dataset

    demos = collect_dataset("builtin", tmp_path / "demos", CollectConfig(episodes=2, seed=0, num_envs=2))
    info_path = demos / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    if env is None:
        del info["vla_rl"]
    else:
        info["vla_rl"] = {"env": env, "env_config": {} if env != "builtin" else info["vla_rl"]["env_config"]}
    info_path.write_text(json.dumps(info))
    calls = []
    monkeypatch.setattr(sft_mod, "evaluate_sft_policy", lambda cfg, *a, **k: calls.append(cfg.eval_episodes) or {})
    sft_mod.run_sft(demos, sft_mod.SFTRunConfig(model="tiny", steps=2, batch_size=8, warmup_steps=1, threads=1,
                                                eval_episodes=asked, out=str(tmp_path / "sft")), progress=False)
    assert calls == ([] if evaluated is None else [evaluated])
    out = capsys.readouterr().out
    assert (says in out) if says else "no success figure" not in out, out
