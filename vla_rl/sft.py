"""Flow-matching behaviour cloning (SFT) on a demonstration dataset."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from vla_rl.actor import Actor
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
