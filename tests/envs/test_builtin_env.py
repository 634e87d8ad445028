"""The built-in ColorReach task: chunk stepping, partial resets, metrics, expert, input errors, and the env
contract every adapter passes (tests/contract.py)."""

import pytest
import torch
from contract import check_env_contract

from vla_rl.envs.builtin import COLORS, QUADRANTS, ColorReachConfig, ColorReachEnv


def test_observation_layout():
    env = ColorReachEnv(5, seed=0)
    obs = env.reset(seed=0)
    assert obs["images"].shape == (5, 1, 32, 32, 3) and obs["images"].dtype == torch.uint8
    assert obs["state"].shape == (5, 4) and obs["state"].dtype == torch.float32
    assert len(obs["instruction"]) == 5 and all(any(c in s for c in COLORS) for s in obs["instruction"])


def test_goal_is_visible_in_the_image_in_its_colour():
    env = ColorReachEnv(8, seed=1)
    obs = env.reset()
    for i in range(8):
        c = int(env.goal[i])
        gx, gy = env.goal_position()[i].tolist()
        col = int((gx + 1) / 2 * 32)
        row = int((1 - (gy + 1) / 2) * 32)  # row 0 is the top of the image
        pix = obs["images"][i, 0, row, col]
        assert int(pix.argmax()) == c, (pix, c)


def test_seeded_resets_are_reproducible():
    a, b = ColorReachEnv(4, seed=0), ColorReachEnv(4, seed=99)
    oa, ob = a.reset(seed=7), b.reset(seed=7)
    assert torch.equal(oa["images"], ob["images"]) and oa["instruction"] == ob["instruction"]


@pytest.mark.parametrize("layout,control", [("fixed", "target"), ("shuffled", "target"), ("fixed", "delta"),
                                            ("shuffled", "delta")])
def test_scripted_expert_always_succeeds(layout, control):
    env = ColorReachEnv(64, config=ColorReachConfig(layout=layout, control=control), seed=0)
    env.reset(seed=0)
    successes = 0
    for _ in range(env.cfg.max_episode_steps):
        out = env.step(env.expert_action()[:, None])
        if out.episodes:
            successes += int(out.episodes["success_once"].sum())
        if successes == 64:
            break
    assert successes >= 64


def test_chunk_stops_at_episode_end_and_resets_only_that_env():
    env = ColorReachEnv(2, config=ColorReachConfig(max_episode_steps=5, control="delta"), seed=0)
    env.reset(seed=0)
    before = env.targets.clone()
    chunk = torch.zeros(2, 8, 2)
    chunk[1] = env.expert_action()[1]  # env 1 heads for the goal, env 0 stands still
    out = env.step(chunk)
    # Env 0 times out after 5 of the 8 sub-steps; its remaining actions are ignored and earn nothing.
    assert out.truncated[0] and not out.terminated[0] and out.steps[0] == 5
    assert (out.rewards[0, 5:] == 0).all()
    assert out.final_obs is not None and out.episodes["length"].tolist()[0] == 5
    assert not torch.equal(env.targets[0], before[0])  # reset in place
    assert env.t[0] == 0


def test_partial_reset_leaves_other_envs_untouched():
    env = ColorReachEnv(3, config=ColorReachConfig(control="delta"), seed=0)
    env.reset(seed=0)
    targets = env.targets.clone()
    pos0 = env.pos.clone()
    chunk = torch.zeros(3, 1, 2)
    goal0 = env.goal_position()[0]
    env.pos[0] = goal0 + 0.05  # just outside the success radius, one step from the goal
    chunk[0, 0] = -0.05 / env.cfg.step_size
    out = env.step(chunk)
    assert out.terminated[0] and out.success[0] and out.rewards[0, 0] > 1.0
    assert out.episodes["env_index"].tolist() == [0] and out.episodes["success_once"].tolist() == [True]
    assert torch.equal(env.targets[1:], targets[1:]) and torch.equal(env.pos[1:], pos0[1:])


def test_builtin_env_passes_the_contract():
    check_env_contract(ColorReachEnv(4, config=ColorReachConfig(max_episode_steps=6)))


def test_builtin_env_resets_one_env_in_place_and_leaves_the_others():
    """Target control with long steps: env 0, sent to its goal, succeeds within a chunk or two."""
    env = ColorReachEnv(4, config=ColorReachConfig(control="target", step_size=0.4, max_episode_steps=8))
    check_env_contract(env, end_first=lambda e: e.goal_position()[0])


def test_fixed_layout_puts_each_colour_in_its_quadrant_and_shuffled_does_not():
    fixed = ColorReachEnv(256, seed=0)
    fixed.reset(seed=0)
    quadrant = (fixed.targets[..., 0] > 0).long() + 2 * (fixed.targets[..., 1] > 0).long()  # [N, 3]
    assert (quadrant == torch.tensor([0, 1, 2])).all()
    assert ((fixed.pos[:, 0] > 0) & (fixed.pos[:, 1] > 0)).all()  # the agent starts in the last quadrant
    assert (fixed.targets - QUADRANTS[:3]).abs().amax() <= fixed.cfg.jitter + 1e-6
    shuffled = ColorReachEnv(256, config=ColorReachConfig(layout="shuffled"), seed=0)
    shuffled.reset(seed=0)
    quadrant = (shuffled.targets[..., 0] > 0).long() + 2 * (shuffled.targets[..., 1] > 0).long()
    assert len({tuple(q) for q in quadrant.tolist()}) > 6  # many arrangements (24 possible)


def test_target_control_heads_for_the_commanded_point_at_step_size():
    env = ColorReachEnv(2, config=ColorReachConfig(control="target"), seed=0)
    env.reset(seed=0)
    env.pos[:] = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    # env 0: far target -> one full step per axis; env 1: target closer than a step -> reached exactly
    out = env.step(torch.tensor([[[-1.0, 0.5]], [[0.45, 0.52]]]))
    assert torch.allclose(env.pos[0], torch.tensor([0.5 - env.cfg.step_size, 0.5]))
    assert out.steps.tolist() == [1, 1]
    assert torch.allclose(env.pos[1], torch.tensor([0.45, 0.52])) or out.done[1]
    assert torch.equal(env.expert_action(), env.goal_position())


def test_unknown_levels_are_errors():
    with pytest.raises(ValueError, match="layout"):
        ColorReachEnv(1, config=ColorReachConfig(layout="diagonal"))
    with pytest.raises(ValueError, match="control"):
        ColorReachEnv(1, config=ColorReachConfig(control="velocity"))


def test_sparse_reward_is_success_only():
    env = ColorReachEnv(4, config=ColorReachConfig(reward="sparse"), seed=0)
    env.reset()
    out = env.step(torch.full((4, 3, 2), 0.3))
    assert set(out.rewards.unique().tolist()) <= {0.0, 1.0}


def test_bad_action_chunks_get_clear_errors():
    env = ColorReachEnv(2)
    env.reset()
    with pytest.raises(ValueError, match=r"shape \[2, H, 2\]"):
        env.step(torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="NaN"):
        env.step(torch.full((2, 4, 2), float("nan")))
    with pytest.raises(ValueError, match="out of range"):
        env.step(torch.full((2, 4, 2), 3.0))
    with pytest.raises(TypeError, match="floating"):
        env.step(torch.zeros(2, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_envs"):
        ColorReachEnv(0)
