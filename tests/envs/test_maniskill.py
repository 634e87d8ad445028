"""ManiSkill3 adapter tests (CPU single env; worker pool and GPU env under the slow / gpu markers).

ManiSkill must be installed (`make sims`): without it these tests fail, unless VLA_RL_SKIP_SIMULATORS=1.
Envs are shared per module: creating one costs seconds, the first camera image of a process ~10 s.
"""

import os
import sys

import numpy as np
import pytest
import torch
from contract import check_env_contract
from helpers import needs_simulator

from vla_rl.envs.maniskill import (
    INSTRUCTIONS,
    LAVAPIPE_ICD,
    ManiSkillConfig,
    ManiSkillSingleEnv,
    default_instruction,
    enable_physx_gpu,
    ensure_vulkan,
    make_maniskill_env,
)

sim = needs_simulator("mani_skill", "ManiSkill")


@pytest.fixture(scope="module")
def pick():
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PickCube-v1"))
    yield env
    env.close()


@pytest.fixture(scope="module")
def push_dense():
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PushCube-v1", reward="dense", max_episode_steps=5))
    yield env
    env.close()


def _rollout(env, seed, actions):
    obs = [env.reset(seed)]
    out = []
    for a in actions:
        o, *rest = env.step(a)
        obs.append(o)
        out.append(rest)
    return obs, out


# ---------------------------------------------------------------------------------------------- config
def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="obs_mode"):
        ManiSkillConfig(obs_mode="depth")
    with pytest.raises(ValueError, match="reward"):
        ManiSkillConfig(reward="normalized_dense")
    with pytest.raises(ValueError, match="sim_backend"):
        ManiSkillConfig(sim_backend="tpu")
    with pytest.raises(ValueError, match="max_episode_steps"):
        ManiSkillConfig(max_episode_steps=0)


def test_instructions_default_per_task_and_fall_back_to_the_task_words():
    assert ManiSkillConfig(task="StackCube-v1").task_instruction == INSTRUCTIONS["StackCube"]
    assert ManiSkillConfig(task="PickCube-v1", instruction="grab it").task_instruction == "grab it"
    assert default_instruction("OpenCabinetDrawer-v1") == "open cabinet drawer"
    assert default_instruction("PushT-v1") == INSTRUCTIONS["PushT"]
    assert all(v for v in INSTRUCTIONS.values())


def test_gpu_backend_on_a_cpu_device_is_an_error():
    with pytest.raises(ValueError, match="cuda"):
        make_maniskill_env(ManiSkillConfig(sim_backend="gpu"), 2, device="cpu")


@sim
def test_gpu_env_renders_the_frames_asked_for_videos():
    """ManiSkill renders all GPU envs at once; ``render_frames`` hands out the asked ones (the video recorder of a
    state-observation evaluation uses it), and refuses an index out of range."""
    from vla_rl.envs.maniskill import ManiSkillGPUEnv

    class Rendering:
        def render(self):
            return torch.arange(3, dtype=torch.uint8).reshape(3, 1, 1, 1).expand(3, 4, 6, 3)

    env = ManiSkillGPUEnv.__new__(ManiSkillGPUEnv)   # no simulator: only the frames' bookkeeping is tested
    env.env = Rendering()
    env.spec = type("Spec", (), {"num_envs": 3})()
    frames = env.render_frames([2, 0])
    assert [f.shape for f in frames] == [(4, 6, 3)] * 2 and [int(f[0, 0, 0]) for f in frames] == [2, 0]
    with pytest.raises(IndexError, match="env index 3 out of range for 3 envs"):
        env.render_frames([3])
    env.env = None


def test_missing_physx_gpu_library_gets_an_error_naming_file_and_place(monkeypatch):
    ensure_vulkan()
    import sapien.physx

    def offline():
        raise ConnectionError("github.com unreachable")

    monkeypatch.setattr(sapien.physx, "enable_gpu", offline)
    with pytest.raises(RuntimeError, match="libPhysXGpu_64.so") as err:
        enable_physx_gpu()
    assert sapien.physx.version() in str(err.value) and ".sapien/physx" in str(err.value)
    assert "ConnectionError" in str(err.value)


# ---------------------------------------------------------------------------------------------- setup
@sim
def test_ensure_vulkan_points_at_the_project_lavapipe(monkeypatch):
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    ensure_vulkan()
    assert LAVAPIPE_ICD.is_file(), "run scripts/setup_maniskill.sh"
    assert os.environ["VK_ICD_FILENAMES"] == str(LAVAPIPE_ICD)
    monkeypatch.setenv("VK_ICD_FILENAMES", "/somewhere/else.json")
    ensure_vulkan()
    assert os.environ["VK_ICD_FILENAMES"] == "/somewhere/else.json"  # a user's choice is kept


def test_missing_maniskill_names_the_setup_script(monkeypatch):
    monkeypatch.setitem(sys.modules, "mani_skill.envs", None)  # makes `import mani_skill.envs` fail
    with pytest.raises(RuntimeError, match="setup_maniskill.sh"):
        ensure_vulkan()


@sim
def test_unknown_task_suggests_similar_ids():
    with pytest.raises(ValueError, match=r"unknown ManiSkill task 'PickCub-v1'.*PickCube-v1"):
        ManiSkillSingleEnv(ManiSkillConfig(task="PickCub-v1"))
    with pytest.raises(ValueError, match=r"'PushCube'.*PushCube-v1"):
        ManiSkillSingleEnv(ManiSkillConfig(task="PushCube"))


# ---------------------------------------------------------------------------------------------- single env
@sim
def test_spec_and_shapes_state_obs(pick):
    s = pick.spec
    assert (s.num_envs, s.action_dim, s.state_dim, s.num_cameras) == (1, 7, 42, 0)
    assert (s.action_low, s.action_high, s.max_episode_steps) == (-1.0, 1.0, 50)
    obs = pick.reset(0)
    assert obs["images"].shape == (0, 64, 64, 3) and obs["images"].dtype == np.uint8
    assert obs["state"].shape == (42,) and obs["state"].dtype == np.float32
    assert obs["instruction"] == INSTRUCTIONS["PickCube"]
    obs, r, term, trunc, succ = pick.step(np.zeros(7, np.float32))
    assert obs["state"].shape == (42,) and np.isfinite(obs["state"]).all()
    assert isinstance(r, float) and all(isinstance(x, bool) for x in (term, trunc, succ))


@sim
def test_state_dims_differ_per_task(pick, push_dense):
    assert pick.spec.state_dim == 42
    assert push_dense.spec.state_dim == 35
    assert push_dense.reset(0)["state"].shape == (35,)


@sim
def test_same_seed_same_episode(pick):
    actions = np.random.default_rng(0).uniform(-1, 1, (5, 7)).astype(np.float32)
    obs_a, out_a = _rollout(pick, 7, actions)
    obs_b, out_b = _rollout(pick, 7, actions)
    for a, b in zip(obs_a, obs_b):
        np.testing.assert_array_equal(a["state"], b["state"])
    assert out_a == out_b
    other = pick.reset(8)["state"]
    assert not np.array_equal(other, obs_a[0]["state"])


@sim
def test_unseeded_resets_follow_the_last_seeded_reset_whatever_came_before(pick):
    """The episodes that start inside a rollout (reset(None)) are drawn from the last seeded reset, not from the
    process's torch RNG (seeded at random in each new process, advanced by every earlier reset): a worker
    started fresh for a resumed run draws the episodes the long-running worker drew."""
    pick.reset(5)
    first = [pick.reset(None)["state"].copy() for _ in range(3)]
    pick.reset(11)
    for a in np.random.default_rng(1).uniform(-1, 1, (20, 7)).astype(np.float32):
        pick.step(a)
    for _ in range(4):
        pick.reset(None)
    torch.manual_seed(1234)   # whatever the process's RNG holds
    pick.reset(5)
    again = [pick.reset(None)["state"].copy() for _ in range(3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], first[1])


def _push(env, seed: int, steps: int = 60) -> np.ndarray:
    """States of a scripted push of PushCube's cube towards its goal (the gripper meets the cube ~step 26)."""
    states = [env.reset(seed)["state"]]
    base = env.env.unwrapped
    for t in range(steps):
        tcp, cube = base.agent.tcp.pose.p[0].numpy(), base.obj.pose.p[0].numpy()
        d = base.goal_region.pose.p[0].numpy()[:2] - cube[:2]
        d /= np.linalg.norm(d) + 1e-9
        target = np.r_[cube[:2] + (-0.05 if t < 25 else 0.05) * d, 0.02]
        a = np.zeros(7, np.float32)
        a[:3] = np.clip((target - tcp) * 20, -1, 1)
        a[6] = -1
        states.append(env.step(a)[0]["state"])
    return np.stack(states)


@sim
def test_after_forget_history_an_episode_does_not_depend_on_the_episodes_before():
    """PhysX carries state across episodes: the same seed and actions give another trajectory once the gripper
    touches the cube, depending on what the env did before. forget_history (what the trainer calls where a run
    can resume) rebuilds the scene at the next reset, after which the episode is bit-identical to a new env's."""
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PushCube-v1", max_episode_steps=200))
    try:
        new = _push(env, 7)
        again = _push(env, 7)                      # the same episode right after itself
        assert np.abs(again - new).max() > 1e-3    # the history shows (1.4 cm here)
        np.testing.assert_array_equal(again[:20], new[:20])   # before the contact it does not
        for seed in (3, 11):
            _push(env, seed, steps=40)
        env.forget_history()
        np.testing.assert_array_equal(_push(env, 7), new)
    finally:
        env.close()


def _grasp_the_cube(pick):
    """Put PickCube's cube between the open fingers and close them: the episode ends holding it."""
    base = pick.env.unwrapped
    base.cube.set_pose(base.agent.tcp.pose)
    close = np.zeros(7, np.float32)
    close[-1] = -1
    for _ in range(5):
        pick.step(close)
    assert bool(base.agent.is_grasping(base.cube)[0])   # the premise: the gripper holds the cube


@sim
def test_reset_after_a_grasp_observes_the_new_state_not_the_old_contacts(pick):
    # ManiSkill's reset reads the last step's contacts: without a refresh the next episode began with
    # is_grasped = 1 (state index 18), and a seed's first observation depended on the previous episode.
    fresh = pick.reset(3)["state"].copy()
    assert fresh[18] == 0
    _grasp_the_cube(pick)
    np.testing.assert_array_equal(pick.reset(3)["state"], fresh)
    _grasp_the_cube(pick)
    assert pick.reset(None)["state"][18] == 0   # the worker's reset after an episode ends


@sim
def test_sparse_reward_is_success_and_dense_is_shaped(pick, push_dense):
    pick.reset(0)
    for _ in range(3):
        _, r, _, _, succ = pick.step(np.zeros(7, np.float32))
        assert r == float(succ)
    push_dense.reset(0)
    rewards = [push_dense.step(np.full(7, 0.3, np.float32))[1] for _ in range(3)]
    assert all(0.0 < r <= 1.0 for r in rewards) and len(set(rewards)) == 3


@sim
def test_dense_cost_is_dense_minus_one(push_dense):
    cost = ManiSkillSingleEnv(ManiSkillConfig(task="PushCube-v1", reward="dense_cost", max_episode_steps=5))
    try:
        actions = [np.full(7, v, np.float32) for v in (0.3, -0.2, 0.5)]
        _, dense = _rollout(push_dense, 3, actions)
        _, shifted = _rollout(cost, 3, actions)
    finally:
        cost.close()
    for d, c in zip(dense, shifted):
        assert c[0] == pytest.approx(d[0] - 1.0, abs=1e-6) and c[0] <= 0.0
        assert c[1:] == d[1:]


@sim
def test_truncation_at_max_episode_steps(push_dense):
    push_dense.reset(1)
    flags = [push_dense.step(np.zeros(7, np.float32))[2:4] for _ in range(5)]
    assert flags == [(False, False)] * 4 + [(False, True)]
    push_dense.reset(1)  # a reset starts the count again
    assert push_dense.step(np.zeros(7, np.float32))[3] is False


@sim
def test_bad_actions_are_errors(pick):
    pick.reset(0)
    with pytest.raises(ValueError, match="shape"):
        pick.step(np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="shape"):
        pick.step(np.zeros((1, 7), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        pick.step(np.full(7, np.nan, np.float32))
    with pytest.raises(ValueError, match="out of range"):
        pick.step(np.full(7, 2.0, np.float32))


@sim
def test_rgb_obs_images_and_proprio_state():
    env = ManiSkillSingleEnv(ManiSkillConfig(task="PickCube-v1", obs_mode="rgb", image_size=64))
    try:
        assert (env.spec.num_cameras, env.spec.image_size) == (1, 64)
        assert env.spec.state_dim == 29  # qpos 9 + qvel 9 + goal_pos 3 + is_grasped 1 + tcp_pose 7
        obs = env.reset(0)
        assert obs["images"].shape == (1, 64, 64, 3) and obs["images"].dtype == np.uint8
        assert obs["images"].std() > 5  # a rendered scene, not a blank frame
        assert obs["state"].shape == (29,) and obs["state"].dtype == np.float32
        obs2, *_ = env.step(np.zeros(7, np.float32))
        assert obs2["images"].shape == (1, 64, 64, 3)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------- slow
@sim
@pytest.mark.slow
def test_rgb_state_mode_and_render_frame():
    env = ManiSkillSingleEnv(ManiSkillConfig(task="StackCube-v1", obs_mode="rgb+state", image_size=32,
                                             render_size=96))
    try:
        assert env.cameras == ["base_camera", "hand_camera"]  # StackCube has a wrist camera too
        obs = env.reset(3)
        assert obs["images"].shape == (2, 32, 32, 3)
        assert obs["state"].shape == (env.spec.state_dim,) and env.spec.state_dim > 29
        again = env.reset(3)
        np.testing.assert_array_equal(obs["images"], again["images"])
        frame = env.render_frame()
        assert frame.shape == (96, 96, 3) and frame.dtype == np.uint8
    finally:
        env.close()


@sim
# The state-mode pool runs in the default suite, so CI checks the contract on real ManiSkill workers.
@pytest.mark.parametrize("obs_mode", ["state", pytest.param("rgb", marks=pytest.mark.slow)])
def test_worker_pool_passes_the_contract(obs_mode):
    cfg = ManiSkillConfig(task="PushCube-v1", obs_mode=obs_mode, image_size=32, max_episode_steps=6)
    env = make_maniskill_env(cfg, 2, seed=0)
    try:
        check_env_contract(env, horizon=4)
        assert env.spec.num_envs == 2
        obs = env.reset(seed=0)
        assert not torch.equal(obs["state"][0], obs["state"][1])  # env i gets seed + i
        local = ManiSkillSingleEnv(cfg)
        np.testing.assert_array_equal(obs["state"][1].numpy(), local.reset(1)["state"])
        local.close()
    finally:
        env.close()


@sim
def test_several_envs_per_worker_run_as_if_alone():
    """Three PushCube envs on two workers (2 + 1) give the observations and rewards of three separate
    in-process envs with the same seeds: envs sharing a process share no simulator state. (Within one
    episode: after an episode ends ManiSkill's seedless reset draws from an unseeded source, grouped or not.)"""
    cfg = ManiSkillConfig(task="PushCube-v1", reward="dense", max_episode_steps=50)
    env = make_maniskill_env(cfg, 3, seed=0, envs_per_worker=2)
    local = [ManiSkillSingleEnv(cfg) for _ in range(3)]
    try:
        assert env.num_workers == 2
        obs = env.reset(seed=4)
        want = [e.reset(4 + i)["state"] for i, e in enumerate(local)]
        np.testing.assert_array_equal(obs["state"].numpy(), np.stack(want))
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            chunk = torch.rand(3, 4, env.spec.action_dim, generator=gen) * 2 - 1
            out = env.step(chunk)
            for i, e in enumerate(local):
                for h in range(4):
                    o, r, *_ = e.step(chunk[i, h].numpy())
                    assert out.rewards[i, h].item() == pytest.approx(r, abs=1e-6)
                np.testing.assert_array_equal(out.obs["state"][i].numpy(), o["state"])
    finally:
        env.close()
        for e in local:
            e.close()


@sim
@pytest.mark.slow
@pytest.mark.parametrize("task", ["StackCube-v1", "PullCube-v1", "LiftPegUpright-v1", "PegInsertionSide-v1",
                                  "PlaceSphere-v1", "PokeCube-v1", "PullCubeTool-v1", "PushT-v1",
                                  "RollBall-v1", "PlugCharger-v1"])
def test_other_tasks_create_and_step(task):
    env = ManiSkillSingleEnv(ManiSkillConfig(task=task))
    try:
        obs = env.reset(0)
        assert obs["state"].shape == (env.spec.state_dim,)
        assert obs["instruction"] == INSTRUCTIONS[task.split("-")[0]]
        a = np.zeros(env.spec.action_dim, np.float32)
        assert np.isfinite(env.step(a)[0]["state"]).all()
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------- gpu
@pytest.mark.gpu
@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
def test_gpu_env_passes_the_contract(obs_mode):
    cfg = ManiSkillConfig(task="PickCube-v1", obs_mode=obs_mode, max_episode_steps=6)
    env = make_maniskill_env(cfg, 8, device="cuda", seed=0)
    try:
        assert type(env).__name__ == "ManiSkillGPUEnv"
        check_env_contract(env, horizon=4)
        obs = env.reset(seed=0)
        assert obs["state"].device.type == "cuda" and obs["images"].device.type == "cuda"
    finally:
        env.close()


@pytest.mark.gpu
def test_gpu_reset_after_a_grasp_observes_the_new_state_not_the_old_contacts():
    cfg = ManiSkillConfig(task="PickCube-v1")
    env = make_maniskill_env(cfg, 2, device="cuda", seed=0)
    try:
        fresh = env.reset(seed=3)["state"].clone()
        assert (fresh[:, 18] == 0).all()
        base = env.env.unwrapped
        base.cube.set_pose(base.agent.tcp.pose)
        close = torch.zeros(2, 5, 7, device="cuda")
        close[..., -1] = -1
        env.step(close)
        assert bool(base.agent.is_grasping(base.cube).all())
        torch.testing.assert_close(env.reset(seed=3)["state"], fresh)
    finally:
        env.close()


@pytest.mark.gpu
def test_gpu_env_partial_reset_keeps_the_others():
    cfg = ManiSkillConfig(task="PickCube-v1", max_episode_steps=3)
    env = make_maniskill_env(cfg, 4, device="cuda", seed=0)
    try:
        env.reset(seed=0)
        env.step(torch.zeros(4, 2, 7, device="cuda"))
        # two more steps end every episode at step 3: one action executed, the rest ignored
        out = env.step(torch.zeros(4, 4, 7, device="cuda"))
        assert out.truncated.all() and (out.steps == 1).all()
        assert (out.rewards[:, 1:] == 0).all()
        assert (out.episodes["length"] == 3).all()
    finally:
        env.close()


@pytest.mark.gpu
def test_gpu_env_renders_ended_episodes_asked_for_before_their_reset():
    cfg = ManiSkillConfig(task="PickCube-v1", obs_mode="state", max_episode_steps=3, render_size=64)
    env = make_maniskill_env(cfg, 4, device="cuda", seed=0)
    try:
        env.reset(seed=0)
        env.set_final_frames([2, 0])
        env.step(torch.zeros(4, 2, 7, device="cuda"))
        out = env.step(torch.zeros(4, 4, 7, device="cuda"))   # every episode ends at step 3
        assert out.done.all() and sorted(out.final_frames) == [0, 2]
        assert all(f.shape == (64, 64, 3) and f.dtype == np.uint8 for f in out.final_frames.values())
        env.set_final_frames([])
        env.step(torch.zeros(4, 2, 7, device="cuda"))
        assert env.step(torch.zeros(4, 4, 7, device="cuda")).final_frames is None
        with pytest.raises(IndexError, match="env index 4 out of range"):
            env.set_final_frames([4])
    finally:
        env.close()


@sim
@pytest.mark.slow
def test_eval_gives_the_same_episodes_with_10_or_40_envs(tmp_path):
    """`vla-rl eval` names every episode by its seed on ManiSkill3 too: 40 PushCube episodes on 10 envs (four rounds,
    so most episodes run in an env that played others before) and on 40 envs give the same per-episode results."""
    import json

    from vla_rl.checkpoint import save_policy
    from vla_rl.cli import main
    from vla_rl.policies.model import FlowPolicy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    probe = ManiSkillSingleEnv(ManiSkillConfig(task="PushCube-v1"))
    state_dim, action_dim = probe.spec.state_dim, probe.spec.action_dim
    probe.close()
    torch.manual_seed(0)
    cfg = policy_preset("tiny", {"depth": 1, "vision": {"depth": 1}, "num_cameras": 0, "state_dim": 64,
                                 "action_dim": 8})
    policy = save_policy(tmp_path / "policy", FlowPolicy(cfg), NormStats(Stats.identity(state_dim),
                                                                        Stats.identity(action_dim)))
    runs = {}
    for n in (10, 40):
        out = tmp_path / f"n{n}.json"
        assert main(["eval", str(policy), "episodes=40", f"num_envs={n}", "method=sde", "env.kind=maniskill",
                     "env.maniskill.task=PushCube-v1", "env.maniskill.reward=dense", "threads=1", f"out={out}",
                     "progress=false"]) == 0
        runs[n] = {e["episode_seed"]: e for e in json.loads(out.read_text())["episodes"]}
    assert sorted(runs[10]) == sorted(runs[40]) == list(range(10_000, 10_040))
    for s, a in runs[10].items():
        b = runs[40][s]
        assert (a["success_once"], a["length"]) == (b["success_once"], b["length"]), s
        assert a["return"] == pytest.approx(b["return"], abs=1e-4), s
    assert len({round(e["return"], 4) for e in runs[40].values()}) > 30   # the episodes differ from each other
