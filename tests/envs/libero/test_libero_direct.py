"""The LIBERO adapter's three ways to step an action, which must give the same trajectories bit for bit: robosuite's
own loop (``direct_step=False, fast_substeps=False``), its substeps split (envs/libero/substeps.py,
``direct_step=False``) and the direct step (envs/libero/direct.py, the default).

The default suite plays a whole expert episode from a sampled placement (its settling steps, grasp contacts) all
three ways, random actions from an official init state with a drawer twice in a row (a reset makes a new
controller; an episode's first goal comes from the pose before the init state was loaded), and a short episode
with both cameras (images sampled on robosuite's observation clock). The slow test runs random actions and the
expert's whole episode on every task of the four suites. Each compares every observation (and reward and success
flag where it plays random actions) and the final MuJoCo state exactly.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import SKIP_SIMULATORS as SKIP

needs_libero = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
WAYS = {"robosuite": dict(direct_step=False, fast_substeps=False), "split": dict(direct_step=False),
        "direct": dict(direct_step=True)}


def final_state(env) -> np.ndarray:
    data = env.sim_env.sim.data
    return np.concatenate([data.qpos, data.qvel, data.qacc_warmstart, data.ctrl])


def random_episodes(suite: str, task: int, way: str, *, steps: int, episodes: int = 1, cameras=(),
                    init_state: int = 0) -> list:
    """(observations, rewards, successes, final state) of ``episodes`` runs of the same random actions."""
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=[task], cameras=cameras, image_size=32,
                                       max_cached_envs=1, max_episode_steps=steps + 1, **WAYS[way]))
    actions = np.random.default_rng(task).uniform(-1.0, 1.0, (steps, 7))
    out = []
    try:
        for _ in range(episodes):
            obs = [env.reset_to(task, init_state)]
            rewards, successes = [], []
            for a in actions:
                o, r, success, _, _ = env.step(a)
                obs.append(o)
                rewards.append(r)
                successes.append(success)
            out.append((obs, rewards, successes, final_state(env)))
    finally:
        env.close()
    return out


def assert_same(a, b) -> None:
    (obs_a, rew_a, succ_a, end_a), (obs_b, rew_b, succ_b, end_b) = a, b
    assert len(obs_a) == len(obs_b)
    for t, (x, y) in enumerate(zip(obs_a, obs_b)):
        assert np.array_equal(x["state"], y["state"]), f"state differs at step {t}"
        assert np.array_equal(x["images"], y["images"]), f"images differ at step {t}"
    assert rew_a == rew_b and succ_a == succ_b
    assert np.array_equal(end_a, end_b)


@needs_libero
def test_three_ways_play_an_expert_episode_bit_for_bit():
    from vla_rl.data.libero_demos import run_expert_episode
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    def episode(way):
        env = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], cameras=(), max_cached_envs=1,
                                           state_mode="robot+objects", init_states="sampled", **WAYS[way]))
        try:
            frames, success, _ = run_expert_episode(env, 0, 3, seed=3)
            return frames, success, final_state(env)
        finally:
            env.close()

    (loop, ok_loop, end_loop), (split, ok_split, end_split), (direct, ok_direct, end_direct) = (
        episode(w) for w in WAYS)
    assert ok_loop and ok_split and ok_direct and len(loop) == len(split) == len(direct)
    for (o1, a1), (o2, a2), (o3, a3) in zip(loop, split, direct):
        assert np.array_equal(o1["state"], o2["state"]) and np.array_equal(o1["state"], o3["state"])
        assert np.array_equal(a1, a2) and np.array_equal(a1, a3)
    assert np.array_equal(end_loop, end_split) and np.array_equal(end_loop, end_direct)


@needs_libero
def test_direct_step_equals_robosuite_over_repeated_episodes_with_a_drawer():
    # LIBERO-Goal task 0 ("open the middle drawer of the cabinet"): two episodes in a row from one env, so the
    # second runs on the controller robosuite made at the reset; random actions at full scale hit the cabinet.
    loop = random_episodes("libero_goal", 0, "robosuite", steps=40, episodes=2)
    direct = random_episodes("libero_goal", 0, "direct", steps=40, episodes=2)
    for a, b in zip(loop, direct):
        assert_same(a, b)
    assert np.array_equal(direct[0][0][5]["state"], direct[1][0][5]["state"])   # and the episodes repeat


@needs_libero
def test_direct_step_images_follow_robosuites_observation_clock():
    loop = random_episodes("libero_object", 1, "robosuite", steps=6, cameras=("agentview", "wrist"))
    direct = random_episodes("libero_object", 1, "direct", steps=6, cameras=("agentview", "wrist"))
    assert direct[0][0][-1]["images"].shape == (2, 32, 32, 3)
    assert_same(loop[0], direct[0])


def test_direct_step_refuses_what_it_does_not_reproduce():
    import mujoco

    from vla_rl.envs.libero.direct import DirectStepUnsupported, _refuse_unsupported

    osc = type("OperationalSpaceController", (SimpleNamespace,), {})   # robosuite's OSC, by name
    ctrl = osc(impedance_mode="fixed", interpolator_pos=object(), interpolator_ori=None, position_limits=None,
               orientation_limits=None, use_delta=True, use_ori=True)
    model = SimpleNamespace(opt=SimpleNamespace(integrator=mujoco.mjtIntegrator.mjINT_RK4))
    robot = SimpleNamespace(has_gripper=True, gripper=type("PandaGripper", (), {})())
    inner = SimpleNamespace(robots=[robot], sim=SimpleNamespace(model=SimpleNamespace(_model=model)))
    with pytest.raises(DirectStepUnsupported, match="interpolator.*RK4.*direct_step=false"):
        _refuse_unsupported(inner, robot, ctrl, mujoco)
    other = SimpleNamespace(has_gripper=True, gripper=type("Robotiq85Gripper", (), {})())
    with pytest.raises(DirectStepUnsupported, match="gripper Robotiq85Gripper"):
        _refuse_unsupported(SimpleNamespace(robots=[other], sim=inner.sim), other, ctrl, mujoco)


def expert_episode(suite: str, task: int, way: str):
    """(frames, success, final state) of the expert's episode from fixed init state 0 (frames empty: no plan)."""
    from vla_rl.data.libero_demos import run_expert_episode
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=[task], cameras=(), max_cached_envs=1,
                                       state_mode="robot+objects", **WAYS[way]))
    try:
        frames, success, _ = run_expert_episode(env, task, 0, seed=0)
        return frames, success, final_state(env)
    finally:
        env.close()


@pytest.mark.slow
@needs_libero
@pytest.mark.parametrize("suite", ["libero_spatial", "libero_object", "libero_goal", "libero_10"])
def test_direct_step_equals_robosuite_on_every_task(suite):
    """Every task of the suite: 60 random actions, and the expert's whole episode from init state 0 (where it has a
    plan), both ways, equal throughout."""
    for task in range(10):
        assert_same(random_episodes(suite, task, "robosuite", steps=60)[0],
                    random_episodes(suite, task, "direct", steps=60)[0])
        (loop, ok_loop, end_loop), (direct, ok_direct, end_direct) = (expert_episode(suite, task, w)
                                                                      for w in ("robosuite", "direct"))
        assert ok_loop == ok_direct and len(loop) == len(direct), (suite, task)
        for (o1, a1), (o2, a2) in zip(loop, direct):
            assert np.array_equal(o1["state"], o2["state"]) and np.array_equal(a1, a2), (suite, task)
        assert np.array_equal(end_loop, end_direct), (suite, task)
