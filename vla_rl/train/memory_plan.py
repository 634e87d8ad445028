"""The memory plan of a training run, per GPU, before anything is allocated (``vla-rl train ... --plan``, and at
the start of every CUDA run): weights, gradients, optimizer state, rollout buffers and the activations of one
micro-batch of the PPO update (and of sampling one chunk for every env), against the device's memory.

Exact parts, from the run's own objects built on the meta device (no memory): the learner is constructed as the run
constructs it (LoRA adapters, frozen parameters, ``param_dtype``), so the trained set, every tensor's dtype and
Adam's state per trained tensor (:mod:`vla_rl.rl.optim`) are the run's; the rollout's tensors have known shapes.

Activations are simulated: the update's forward and backward of one micro-batch (and one chunk's sampling) run on
the meta device while a dispatch mode adds up the bytes of every tensor alive at each moment (:class:`LiveBytes`),
with the run's activation checkpointing; on CUDA the attention is counted as the fused kernels keep it (q, k, v,
output and log-sum-exp saved, no [L, L] matrix) and the matmuls in bf16 under autocast (``bf16=true``). Checked
against measured peaks on the CPU (tests/train/test_memory_plan.py); what the CUDA allocator adds (fragmentation, cuBLAS
workspaces, the CUDA context) is covered by ``RESERVE``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vla_rl.checkpoint.folders import read_yaml_file
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.distributed.ray_config import RayConfig
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.inference import cast_weights
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.policy_config import PolicyConfig
from vla_rl.policies.recompute import activation_checkpointing
from vla_rl.presets import policy_preset
from vla_rl.rl.algorithms import make_algorithm
from vla_rl.rl.algorithms.seam import Batch, Step
from vla_rl.rl.learner import Learner
from vla_rl.rl.optim import LeanAdamW

GIB = 2**30
# Kept free for what the plan does not model: the CUDA context and allocator fragmentation, cuBLAS / attention
# workspaces, the sampler's small tensors.
RESERVE = 2 * GIB


class LiveBytes(TorchDispatchMode):
    """Adds up the bytes of the tensors that operations create while it is active, as long as they are alive; keeps
    the peak. Tensors made before (weights, inputs) are not counted. Works on the meta device (nothing allocated)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list] = {}   # storage -> [tensors alive on it, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # outputs on an input's storage (views, in-place ops) are new memory only if that storage is
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            key = t.untyped_storage()._cdata
            entry = self._refs.get(key)
            if entry is None and key in inputs:   # a tensor made before (a weight, a gradient, an input)
                continue
            if entry is None:
                nbytes = t.untyped_storage().nbytes()
                entry = self._refs[key] = [0, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._release, key)
        return out


class _FusedAttention(torch.autograd.Function):
    """Stands in for ``scaled_dot_product_attention`` as CUDA's fused kernels run it: the output from q's shape, q,
    k, v, the output and a float32 log-sum-exp saved for the backward, no [Lq, Lk] matrix (meta tensors only)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FusedAttention.apply(q, k, v)   # grouped-query kernels read the shared k, v without copies


@contextlib.contextmanager
def _cuda_attention():
    """``scaled_dot_product_attention`` replaced by :class:`_FusedAttention` within the block (a module attribute,
    so that activation checkpointing's recomputation in the backward pass sees it too)."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _probe_inputs(cfg, n: int, device) -> tuple[dict, Tensor, Tensor]:
    size = cfg.vision.image_size
    obs = {"images": torch.zeros(n, cfg.num_cameras, size, size, 3, dtype=torch.uint8, device=device),
           "state": torch.zeros(n, cfg.state_dim, device=device),
           "tokens": torch.zeros(n, cfg.max_text_tokens, dtype=torch.long, device=device),
           "token_mask": torch.ones(n, cfg.max_text_tokens, dtype=torch.bool, device=device)}
    x = torch.zeros(n, cfg.action_horizon, cfg.action_dim, device=device)
    return obs, x, torch.full((n,), 0.5, device=device)


def update_probe(learner: Learner, n: int, sampler) -> Tensor:
    """The learner's algorithm's own loss on ``n`` samples (the passes :meth:`Learner.update` runs per
    micro-batch): a batch of zero inputs of the rollout's shapes, with the algorithm's extras
    (:meth:`~vla_rl.rl.algorithms.seam.Algorithm.extras_spec`), through ``prepare`` and ``loss``."""
    actor, algo = learner.actor, learner.algorithm
    cfg = actor.model_config
    obs, x, _ = _probe_inputs(cfg, n, actor.device)
    k = sampler.num_steps
    dev = actor.device
    stochastic = flow.stochastic_steps(sampler.method, k, n, sde_mode=sampler.sde_mode, device=dev)
    zeros = torch.zeros(n, device=dev)
    extras = {name: torch.zeros(n, *shape, dtype=dtype, device=dev)
              for name, (shape, dtype) in algo.extras_spec(cfg, sampler).items()}
    batch = Batch(actor.model.prepare(obs), torch.zeros(n, k + 1, *x.shape[1:], device=dev), stochastic,
                  torch.zeros(n, k, *x.shape[1:], device=dev), zeros, zeros, zeros if algo.uses_critic else None,
                  extras)
    step = Step(sampler, cfg.action_horizon, actor.dim_mask)
    loss, _ = algo.loss(actor, algo.prepare(batch, step), step)
    return loss


def sampling_probe(model, n: int, *, num_steps: int) -> None:
    """One chunk's sampling for ``n`` envs without autograd: the prefix, then ``num_steps`` expert passes."""
    obs, x, t = _probe_inputs(model.cfg, n, model.device)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        model.value(prefix)
        for _ in range(num_steps):
            x = x + 0.1 * model.expert(prefix, x, t).velocity


def simulate(fn, *, cuda: bool) -> int:
    """Peak bytes of the tensors ``fn`` (on meta tensors) creates and keeps alive, including its backward if it
    returns a loss; ``cuda``: attention as CUDA's fused kernels keep it."""
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(_cuda_attention())
        tracker = stack.enter_context(LiveBytes())
        loss = fn()
        if loss is not None:
            loss.backward()
            del loss
        return tracker.peak


@dataclass
class MemoryPlan:
    """Bytes per GPU. ``rows``: (what, bytes, how it was obtained)."""

    rows: list[tuple[str, int, str]] = field(default_factory=list)
    device_bytes: int | None = None
    device_name: str = ""
    learners: int = 1
    sharded: bool = False

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.rows)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total + RESERVE <= self.device_bytes

    def table(self) -> str:
        lines = [f"memory plan per GPU ({self.learners} learner(s){', sharded (fsdp)' if self.sharded else ''}):",
                 "| what | GiB | how |", "|---|---|---|"]
        lines += [f"| {what} | {b / GIB:.2f} | {how} |" for what, b, how in self.rows]
        lines.append(f"| total (+ {RESERVE / GIB:.0f} GiB reserve) | {(self.total + RESERVE) / GIB:.2f} | |")
        if self.device_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"| {self.device_name or 'device'} | {self.device_bytes / GIB:.2f} | {verdict} |")
        return "\n".join(lines)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def meta_learner(policy_cfg, learner_cfg, algorithm_cfg):
    """The learner a run with policy ``policy_cfg``, ``learner`` and ``algorithm`` settings builds, on the meta device
    (no memory): its model with LoRA adapters, its trained set and dtypes, its optimizer, its algorithm."""
    with torch.device("meta"):
        model = make_policy(policy_cfg)
    norm = NormStats(Stats.identity(policy_cfg.state_dim), Stats.identity(policy_cfg.action_dim))
    return Learner(Actor(model, norm), learner_cfg, make_algorithm(algorithm_cfg))


def _policy_config(train_cfg):
    """The policy config a training config trains: its ``init`` folder's (config.yaml only), else ``model``."""
    if train_cfg.init:
        path = Path(train_cfg.init)
        if (path / "config.yaml").is_file():
            data = read_yaml_file(path / "config.yaml")
            if "policy" in data:
                return from_dict(PolicyConfig, data["policy"], prefix="policy")
    return policy_preset(train_cfg.model)


def without_gradients(model, method: str) -> set[str]:
    """Trained parameters the update's loss never reaches, so they get no gradient and no optimizer state (the
    model's :meth:`~vla_rl.policies.seam.FlowVLA.idle_parameters`; the Flow-Noise std head unless ``method`` is
    ``noise``)."""
    return model.idle_parameters(noise_head=method == "noise")


def static_bytes(learner, *, learners: int = 1, sharded: bool = False, method: str = "noise") -> dict[str, int]:
    """Weights, gradients and optimizer state per learner (exact; the trained parameters that ``method``'s loss
    reaches; sharded: each tensor split in ``learners`` along its first dim, padded as FSDP pads it), plus
    (sharded) the whole weights of the two largest FSDP units that are gathered at a time (the current unit and the
    prefetched one)."""
    model, opt = learner.actor.model, learner.optimizer

    def part(t: Tensor) -> int:
        if not sharded or t.dim() == 0:
            return _nbytes(t)
        rows = math.ceil(t.shape[0] / learners)
        return rows * (t.numel() // max(t.shape[0], 1)) * t.element_size()

    idle = {id(p) for n, p in model.named_parameters() if n in without_gradients(model, method)}
    trained = [p for g in opt.param_groups for p in g["params"] if id(p) not in idle]
    weights = sum(part(p) for p in model.parameters()) + sum(part(b) for b in model.buffers())
    grads = sum(part(p) for p in trained)
    state = 0
    for p in trained:
        if isinstance(opt, LeanAdamW):
            state += 2 * part(p) // p.element_size() * torch.tensor([], dtype=opt.state_dtype).element_size()
            state += 4 * part(p) // p.element_size() if p.dtype != torch.float32 else 0
        else:
            state += 2 * part(p)
        state += 4   # the step counter (a float32 scalar)
    out = {"weights": weights, "gradients": grads, "optimizer state": state}
    if sharded:
        units = [block for group in model.layer_groups() for block in group.modules]
        sizes = sorted((sum(_nbytes(p) for p in u.parameters()) for u in units), reverse=True)
        out["gathered layers (fsdp)"] = sum(sizes[:2])
    return out


def rollout_bytes(policy_cfg, *, num_envs: int, chunks: int, num_steps: int, image_size: int | None = None,
                  num_cameras: int | None = None) -> int:
    """Bytes of a :class:`~vla_rl.rl.rollout.Rollout` of ``chunks`` x ``num_envs`` (exact, for images of
    ``image_size`` from ``num_cameras`` cameras; default the policy's)."""
    c = policy_cfg
    size = c.vision.image_size if image_size is None else image_size
    cams = c.num_cameras if num_cameras is None else num_cameras
    tn = chunks * num_envs
    obs = tn * (cams * size * size * 3 + c.num_cameras + 4 * c.state_dim + 8 * c.max_text_tokens + c.max_text_tokens)
    chain = tn * (num_steps + 1) * c.action_horizon * c.action_dim * 4
    log_probs = tn * num_steps * c.action_horizon * c.action_dim * 4
    stochastic = tn * num_steps
    per_chunk = tn * (4 * 5 + 3)   # entropy, values, rewards, final_values, valid... floats; 3 bool flags
    return obs + chain + log_probs + stochastic + per_chunk - tn * 4 + num_envs * 4


def micro_batch(train_cfg, learners: int = 1) -> int:
    """Samples one learner runs through forward and backward at a time."""
    lcfg = train_cfg.learner
    samples = train_cfg.env.num_envs * train_cfg.rollout_chunks
    mb = math.ceil(samples / lcfg.minibatches)
    return max(1, math.ceil(math.ceil(mb / learners) / lcfg.grad_accum))


@functools.lru_cache(maxsize=256)
def _peak(policy_cfg, lcfg, algorithm_cfg, sampler, bf16: bool, cuda: bool, n: int, what: str) -> int:
    """Simulated peak of a learner of ``policy_cfg`` (at its depth): ``update`` of a micro-batch of ``n``, or
    ``sampling`` of one chunk for ``n`` envs. Cached: suggestions plan many variants of one run."""
    learner = meta_learner(policy_cfg, lcfg, algorithm_cfg)
    model = learner.actor.model
    if cuda and bf16:
        # autocast does not act on meta tensors: bf16 weights give the simulation autocast's bf16 activations
        cast_weights(model, "bf16")
    if what == "sampling":
        return simulate(lambda: sampling_probe(model.eval(), n, num_steps=sampler.num_steps), cuda=cuda)
    for p in learner.params:   # the gradients are counted on their own line: the backward only adds into them
        p.grad = torch.zeros_like(p)
    model.train()
    with activation_checkpointing(model, lcfg.grad_checkpointing):
        return simulate(lambda: update_probe(learner, n, sampler), cuda=cuda)


def simulated_activations(policy_cfg, train_cfg, n: int, *, cuda: bool, full_depth: bool = False) -> tuple[int, int]:
    """Peak activation bytes (update micro-batch of ``n``, sampling of every env). Simulating every op of a
    3B-parameter model on the meta device takes minutes, so the simulation runs at 2 and 3 stream layers and 1 and
    2 vision blocks and extrapolates linearly in depth (each layer adds the activations it keeps for the backward
    pass; the peak comes early in the backward pass); ``full_depth`` simulates the whole model. (Not extrapolated
    in the batch: at small batches a constant transient, such as the embedding table's gradient, sets the peak.)"""
    # what decides the activations (not the number of minibatches or their accumulation: that is n)
    lcfg = replace(train_cfg.learner, minibatches=1, grad_accum=1)
    key = (train_cfg.algorithm, train_cfg.sampler, train_cfg.bf16, cuda)
    envs = train_cfg.env.num_envs
    if full_depth:
        return _peak(policy_cfg, lcfg, *key, n, "update"), _peak(policy_cfg, lcfg, *key, envs, "sampling")

    def at(vd: int, d: int) -> tuple[int, int]:
        cfg = replace(policy_cfg, depth=d, vision=replace(policy_cfg.vision, depth=vd))
        return _peak(cfg, lcfg, *key, n, "update"), _peak(cfg, lcfg, *key, envs, "sampling")

    # Two and three stream layers: with fewer, the prefix has no layer that runs its MLP (the last one computes
    # keys and values only), and the one-off transient of a layer's backward would be counted as per-layer.
    d0 = min(2, policy_cfg.depth)
    vd0 = min(1, policy_cfg.vision.depth)
    base = at(vd0, d0)
    deeper = at(vd0, d0 + 1) if policy_cfg.depth > d0 else base
    wider = at(vd0 + 1, d0) if policy_cfg.vision.depth > vd0 else base
    return tuple(int(b + (policy_cfg.depth - d0) * (d - b) + (policy_cfg.vision.depth - vd0) * (w - b))
                 for b, d, w in zip(base, deeper, wider))


def plan_memory(train_cfg, *, device_bytes: int | None = None, device_name: str = "", cuda: bool = True,
                learners: int | None = None, sharded: bool | None = None) -> MemoryPlan:
    """The memory plan of ``train_cfg`` per learner GPU (the local runtime: the one GPU, which also samples)."""
    ray = train_cfg.ray if train_cfg.runtime == "ray" else None
    learners = learners if learners is not None else (ray.learners if ray and ray.learners else 1)
    sharded = sharded if sharded is not None else bool(ray and ray.sharding == "fsdp")
    policy_cfg = _policy_config(train_cfg)
    learner = meta_learner(policy_cfg, train_cfg.learner, train_cfg.algorithm)
    plan = MemoryPlan(device_bytes=device_bytes, device_name=device_name, learners=learners, sharded=sharded)
    static = static_bytes(learner, learners=learners, sharded=sharded, method=train_cfg.sampler.method)
    how = "exact" + (f", 1/{learners} per learner" if sharded else "")
    plan.rows += [(k, v, "exact (whole layers)" if "fsdp" in k else how) for k, v in static.items()]
    plan.rows.append(("rollout buffers", rollout_bytes(policy_cfg, num_envs=train_cfg.env.num_envs,
                                                       chunks=train_cfg.rollout_chunks,
                                                       num_steps=train_cfg.sampler.num_steps),
                      f"exact ({train_cfg.rollout_chunks} chunks x {train_cfg.env.num_envs} envs, policy-size images)"))
    if cuda and train_cfg.bf16 and train_cfg.learner.param_dtype == "fp32":
        extra = sum(_nbytes(p) // 2 for p in learner.params if p.dim() >= 2)
        plan.rows.append(("autocast bf16 weight copies", extra, "exact (trained matrices, cached per forward)"))
    n = micro_batch(train_cfg, learners)
    sampler, ckpt = train_cfg.sampler, train_cfg.learner.grad_checkpointing
    act, sample = simulated_activations(policy_cfg, train_cfg, n, cuda=cuda)
    # The update and the sampling do not overlap: the larger of the two counts.
    if act >= sample:
        plan.rows.append((f"activations, update micro-batch of {n}", act,
                          f"simulated (checkpointing {ckpt}, {train_cfg.algorithm.name}, {sampler.method}, "
                          f"K={sampler.num_steps})"))
    else:
        plan.rows.append((f"sampling {train_cfg.env.num_envs} envs (> update activations {act / GIB:.2f} GiB)",
                          sample, "simulated"))
    return plan


def suggestions(train_cfg, device_bytes: int, *, cuda: bool = True, limit: int = 4) -> list[str]:
    """Settings (``key=value``) that would make ``train_cfg`` fit ``device_bytes`` per GPU, each checked with its own
    plan; the cheapest changes first."""
    lcfg, out = train_cfg.learner, []
    tries: list[tuple[str, dict]] = []
    if lcfg.grad_checkpointing != "all":
        tries.append(("learner.grad_checkpointing=all", {"learner": replace(lcfg, grad_checkpointing="all")}))
    for factor in (2, 4, 8):
        tries.append((f"learner.grad_accum={lcfg.grad_accum * factor}",
                      {"learner": replace(lcfg, grad_accum=lcfg.grad_accum * factor)}))
    if "bf16" not in (lcfg.param_dtype, lcfg.optimizer_state_dtype):
        tries.append(("learner.param_dtype=bf16 learner.optimizer_state_dtype=bf16",
                      {"learner": replace(lcfg, param_dtype="bf16", optimizer_state_dtype="bf16")}))
    if not lcfg.lora.enabled and not lcfg.freeze_prefix:
        tries.append(("learner.lora.rank=16", {"learner": replace(lcfg, lora=replace(lcfg.lora, rank=16))}))
    if not lcfg.freeze_prefix and not (lcfg.lora.enabled and "prefix" in lcfg.lora.parts):
        tries.append(("learner.freeze_prefix=true", {"learner": replace(lcfg, freeze_prefix=True)}))
    for k in (2, 4, 8):
        tries.append((f"runtime=ray ray.learners={k} ray.learner_gpus=1 ray.sharding=fsdp",
                      {"runtime": "ray", "ray": RayConfig(learners=k, learner_gpus=1, sharding="fsdp")}))
    for label, change in tries:
        try:
            cfg = replace(train_cfg, **change)
        except Exception:   # a combination the config refuses
            continue
        if plan_memory(cfg, device_bytes=device_bytes, cuda=cuda).fits:
            out.append(label)
            if len(out) >= limit:
                break
    return out


def device_memory(device: torch.device) -> tuple[int, str] | None:
    """(free bytes, name) of a CUDA device; None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free, f"{torch.cuda.get_device_name(device)} (free)"


def check_plan(train_cfg, *, device_bytes: int | None, device_name: str = "", cuda: bool = True,
               log=print, max_suggestions: int = 4) -> MemoryPlan:
    """Print ``train_cfg``'s plan; raise :class:`~vla_rl.presets.ConfigError` if it does not fit ``device_bytes``,
    naming the settings that would make it fit."""
    plan = plan_memory(train_cfg, device_bytes=device_bytes, device_name=device_name, cuda=cuda)
    log(plan.table())
    if plan.fits is False:
        fixes = suggestions(train_cfg, device_bytes, cuda=cuda, limit=max_suggestions)
        advice = ("it would fit with " + "; or ".join(f"`{f}`" for f in fixes)) if fixes else \
            "none of checkpointing, smaller micro-batches, bf16 optimizer options, LoRA, freeze_prefix or up to 8 " \
            "sharded learners makes it fit"
        raise ConfigError(f"the run needs {(plan.total + RESERVE) / GIB:.1f} GiB per GPU (plan above) but "
                          f"{device_name or 'the device'} has {device_bytes / GIB:.1f} GiB: {advice} "
                          "(memory_plan=false skips this check)")
    return plan
