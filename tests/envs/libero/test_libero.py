"""LIBERO adapter: real libero_spatial envs (one task, one or two init states).

LIBERO is part of the test install (``make test`` runs ``scripts/setup_libero.sh``), so a missing
LIBERO is a failure, not a skip, unless ``VLA_RL_SKIP_SIMULATORS=1``. Creating an env takes 5-15 s
and a camera step ~0.5 s on a CPU, so the default suite keeps one module-scoped env and few steps.
"""

import math

import numpy as np
import pytest
from helpers import SKIP_SIMULATORS as SKIP

from vla_rl.envs.libero.robosuite_env import (
    SUITE_MAX_STEPS,
    LiberoConfig,
    LiberoNotInstalled,
    LiberoSingleEnv,
    _libero,
    episode_of,
    quat_to_axis_angle,
)

needs_libero = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")
INSTRUCTION = "pick up the black bowl between the plate and the ramekin and place it on the plate"


# ---------------------------------------------------------------------------------------------- pure
def test_quat_to_axis_angle_known_answers():
    assert np.array_equal(quat_to_axis_angle([0, 0, 0, 1]), np.zeros(3))
    axis, angle = np.array([1.0, 2.0, -2.0]) / 3.0, 0.7
    q = np.r_[axis * math.sin(angle / 2), math.cos(angle / 2)]
    np.testing.assert_allclose(quat_to_axis_angle(q), axis * angle, atol=1e-12)
    # LIBERO's gripper pointing down is about (1, 0, 0, 0): a half turn about x.
    np.testing.assert_allclose(quat_to_axis_angle([1, 0, 0, 0]), [math.pi, 0, 0], atol=1e-12)
    # Like openpi's: no sign canonicalisation (w < 0 gives an angle above pi), w clipped to [-1, 1].
    np.testing.assert_allclose(quat_to_axis_angle(-q), -axis * (2 * math.pi - angle), atol=1e-12)
    assert np.array_equal(quat_to_axis_angle([0, 0, 0, 1.0000001]), np.zeros(3))


def test_config_defaults_and_validation():
    cfg = LiberoConfig()
    assert cfg.episode_steps == 220 and cfg.cameras == ("agentview", "wrist")
    assert [LiberoConfig(suite=s).episode_steps for s in SUITE_MAX_STEPS] == [220, 280, 300, 520, 400]
    assert LiberoConfig(max_episode_steps=7).episode_steps == 7
    for bad in ({"suite": "libero_100"}, {"cameras": ("front",)}, {"cameras": ("wrist", "wrist")},
                {"image_size": 0}, {"max_episode_steps": 0}, {"task_ids": []}, {"init_state_ids": [-1]}):
        with pytest.raises(ValueError):
            LiberoConfig(**bad)


def test_missing_config_names_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path))
    with pytest.raises(LiberoNotInstalled, match="setup_libero.sh"):
        _libero()


# ---------------------------------------------------------------------------------------------- real
@pytest.fixture(scope="module")
def env():
    if SKIP:
        pytest.skip("VLA_RL_SKIP_SIMULATORS=1")
    # No try/except: without LIBERO this fails with the setup hint (CI installs it).
    e = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], init_state_ids=[0],
                                     max_episode_steps=3))
    yield e
    e.close()


@needs_libero
def test_libero_is_installed_and_importable():
    benchmark, _, _ = _libero()
    assert benchmark.get_benchmark_dict()["libero_spatial"]().get_num_tasks() == 10


@needs_libero
def test_single_env_contract(env):
    spec = env.spec
    assert (spec.num_envs, spec.action_dim, spec.state_dim, spec.num_cameras, spec.image_size) == (1, 7, 8, 2, 128)
    assert (spec.action_low, spec.action_high, spec.max_episode_steps) == (-1.0, 1.0, 3)
    assert not spec.images_rot180   # upright images: videos show them as they are
    turned = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], image_orientation="rot180"))
    assert turned.spec.images_rot180   # openpi's orientation: videos turn the frames back
    turned.close()
    obs = env.reset(seed=0)
    assert (env.task_id, env.init_state_id) == (0, 0)
    assert obs["images"].dtype == np.uint8 and obs["images"].shape == (2, 128, 128, 3)
    assert obs["state"].dtype == np.float32 and obs["state"].shape == (8,)
    assert obs["instruction"] == INSTRUCTION
    # Settled, gripper open and pointing down: axis-angle about x near pi, fingers ~4 cm apart.
    assert abs(abs(obs["state"][3]) - math.pi) < 0.3
    assert obs["state"][6] > 0.03 and obs["state"][7] < -0.03
    # Upright: our image is the raw MuJoCo render (row 0 = bottom) with its rows flipped. Not bit-equal:
    # robosuite captures the camera at a physics sub-step slightly before the step's end.
    raw = env._env.sim.render(width=128, height=128, camera_name="agentview").astype(int)
    img = obs["images"][0].astype(int)
    assert np.abs(img - raw[::-1]).mean() < 0.5
    assert np.abs(img - raw).mean() > 10 and np.abs(img - raw[::-1, ::-1]).mean() > 10
    frame = env.render_frame()
    assert frame.dtype == np.uint8 and frame.shape == (128, 256, 3)
    # Steps: sparse reward, no success with a still arm, truncation after max_episode_steps.
    before = obs["state"].copy()
    for t in range(3):
        obs, reward, terminated, truncated, success = env.step(np.array([0, 0, 0.5, 0, 0, 0, -1.0]))
        assert (reward, terminated, success) == (0.0, False, False) and truncated == (t == 2)
    assert obs["state"][2] > before[2] + 0.005          # +z action lifts the end effector
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(7))
    obs = env.reset(seed=1)                             # the same episode again (one task, one state)
    for bad, match in ((np.zeros(6), "shape"), (np.full(7, np.nan), "NaN"), (np.full(7, 1.5), "out of range")):
        with pytest.raises(ValueError, match=match):
            env.step(bad)


@needs_libero
def test_soft_reset_repeats_an_episode_exactly(env):
    # A reused (soft-reset) env must give the same episode as the one before: images and state.
    def episode():
        obs = [env.reset_to(0, 0)]
        obs += [env.step(np.array([0.3, -0.2, 0.1, 0, 0, 0.2, 1.0]))[0] for _ in range(2)]
        return obs
    first, again = episode(), episode()
    for a, b in zip(first, again):
        assert np.array_equal(a["images"], b["images"]) and np.array_equal(a["state"], b["state"])


def test_indexed_episodes_are_task_major_and_wrap():
    assert [episode_of(k, [3, 5], [0, 1, 2]) for k in range(7)] == [(3, 0), (3, 1), (3, 2), (5, 0), (5, 1), (5, 2),
                                                                     (3, 0)]


@needs_libero
def test_indexed_reset_plays_the_numbered_episode(env):
    cfg = LiberoConfig(suite="libero_spatial", task_ids=[0], init_state_ids=[0, 1, 2], episode_order="indexed",
                       max_episode_steps=3, cameras=(), max_cached_envs=1)
    indexed = LiberoSingleEnv(cfg)
    try:
        a = indexed.reset(seed=2)
        assert (indexed.task_id, indexed.init_state_id) == (0, 2)
        b = env.reset_to(0, 2)
        assert np.array_equal(a["state"], b["state"])     # the camera env and the state-only one agree
        # State-only: no render context until a frame is asked for (it costs ~0.5 GB per env); then the same
        # agentview image as the camera env's.
        assert indexed._env.sim._render_context_offscreen is None
        frame = indexed.render_frame()
        assert frame.shape == (128, 128, 3) and np.abs(frame.astype(int) - b["images"][0].astype(int)).mean() < 0.5
        indexed.reset()                    # None: the next episode, wrapping to the first
        assert (indexed.task_id, indexed.init_state_id) == (0, 0)
    finally:
        indexed.close()
    # Closing that env freed the GL context current in this process; the camera env still draws its own scene
    # (robosuite renders into whatever context is current: garbage, ~100 grey levels off, unless the adapter
    # makes its own current).
    assert np.array_equal(env.reset_to(0, 2)["images"], b["images"])


@needs_libero
def test_reflections_off_draws_the_same_scene_without_mirror_images(env):
    import mujoco

    flat = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], max_episode_steps=3, reflections=False))
    try:
        a, b = env.reset_to(0, 0), flat.reset_to(0, 0)
        flag = mujoco.mjtRndFlag.mjRND_REFLECTION
        assert env._env.sim._render_context_offscreen.scn.flags[flag] == 1
        assert flat._env.sim._render_context_offscreen.scn.flags[flag] == 0
        assert np.array_equal(a["state"], b["state"])        # rendering only: the physics is the same
        # The same scene (a few grey levels apart on average), and not bit-equal: the table's mirror image is gone.
        diff = np.abs(a["images"].astype(int) - b["images"].astype(int))
        assert 0 < diff.mean() < 5
        assert flat.render_frame().shape == (128, 256, 3)
    finally:
        flat.close()


@pytest.mark.slow
@needs_libero
def test_soft_reset_equals_hard_reset(env):
    # The reused env (after other episodes) against a freshly built one that rebuilds its model on reset.
    action = np.array([0.2, 0.3, -0.1, 0.1, 0, 0, 1.0])
    env.reset_to(0, 1)
    env.step(action)
    hard = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], soft_reset=False))
    try:
        for e in (env, hard):
            e.reset_to(0, 2)
        for _ in range(3):
            a, b = env.step(action)[0], hard.step(action)[0]
            assert np.array_equal(a["images"], b["images"]) and np.array_equal(a["state"], b["state"])
    finally:
        hard.close()


@pytest.mark.slow
@needs_libero
@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_worker_pool_of_libero_envs_passes_the_contract(envs_per_worker):
    import functools

    from contract import check_env_contract

    from vla_rl.envs.workers import WorkerVectorEnv

    cfg = LiberoConfig(task_ids=[0], init_state_ids=[0, 1, 2], max_episode_steps=4, image_size=64)
    pool = WorkerVectorEnv(functools.partial(LiberoSingleEnv, cfg), 2, name="libero",
                           envs_per_worker=envs_per_worker)
    try:
        assert pool.num_workers == 2 // envs_per_worker
        check_env_contract(pool, horizon=3)
        obs = pool.reset(seed=3)
        assert obs["images"].shape == (2, 2, 64, 64, 3) and obs["state"].shape == (2, 8)
        assert obs["instruction"] == [INSTRUCTION] * 2
        assert pool.render_frames()[0].shape == (64, 128, 3)
    finally:
        pool.close()
