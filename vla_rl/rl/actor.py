"""The acting policy: model + normalisation + a sampler, from env observations to env action chunks.

The model works in normalised units and may have more state / action dims than the env (π0 pads to 32);
the actor pads the env's state, and cuts, unnormalises and clips the model's actions, with the conversions of
:mod:`vla_rl.policies.normalize` (an exported policy uses the same ones).

Glossary: N envs, H actions per chunk, A model action dims, a env action dims, K denoising steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vla_rl.config import check_ranges, positive, ranged
from vla_rl.policies import flow
from vla_rl.policies.inference import CompileMode, Denoiser
from vla_rl.policies.model import FlowPolicy, Prefix
from vla_rl.policies.normalize import NormStats, actions_from_model, actions_to_model, state_to_model


@dataclass(frozen=True)
class SamplerConfig:
    """How action chunks are drawn: ``num_steps`` (K) denoising steps with ``method``."""

    num_steps: int = ranged(4, 1)
    method: Literal["ode", "sde", "noise"] = "ode"
    noise_level: float = positive(0.5)
    sde_mode: Literal["all", "mixed"] = "mixed"

    def __post_init__(self):
        check_ranges(self)


@dataclass
class Act:
    """actions ``[N, H, a]`` in env units (clipped); sample: the flow chain in model units; prefix."""

    actions: Tensor
    sample: flow.FlowSample
    prefix: Prefix


class Actor:
    """``model`` + ``norm`` acting on an env of ``env_state_dim`` / ``env_action_dim`` (default: the widths of
    ``norm``'s statistics, which are the env's) with actions clipped to ``[action_low, action_high]``.
    :meth:`for_env` takes all four from an env's spec. ``compile`` says how :meth:`chunk`'s denoising loop
    runs (:class:`~vla_rl.policies.inference.Denoiser`: ``none``, ``compile`` or ``cudagraph``)."""

    def __init__(self, model: FlowPolicy, norm: NormStats, *, env_state_dim: int | None = None,
                 env_action_dim: int | None = None, action_low: float = -1.0, action_high: float = 1.0,
                 compile: CompileMode = "none"):
        cfg = model.cfg
        if env_state_dim is None:
            env_state_dim = norm.state.mean.shape[0]
        if env_action_dim is None:
            env_action_dim = norm.action.mean.shape[0]
        if env_state_dim > cfg.state_dim or env_action_dim > cfg.action_dim:
            raise ValueError(f"env has state/action dims {env_state_dim}/{env_action_dim}, more than the "
                             f"model's {cfg.state_dim}/{cfg.action_dim}")
        stats = (norm.state.mean.shape[0], norm.action.mean.shape[0])
        if stats != (env_state_dim, env_action_dim):
            raise ValueError(f"the policy's normalisation statistics are for state/action dims {stats[0]}/{stats[1]}, "
                             f"the env has {env_state_dim}/{env_action_dim} (a policy made for another task?)")
        self.model, self.norm = model, norm
        self.env_state_dim, self.env_action_dim = env_state_dim, env_action_dim
        self.action_low, self.action_high = action_low, action_high
        self.denoiser = Denoiser(model, compile)

    @classmethod
    def for_env(cls, model: FlowPolicy, norm: NormStats, spec, *, compile: CompileMode = "none") -> Actor:
        """The actor for an env with ``spec`` (an :class:`~vla_rl.envs.base.EnvSpec`): its state and action
        widths and its action bounds."""
        return cls(model, norm, env_state_dim=spec.state_dim, env_action_dim=spec.action_dim,
                   action_low=spec.action_low, action_high=spec.action_high, compile=compile)

    @property
    def dim_mask(self) -> Tensor:
        """``[A]`` True on the model action dims that the env really has."""
        m = torch.zeros(self.model.cfg.action_dim, dtype=torch.bool, device=self.model.device)
        m[: self.env_action_dim] = True
        return m

    def model_obs(self, obs: dict) -> dict:
        """Env observation -> model input (normalised state padded to the model's width)."""
        state = obs["state"].to(self.model.device, torch.float32)
        if state.shape[-1] != self.env_state_dim:
            raise ValueError(f"state has {state.shape[-1]} dims, expected {self.env_state_dim}")
        out = {"images": obs["images"].to(self.model.device),
               "state": state_to_model(self.norm, state, self.model.cfg.state_dim)}
        for key in ("instruction", "tokens", "token_mask"):
            if key in obs:
                out[key] = obs[key]
        return out

    def model_actions(self, actions: Tensor) -> Tensor:
        """Env-unit actions ``[..., a]`` -> normalised model actions ``[..., A]`` (padded with 0)."""
        return actions_to_model(self.norm, actions.to(self.model.device, torch.float32), self.model.cfg.action_dim)

    def env_actions(self, x: Tensor) -> Tensor:
        """Model actions ``[..., A]`` -> env units ``[..., a]``, clipped to the action bounds."""
        return actions_from_model(self.norm, x, self.env_action_dim, self.action_low, self.action_high)

    def encode(self, obs: dict) -> Prefix:
        return self.model.encode_prefix(self.model_obs(obs))

    def act(self, obs: dict, sampler: SamplerConfig, *, generator: torch.Generator | None = None,
            prefix: Prefix | None = None, draws: flow.SampleNoise | None = None) -> Act:
        """Sample a chunk per env. ``draws`` (from :meth:`draw`): the random draws to use instead of drawing
        them from ``generator`` (same numbers: :meth:`draw` with that generator)."""
        prefix = prefix if prefix is not None else self.encode(obs)
        if draws is None:
            draws = self.draw(prefix.batch_size, sampler, generator=generator)
        elif draws.initial.shape[0] != prefix.batch_size:
            raise ValueError(f"draws are for {draws.initial.shape[0]} chunks, the batch has {prefix.batch_size}")
        sample = flow.sample(self.model.field(prefix), draws.initial, num_steps=sampler.num_steps,
                             method=sampler.method, noise_level=sampler.noise_level,
                             sde_mode=sampler.sde_mode, stochastic=draws.stochastic, step_noise=draws.steps)
        return Act(actions=self.env_actions(sample.actions), sample=sample, prefix=prefix)

    def draw(self, batch: int, sampler: SamplerConfig, *, generator: torch.Generator | None = None
             ) -> flow.SampleNoise:
        """Every random draw of sampling ``batch`` chunks with ``sampler`` (:func:`flow.draw_sample_noise`)."""
        cfg = self.model.cfg
        return flow.draw_sample_noise(batch, cfg.action_horizon, cfg.action_dim, num_steps=sampler.num_steps,
                                      method=sampler.method, sde_mode=sampler.sde_mode, generator=generator,
                                      device=self.model.device)

    def draw_keyed(self, keys: list[Tensor | int], sampler: SamplerConfig) -> flow.SampleNoise:
        """Every random draw of sampling one chunk per row, row ``i``'s a function of its ``keys`` alone
        (:func:`flow.keyed_sample_noise`): what an evaluation episode named by its seed draws, whatever batch it
        runs in."""
        cfg = self.model.cfg
        return flow.keyed_sample_noise(keys, cfg.action_horizon, cfg.action_dim, num_steps=sampler.num_steps,
                                       method=sampler.method, sde_mode=sampler.sde_mode, device=self.model.device)

    def chunk(self, obs: dict, sampler: SamplerConfig, *, generator: torch.Generator | None = None,
              draws: flow.SampleNoise | None = None) -> Tensor:
        """Env-unit actions ``[N, H, a]`` alone (evaluation, deployment), from ``draws`` (:meth:`draw_keyed`,
        :meth:`draw`) or else drawn from ``generator``. The ODE sampler takes the deterministic fast path
        (:func:`flow.denoise` of :meth:`FlowPolicy.velocity_field`, its loop run as ``compile`` says: no step
        noise, densities, chain, std or value head, nor the prefix's unread last-layer outputs); the stochastic
        samplers need their step noise and run :meth:`act`."""
        if sampler.method != "ode":
            return self.act(obs, sampler, generator=generator, draws=draws).actions
        prefix = self.model.encode_prefix(self.model_obs(obs), hidden=False)
        cfg = self.model.cfg
        if draws is not None:
            if draws.initial.shape[0] != prefix.batch_size:
                raise ValueError(f"draws are for {draws.initial.shape[0]} chunks, the batch has {prefix.batch_size}")
            noise = draws.initial
        else:
            noise = torch.randn(prefix.batch_size, cfg.action_horizon, cfg.action_dim, generator=generator,
                                device=self.model.device)
        return self.env_actions(self.denoiser(prefix, noise, num_steps=sampler.num_steps))
