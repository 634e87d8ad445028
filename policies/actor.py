"""The acting policy: model + normalisation + a sampler, from env observations to env action chunks.

The model works in normalised units and may have more state / action dims than the env (π0 pads to 32);
the actor pads the env's state, and cuts, unnormalises and clips the model's actions, with the conversions of
:mod:`vla_rl.policies.normalize` (an exported policy uses the same ones).

The actor is a rollout's only door to the model: :meth:`Actor.observe` turns an env observation into the model's
prepared inputs (validated and tokenized once) and their prefix; :meth:`Actor.act` samples a chunk from them and
returns everything a rollout stores (the chain, its log-densities, the mean step entropy, the value);
:meth:`Actor.value` is the value of an observation. Evaluation and deployment call :meth:`Actor.chunk`.

Glossary: N envs, H actions per chunk, A model action dims, a env action dims, K denoising steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vla_rl.core.ranges import check_ranges, positive, ranged, setting
from vla_rl.policies.base import Prefix
from vla_rl.policies.inference import CompileMode, Denoiser
from vla_rl.policies.normalize import NormStats, actions_from_model, actions_to_model, state_to_model
from vla_rl.policies.seam import FlowVLA

from . import flow


@dataclass(frozen=True)
class SamplerConfig:
    """How action chunks are drawn: ``num_steps`` (K) denoising steps with ``method``."""

    num_steps: int = ranged(4, 1, doc="K: denoising steps from noise (t = 1) to an action chunk (t = 0)")
    method: Literal["ode", "sde", "noise"] = setting(
        "ode", doc="ode: deterministic given the initial noise (a deployed policy's sampler); sde: Flow-SDE; noise: "
                   "Flow-Noise (a learned noise head); RL needs sde or noise, which have a likelihood (docs/flow.md)")
    noise_level: float = positive(0.5, doc="Flow-SDE's noise scale a: sigma_t = a sqrt(t / (1 - t))")
    sde_mode: Literal["all", "mixed"] = setting(
        "mixed", doc="Flow-SDE: all = every denoising step stochastic; mixed = one random step per chunk, the rest ODE")

    def __post_init__(self):
        check_ranges(self)


@dataclass
class Observation:
    """What the actor saw of ``N`` env observations: the model's prepared inputs (:meth:`FlowVLA.prepare`:
    ``images``, ``image_mask``, normalised padded ``state``, ``tokens``, ``token_mask``; what a rollout stores and
    the learner re-encodes) and their prefix."""

    inputs: dict[str, Tensor]
    prefix: Prefix
    state: Tensor | None = None   # the env state [N, s] as observed (for a policy with relative action dims)


@dataclass
class Act:
    """One sampled chunk per env: what a rollout stores.

    actions     ``[N, H, a]``        env units, clipped to the action bounds
    chain       ``[N, K+1, H, A]``   the flow chain in model units (``chain[:, -1]``: the model's actions)
    stochastic  ``[N, K]``           which denoising steps were Gaussian
    log_probs   ``[N, K, H, A]``     per-element log-densities of the chain's steps, as sampled
    entropy     ``[N]``              mean Gaussian step entropy (:func:`flow.mean_entropy`): executed actions, real dims
    value       ``[N]``              the critic's value of the observation
    """

    actions: Tensor
    chain: Tensor
    stochastic: Tensor
    log_probs: Tensor
    entropy: Tensor
    value: Tensor


class Actor:
    """``model`` + ``norm`` acting on an env of ``env_state_dim`` / ``env_action_dim`` (default: the widths of
    ``norm``'s statistics, which are the env's) with actions clipped to ``[action_low, action_high]``.
    :meth:`for_env` takes all four from an env's spec. ``compile`` says how :meth:`chunk`'s denoising loop
    runs (:class:`~vla_rl.policies.inference.Denoiser`: ``none``, ``compile`` or ``cudagraph``)."""

    def __init__(self, model: FlowVLA, norm: NormStats, *, env_state_dim: int | None = None,
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
    def for_env(cls, model: FlowVLA, norm: NormStats, spec, *, compile: CompileMode = "none") -> Actor:
        """The actor for an env with ``spec`` (an :class:`~vla_rl.envs.base.EnvSpec`): its state and action
        widths and its action bounds."""
        return cls(model, norm, env_state_dim=spec.state_dim, env_action_dim=spec.action_dim,
                   action_low=spec.action_low, action_high=spec.action_high, compile=compile)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def model_config(self):
        """The model's :class:`~vla_rl.policies.policy_config.PolicyConfig` (sizes: horizon, action dims, ...)."""
        return self.model.cfg

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
        images = obs["images"]   # one tensor, or one per camera (cameras of different sizes)
        images = [c.to(self.model.device) for c in images] if isinstance(images, (list, tuple)) else \
            images.to(self.model.device)
        out = {"images": images,
               "state": state_to_model(self.norm, state, self.model.cfg.state_dim)}
        for key in ("instruction", "tokens", "token_mask"):
            if key in obs:
                out[key] = obs[key]
        return out

    def model_actions(self, actions: Tensor, state: Tensor | None = None) -> Tensor:
        """Env-unit actions ``[..., a]`` -> normalised model actions ``[..., A]`` (padded with 0); ``state``: the env
        state they were taken in (``[N, s]`` for chunks ``[N, H, a]``), needed by a policy with relative action
        dims (:attr:`NormStats.relative_actions`)."""
        return actions_to_model(self.norm, actions.to(self.model.device, torch.float32), self.model.cfg.action_dim,
                                state)

    def env_actions(self, x: Tensor, state: Tensor | None = None) -> Tensor:
        """Model actions ``[..., A]`` -> env units ``[..., a]``, clipped to the action bounds (``state``: as in
        :meth:`model_actions`)."""
        return actions_from_model(self.norm, x, self.env_action_dim, self.action_low, self.action_high, state)

    def observe(self, obs: dict, *, hidden: bool = True) -> Observation:
        """An env observation as the model's prepared inputs and their prefix (``hidden=False``: without the last
        prefix layer's outputs, which only a prefix-sourced value head reads)."""
        inputs = self.model.prepare(self.model_obs(obs))
        state = obs["state"].to(self.model.device, torch.float32) if self.norm.relative_actions else None
        return Observation(inputs, self.prefix(inputs, hidden=hidden), state)

    def prefix(self, inputs: dict[str, Tensor], *, hidden: bool = True) -> Prefix:
        """The prefix of prepared model inputs (:attr:`Observation.inputs`, e.g. as a rollout stored them)."""
        return self.model.encode_prefix(inputs, hidden=hidden, prepared=True)

    def act(self, seen: Observation, sampler: SamplerConfig, *, generator: torch.Generator | None = None,
            draws: flow.SampleNoise | None = None, execute: int | None = None) -> Act:
        """Sample a chunk per env from what :meth:`observe` saw. ``draws`` (from :meth:`draw`): the random draws to
        use instead of drawing them from ``generator`` (same numbers: :meth:`draw` with that generator);
        ``execute``: the actions of each chunk the env will run (the entropy counts those)."""
        s = self._sample(seen.prefix, sampler, generator=generator, draws=draws)
        return Act(actions=self.env_actions(s.actions, seen.state), chain=s.chain, stochastic=s.stochastic,
                   log_probs=s.log_probs,
                   entropy=flow.mean_entropy(s.entropy, s.stochastic, executed=execute, dim_mask=self.dim_mask),
                   value=self.model.value(seen.prefix))

    def _sample(self, prefix: Prefix, sampler: SamplerConfig, *, generator: torch.Generator | None,
                draws: flow.SampleNoise | None) -> flow.FlowSample:
        if draws is None:
            draws = self.draw(prefix.batch_size, sampler, generator=generator)
        elif draws.initial.shape[0] != prefix.batch_size:
            raise ValueError(f"draws are for {draws.initial.shape[0]} chunks, the batch has {prefix.batch_size}")
        return flow.sample(self.model.field(prefix), draws.initial, num_steps=sampler.num_steps,
                           method=sampler.method, noise_level=sampler.noise_level,
                           sde_mode=sampler.sde_mode, stochastic=draws.stochastic, step_noise=draws.steps)

    def value(self, seen: Observation) -> Tensor:
        """``[N]``: the critic's value of what :meth:`observe` saw."""
        return self.model.value(seen.prefix)

    # ------------------------------------------------------------------------------------------------
    # What a learner's loss asks of the policy (the learner reaches the model through these alone)
    # ------------------------------------------------------------------------------------------------
    @property
    def value_from_prefix(self) -> bool:
        """Whether the critic reads the prefix's final hidden states (encode them: :meth:`prefix` ``hidden=``)."""
        return self.model.cfg.value_source == "prefix"

    def prefix_value(self, prefix: Prefix) -> Tensor:
        """``[N]``: the critic's value of the observations encoded in ``prefix`` (:meth:`prefix`)."""
        return self.model.value(prefix)

    def chain_log_prob(self, prefix: Prefix, chain: Tensor, stochastic: Tensor,
                       sampler: SamplerConfig) -> flow.ChainLogProb:
        """The per-element log-densities of stored chains ``[N, K+1, H, A]`` under the current parameters, each
        step Gaussian as ``stochastic`` ``[N, K]`` and ``sampler`` (its method and noise level) say."""
        return flow.chain_log_prob(self.model.field(prefix), chain, stochastic, method=sampler.method,
                                   noise_level=sampler.noise_level)

    def flow_matching_errors(self, prefix: Prefix, actions: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """``[N, H, A]`` squared errors of the velocity at ``x_t = t * noise + (1 - t) * actions`` (model units,
        ``actions`` / ``noise`` ``[N, H, A]``, ``t`` ``[N]``) against the conditional target ``noise - actions``:
        the conditional flow-matching loss per element (likelihood-free methods compare it across parameters)."""
        return flow.flow_matching_errors(self.model.velocity_field(prefix), actions, t, noise)

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
        (:func:`flow.denoise` of :meth:`FlowVLA.velocity_field`, its loop run as ``compile`` says: no step
        noise, densities, chain, std or value head, nor the prefix's unread last-layer outputs); the stochastic
        samplers need their step noise and sample as :meth:`act` does (without the value)."""
        if sampler.method != "ode":
            seen = self.observe(obs)
            return self.env_actions(self._sample(seen.prefix, sampler, generator=generator, draws=draws).actions,
                                    seen.state)
        seen = self.observe(obs, hidden=False)
        prefix = seen.prefix
        cfg = self.model.cfg
        if draws is not None:
            if draws.initial.shape[0] != prefix.batch_size:
                raise ValueError(f"draws are for {draws.initial.shape[0]} chunks, the batch has {prefix.batch_size}")
            noise = draws.initial
        else:
            noise = torch.randn(prefix.batch_size, cfg.action_horizon, cfg.action_dim, generator=generator,
                                device=self.model.device)
        return self.env_actions(self.denoiser(prefix, noise, num_steps=sampler.num_steps), seen.state)
