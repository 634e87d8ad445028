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
from vla_rl.core.outputs import DEMO, check_output, clear_output
from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged, setting
from vla_rl.core.schema import to_dict
from vla_rl.core.threads import policy_threads, threads_note, threads_setting, torch_threads
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.envs.registry import BUILTIN
from vla_rl.eval.evaluate import evaluate
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.model import count_parameters
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import load_preset, merge, policy_preset
from vla_rl.train.sft import SFTConfig, loss_summary, train_sft
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
    # Off by default: with 3 / 5 / 0.05 seed 0's run fell from 0.64 to 0.18 rollout success by iteration 36 and
    # seed 1 lifted +0.075 against +0.11 without (benchmarks/RESULTS.md, robustness of the demo).
    rl_critic_warmup: int = nonneg(0, doc="RL stage: learner.critic_warmup_iters over the preset's when set")
    rl_actor_lr_warmup: int = nonneg(0, doc="RL stage: learner.actor_lr_warmup_iters over the preset's when set")
    rl_target_kl: float | None = positive(None, doc="RL stage: learner.target_kl over the preset's when set")
    seed: int = nonneg(0, doc="seed of the demos, the weights and the evaluation seeds (10_000 + seed)")
    out: str = setting("runs/demo", doc="the demo folder (sft/ and rl/ inside)")
    threads: int | Literal["auto"] = threads_setting()

    def __post_init__(self):
        check_ranges(self)


# What the default demo's RL stage gave in benchmarks/bench_robustness.py (RESULTS.md, robustness of the demo):
# the after-RL minus SFT success over its runs (RL seeds 0-4, each on 1 and on 2 torch threads): min, median, max,
# number of runs.
MEASURED_LIFT = (0.11, 0.25, 0.37, 10)


def demo_expectation(cfg: DemoConfig) -> str | None:
    """What to expect of the RL stage, for the default settings (any ``out``); None for others: nothing was
    measured for them."""
    if {**to_dict(cfg), "out": None} != {**to_dict(DemoConfig()), "out": None}:
        return None
    lo, med, hi, n = MEASURED_LIFT
    return (f"expected lift (after RL - SFT) with these settings: {lo:+.2f} to {hi:+.2f}, median {med:+.2f}, "
            f"over {n} runs (RL seeds x 1 and 2 threads; benchmarks/RESULTS.md): short PPO runs "
            "diverge with float rounding, so your run is one draw from that range")


def demo_eval_seed(cfg: DemoConfig) -> int:
    """The first seed of the demo's before / after evaluation episodes."""
    return 10_000 + cfg.seed


def demo_success(actor: Actor, cfg: DemoConfig) -> float:
    """ODE success of ``actor`` on the demo's ``eval_episodes`` fixed-seed episodes of the built-in task."""
    env = ColorReachEnv(min(cfg.eval_episodes, 100), config=cfg.env, seed=cfg.seed)
    m = evaluate(actor, env, num_episodes=cfg.eval_episodes, sampler=replace(cfg.sampler, method="ode"),
                 execute=cfg.execute, seed=demo_eval_seed(cfg))
    return m["eval/success_once"]


def demo_train_config(cfg: DemoConfig, sft_path: str | Path, *, out: str | Path, progress: bool = True,
                      overrides: dict | None = None):
    """The RL stage's :class:`~vla_rl.train.trainer.TrainConfig`: the ``rl`` preset from ``sft_path`` for
    ``rl_iterations`` iterations on the demo's task level (``overrides``, e.g. another RL ``seed``, on top)."""
    base = {"init": str(sft_path), "out": str(out), "iterations": cfg.rl_iterations,
            "env": {BUILTIN: to_dict(cfg.env)}, "seed": cfg.seed, "progress": progress, "threads": cfg.threads,
            "eval_every": max(1, cfg.rl_iterations // 4)}
    # only the stabilisers asked for: unset ones keep the preset's values
    learner = {"critic_warmup_iters": cfg.rl_critic_warmup, "actor_lr_warmup_iters": cfg.rl_actor_lr_warmup,
               "target_kl": cfg.rl_target_kl}
    base["learner"] = {k: v for k, v in learner.items() if v}
    return load_preset(TrainConfig, "experiment", cfg.rl, merge(base, overrides or {}))


def train_demo_sft(cfg: DemoConfig, *, progress: bool = True) -> tuple[Actor, Path, list[dict]]:
    """Collect the demos and train the SFT policy into ``<out>/sft``: (its actor, the folder, the SFT log)."""
    torch.manual_seed(cfg.seed)
    data = collect_builtin_demos(cfg.demos, seed=cfg.seed, config=cfg.env)
    print(f"collected {data.num_episodes} expert demos ({len(data)} frames) of the built-in ColorReach task")
    spec = ColorReachEnv(1, config=cfg.env).spec
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    model = make_policy(policy_preset(cfg.model))
    actor = Actor.for_env(model, norm, spec)
    print(f"policy '{cfg.model}': {count_parameters(model) / 1e6:.2f}M parameters; SFT for {cfg.sft.steps} steps")
    log = train_sft(actor, data, cfg.sft, progress=progress)
    print(loss_summary(log))
    sft_path = save_policy(Path(cfg.out) / "sft", model, norm,
                           meta={"env": {"name": "builtin/color_reach", "state_dim": spec.state_dim,
                                         "action_dim": spec.action_dim}, "demo": to_dict(cfg)})
    return actor, sft_path, log


def run_demo(cfg: DemoConfig, *, progress: bool = True, overwrite: bool = False) -> dict:
    """Run the demo (module docstring) into ``cfg.out``; returns what it measured."""
    with torch_threads(policy_threads(cfg.threads)) as threads:
        print(f"torch threads: {threads_note(cfg.threads, threads)}")
        return _run_demo(cfg, progress=progress, overwrite=overwrite)


def _run_demo(cfg: DemoConfig, *, progress: bool, overwrite: bool) -> dict:
    check_output(cfg.out, overwrite=overwrite, kind=DEMO)
    if overwrite:
        clear_output(cfg.out)
    t0 = time.time()
    actor, sft_path, log = train_demo_sft(cfg, progress=progress)
    env = ColorReachEnv(min(cfg.eval_episodes, 100), config=cfg.env, seed=cfg.seed)
    eval_seed = demo_eval_seed(cfg)
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

    train_cfg = demo_train_config(cfg, sft_path, out=Path(cfg.out) / "rl", progress=progress)
    print(f"\nRL: preset '{cfg.rl}' ({train_cfg.sampler.method}, {train_cfg.algorithm.name}), "
          f"{cfg.rl_iterations} iterations x {train_cfg.env.num_envs} envs -> {train_cfg.out}")
    expectation = demo_expectation(cfg)
    if expectation:
        print(expectation)
    with Trainer(train_cfg) as trainer:
        results["rl_history"] = trainer.run()
    after = demo_success(trainer.actor, cfg)
    results["success_after_rl"] = after
    print(f"\nsuccess (ODE sampler, {cfg.eval_episodes} episodes, seeds {eval_seed}...): "
          f"SFT {before:.2f} -> after RL {after:.2f}   ({time.time() - t0:.0f} s in all)")
    if expectation:
        lo, med, hi, n = MEASURED_LIFT
        print(f"lift {after - before:+.2f}; measured over {n} runs of these settings: {lo:+.2f} / {med:+.2f} / "
              f"{hi:+.2f} (min / median / max)")
    return results
