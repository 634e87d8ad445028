"""The quick demonstration behind ``vla-rl demo``: few-shot SFT on the built-in task, then sampling
with every method (ODE, Flow-SDE, Flow-Noise), each evaluated on the same fixed seeds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.checkpoint import save_policy
from vla_rl.collect import collect_builtin_demos
from vla_rl.config import to_dict
from vla_rl.envs.builtin import ColorReachEnv
from vla_rl.evaluate import evaluate
from vla_rl.policies import flow
from vla_rl.policies.config import policy_preset
from vla_rl.policies.model import FlowPolicy, count_parameters
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.sft import SFTConfig, train_sft


@dataclass(frozen=True)
class DemoConfig:
    model: str = "tiny"
    demos: int = 20
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=1000))
    num_steps: int = 4
    execute: int = 8
    eval_episodes: int = 100
    seed: int = 0
    out: str = "runs/demo"


def run_demo(cfg: DemoConfig, *, progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    data = collect_builtin_demos(cfg.demos, seed=cfg.seed)
    print(f"collected {data.num_episodes} expert demos ({len(data)} frames) of the built-in ColorReach task")
    env = ColorReachEnv(min(cfg.eval_episodes, 100), seed=cfg.seed)
    spec = env.spec
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    model = FlowPolicy(policy_preset(cfg.model))
    actor = Actor(model, norm, env_state_dim=spec.state_dim, env_action_dim=spec.action_dim)
    print(f"policy '{cfg.model}': {count_parameters(model) / 1e6:.2f}M parameters; SFT for {cfg.sft.steps} steps")
    log = train_sft(actor, data, cfg.sft, progress=progress)
    print(f"flow-matching loss {log[0]['losses/flow_matching']:.3f} -> {log[-1]['losses/flow_matching']:.3f}")
    results = {}
    print(f"\n{'sampler':<22}{'success':>9}{'return':>9}{'log-prob/chunk':>16}")
    for name, sampler in [("ODE (deterministic)", SamplerConfig(cfg.num_steps, "ode")),
                          ("Flow-SDE (mixed)", SamplerConfig(cfg.num_steps, "sde", sde_mode="mixed")),
                          ("Flow-Noise", SamplerConfig(cfg.num_steps, "noise"))]:
        m = evaluate(actor, env, num_episodes=cfg.eval_episodes, sampler=sampler, execute=cfg.execute,
                     seed=10_000 + cfg.seed)
        with torch.inference_mode():  # log-likelihood of a batch of sampled chunks (πRL aggregation)
            obs = env.reset(seed=cfg.seed)
            act = actor.act(obs, sampler, generator=torch.Generator().manual_seed(cfg.seed))
            lp = flow.aggregate(act.sample.log_probs, act.sample.stochastic, executed=cfg.execute,
                                dim_mask=actor.dim_mask)
        lp_text = "-" if sampler.method == "ode" else f"{lp.mean().item():.2f}"
        print(f"{name:<22}{m['eval/success_once']:>9.2f}{m['eval/return']:>9.2f}{lp_text:>16}")
        results[name] = m
    path = save_policy(Path(cfg.out) / "sft", model, norm,
                       meta={"env": {"name": "builtin/color_reach", "state_dim": spec.state_dim,
                                     "action_dim": spec.action_dim}, "demo": to_dict(cfg)})
    print(f"\nsaved the SFT policy to {path} ({time.time() - t0:.0f} s in all)")
    return {"sft_log": log, "eval": results}
