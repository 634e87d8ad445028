"""Flow-matching behaviour cloning (SFT) on a demonstration dataset."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from vla_rl.actor import Actor, SamplerConfig
from vla_rl.data import DemoDataset
from vla_rl.policies import flow


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-4  # 1e-3 collapses the from-scratch vision features (measured), then only the state is used
    weight_decay: float = 1e-4
    warmup_steps: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 100


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_sft(actor: Actor, data: DemoDataset, cfg: SFTConfig, *, progress: bool = True) -> list[dict]:
    """Train ``actor.model`` on ``data`` (normalisation already in ``actor.norm``); returns the log."""
    model = actor.model
    device = model.device
    chunks, chunk_mask = data.action_chunks(model.cfg.action_horizon)
    targets = actor.model_actions(chunks)                                 # [M, H, A] normalised
    chunk_mask, dim_mask = chunk_mask.to(device), actor.dim_mask
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    log, running = [], []
    model.train()
    bar = tqdm(range(cfg.steps), desc="sft", disable=not progress, leave=False)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        idx = torch.randint(len(data), (cfg.batch_size,), generator=gen)
        obs = {"images": data.images[idx], "state": data.state[idx], "instruction": data.instructions(idx)}
        prefix = actor.encode(obs)
        loss, _ = flow.flow_matching_loss(
            model.field(prefix), targets[idx.to(device)],
            action_mask=chunk_mask[idx.to(device)], dim_mask=dim_mask,
            generator=gen if device.type == "cpu" else None)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running.append(loss.item())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "losses/flow_matching": sum(running) / len(running),
                     "lr": lr_at(step, cfg)}
            log.append(entry)
            bar.set_postfix(loss=f"{entry['losses/flow_matching']:.4f}")
            running = []
    model.eval()
    return log


@dataclass(frozen=True)
class SFTRunConfig:
    """``vla-rl sft DATASET`` settings (the dataset is a LeRobot v3.0 folder, see :mod:`vla_rl.lerobot`)."""

    model: str = "tiny"                    # model preset (configs/model) ...
    policy: dict[str, Any] = field(default_factory=dict)  # ... with these PolicyConfig overrides (policy.depth=2)
    steps: int = 500
    batch_size: int = 64
    lr: float = 3e-4
    warmup_steps: int = 100
    norm: Literal["mean_std", "quantile"] = "mean_std"
    seed: int = 0
    out: str = "runs/sft"
    eval_episodes: int = 100               # built-in datasets only; 0 skips the evaluation
    num_steps: int = 4                     # ODE steps of the evaluation
    execute: int = 8                       # actions executed per chunk in the evaluation


def run_sft(dataset: str | Path, cfg: SFTRunConfig, *, progress: bool = True) -> dict:
    """Train a policy on a LeRobot dataset, save it to ``cfg.out`` (weights + normalisation stats of the
    data), and evaluate it with the ODE sampler if the dataset came from the built-in task."""
    from vla_rl.checkpoint import save_policy
    from vla_rl.config import ConfigError, from_dict, to_dict
    from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
    from vla_rl.evaluate import evaluate
    from vla_rl.lerobot import read_lerobot_dataset, read_lerobot_info
    from vla_rl.policies.config import policy_preset
    from vla_rl.policies.model import FlowPolicy, count_parameters
    from vla_rl.policies.normalize import NormStats, Stats

    torch.manual_seed(cfg.seed)
    info = read_lerobot_info(dataset)
    data = read_lerobot_dataset(dataset)
    _, cams, h, w, _ = data.images.shape
    state_dim, action_dim = data.state.shape[1], data.action.shape[1]
    print(f"dataset {dataset}: {data.num_episodes} episodes, {len(data)} frames, {len(data.tasks)} tasks, "
          f"{cams} camera(s) {h}x{w}, state {state_dim}, action {action_dim}")
    pcfg = policy_preset(cfg.model, cfg.policy)
    # The model must see what the data holds; say so here rather than fail deep inside the forward pass.
    if (pcfg.num_cameras, pcfg.vision.image_size, pcfg.vision.image_size) != (cams, h, w):
        raise ConfigError(f"model '{cfg.model}' takes {pcfg.num_cameras} camera(s) of {pcfg.vision.image_size}px, "
                          f"the dataset has {cams} of {h}x{w} (override policy.num_cameras / "
                          "policy.vision.image_size)")
    if state_dim > pcfg.state_dim or action_dim > pcfg.action_dim:
        raise ConfigError(f"model '{cfg.model}' has state/action dims {pcfg.state_dim}/{pcfg.action_dim}, the "
                          f"dataset needs {state_dim}/{action_dim}")
    norm = NormStats(Stats.of(data.state), Stats.of(data.action), cfg.norm)
    model = FlowPolicy(pcfg)
    actor = Actor(model, norm, env_state_dim=state_dim, env_action_dim=action_dim)
    print(f"policy '{cfg.model}': {count_parameters(model) / 1e6:.2f}M parameters; SFT for {cfg.steps} steps")
    sft_cfg = SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                        seed=cfg.seed, log_every=max(1, min(100, cfg.steps)))
    log = train_sft(actor, data, sft_cfg, progress=progress)
    print(f"flow-matching loss {log[0]['losses/flow_matching']:.3f} -> {log[-1]['losses/flow_matching']:.3f}")
    origin = info.get("vla_rl") if isinstance(info.get("vla_rl"), dict) else {}
    env_name = "builtin/color_reach" if origin.get("env") == "builtin" else f"lerobot/{info.get('robot_type')}"
    path = save_policy(cfg.out, model, norm, meta={
        "env": {"name": env_name, "state_dim": state_dim, "action_dim": action_dim},
        "sft": {**to_dict(cfg), "dataset": str(dataset), "tasks": list(data.tasks)}})
    print(f"saved the policy to {path}")
    results: dict = {"sft_log": log, "path": str(path)}
    if origin.get("env") == "builtin" and cfg.eval_episodes > 0:
        env_cfg = from_dict(ColorReachConfig, origin.get("env_config") or {}, prefix="info.json vla_rl.env_config")
        env = ColorReachEnv(min(cfg.eval_episodes, 100), config=env_cfg, seed=cfg.seed)
        eval_seed = 10_000 + cfg.seed  # fixed seeds, disjoint from the collection seeds
        m = evaluate(actor, env, num_episodes=cfg.eval_episodes, sampler=SamplerConfig(cfg.num_steps, "ode"),
                     execute=cfg.execute, seed=eval_seed)
        results["eval"] = m
        print(f"success (ODE sampler, {cfg.eval_episodes} episodes, seeds {eval_seed}...): "
              f"{m['eval/success_once']:.2f}")
    return results
