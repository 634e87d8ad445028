"""Training-health signals (vla_rl/rl/health.py): the trend test against hand-computed values, the signals on
made-up metrics, and two real runs: one made to collapse (a huge learning rate) and one with no signal (a task
the policy never solves)."""

import json
import math

import pytest
from helpers import train_config

from vla_rl.cli import main as cli_main
from vla_rl.rl.health import (
    HealthConfig,
    HealthMonitor,
    conditions,
    mann_kendall,
    noise_cost,
    noise_cost_line,
    success_trend,
    trend_statement,
)
from vla_rl.train.trainer import Trainer


def test_mann_kendall_by_hand():
    # 1..5: every pair rises, S = 10; var = 5*4*15/18; z = (10 - 1) / sqrt(var)
    s, tau, p = mann_kendall([1, 2, 3, 4, 5])
    assert (s, tau) == (10, 1.0)
    assert p == pytest.approx(math.erfc(9 / math.sqrt(5 * 4 * 15 / 18) / math.sqrt(2)))
    assert p == pytest.approx(0.0275, abs=5e-4)
    # with a tie: pairs 0, +1, -1, +1, -1, -1 -> S = -1; the continuity correction takes |S| = 1 to z = 0
    assert mann_kendall([0.5, 0.5, 0.6, 0.4]) == (-1, -1 / 6, 1.0)
    assert mann_kendall([0.3, 0.2, 0.5])[2] is None            # too few for a p-value
    assert mann_kendall([0.4] * 6) == (0, 0.0, 1.0)              # all tied


def test_trend_statements():
    rose = success_trend([(0, 0.55), (20, 0.7), (40, 0.8), (60, 0.82), (80, 0.9), (100, 0.88)])
    assert rose.first == 0.55 and rose.last == pytest.approx((0.82 + 0.9 + 0.88) / 3) and rose.p < 0.05
    assert trend_statement(rose).startswith("success rose over the run: 0.550 at the start -> 0.867")
    flat = success_trend([(0, 0.3), (10, 0.32), (20, 0.27), (30, 0.31), (40, 0.29), (50, 0.3)])
    assert trend_statement(flat).startswith("success 0.300 at the start -> 0.300 (mean of the last 3 evaluations); "
                                            "the evaluations show no significant trend (Mann-Kendall over 6")
    fell = success_trend([(i, 0.9 - 0.1 * i) for i in range(6)])
    assert trend_statement(fell).startswith("success fell over the run")
    assert "2 evaluations are too few for a trend test" in trend_statement(success_trend([(0, 0.5), (5, 0.6)]))
    # 4 points cannot reach p < 0.05 even strictly rising: no test result, and no verdict either way
    assert "4 evaluations are too few" in trend_statement(success_trend([(i, 0.1 * i) for i in range(4)]))
    # the demo's 5 points, up then down: not significant, and not called "stayed around its start" either
    demo = trend_statement(success_trend([(0, 0.4), (20, 0.7), (40, 0.66), (60, 0.72), (80, 0.69)]))
    assert demo.startswith("success 0.400 at the start -> 0.690") and "no significant trend" in demo
    assert "stayed" not in demo


def test_noise_cost_and_its_rule():
    assert noise_cost(0.25, 0.11) == pytest.approx(0.56)
    assert (noise_cost(0.0, 0.0), noise_cost(0.0, 0.2)) == (0.0, -1.0)
    line = noise_cost_line(0.25, 0.11, episodes=200, sampler_text="Flow-Noise", max_cost=0.5)
    assert "cost 56 %" in line and "noise_std_min" in line and "sampler.noise_level" in line
    assert "lower the noise" not in noise_cost_line(0.55, 0.45, episodes=200, sampler_text="x", max_cost=0.5)


def test_signals_on_made_up_metrics():
    cfg = HealthConfig(patience=2)
    healthy = {"rollout/success_once": 0.4, "rollout/episodes": 64, "losses/approx_kl": 0.02,
               "losses/clipfrac": 0.1, "losses/explained_variance": 0.5, "train/samples": 256,
               "train/applied_steps": 16, "train/advantage_std_raw": 0.3, "rollout/entropy": 0.0}
    assert conditions(healthy, cfg, entropy_min=-1.0) == {"no_signal": None, "collapse": None, "value_blind": None}
    c = conditions({**healthy, "rollout/success_once": 0.0, "losses/approx_kl": 3.0, "losses/explained_variance": -0.2,
                    "rollout/entropy": -0.99}, cfg, entropy_min=-1.0)
    assert c["no_signal"] == "no success in 64 rollout episodes"
    assert "approx-KL 3 > 0.5" in c["collapse"] and "lower bound" in c["collapse"]
    assert c["value_blind"] == "explained variance -0.20"
    assert "every update step was skipped" in conditions({**healthy, "train/applied_steps": 0}, cfg)["collapse"]
    assert conditions({**healthy, "train/advantage_std_raw": 0.0}, cfg)["no_signal"].startswith("raw advantage std")
    assert conditions({"train/samples": 0.0}, cfg)["no_signal"] == "no sample took part in the update"

    mon = HealthMonitor(cfg)
    said = []
    for it, kl in enumerate([0.9, 0.01, 0.9, 0.9, 0.9, 0.01], start=1):
        m = {**healthy, "iteration": it, "losses/approx_kl": kl}
        said.append(mon.update(m))
        assert m["health/collapse"] == float(it in (4, 5))   # two in a row: raised at 4, held at 5
    assert said[3] and said[3][0].startswith("health: collapse for 2 iterations (approx-KL 0.9 > 0.5)")
    assert "lower learner.lr_actor" in said[3][0]
    assert said[5] == ["health: collapse cleared at iteration 6"] and not any(said[:3]) and not said[4]


def run_log(cfg):
    lines = []
    with Trainer(cfg, log=lines.append) as trainer:
        history = trainer.run()
    return history, "\n".join(lines)


def test_a_run_made_to_collapse_says_so(sft_checkpoint, tmp_path, capsys):
    cfg = train_config(sft_checkpoint, tmp_path / "collapse", iterations=3, eval_every=3,
                       learner={"update_epochs": 2, "minibatches": 2, "lr_actor": 1.0}, health={"patience": 2},
                       max_skipped_iterations=5)
    history, log = run_log(cfg)
    assert [h.get("health/collapse") for h in history[1:]] == [0.0, 1.0, 1.0]
    assert "health: collapse for 2 iterations" in log and "lower learner.lr_actor" in log
    summary = next(line for line in log.splitlines() if line.startswith("summary: health signals raised:"))
    assert "collapse in 2 iterations" in summary   # (a collapsed policy may also lose its successes: no signal)
    assert history[0]["explore/success_ode"] == history[0]["eval/success_once"]
    assert "exploration noise: the rollout sampler (Flow-Noise, std in [0.2, 0.4])" in log
    # vla-rl report shows it
    assert cli_main(["report", str(tmp_path / "collapse"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "collapse: iterations 2-3" in out and "lower learner.lr_actor" in out


def test_a_run_without_signal_says_so(sft_checkpoint, tmp_path, capsys):
    # the goal square shrunk to a point and a sparse reward: nothing ever succeeds, nothing is rewarded
    env = {"num_envs": 8, "builtin": {"max_episode_steps": 16, "target_half_size": 1e-6, "reward": "sparse"}}
    cfg = train_config(sft_checkpoint, tmp_path / "nosignal", iterations=3, eval_every=1, env=env,
                       health={"patience": 2})
    history, log = run_log(cfg)
    assert [h.get("health/no_signal") for h in history[1:]] == [0.0, 1.0, 1.0]
    assert all(h["rollout/success_once"] == 0 and h["train/advantage_std_raw"] < 0.05 for h in history[1:])
    assert "health: no signal for 2 iterations (no success in" in log and "denser reward" in log
    assert "summary: success 0.000 at the start -> 0.000" in log and "4 evaluations are too few" in log
    assert history[-1]["eval/trend_p"] == 1.0
    metrics = [json.loads(line) for line in (tmp_path / "nosignal" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["health/no_signal"] == 1.0
    assert cli_main(["report", str(tmp_path / "nosignal"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "no signal: iterations 2-3" in out and "4 evaluations are too few" in out


def test_no_signal_says_when_the_episodes_ran_into_a_short_cap():
    """A recipe's step cap fitted to another task's demos: every episode truncated at 160 steps on a suite whose own
    limit is 300; the no-signal reason says so (and says nothing when the cap is the task's own or not reached)."""
    m = {"iteration": 1, "rollout/success_once": 0.0, "rollout/episodes": 16, "rollout/episode_length": 160.0}
    why = conditions(m, HealthConfig(), episode_cap=160, official_steps=300)["no_signal"]
    assert "160-step cap" in why and "limit of 300" in why
    assert "cap" not in conditions(m, HealthConfig(), episode_cap=300, official_steps=300)["no_signal"]
    assert "cap" not in conditions({**m, "rollout/episode_length": 90.0}, HealthConfig(), episode_cap=160,
                                   official_steps=300)["no_signal"]
    assert "cap" not in conditions(m, HealthConfig(), episode_cap=160)["no_signal"]   # a task with no own limit
    monitor = HealthMonitor(HealthConfig(patience=1), episode_cap=160, official_steps=300)
    (line,) = monitor.update(dict(m))
    assert "raise the env's max_episode_steps" in line


def test_libero_kinds_know_their_suites_limit():
    from vla_rl.core.schema import from_dict
    from vla_rl.envs.registry import EnvConfig, official_episode_steps

    env = lambda d: from_dict(EnvConfig, d, prefix="env")   # noqa: E731
    assert official_episode_steps(env({"kind": "libero", "libero": {"suite": "libero_goal"}})) == 300
    assert official_episode_steps(env({"kind": "libero_warp", "libero_warp": {"suite": "libero_10"}})) == 520
    assert official_episode_steps(EnvConfig()) is None
