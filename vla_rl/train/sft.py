"""Flow-matching behaviour cloning (SFT) on a demonstration dataset."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from vla_rl.checkpoint.policy import load_any_policy, save_policy
from vla_rl.core.outputs import POLICY, check_output
from vla_rl.core.progress import progress as progress_bar
from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, positive, ranged, setting
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.core.threads import policy_threads, threads_setting, torch_threads
from vla_rl.data.dataset import DemoDataset, drop_idle_frames, take_episodes
from vla_rl.data.lerobot import LeRobotDatasetError, read_lerobot_dataset, read_lerobot_info
from vla_rl.data.maniskill_demos import demo_env_config
from vla_rl.data.maniskill_h5 import read_maniskill_h5, read_trajectory_info
from vla_rl.envs.registry import ENV_KINDS, MANISKILL, EnvConfig, make_env
from vla_rl.envs.workers import local_worker_processes
from vla_rl.eval.evaluate import evaluate
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.model import count_parameters
from vla_rl.policies.normalize import NormStats, Stats, parse_dims
from vla_rl.policies.seam import FlowVLA
from vla_rl.presets import policy_preset


@dataclass(frozen=True)
class SFTConfig:
    """The flow-matching training loop: AdamW, linear warm-up, then cosine decay to 10 % of ``lr``."""

    steps: int = ranged(2000, 1, doc="optimizer steps")
    batch_size: int = ranged(64, 1, doc="frames per step")
    lr: float = ranged(3e-4, 0, 1, lo_open=True, doc="peak learning rate (1e-3 collapses the vision features of a "
                                                      "model trained from scratch)")
    weight_decay: float = nonneg(1e-4, doc="AdamW's weight decay")
    warmup_steps: int = nonneg(100, doc="steps of the linear warm-up")
    grad_clip: float = positive(1.0, doc="gradient norm clip")
    seed: int = nonneg(0, doc="seed of the batches and the flow-matching noise")
    log_every: int = ranged(100, 1, doc="steps per logged mean loss")

    def __post_init__(self):
        check_ranges(self)


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def loss_summary(log: list[dict]) -> str:
    """``flow-matching loss 0.970 (steps 1-10) -> 0.412 (steps 91-100)``: the mean loss over the first and
    the last logged window of a :func:`train_sft` log (one window: its mean alone)."""
    def window(i: int) -> str:
        start = log[i - 1]["step"] + 1 if i > 0 else 1
        end = log[i]["step"]
        return f"step {end}" if start == end else f"steps {start}-{end}"

    first = f"flow-matching loss {log[0]['losses/flow_matching']:.3f} ({window(0)})"
    if len(log) == 1:
        return first
    return f"{first} -> {log[-1]['losses/flow_matching']:.3f} ({window(len(log) - 1)})"


def train_sft(actor: Actor, data: DemoDataset, cfg: SFTConfig, *, progress: bool = True) -> list[dict]:
    """Train ``actor.model`` on ``data`` (normalisation already in ``actor.norm``); returns the log."""
    model = actor.model
    device = model.device
    chunks, chunk_mask = data.action_chunks(model.cfg.action_horizon)
    targets = actor.model_actions(chunks, data.state)                     # [M, H, A] normalised
    chunk_mask, dim_mask = chunk_mask.to(device), actor.dim_mask
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    log, running = [], []
    model.train()
    bar = progress_bar(range(cfg.steps), desc="sft", unit="steps", enabled=progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        idx = torch.randint(len(data), (cfg.batch_size,), generator=gen)
        obs = {"images": data.images[idx], "state": data.state[idx], "instruction": data.instructions(idx)}
        prefix = actor.observe(obs).prefix
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
    """``vla-rl sft DATASET`` settings (DATASET: a LeRobot v3.0 / v2.x folder, see
    :mod:`vla_rl.data.lerobot`, or a ManiSkill trajectory ``.h5`` with state observations, see
    :mod:`vla_rl.data.maniskill_h5`)."""

    MOVED = {"num_steps": "sampler.num_steps"}

    model: str = setting("tiny", doc="model preset (configs/model), sized to the data's cameras and dims")
    policy: dict[str, Any] = setting(default_factory=dict,
                                     doc="PolicyConfig overrides of the preset (e.g. policy.depth=2)")
    init: str | None = setting(None, doc="or start from this policy folder (ours, an imported or a LeRobot π0 / π0.5 "
                                         "folder): its architecture and weights, new normalisation statistics")
    steps: int = ranged(500, 1, doc="optimizer steps")
    batch_size: int = ranged(64, 1, doc="frames per step")
    lr: float = ranged(3e-4, 0, 1, lo_open=True, doc="peak learning rate")
    warmup_steps: int = nonneg(100, doc="steps of the linear warm-up")
    norm: Literal["mean_std", "quantile"] = setting("mean_std", doc="how states and actions are normalised")
    seed: int = nonneg(0, doc="seed of the weights, the batches and the noise")
    out: str = setting("runs/sft", doc="the policy folder to write")
    max_episodes: int | None = ranged(None, 1, doc="few-shot: train on the first N episodes only (None: all)")
    idle_threshold: float | None = positive(
        None, doc="drop idle frames (arm |a| below this, gripper unchanged; see data.dataset.idle_frames), e.g. 0.02 "
                  "for ManiSkill motion-planner demos")
    hidden_state_dims: str | int | list[int] | None = nonneg(
        None, doc='state dims the policy never sees (0 after normalising, here and in RL / eval): "9-17" hides '
                  "ManiSkill Panda's joint velocities (see NormStats)")
    eval_episodes: int | None = nonneg(
        None, doc="evaluation episodes after training, for datasets that name their env; 0 skips it. None: 100 on "
                  "the built-in task and ManiSkill, 0 on LIBERO (robosuite evaluates ~15 episodes a minute on 2 "
                  "cores: give a number to evaluate, or use vla-rl eval / bench later)")
    eval_num_envs: int | None = ranged(None, 1, doc="None: 100 built-in envs, 2 ManiSkill worker processes")
    eval_seed: int | None = nonneg(None, doc="None: 10_000 + seed (disjoint from the collection seeds)")
    sampler: SamplerConfig = setting(default_factory=SamplerConfig, doc="the evaluation's sampler (ODE by default)")
    execute: int = ranged(8, 1, doc="actions executed per chunk in the evaluation")
    threads: int | Literal["auto"] = threads_setting()

    def __post_init__(self):
        check_ranges(self)


def load_demos(dataset: str | Path, max_episodes: int | None = None) -> tuple[DemoDataset, dict]:
    """A demo dataset and the env it came from (``{"kind": ..., ...}`` as in ``TrainConfig.env``, or {}).

    ``dataset``: a LeRobot v3.0 folder (its info.json's ``vla_rl`` entry names the env) or a ManiSkill
    trajectory ``.h5`` (the task and control mode come from the ``.json`` beside it)."""
    path = Path(dataset)
    if path.suffix == ".h5":
        data = read_maniskill_h5(path, max_episodes=max_episodes)
        meta = read_trajectory_info(path)
        env_cfg = demo_env_config(data, task=meta.task, control_mode=meta.control_mode or "pd_ee_delta_pose",
                                  obs_mode=meta.obs_mode or "state")
        return data, {"kind": MANISKILL, MANISKILL: to_dict(env_cfg)}
    info = read_lerobot_info(path)
    data = read_lerobot_dataset(path, max_episodes=max_episodes)
    origin = info.get("vla_rl") if isinstance(info.get("vla_rl"), dict) else {}
    kind = origin.get("env")
    if kind in ENV_KINDS:
        return data, {"kind": kind, kind: origin.get("env_config") or {}}
    return data, {}


def run_sft(dataset: str | Path, cfg: SFTRunConfig, *, progress: bool = True, overwrite: bool = False) -> dict:
    """Train a policy on a demo dataset, save it to ``cfg.out`` (weights + normalisation stats of the data +
    the env it came from), and evaluate it with the ODE sampler when the dataset names its env. A ``cfg.out``
    that holds anything is refused before any work unless ``overwrite`` (then replaced atomically at the save).

    The model preset's camera count and state / action sizes follow the data unless ``cfg.policy`` sets
    them (sizes only grow: a smaller env vector is zero-padded into the model's)."""
    check_output(cfg.out, overwrite=overwrite, kind=POLICY, inputs={"dataset": dataset, "init policy": cfg.init})
    torch.manual_seed(cfg.seed)
    data, env_dict, longest = sft_data(dataset, cfg)
    model = sft_model(cfg, data)
    norm = sft_norm(cfg, data)
    print(f"policy '{cfg.init or cfg.model}': {count_parameters(model) / 1e6:.2f}M parameters; "
          f"SFT for {cfg.steps} steps")
    sft_cfg = SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                        seed=cfg.seed, log_every=max(1, min(100, cfg.steps // 10)))
    with torch_threads(policy_threads(cfg.threads)):
        log = train_sft(Actor(model, norm), data, sft_cfg, progress=progress)
    print(loss_summary(log))
    path = save_sft_policy(dataset, cfg, model, norm, data, env_dict, longest)
    print(f"saved the policy to {path}")
    results: dict = {"sft_log": log, "path": str(path)}
    kind = ENV_KINDS.get(env_dict.get("kind"))
    episodes = cfg.eval_episodes if cfg.eval_episodes is not None else (100 if kind and kind.sft_eval else 0)
    if kind is not None and episodes > 0:
        results["eval"] = evaluate_sft_policy(replace(cfg, eval_episodes=episodes), model, norm, env_dict,
                                              progress=progress)
    elif cfg.eval_episodes is None:   # say why there is no success figure, and how to get one
        if kind is not None:
            print(f"no success figure ({kind.name} evaluations are slow: give eval_episodes=N to evaluate here, or "
                  f"run `vla-rl eval {path} episodes=N` later)")
        else:
            print(f"no success figure (the dataset names no env this project runs: `vla-rl eval {path} "
                  "env.kind=... episodes=N` evaluates it on one)")
    return results


def sft_data(dataset: str | Path, cfg: SFTRunConfig) -> tuple[DemoDataset, dict, int]:
    """The frames to train on (``cfg.max_episodes``, idle frames dropped), the env the dataset came from and the
    longest of those demos in env steps (before dropping idle frames: what an episode of the task took)."""
    data, env_dict = load_demos(dataset, cfg.max_episodes)  # reads (and decodes videos of) those episodes only
    if len(data) == 0:
        raise LeRobotDatasetError(f"{dataset} holds no episodes: nothing to train on")
    if cfg.max_episodes is not None:
        data = take_episodes(data, cfg.max_episodes)
    longest = int(torch.unique(data.episode_index, return_counts=True)[1].max())
    if cfg.idle_threshold is not None:
        before = len(data)
        data = drop_idle_frames(data, cfg.idle_threshold)
        print(f"dropped {before - len(data)} idle frames of {before} (idle_threshold={cfg.idle_threshold})")
        if len(data) == 0:
            raise ConfigError(f"idle_threshold={cfg.idle_threshold} drops every frame of {dataset}; lower it")
    _, cams, h, w, _ = data.images.shape
    print(f"dataset {dataset}: {data.num_episodes} episodes, {len(data)} frames, {len(data.tasks)} tasks, "
          f"{cams} camera(s){f' {h}x{w}' if cams else ''}, state {data.state.shape[1]}, action {data.action.shape[1]}")
    return data, env_dict, longest


def sft_model(cfg: SFTRunConfig, data: DemoDataset) -> FlowVLA:
    """The policy to train: ``cfg.init``'s, or a fresh one of ``cfg.model`` sized to the data; one that cannot see
    what the data holds is refused here rather than deep inside the forward pass."""
    _, cams, h, w, _ = data.images.shape
    state_dim, action_dim = data.state.shape[1], data.action.shape[1]
    if cfg.init is not None:
        if cfg.policy:
            raise ConfigError("policy.* overrides change a fresh preset; an init= policy keeps its architecture")
        model, _, _ = load_any_policy(cfg.init)
        pcfg = model.cfg
        # A pretrained policy resizes any image to its own resolution, and masks the camera slots the data lacks.
        fits = pcfg.num_cameras == cams or (0 < cams < pcfg.num_cameras and pcfg.missing_cameras == "mask")
        if not fits:
            raise ConfigError(f"the policy {cfg.init} takes {pcfg.num_cameras} camera(s), the dataset has {cams}")
        print(f"starting from {cfg.init} ({pcfg.num_cameras} camera slot(s), the first {cams} filled)")
    else:
        base = policy_preset(cfg.model)
        auto = {"num_cameras": cams, "state_dim": max(base.state_dim, state_dim),
                "action_dim": max(base.action_dim, action_dim)}
        pcfg = policy_preset(cfg.model, {**auto, **cfg.policy})
        model = None
        if pcfg.num_cameras != cams or (cams and (pcfg.vision.image_size, pcfg.vision.image_size) != (h, w)):
            raise ConfigError(f"model '{cfg.model}' takes {pcfg.num_cameras} camera(s) of {pcfg.vision.image_size}px, "
                              f"the dataset has {cams} of {h}x{w} (override policy.num_cameras / "
                              "policy.vision.image_size)")
    if state_dim > pcfg.state_dim or action_dim > pcfg.action_dim:
        raise ConfigError(f"model '{cfg.model}' has state/action dims {pcfg.state_dim}/{pcfg.action_dim}, the "
                          f"dataset needs {state_dim}/{action_dim}")
    return make_policy(pcfg) if model is None else model


def sft_norm(cfg: SFTRunConfig, data: DemoDataset) -> NormStats:
    """The data's normalisation statistics (``cfg.norm``), with the state dims the policy never sees."""
    try:
        hidden = parse_dims(cfg.hidden_state_dims, data.state.shape[1])
    except ValueError as e:
        raise ConfigError(f"hidden_state_dims: {e}") from None
    norm = NormStats(Stats.of(data.state), Stats.of(data.action), cfg.norm, hidden)
    if hidden:
        print(f"hidden state dims (the policy sees 0 there): {list(hidden)}")
    return norm


def save_sft_policy(dataset: str | Path, cfg: SFTRunConfig, model: FlowVLA, norm: NormStats, data: DemoDataset,
                    env_dict: dict, longest_episode: int) -> Path:
    """The policy folder ``cfg.out``: weights, normalisation, the env it is for (what `vla-rl eval` and
    `vla-rl train init=` use by default) and how it was trained."""
    kind = env_dict.get("kind")
    label = ENV_KINDS[kind].label if kind in ENV_KINDS else None
    env_name = label(env_dict.get(kind) or {}) if label else "lerobot"
    return save_policy(cfg.out, model, norm, meta={
        "env": {"name": env_name, "state_dim": data.state.shape[1], "action_dim": data.action.shape[1]},
        "env_config": env_dict,
        "sft": {**to_dict(cfg), "dataset": str(dataset), "tasks": list(data.tasks),
                "episodes": data.num_episodes, "frames": len(data),
                # what `vla-rl train episode_limit=demos` sizes episodes by (vla_rl.train.lengths)
                "longest_episode": longest_episode}})


def evaluate_sft_policy(cfg: SFTRunConfig, model: FlowVLA, norm: NormStats, env_dict: dict, *,
                        progress: bool) -> dict:
    """The trained policy's success on the env the dataset came from (``cfg.eval_episodes``, ``cfg.sampler``)."""
    env_cfg = from_dict(EnvConfig, env_dict, prefix="dataset env")
    info = env_cfg.info   # an in-process batch is no bigger than the episodes; worker envs are processes
    n = cfg.eval_num_envs or (min(cfg.eval_episodes, info.eval_envs) if info.batched else info.eval_envs)
    eval_seed = 10_000 + cfg.seed if cfg.eval_seed is None else cfg.eval_seed
    env = make_env(env_cfg, num_envs=n, device=torch.device("cpu"), seed=eval_seed)
    try:
        actor = Actor.for_env(model, norm, env.spec)
        threads = policy_threads(cfg.threads, worker_processes=local_worker_processes([env]))
        with torch_threads(threads):
            m = evaluate(actor, env, num_episodes=cfg.eval_episodes, sampler=cfg.sampler,
                         execute=cfg.execute, seed=eval_seed, progress=progress)
    finally:
        if hasattr(env, "close"):
            env.close()
    print(f"success ({cfg.sampler.method.upper()} sampler, {cfg.eval_episodes} episodes, seeds {eval_seed}...): "
          f"{m['eval/success_once']:.2f}")
    return m
