"""How a flow policy runs for deployment and evaluation: the weights' precision and how the K-step denoising
loop is executed. Configuration only: the model and the flow math are the same whatever is chosen here.

- ``dtype``: ``fp32``, or ``bf16`` weights (:func:`cast_weights`). What bf16 weights leave in float32: the
  RMSNorm scales (read in float32 by the norm, which also accumulates in float32), the rotary tables and the
  flow-time embedding's angles (computed from positions and t, never from weights), the Euler iterate ``x``
  and every velocity (the velocity head's output is cast to float32 before the step).
- ``compile``: how the denoising loop runs (:class:`Denoiser`):
    ``none``       eagerly, :func:`flow.denoise` of :meth:`FlowVLA.velocity_field` (the reference);
    ``compile``    the K expert passes and Euler steps as one ``torch.compile`` region (static shapes: a new
                   batch size or prefix length compiles again);
    ``cudagraph``  the K steps captured once per shape as a CUDA graph over static input buffers (the
                   prefix's keys/values, mask, rotary tables, state token and the initial noise are copied
                   into them, then the graph replays: one launch for the whole loop).
  Where the chosen mode cannot run (``cudagraph`` off CUDA, ``torch.compile`` failing, autograd enabled, more
  distinct shapes than ``max_graphs``) the loop runs eagerly, with a warning said once per process.

Glossary: N batch, H actions per chunk, A action dims, K denoising steps, P prefix tokens.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from vla_rl.policies.base import ExpertContext, Prefix
from vla_rl.policies.layers import RMSNorm
from vla_rl.policies.seam import FlowVLA

from . import flow

WeightDtype = Literal["fp32", "bf16"]
CompileMode = Literal["none", "compile", "cudagraph"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPILE_MODES = ("none", "compile", "cudagraph")


def cast_weights(model: FlowVLA, dtype: WeightDtype) -> FlowVLA:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` in place (and return it), keeping
    the RMSNorm scales in float32: the norm reads them in float32 anyway, and Gemma's scales ``1 + w`` lose
    their low bits in bf16 for the cost of a few kilobytes. ``fp32`` casts every tensor back to float32
    (exact from bf16)."""
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype must be one of {list(DTYPES)}, got {dtype!r}")
    target = DTYPES[dtype]
    for module in model.modules():
        keep = torch.float32 if isinstance(module, RMSNorm) else target
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != keep:
                p.data = p.data.to(keep)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and b.dtype != keep:
                module._buffers[name] = b.to(keep)
    return model


def weight_dtype(model: FlowVLA) -> str:
    """``fp32`` / ``bf16``: the dtype of the model's linear weights (``other`` for anything else)."""
    return {v: k for k, v in DTYPES.items()}.get(model.dtype, "other")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def euler_steps(model: FlowVLA, prefix: Prefix, ctx: ExpertContext, x: Tensor, grid: Tensor) -> Tensor:
    """The ODE sampler's K Euler steps from ``x`` ``[N, H, A]`` (float32, t = 1) over ``grid`` ``[K+1]``: the
    operations of :func:`flow.denoise` on :meth:`FlowVLA.velocity_field`, without its input checks (a
    check that reads a tensor's value synchronises, which a CUDA graph cannot capture)."""
    n = x.shape[0]
    for k in range(grid.shape[0] - 1):
        v = model.sampling_velocity(prefix, ctx, x, grid[k].expand(n))
        x = flow.ode_mean(x, v, grid[k] - grid[k + 1])
    return x


class _Graph:
    """One captured CUDA graph of :func:`euler_steps` and the static tensors it reads and writes."""

    def __init__(self, model: FlowVLA, prefix: Prefix, noise: Tensor, num_steps: int):
        self.prefix = Prefix([k.clone() for k in prefix.keys], [v.clone() for v in prefix.values],
                             prefix.mask.clone(), None,
                             None if prefix.state_token is None else prefix.state_token.clone())
        self.ctx = model.sampling_context(self.prefix)
        self.x = noise.float().clone()
        self.grid = flow.time_grid(num_steps, device=noise.device)
        side = torch.cuda.Stream(device=noise.device)
        side.wait_stream(torch.cuda.current_stream(noise.device))
        with torch.cuda.stream(side):   # warm-up off the capture: lazy initialisations, kernel choices
            for _ in range(2):
                euler_steps(model, self.prefix, self.ctx, self.x, self.grid)
        torch.cuda.current_stream(noise.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = euler_steps(model, self.prefix, self.ctx, self.x, self.grid)

    def __call__(self, model: FlowVLA, prefix: Prefix, noise: Tensor) -> Tensor:
        p = prefix.mask.shape[1]
        fresh = model.sampling_context(prefix, buffers=False)
        for static, new in zip(self.ctx.rope, fresh.rope):
            static.copy_(new)
        self.ctx.attn_mask.copy_(fresh.attn_mask)
        self.prefix.mask.copy_(prefix.mask)
        for static, new in zip(self.ctx.keys + self.ctx.values, prefix.keys + prefix.values):
            static[:, :, :p].copy_(new)
        if prefix.state_token is not None:
            self.prefix.state_token.copy_(prefix.state_token)
        self.x.copy_(noise)
        self.graph.replay()
        return self.out


class Denoiser:
    """The ODE sampler's actions ``[N, H, A]`` from a prefix and initial noise, the loop run as ``mode`` says
    (module doc). ``mode="none"`` is :func:`flow.denoise` of :meth:`FlowVLA.velocity_field` itself; the
    other modes compute the same operations (tests/test_gpu_path.py)."""

    def __init__(self, model: FlowVLA, mode: CompileMode = "none", *, max_graphs: int = 4):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {list(COMPILE_MODES)}, got {mode!r}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.model, self.mode, self.max_graphs = model, mode, max_graphs
        self._graphs: dict[tuple, _Graph] = {}
        self._compiled = None
        self._compile_failed = False
        self._shapes: set[tuple] = set()

    def eager(self, prefix: Prefix, noise: Tensor, num_steps: int) -> Tensor:
        return flow.denoise(self.model.velocity_field(prefix), noise, num_steps=num_steps)

    def __call__(self, prefix: Prefix, noise: Tensor, *, num_steps: int) -> Tensor:
        if self.mode == "none":
            return self.eager(prefix, noise, num_steps)
        if torch.is_grad_enabled():
            _warn_once(f"compile={self.mode} runs without autograd only (under torch.no_grad or "
                       "torch.inference_mode); the denoising loop runs eagerly")
            return self.eager(prefix, noise, num_steps)
        flow._check_chunk("noise", noise)   # the checks flow.denoise makes, once per chunk, outside the loop
        key = (tuple(noise.shape), prefix.mask.shape[1], self.model.dtype, noise.device, num_steps,
               torch.is_inference_mode_enabled())
        if self.mode == "cudagraph":
            return self._graphed(key, prefix, noise, num_steps)
        return self._compile(key, prefix, noise, num_steps)

    def _new_shape_allowed(self, key: tuple) -> bool:
        if key in self._shapes:
            return True
        if len(self._shapes) >= self.max_graphs:
            _warn_once(f"compile={self.mode}: more than max_graphs={self.max_graphs} distinct input shapes; "
                       "new shapes run the denoising loop eagerly")
            return False
        self._shapes.add(key)
        return True

    def _graphed(self, key: tuple, prefix: Prefix, noise: Tensor, num_steps: int) -> Tensor:
        if noise.device.type != "cuda" or not torch.cuda.is_available():
            _warn_once("compile=cudagraph needs a CUDA device; the denoising loop runs eagerly")
            return self.eager(prefix, noise, num_steps)
        if not self._new_shape_allowed(key):
            return self.eager(prefix, noise, num_steps)
        # The static buffers are written in place at every call: they are made, and always written, in
        # inference mode (an inference tensor cannot be written outside it); the result is cloned out.
        with torch.inference_mode():
            if key not in self._graphs:
                self._graphs[key] = _Graph(self.model, prefix, noise, num_steps)
            out = self._graphs[key](self.model, prefix, noise)
        return out.clone()

    def _compile(self, key: tuple, prefix: Prefix, noise: Tensor, num_steps: int) -> Tensor:
        if self._compile_failed or not self._new_shape_allowed(key):
            return self.eager(prefix, noise, num_steps)
        if self._compiled is None:
            model = self.model

            def loop(prefix: Prefix, ctx: ExpertContext, x: Tensor, grid: Tensor) -> Tensor:
                return euler_steps(model, prefix, ctx, x, grid)

            self._compiled = torch.compile(loop, dynamic=False)
        ctx = self.model.sampling_context(prefix)
        grid = flow.time_grid(num_steps, device=noise.device)
        try:
            return self._compiled(prefix, ctx, noise.float(), grid)
        except Exception as e:   # noqa: BLE001  (no compiler, an unsupported operation: run eagerly instead)
            self._compile_failed = True
            _warn_once(f"compile=compile: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                       "the denoising loop runs eagerly")
            return self.eager(prefix, noise, num_steps)
