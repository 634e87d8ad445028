"""The quick demonstration behind ``vla-rl demo`` (and ``make demo``): few-shot SFT on the built-in task,
then online RL from that policy, then evaluation, printing success before and after RL.

1. Collect ``demos`` scripted-expert episodes, train the ``model`` preset on them (flow matching), save
   the policy to ``<out>/sft``.
2. Evaluate it with each sampler (ODE, Flow-SDE, Flow-Noise) on the same fixed seeds, with the chunk
   log-likelihood the RL methods use.
3. Run the ``rl`` experiment preset (Flow-SDE PPO by default) from that policy for ``rl_iterations``
   iterations into ``<out>/rl`` (a normal run folder: metrics, TensorBoard, checkpoints).
4. Evaluate before and after RL with the deterministic ODE sampler on the same seeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from vla_rl.checkpoint.policy import save_policy
from vla_rl.config import check_ranges, load_preset, nonneg, policy_preset, ranged, setting, to_dict
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.eval.evaluate import evaluate
from vla_rl.outputs import DEMO, check_output, clear_output
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy, count_parameters
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.sft import SFTConfig, loss_summary, train_sft
from vla_rl.threads import policy_threads, threads_note, threads_setting, torch_threads
from vla_rl.train.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class DemoConfig:
    """``vla-rl demo`` settings."""

    MOVED = {"num_steps": "sampler.num_steps"}

    model: str = setting("tiny", doc="model preset (configs/model)")
    env: ColorReachConfig = setting(default_factory=ColorReachConfig, doc="the built-in task's level")
    demos: int = ranged(10, 1, doc="scripted-expert episodes to train on")
    sft: SFTConfig = setting(default_factory=lambda: SFTConfig(steps=500), doc="the SFT stage")
    sampler: SamplerConfig = setting(default_factory=SamplerConfig,
                                     doc="denoising steps and noise settings; the demo runs each method with them")
    execute: int = ranged(8, 1, doc="actions executed per chunk")
    eval_episodes: int = ranged(200, 1, doc="episodes per evaluation")
    rl: str = setting("builtin_flow_sde", doc="experiment preset of the RL stage (configs/experiment)")
    rl_iterations: int = nonneg(80, doc="RL iterations; 0: SFT only")
    seed: int = nonneg(0, doc="seed of the demos, the weights and the evaluation seeds (10_000 + seed)")
    out: str = setting("runs/demo", doc="the demo folder (sft/ and rl/ inside)")
    threads: int | Literal["auto"] = threads_setting()

    def __post_init__(self):
        check_ranges(self)


def run_demo(cfg: DemoConfig, *, progress: bool = True, overwrite: bool = False) -> dict:
    """Run the demo (module docstring) into ``cfg.out``; returns what it measured."""
    with torch_threads(policy_threads(cfg.threads)) as threads:
        print(f"torch threads: {threads_note(cfg.threads, threads)}")
        return _run_demo(cfg, progress=progress, overwrite=overwrite)


def _run_demo(cfg: DemoConfig, *, progress: bool, overwrite: bool) -> dict:
    check_output(cfg.out, overwrite=overwrite, kind=DEMO)
    if overwrite:
        clear_output(cfg.out)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    data = collect_builtin_demos(cfg.demos, seed=cfg.seed, config=cfg.env)
    print(f"collected {data.num_episodes} expert demos ({len(data)} frames) of the built-in ColorReach task")
    env = ColorReachEnv(min(cfg.eval_episodes, 100), config=cfg.env, seed=cfg.seed)
    spec = env.spec
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    model = FlowPolicy(policy_preset(cfg.model))
    actor = Actor.for_env(model, norm, spec)
    print(f"policy '{cfg.model}': {count_parameters(model) / 1e6:.2f}M parameters; SFT for {cfg.sft.steps} steps")
    log = train_sft(actor, data, cfg.sft, progress=progress)
    print(loss_summary(log))
    sft_path = save_policy(Path(cfg.out) / "sft", model, norm,
                           meta={"env": {"name": "builtin/color_reach", "state_dim": spec.state_dim,
                                         "action_dim": spec.action_dim}, "demo": to_dict(cfg)})
    eval_seed = 10_000 + cfg.seed

    def success(policy: Actor) -> float:
        m = evaluate(policy, env, num_episodes=cfg.eval_episodes, sampler=replace(cfg.sampler, method="ode"),
                     execute=cfg.execute, seed=eval_seed)
        return m["eval/success_once"]

    results: dict = {"sft_log": log, "samplers": {}}
    print(f"\nSFT policy, {cfg.eval_episodes} episodes per sampler")
    print(f"{'sampler':<22}{'success':>9}{'return':>9}{'log-prob/chunk':>16}")
    for name, sampler in [("ODE (deterministic)", replace(cfg.sampler, method="ode")),
                          (f"Flow-SDE ({cfg.sampler.sde_mode})", replace(cfg.sampler, method="sde")),
                          ("Flow-Noise", replace(cfg.sampler, method="noise"))]:
        m = evaluate(actor, env, num_episodes=cfg.eval_episodes, sampler=sampler, execute=cfg.execute,
                     seed=eval_seed)
        with torch.inference_mode():  # log-likelihood of a batch of sampled chunks (πRL aggregation)
            obs = env.reset(seed=cfg.seed)
            act = actor.act(actor.observe(obs), sampler, generator=torch.Generator().manual_seed(cfg.seed))
            lp = flow.aggregate(act.log_probs, act.stochastic, executed=cfg.execute, dim_mask=actor.dim_mask)
        lp_text = "-" if sampler.method == "ode" else f"{lp.mean().item():.2f}"
        print(f"{name:<22}{m['eval/success_once']:>9.2f}{m['eval/return']:>9.2f}{lp_text:>16}")
        results["samplers"][name] = m
    before = results["samplers"]["ODE (deterministic)"]["eval/success_once"]
    results["success_before_rl"] = before
    print(f"\nsaved the SFT policy to {sft_path} ({time.time() - t0:.0f} s so far)")
    if cfg.rl_iterations <= 0:
        return results

    train_cfg = load_preset(TrainConfig, "experiment", cfg.rl, {
        "init": str(sft_path), "out": str(Path(cfg.out) / "rl"), "iterations": cfg.rl_iterations,
        "env": {"builtin": to_dict(cfg.env)},
        "seed": cfg.seed, "progress": progress, "threads": cfg.threads, "eval_every": max(1, cfg.rl_iterations // 4)})
    print(f"\nRL: preset '{cfg.rl}' ({train_cfg.sampler.method}, {train_cfg.ppo.algorithm}), "
          f"{cfg.rl_iterations} iterations x {train_cfg.env.num_envs} envs -> {train_cfg.out}")
    with Trainer(train_cfg) as trainer:
        results["rl_history"] = trainer.run()
    after = success(trainer.actor)
    results["success_after_rl"] = after
    print(f"\nsuccess (ODE sampler, {cfg.eval_episodes} episodes, seeds {eval_seed}...): "
          f"SFT {before:.2f} -> after RL {after:.2f}   ({time.time() - t0:.0f} s in all)")
    return results
