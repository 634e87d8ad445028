"""The LIBERO scripted expert (envs/libero/expert.py), its shaped reward (envs/libero/reward.py) and the adapter's
expert-facing settings (objects in the state, sampled placements).

The pure parts are tested on hand-made scenes against known answers. The simulator tests need LIBERO like
tests/envs/libero/test_libero.py: the default suite runs one whole expert episode of a LIBERO-Object and a
LIBERO-Spatial task from an official init state (state only, ~80-130 steps each); the slow test runs the expert on
every task of both suites.
"""

import math

import numpy as np
import pytest
from helpers import SKIP_SIMULATORS as SKIP

from vla_rl.envs.libero.expert import (
    Body,
    LiberoExpert,
    PickPlace,
    Push,
    Scene,
    Site,
    UnsupportedGoal,
    closing_yaw,
    corridor_top,
    down_orientation,
    grasp_pose,
    nearest_yaw,
    place_xy,
    plan_goal,
    pose_action,
    rot_z,
    rotation_log,
)
from vla_rl.envs.libero.reward import box_distance, held, placed, progress

needs_libero = pytest.mark.skipif(SKIP, reason="VLA_RL_SKIP_SIMULATORS=1")


def box(center, half, mat=None):
    center, half = np.asarray(center, float), np.asarray(half, float)
    mat = np.eye(3) if mat is None else mat
    ext = np.abs(mat) @ half
    return Body(pos=center.copy(), mat=mat, lo=center - ext, hi=center + ext, local_half=half)


def scene(eef=(0.0, 0.0, 0.3), opening=0.08, **bodies):
    return Scene(eef_pos=np.asarray(eef, float), eef_mat=down_orientation(0.0),
                 gripper_qpos=np.array([opening / 2, -opening / 2]), bodies=bodies,
                 sites={"bin_region": Site(pos=np.array([0.3, 0.0, 0.05]), mat=np.eye(3),
                                           size=np.array([0.05, 0.05, 0.05]), parent="bin")})


# ---------------------------------------------------------------------------------------------- rotations
def test_rotation_log_known_answers():
    assert np.allclose(rotation_log(np.eye(3)), 0)
    axis = np.array([1.0, -2.0, 2.0]) / 3.0
    for angle in (0.3, 2.0, math.pi - 1e-6, math.pi):
        k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
        r = np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k   # Rodrigues
        w = rotation_log(r)
        assert math.isclose(np.linalg.norm(w), angle, abs_tol=1e-6)
        # at exactly a half turn, axis and -axis are the same rotation
        assert np.allclose(w / angle, axis, atol=1e-5) or (angle == math.pi and np.allclose(-w / angle, axis))
    assert np.allclose(rotation_log(rot_z(0.7)), [0, 0, 0.7])


def test_down_orientation_points_down_and_closes_along_yaw():
    for yaw in (0.0, 1.0, -2.5):
        r = down_orientation(yaw)
        assert np.allclose(r.T @ r, np.eye(3)) and math.isclose(np.linalg.det(r), 1.0)
        assert np.allclose(r[:, 2], [0, 0, -1]) and math.isclose(closing_yaw(r), yaw)
    # LIBERO's Panda at rest: grip-site x along world y, y along world x, z down (read from the simulator)
    assert np.allclose(down_orientation(math.pi / 2), [[0, 1, 0], [1, 0, 0], [0, 0, -1]], atol=1e-12)
    assert math.isclose(nearest_yaw(0.1 + math.pi, 0.0), 0.1) and math.isclose(nearest_yaw(-3.0, 0.0), math.pi - 3.0)


def test_pose_action_scales_clips_and_rotates_in_the_world_frame():
    a = pose_action(np.zeros(3), np.eye(3), [0.01, -0.5, 0.0], rot_z(0.1), 1.0, gain=2.0, max_pos=0.8)
    assert np.allclose(a[:3], [0.4, -0.8, 0.0])          # 2 x 0.01 / 0.05; the other axis clipped alone
    assert np.allclose(a[3:6], [0, 0, 0.2]) and a[6] == 1.0   # 0.1 rad / 0.5 rad per unit
    # The controller applies R(delta) @ R: the action's rotation is the world-frame error.
    cur = rot_z(0.3) @ down_orientation(0.0)
    a = pose_action(np.zeros(3), cur, np.zeros(3), down_orientation(0.0), -1.0)
    assert np.allclose(a[3:6], [0, 0, -0.6])


# ---------------------------------------------------------------------------------------------- planning
def test_plan_goal_maps_predicates_and_refuses_the_rest():
    s = scene(can=box([0, 0, 0.03], [0.03, 0.03, 0.03]), plate=box([0.2, 0, 0.01], [0.08, 0.08, 0.01]))
    assert plan_goal([["on", "can", "plate"], ["In", "can", "bin_region"]], s) == [
        PickPlace("can", "plate", "on"), PickPlace("can", "bin_region", "in")]
    # a plate (flat, wider than the gripper opens) is pushed, not picked
    assert plan_goal([["on", "plate", "bin_region"]], s) == [Push("plate", "bin_region", "on")]
    for bad, match in (([["open", "cabinet_region"]], "no primitive"), ([["on", "cup", "plate"]], "cup is not"),
                       ([["on", "can", "shelf"]], "unknown target")):
        with pytest.raises(UnsupportedGoal, match=match):
            plan_goal(bad, s)


def test_objects_sharing_a_region_are_set_down_apart():
    """Two pick-and-places into one region get slots (0, 2) and (1, 2): places 40 % of the region's half-sizes
    from its centre along its diagonal, so the second does not land on the first; a single one goes to the centre."""
    s = scene(can=box([0, 0, 0.03], [0.03, 0.03, 0.03]), cup=box([0.1, 0, 0.03], [0.03, 0.03, 0.03]))
    plan = plan_goal([["in", "can", "bin_region"], ["in", "cup", "bin_region"]], s)
    assert plan == [PickPlace("can", "bin_region", "in", (0, 2)), PickPlace("cup", "bin_region", "in", (1, 2))]
    first, _ = place_xy(s, "bin_region", "in", s.bodies["can"], (0, 2))
    second, floor = place_xy(s, "bin_region", "in", s.bodies["cup"], (1, 2))
    assert np.allclose(first, [0.28, -0.02]) and np.allclose(second, [0.32, 0.02]) and math.isclose(floor, 0.0)
    assert np.allclose(place_xy(s, "bin_region", "in", s.bodies["can"])[0], [0.3, 0.0])


def test_moka_pots_are_grasped_by_their_handle():
    # LIBERO's pot turned half a turn about z (as in LIBERO-10): its handle (body +y) points to world -y.
    pot = box([0.1, 0.2, 0.97], [0.041, 0.074, 0.076], rot_z(math.pi))
    pos, yaw = grasp_pose(pot, np.array([0.0, 0.0, 1.2]), 0.0, scene(moka_pot_1=pot), "moka_pot_1")
    assert np.allclose(pos, [0.1, 0.2 - 0.072, 0.97 + 0.045]) and math.isclose(abs(math.cos(yaw)), 1.0)


def test_drawer_slide_pose_keeps_the_side_of_the_current_closing_axis():
    """The closed fingers are symmetric under a half turn about their axis: of the two slide poses the expert
    takes the one whose closing axis is on the side of the current one (the other was a half turn of a wrist near
    its limit)."""
    expert = LiberoExpert([])
    c = np.array([0.0, 1.0, 0.0])
    for yaw in (0.1, math.pi - 0.1):
        mat = expert._slide_pose(c, down_orientation(yaw))
        assert np.allclose(mat.T @ mat, np.eye(3)) and math.isclose(np.linalg.det(mat), 1.0)
        assert float(mat[:, 0] @ down_orientation(yaw)[:, 0]) > 0.9
        assert mat[1, 2] > 0.0 and mat[2, 2] < 0.0          # fingers along the slide, pitched down


def test_grasp_pose_narrow_objects_across_their_narrow_side():
    # A box 8 x 4 x 2 cm turned 90 degrees: close along world x (its narrow side), 1 cm above its bottom.
    b = box([0.1, 0.2, 0.01], [0.04, 0.02, 0.01], rot_z(math.pi / 2))
    pos, yaw = grasp_pose(b, np.array([0, 0, 0.3]), 0.0)
    assert np.allclose(pos, [0.1, 0.2, 0.01]) and math.isclose(math.cos(yaw) ** 2, 1.0, abs_tol=1e-9)
    # A can 6 cm wide, 12 cm tall: 3 cm below its top.
    pos, _ = grasp_pose(box([0, 0, 0.06], [0.03, 0.03, 0.06]), np.array([0, 0, 0.3]), 0.0)
    assert np.allclose(pos, [0, 0, 0.09])


def test_grasp_pose_wide_objects_by_the_free_rim():
    bowl = box([0.0, 0.0, 0.025], [0.055, 0.055, 0.025])
    pos, yaw = grasp_pose(bowl, np.array([-0.3, 0.0, 0.3]), 0.0)
    assert np.allclose(pos, [-0.04, 0.0, 0.03]) and math.isclose(math.cos(yaw) ** 2, 1.0)   # rim facing the eef
    # A wall on that side: the fingers go to another side of the rim, one without collisions.
    s = Scene(eef_pos=np.array([-0.3, 0, 0.3]), eef_mat=down_orientation(0), gripper_qpos=np.zeros(2),
              bodies={"bowl": bowl}, geom_lo=np.array([[-0.2, -0.3, 0.0]]), geom_hi=np.array([[-0.06, 0.3, 0.3]]),
              geom_owner=("wall",))
    pos, _ = grasp_pose(bowl, s.eef_pos, 0.0, s, "bowl")
    assert pos[0] > -0.03 and math.isclose(np.linalg.norm(pos[:2]), 0.04)


def test_corridor_top_sees_what_lies_on_the_way():
    s = scene(low=box([0.1, 0, 0.02], [0.02, 0.02, 0.02]), high=box([0.1, 0.3, 0.1], [0.02, 0.02, 0.1]))
    assert math.isclose(corridor_top(s, np.zeros(3), np.array([0.2, 0, 0]), 0.01, set()), 0.04)
    assert corridor_top(s, np.zeros(3), np.array([0.2, 0, 0]), 0.01, {"low"}) == -np.inf


# ---------------------------------------------------------------------------------------------- reward
def test_progress_potential_rises_through_the_stages():
    p = [PickPlace("can", "bin_region", "in")]
    can = box([0.0, 0.0, 0.03], [0.03, 0.03, 0.03])
    far = progress(scene(eef=(0, 0, 0.5), can=can), p)
    near = progress(scene(eef=(0, 0, 0.07), can=can), p)
    holding = progress(scene(eef=(0, 0, 0.05), opening=0.06, can=can), p)
    lifted = box([0.25, 0.0, 0.2], [0.03, 0.03, 0.03])
    carried = progress(scene(eef=(0.25, 0, 0.22), opening=0.06, can=lifted), p)
    placed = progress(scene(eef=(0.3, 0, 0.3), can=box([0.3, 0.01, 0.03], [0.03, 0.03, 0.03])), p)
    assert 0 < far < near < 1 / 3 < holding < carried < 1 and placed == 1.0
    assert math.isclose(holding, (1 + 1 + 1 - math.tanh(1.5)) / 3)
    assert not held(scene(eef=(0, 0, 0.05), opening=0.0, can=can), "can")      # closed on nothing
    assert box_distance(np.array([0.0, 0.0, 0.5]), np.zeros(3), np.ones(3) * 0.1) == pytest.approx(0.4)


def test_progress_of_objects_sharing_a_region_aims_at_their_slots():
    """Set down at its slot of a shared region (4-5 cm from the centre), the first object counts as placed (inside
    the region's box, where LIBERO's In looks; outside it, it does not), and the second one's potential points at
    its own slot, not at the centre where the first one lies."""
    p = [PickPlace("can", "bin_region", "in", (0, 2)), PickPlace("cup", "bin_region", "in", (1, 2))]
    cup_high = box([0.32, 0.02, 0.2], [0.03, 0.03, 0.03])
    in_corner = box([0.34, 0.03, 0.03], [0.03, 0.03, 0.03])
    assert placed(scene(can=in_corner, cup=cup_high), p[0])
    assert not placed(scene(can=box([0.36, 0.0, 0.03], [0.03, 0.03, 0.03]), cup=cup_high), p[0])
    at_slot = progress(scene(eef=(0.32, 0.02, 0.22), opening=0.06, can=in_corner, cup=cup_high), p)
    at_centre = progress(scene(eef=(0.3, 0.0, 0.22), opening=0.06, can=in_corner,
                               cup=box([0.3, 0.0, 0.2], [0.03, 0.03, 0.03])), p)
    assert math.isclose(at_slot, (1 + (1 + 1 + 1) / 3) / 2) and at_centre < at_slot


def test_expert_gives_up_after_its_retries():
    # The object never rises (a scene that never changes): every lift is a failed grasp, retried twice.
    s = scene(can=box([0.0, 0.0, 0.03], [0.03, 0.03, 0.03]))
    expert = LiberoExpert([PickPlace("can", "bin_region", "in")], seed=0)
    for _ in range(2000):
        a = expert.act(s)
        assert a.shape == (7,) and np.all(np.abs(a) <= 1)
        if expert.status != "running":
            break
    assert expert.status == "failed" and expert.retries == 3


# ---------------------------------------------------------------------------------------------- simulator
def run_expert(suite, task_id, init_id, jitter=0.0):
    from vla_rl.data.libero_demos import run_expert_episode
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=[task_id], cameras=(), max_cached_envs=1))
    try:
        return run_expert_episode(env, task_id, init_id, seed=init_id, jitter=jitter)
    finally:
        env.close()


@needs_libero
@pytest.mark.parametrize("suite", ["libero_object", "libero_spatial"])
def test_expert_solves_a_task_from_an_official_init_state(suite):
    frames, success, why = run_expert(suite, 0, 0)
    assert success, why
    assert 40 < len(frames) < 200
    actions = np.stack([a for _, a in frames])
    assert actions.dtype == np.float32 and np.abs(actions).max() <= 1.0
    assert set(np.unique(actions[:, 6])) == {-1.0, 1.0}        # it opened and closed the gripper


@needs_libero
def test_expert_pushes_the_plate_to_the_front_of_the_stove():
    """LIBERO-Goal task 5: the plate lies 3 cm from the cabinet's handles; the fingers push it from inside its
    rim (envs/libero/expert.py, Push)."""
    frames, success, why = run_expert("libero_goal", 5, 0)
    assert success, why
    assert np.all(np.stack([a for _, a in frames])[:, 6] == 1.0)   # fingers closed throughout: a push, no grasp


@needs_libero
def test_expert_opens_drawers():
    """LIBERO-Goal task 0 ("open the middle drawer": the handle above blocks a vertical reach) and task 3 ("open
    the top drawer and put the bowl inside", whose goal says only "in": the closed drawer is opened first)."""
    frames, success, why = run_expert("libero_goal", 0, 0)
    assert success, why
    frames, success, why = run_expert("libero_goal", 3, 0)
    assert success, why


@needs_libero
def test_expert_turns_the_stove_on():
    """LIBERO-Goal task 7: grasp the knob's bar across and twist about the hinge (a push stalls on its damping)."""
    frames, success, why = run_expert("libero_goal", 7, 0)
    assert success, why
    assert len(frames) < 150


@needs_libero
@pytest.mark.parametrize("task_id", [0, 2, 3, 7, 8])
def test_expert_solves_libero_10_multi_step_tasks(task_id):
    """Two objects into the basket, corner to corner (0, 7: the retreat clears the basket's handle before the
    second approach); the stove turned on, then the moka pot on it by its handle (2); both moka pots on the stove,
    side by side (8); the bowl into the bottom drawer, then the drawer shut (3: opened fully first, pushed closed
    last)."""
    frames, success, why = run_expert("libero_10", task_id, 0)
    assert success, why


@needs_libero
def test_expert_pushes_an_open_drawer_shut():
    """LIBERO-10 task 3's bottom drawer starts open: the CloseDrawer primitive (fingers pitched down along the
    slide) pushes it in until LIBERO's own close predicate holds."""
    from vla_rl.envs.libero.expert import CloseDrawer, read_scene
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite="libero_10", task_ids=[3], cameras=(), max_cached_envs=1,
                                       max_episode_steps=200))
    try:
        env.reset_to(3, 0)
        sim, region = env.sim_env, "white_cabinet_1_bottom_region"
        scene = read_scene(sim)
        cabinet = sim.get_object("white_cabinet_1")
        assert scene.drawers[region].q < -0.14 and not cabinet.is_close(scene.drawers[region].q)
        assert plan_goal(sim.parsed_problem["goal_state"], scene)[-1] == CloseDrawer(region)   # after the "in"
        expert = LiberoExpert([CloseDrawer(region)])
        for _ in range(200):
            if expert.status != "running":
                break
            env.step(expert.act(scene).astype(np.float32))
            scene = read_scene(sim)
        assert expert.status == "done" and cabinet.is_close(scene.drawers[region].q)
    finally:
        env.close()


@pytest.mark.slow
@needs_libero
@pytest.mark.parametrize("suite", ["libero_object", "libero_spatial"])
@pytest.mark.parametrize("task_id", range(10))
def test_expert_solves_every_task_of_object_and_spatial(suite, task_id):
    # Deterministic: the same init state and seed give the same actions.
    for init_id in (0, 1):
        frames, success, why = run_expert(suite, task_id, init_id)
        assert success, f"{suite} task {task_id} init state {init_id}: {why}"
    again, _, _ = run_expert(suite, task_id, 1)
    assert np.array_equal(np.stack([a for _, a in frames]), np.stack([a for _, a in again]))


@needs_libero
def test_objects_in_the_state_and_sampled_placements():
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    cfg = LiberoConfig(suite="libero_object", task_ids=[0], cameras=(), state_mode="robot+objects",
                       init_states="sampled", reward="shaped", max_cached_envs=1, max_episode_steps=2)
    assert cfg.state_dim == 8 + 2 * 9
    env = LiberoSingleEnv(cfg)
    try:
        a, b, a_again = (env.reset_to(0, k)["state"] for k in (0, 1, 0))
        assert a.shape == (26,) and np.array_equal(a, a_again) and not np.array_equal(a, b)
        sim = env.sim_env
        soup, basket = (sim.obj_body_id[n] for n in ("alphabet_soup_1", "basket_1"))
        np.testing.assert_allclose(a[8:11], sim.sim.data.body_xpos[soup], atol=1e-6)
        np.testing.assert_allclose(a[17:20], sim.sim.data.body_xpos[basket], atol=1e-6)
        mat = np.asarray(sim.sim.data.body_xmat[basket]).reshape(3, 3)
        np.testing.assert_allclose(a[20:26], np.r_[mat[:, 0], mat[:, 1]], atol=1e-6)
        # Shaped reward: moving towards the soup raises the potential (a positive shaping term, no success).
        toward = np.r_[np.clip((a[8:11] - a[:3]) / 0.05, -1, 1), 0, 0, 0, -1.0]
        _, reward, terminated, truncated, _ = env.step(toward)
        assert reward > 0 and not terminated and not truncated
    finally:
        env.close()


@needs_libero
def test_a_region_of_interest_is_in_the_state_by_its_site():
    """LIBERO-Goal's "open the middle drawer": the objects of interest are a region site (it moves with the
    drawer), not a body; the state holds its pose."""
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv

    env = LiberoSingleEnv(LiberoConfig(suite="libero_goal", task_ids=[0], cameras=(), state_mode="robot+objects",
                                       max_cached_envs=1, max_episode_steps=2))
    try:
        state = env.reset_to(0, 0)["state"]
        sim = env.sim_env
        assert sim.parsed_problem["obj_of_interest"][0] == "wooden_cabinet_1_middle_region"
        site = sim.sim.model.site_name2id("wooden_cabinet_1_middle_region")
        np.testing.assert_allclose(state[8:11], sim.sim.data.site_xpos[site], atol=1e-6)
    finally:
        env.close()


def test_a_recording_takes_every_task_of_its_suite_by_default():
    from vla_rl.data.libero_demos import LiberoRecordConfig

    assert LiberoRecordConfig(suite="libero_10").env_config()["task_ids"] == list(range(10))
    assert LiberoRecordConfig(suite="libero_10", task_ids=[9]).ids == [9]
    with pytest.raises(ValueError, match="out of range"):
        LiberoRecordConfig(suite="libero_goal", task_ids=[10])


@needs_libero
def test_a_goal_the_expert_cannot_plan_is_tried_once_per_task(capsys):
    """LIBERO-10 task 9 ("... in the microwave and close it": a hinged door) has no primitive: the recording says
    why once and moves on instead of resetting each of its init states to fail the same way."""
    from vla_rl.data.libero_demos import LiberoRecordConfig, record_libero_episodes, report_table

    cfg = LiberoRecordConfig(suite="libero_10", task_ids=[9], policy="expert", episodes_per_task=2, max_tries=10,
                             cameras=[], seed=0)
    report: list = []
    logged: list[str] = []
    with pytest.raises(RuntimeError, match="task 9: unsupported goal"):   # nothing recorded: no dataset
        record_libero_episodes(cfg, progress=False, log=logged.append, report=report)
    (task,) = report
    assert task["tried"] == 1 and task["succeeded"] == 0 and task["unsupported"].startswith("unsupported goal")
    assert len(logged) == 1 and "other init states are not tried" in logged[0]
    assert "unsupported goal" in report_table(report)


@needs_libero
def test_sampled_placements_put_objects_inside_their_drawer(monkeypatch):
    """LIBERO-Spatial task 4 starts a bowl in the cabinet's top drawer: LIBERO's in-site sampler adds the drawer's
    world position to the cabinet's, right on a freshly built model only; after a soft reset the adapter restores
    the built fixture poses, so every draw starts the bowl in the drawer, not a metre above it. Task 5's bowl on a
    ramekin settles too. A task whose draws never settle is reported once by the recording."""
    from vla_rl.data import libero_demos
    from vla_rl.envs.libero.robosuite_env import LiberoConfig, LiberoSingleEnv, NoStablePlacement

    env = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[4, 5], cameras=(), init_states="sampled",
                                       max_cached_envs=1))
    try:
        for k in (0, 1):   # the second draw comes after a soft reset
            env.reset_to(4, k)
            sim = env.sim_env
            bowl = sim.sim.data.body_xpos[sim.obj_body_id["akita_black_bowl_1"]]
            drawer = sim.sim.data.site_xpos[sim.sim.model.site_name2id("wooden_cabinet_1_top_region")]
            assert np.linalg.norm(bowl[:2] - drawer[:2]) < 0.08 and abs(bowl[2] - drawer[2]) < 0.08
        # Task 5 drops its bowl onto the ramekin from ~14 cm, where it slides a few cm in every draw: the first draw
        # within the drop rule is taken, and the bowl rests there.
        env.reset_to(5, 0)
        sim = env.sim_env
        bowl, ramekin = (sim.sim.data.body_xpos[sim.obj_body_id[n]] for n in ("akita_black_bowl_1",
                                                                               "glazed_rim_porcelain_ramekin_1"))
        assert np.linalg.norm(bowl[:2] - ramekin[:2]) < 0.06 and bowl[2] > ramekin[2] + 0.03
    finally:
        env.close()

    # The drop rule only ever picks a draw when none passes strictly: Spatial task 0's placement 1, whose first draw
    # it would pass but the strict rule rejects, is the strict rule's (row 1's demos stay as they were recorded).
    from vla_rl.envs.libero import robosuite_env

    env = LiberoSingleEnv(LiberoConfig(suite="libero_spatial", task_ids=[0], cameras=(), init_states="sampled",
                                       max_cached_envs=1))
    try:
        placed = env.reset_to(0, 1)["state"]
        monkeypatch.setattr(robosuite_env, "SAMPLED_DROP", np.inf)
        assert np.array_equal(placed, env.reset_to(0, 1)["state"])
    finally:
        env.close()

    def unplaceable(env, task_id, init_id, **_):
        raise NoStablePlacement(f"libero_spatial task {task_id}: no stable placement")

    monkeypatch.setattr(libero_demos, "run_expert_episode", unplaceable)
    report: list = []
    cfg = libero_demos.LiberoRecordConfig(suite="libero_spatial", task_ids=[4], policy="expert", episodes_per_task=2,
                                          init_states="sampled", cameras=[], seed=0)
    with pytest.raises(RuntimeError, match="no sampled placements"):
        libero_demos.record_libero_episodes(cfg, progress=False, log=lambda _: None, report=report)
    assert report[0]["tried"] == 1 and report[0]["unsupported"].startswith("no sampled placements")
