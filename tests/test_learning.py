"""Proof that RL learns (CPU, CI-sized): from a few-shot SFT policy of the ``tiny`` preset on the built-in
task, Flow-SDE PPO and Flow-Noise PPO (the shipped experiment presets, shortened) each raise evaluation
success well above the SFT policy.

"Well above" is measured, not assumed: success is evaluated with the deterministic ODE sampler on the
same 400 fixed-seed episodes (not the trainer's own evaluation seeds) before and after RL, and the lift
must exceed both 0.10 and three standard errors of the difference of the two success rates (binomial,
about 0.035 here). The runs' approx-KL and clip-fraction must stay in a sane range after the first
updates. Both trainings run at once through the CLI, one process and one torch thread each, so the
module takes about as long as one of them.
"""

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from vla_rl.checkpoint import load_policy, save_policy
from vla_rl.config import policy_preset
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.envs.builtin import ColorReachEnv
from vla_rl.eval.evaluate import evaluate
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.rl.actor import Actor, SamplerConfig
from vla_rl.sft import SFTConfig, train_sft

EVAL_EPISODES = 400
EVAL_SEED = 20_000
ITERATIONS = 60
PRESETS = ("builtin_flow_sde", "builtin_flow_noise")


def success(actor: Actor) -> float:
    env = ColorReachEnv(100, seed=0)
    m = evaluate(actor, env, num_episodes=EVAL_EPISODES, sampler=SamplerConfig(4, "ode"), execute=8,
                 seed=EVAL_SEED)
    return m["eval/success_once"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SFT as in the demo (10 expert demos, 500 steps), then both RL presets from it, concurrently."""
    root = tmp_path_factory.mktemp("learning")
    torch.manual_seed(0)
    data = collect_builtin_demos(10, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    actor = Actor(FlowPolicy(policy_preset("tiny")), norm)
    train_sft(actor, data, SFTConfig(steps=500), progress=False)
    sft = save_policy(root / "sft", actor.model, actor.norm)
    before = success(actor)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with contextlib.ExitStack() as logs:
        procs = {}
        for preset in PRESETS:
            cmd = [sys.executable, "-m", "vla_rl.cli", "train", preset, f"init={sft}", f"out={root / preset}",
                   f"iterations={ITERATIONS}", f"eval_every={ITERATIONS}", f"save_every={ITERATIONS}",
                   "tensorboard=false", "--no-progress"]
            log = logs.enter_context(open(root / f"{preset}.log", "w"))
            procs[preset] = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        codes = {preset: proc.wait(timeout=1800) for preset, proc in procs.items()}
    out = {}
    for preset, rc in codes.items():
        text = (root / f"{preset}.log").read_text()
        assert rc == 0, f"{preset} failed:\n{text[-3000:]}"
        history = [json.loads(line) for line in (root / preset / "metrics.jsonl").read_text().splitlines()]
        model, norm_rl, _ = load_policy(root / preset / "checkpoints" / f"iter_{ITERATIONS:06d}")
        after = success(Actor(model, norm_rl))
        out[preset] = (after, history, text)
    return before, out


@pytest.mark.parametrize("preset", PRESETS)
def test_rl_lifts_success_well_above_the_sft_policy(runs, preset):
    before, out = runs
    after, history, log = out[preset]
    se = math.sqrt((before * (1 - before) + after * (1 - after)) / EVAL_EPISODES)
    kl = [h["losses/approx_kl"] for h in history if "losses/approx_kl" in h]
    clip = [h["losses/clipfrac"] for h in history if "losses/clipfrac" in h]
    later = len(kl) // 5  # the first updates, from a fresh critic, move the most
    print(f"\n{preset}: success {before:.3f} -> {after:.3f} over {EVAL_EPISODES} episodes (lift {after - before:+.3f}, "
          f"3 s.e. = {3 * se:.3f}); approx-KL median {statistics.median(kl[later:]):.3f}, clip-fraction median "
          f"{statistics.median(clip[later:]):.3f}\n{log[-1500:]}")
    assert len(history) == ITERATIONS + 1
    assert after - before >= max(0.10, 3 * se), (before, after)
    assert statistics.median(kl[later:]) < 0.2 and statistics.median(clip[later:]) < 0.45
