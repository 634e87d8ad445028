"""benchmarks/explore_spread.py: each env's first episode is credited to the right (state, sample) cell."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SPEC = importlib.util.spec_from_file_location(
    "explore_spread", Path(__file__).resolve().parents[1] / "benchmarks" / "explore_spread.py")
explore_spread = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(explore_spread)


class SeedEnv:
    """Env ``i`` starts from state ``seed + i // group_size`` (as the worker envs do). Its first episode
    lasts ``1 + i % 3`` chunks and succeeds when state + sample index is even; later episodes always
    succeed, so crediting one of them instead of the first shows up as a wrong cell."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs

    def reset(self, seed: int, *, group_size: int = 1):
        self.group = group_size
        self.state = [seed + i // group_size for i in range(self.num_envs)]
        self.clock = [0] * self.num_envs
        self.first = [True] * self.num_envs
        return {}

    def step(self, chunk):
        assert chunk.shape[1] == 2  # execute=2 of the 4-action chunk
        ended, wins = [], []
        for i in range(self.num_envs):
            self.clock[i] += 1
            if self.clock[i] >= 1 + i % 3:
                ended.append(i)
                wins.append((self.state[i] + i % self.group) % 2 == 0 if self.first[i] else True)
                self.first[i], self.clock[i] = False, 0
        episodes = {}
        if ended:  # every key a real env's episode tracker reports (envs/base.py, ChunkStep.episodes)
            episodes = {"env_index": torch.tensor(ended), "success_once": torch.tensor(wins),
                        "success_at_end": torch.tensor(wins), "return": torch.tensor(wins).float(),
                        "length": torch.ones(len(ended), dtype=torch.long)}
        return SimpleNamespace(obs={}, episodes=episodes)


class ZeroActor:
    model = SimpleNamespace(device=torch.device("cpu"))

    def act(self, obs, sampler, generator=None):
        return SimpleNamespace(actions=torch.zeros(8, 4, 2))


def test_outcomes_credits_first_episode_of_each_state_and_sample():
    # 5 states x 4 samples on 8 envs: three rounds of 2 states, the last one half used.
    res = explore_spread.outcomes(ZeroActor(), SeedEnv(8), states=5, samples=4, seed=100, sampler=None, execute=2)
    expected = torch.tensor([[float((100 + s + k) % 2 == 0) for k in range(4)] for s in range(5)])
    assert torch.equal(res, expected)


def test_outcomes_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of samples"):
        explore_spread.outcomes(ZeroActor(), SeedEnv(6), states=2, samples=4, seed=0, sampler=None, execute=2)


def test_binary_gripper_thresholds_only_the_last_dim():
    arm = torch.tensor([[-0.5, 0.25], [0.1, -0.9], [0.0, 0.3]])
    grip = torch.tensor([-0.3, 0.0, 0.7])

    class Actor:
        def act(self, obs, sampler, generator=None):
            return SimpleNamespace(actions=torch.cat([arm, grip[:, None]], 1)[:, None].clone())  # [3, 1, 3]

    out = explore_spread.binary_gripper(Actor()).act({}, None).actions
    assert torch.equal(out[:, 0, :2], arm)
    assert torch.equal(out[:, 0, 2], torch.tensor([-1.0, 1.0, 1.0]))
