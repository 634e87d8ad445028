"""Pure flow-matching math: samplers and chain likelihoods for ODE, Flow-SDE and Flow-Noise.

Time runs from t=1 (pure noise) to t=0 (the action), as in openpi. The learned velocity points from the
action to the noise (target ``eps - a`` for ``x_t = t*eps + (1-t)*a``), so a denoising step is
``x_{t-dt} = x_t - dt * v``.

Everything here is a function of a *field* callable ``field(x_t, t)``:
  - ``x_t`` ``[N, H, A]`` the current noisy chunk, ``t`` ``[N]`` the time of each sample;
  - returns the velocity ``[N, H, A]``, or a tuple ``(velocity, std)`` where ``std`` ``[N, H, A]``
    is the Flow-Noise head's per-element standard deviation (needed only by ``method="noise"``).
No model classes and no config objects: that is what makes these functions testable against closed
forms.

Glossary: N samples (envs), H actions per chunk, A action dims, K denoising steps. Signatures carry the shapes
(jaxtyping: ``Float[Tensor, "n h a"]``; ``k1`` is K + 1); tests/policies/test_shapes.py checks them at run time.
The chain ``x_0..x_K`` is stored as ``chain[:, k]``: ``chain[:, 0]`` is the initial noise (t=1) and
``chain[:, K]`` the action (t=0). Step ``k`` maps ``chain[:, k]`` (time ``t_k``) to ``chain[:, k+1]``.

Methods:
  - ``"ode"``   deterministic Euler, sigma = 0 (evaluation and deployment; :func:`denoise` is its fast
                path when only the actions are wanted).
  - ``"sde"``   Flow-SDE: the ODE turned into an SDE with the same marginals,
                sigma_t = a * sqrt(t / (1 - t)); ``sde_mode="all"`` makes every step stochastic,
                ``"mixed"`` one step per sample chosen at random (the others ODE): the cheap default,
                whose likelihood needs one field evaluation per chunk.
  - ``"noise"`` Flow-Noise: ODE mean with the learned std; every step stochastic; the joint
                likelihood also counts the initial noise's N(0, I) density.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vla_rl.core.keyed_random import keyed_normal, keyed_uniform
from vla_rl.core.shapes import Bool, Float

Method = Literal["ode", "sde", "noise"]
SDEMode = Literal["all", "mixed"]
Field = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, Tensor]"]
Reduce = Literal["sum", "mean", "none"]

METHODS = ("ode", "sde", "noise")
SDE_MODES = ("all", "mixed")
_LOG_2PI = math.log(2.0 * math.pi)


# ----------------------------------------------------------------------------------------------------
# Per-step closed forms
# ----------------------------------------------------------------------------------------------------
def time_grid(num_steps: int, *, device=None, dtype=torch.float32) -> Float[Tensor, " k1"]:
    """Times ``[K+1]`` from 1 down to 0 in ``num_steps`` equal steps."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    return torch.linspace(1.0, 0.0, num_steps + 1, device=device, dtype=dtype)


def sde_sigma(t: Float[Tensor, "*s"], noise_level: float, t_guard: float) -> Float[Tensor, "*s"]:
    """Flow-SDE diffusion coefficient sigma_t = a * sqrt(t / (1 - t)).

    At t = 1 the formula diverges; as in the πRL implementation, the denominator then uses the next grid
    time ``t_guard`` (i.e. 1 - t becomes 1 - t_guard), which keeps the first step finite.
    """
    denom_t = torch.where(t >= 1.0, torch.full_like(t, t_guard), t)
    return noise_level * torch.sqrt(t / (1.0 - denom_t))


def ode_mean(x_t: Tensor, v: Tensor, dt: Tensor) -> Tensor:
    """Euler step mean x_t - dt * v (``dt`` broadcastable to ``x_t``)."""
    return x_t - dt * v


def sde_mean_std(x_t: Tensor, v: Tensor, t: Tensor, dt: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """Flow-SDE transition x_{t-dt} ~ N(mean, std^2) with the ODE's marginals.

    With x0_hat = x_t - t v and x1_hat = x_t + (1 - t) v:
    mean = x0_hat (1 - (t - dt)) + x1_hat (t - dt - sigma^2 dt / (2 t)),  std = sigma sqrt(dt).
    ``t``, ``dt``, ``sigma`` broadcastable to ``x_t``. With sigma = 0 this is exactly the Euler step.
    """
    x0_hat = x_t - t * v
    x1_hat = x_t + (1.0 - t) * v
    t_next = t - dt
    mean = x0_hat * (1.0 - t_next) + x1_hat * (t_next - sigma.pow(2) * dt / (2.0 * t))
    return mean, sigma * torch.sqrt(dt)


def gaussian_log_prob(x: Float[Tensor, "*s"], mean: Float[Tensor, "*s"], std: Float[Tensor, "*s"]
                      ) -> Float[Tensor, "*s"]:
    """Elementwise log N(x; mean, std^2)."""
    return -0.5 * ((x - mean) / std).pow(2) - torch.log(std) - 0.5 * _LOG_2PI


def gaussian_entropy(std: Float[Tensor, "*s"]) -> Float[Tensor, "*s"]:
    """Elementwise entropy of N(., std^2): 0.5 log(2 pi e std^2)."""
    return torch.log(std) + 0.5 * (_LOG_2PI + 1.0)


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------
def _check_method(method: str, sde_mode: str, noise_level: float) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown flow method {method!r}; expected one of {METHODS}")
    if sde_mode not in SDE_MODES:
        raise ValueError(f"unknown sde_mode {sde_mode!r}; expected one of {SDE_MODES}")
    if not (noise_level >= 0.0 and math.isfinite(noise_level)):
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}")


def _check_chunk(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must have shape [N, H, A], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")


def _eval_field(field: Field, x_t: Tensor, t: Tensor, need_std: bool) -> tuple[Tensor, Tensor | None]:
    out = field(x_t, t)
    v, std = (out if isinstance(out, tuple) else (out, None))
    if v.shape != x_t.shape:
        raise ValueError(f"field returned velocity of shape {tuple(v.shape)}, expected {tuple(x_t.shape)}")
    if need_std:
        if std is None:
            raise ValueError("method='noise' needs a field that returns (velocity, std)")
        std = std.expand_as(x_t)
    return v.float(), (std.float() if std is not None else None)


# ----------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlowSample:
    """Result of :func:`sample`.

    actions     ``[N, H, A]``        the sampled chunk (== ``chain[:, -1]``)
    chain       ``[N, K+1, H, A]``   x at every grid time, ``chain[:, 0]`` is the initial noise
    stochastic  ``[N, K]`` bool      which steps were Gaussian (False: deterministic ODE step)
    log_probs   ``[N, K, H, A]``     per-step, per-element log-density of the taken transition
                                     (0 where the step was deterministic)
    init_log_prob ``[N, H, A]``      log N(chain[:, 0]; 0, I)
    entropy     ``[N, K, H, A]``     entropy of each Gaussian step (0 where deterministic)
    """

    actions: Float[Tensor, "n h a"]
    chain: Float[Tensor, "n k1 h a"]
    stochastic: Bool[Tensor, "n k"]
    log_probs: Float[Tensor, "n k h a"]
    init_log_prob: Float[Tensor, "n h a"]
    entropy: Float[Tensor, "n k h a"]


def stochastic_steps(
    method: str, num_steps: int, batch: int, *, sde_mode: str = "mixed", generator=None, device=None
) -> Bool[Tensor, "n k"]:
    """Which of the K steps are stochastic, ``[N, K]`` bool, for a method."""
    if method == "ode":
        return torch.zeros(batch, num_steps, dtype=torch.bool, device=device)
    if method == "noise" or sde_mode == "all":
        return torch.ones(batch, num_steps, dtype=torch.bool, device=device)
    pick = torch.randint(num_steps, (batch,), generator=generator, device=device)
    return torch.nn.functional.one_hot(pick, num_steps).bool()


def _step(
    method: str, x_t: Tensor, v: Tensor, std_head: Tensor | None, t: Tensor, dt: Tensor,
    stoch: Tensor, noise_level: float, t_guard: float,
) -> tuple[Tensor, Tensor]:
    """Mean and std ``[N, H, A]`` of one transition; t, dt, stoch are ``[N]``."""
    t3, dt3, s3 = t[:, None, None], dt[:, None, None], stoch[:, None, None]
    if method == "sde":
        sigma = sde_sigma(t3, noise_level, t_guard) * s3
        mean, std = sde_mean_std(x_t, v, t3, dt3, sigma)
        return mean, std.expand_as(x_t)
    mean = ode_mean(x_t, v, dt3)
    if method == "noise":
        return mean, std_head * s3
    return mean, torch.zeros_like(x_t)


def sample(
    field: Field,
    noise: Float[Tensor, "n h a"],
    *,
    num_steps: int,
    method: Method = "ode",
    noise_level: float = 0.5,
    sde_mode: SDEMode = "mixed",
    stochastic: Bool[Tensor, "n k"] | None = None,
    step_noise: Float[Tensor, "k n h a"] | None = None,
    generator: torch.Generator | None = None,
) -> FlowSample:
    """Denoise ``noise`` ``[N, H, A]`` (the t=1 sample) into an action chunk in ``num_steps`` steps.

    ``stochastic`` ``[N, K]`` overrides which steps are Gaussian (default: by method / sde_mode).
    ``step_noise`` ``[K, N, H, A]``: the standard normal draw of each step (default: drawn here, one
    ``[N, H, A]`` draw per step). ``generator`` (on the same device as ``noise``) makes the step noise and
    the mixed step choice reproducible. :func:`draw_sample_noise` draws all three as this function would.
    """
    _check_method(method, sde_mode, noise_level)
    _check_chunk("noise", noise)
    n, device = noise.shape[0], noise.device
    if step_noise is not None and step_noise.shape != (num_steps, *noise.shape):
        raise ValueError(f"step_noise must have shape {(num_steps, *noise.shape)}, got {tuple(step_noise.shape)}")
    grid = time_grid(num_steps, device=device)
    t_guard = float(grid[1]) if num_steps > 1 else 0.5
    if stochastic is None:
        stochastic = stochastic_steps(method, num_steps, n, sde_mode=sde_mode, generator=generator,
                                      device=device)
    elif stochastic.shape != (n, num_steps):
        raise ValueError(f"stochastic must have shape {(n, num_steps)}, got {tuple(stochastic.shape)}")
    x = noise.float()
    chain, log_probs, entropy = [x], [], []
    for k in range(num_steps):
        t = grid[k].expand(n)
        dt = (grid[k] - grid[k + 1]).expand(n)
        v, std_head = _eval_field(field, x, t, need_std=(method == "noise"))
        mean, std = _step(method, x, v, std_head, t, dt, stochastic[:, k], noise_level, t_guard)
        eps = torch.randn(x.shape, generator=generator, device=device) if step_noise is None else step_noise[k]
        x_next = mean + std * eps
        lp, ent = _masked_log_prob(x_next, mean, std, stochastic[:, k])
        chain.append(x_next)
        log_probs.append(lp)
        entropy.append(ent)
        x = x_next
    return FlowSample(
        actions=x,
        chain=torch.stack(chain, dim=1),
        stochastic=stochastic,
        log_probs=torch.stack(log_probs, dim=1),
        init_log_prob=gaussian_log_prob(noise.float(), torch.zeros_like(x), torch.ones_like(x)),
        entropy=torch.stack(entropy, dim=1),
    )


@dataclass(frozen=True)
class SampleNoise:
    """Every random draw of :func:`sample` for ``N`` chunks, drawn ahead: the initial noise ``[N, H, A]``,
    which steps are stochastic ``[N, K]`` and the step noise ``[K, N, H, A]``. Row ``i`` is chunk ``i``'s,
    so a batch sampled in parts (:meth:`rows`) gets the draws it would get sampled whole."""

    initial: Float[Tensor, "n h a"]
    stochastic: Bool[Tensor, "n k"]
    steps: Float[Tensor, "k n h a"]

    def rows(self, index: slice | range) -> SampleNoise:
        """The draws of the chunks ``index`` (contiguous)."""
        sl = slice(index.start, index.stop) if isinstance(index, range) else index
        return SampleNoise(self.initial[sl], self.stochastic[sl], self.steps[:, sl])


def draw_sample_noise(
    batch: int, horizon: int, action_dim: int, *, num_steps: int, method: Method = "ode",
    sde_mode: SDEMode = "mixed", generator: torch.Generator | None = None, device=None,
) -> SampleNoise:
    """The draws of ``randn(batch, horizon, action_dim)`` initial noise followed by ``sample(...)`` with this
    ``generator``, in the same order: passed to :func:`sample` (``noise``, ``stochastic``, ``step_noise``)
    they give its result bit for bit."""
    shape = (batch, horizon, action_dim)
    initial = torch.randn(shape, generator=generator, device=device)
    stochastic = stochastic_steps(method, num_steps, batch, sde_mode=sde_mode, generator=generator, device=device)
    steps = torch.stack([torch.randn(shape, generator=generator, device=device) for _ in range(num_steps)])
    return SampleNoise(initial, stochastic, steps)


def keyed_sample_noise(
    keys: list[Tensor | int], horizon: int, action_dim: int, *, num_steps: int, method: Method = "ode",
    sde_mode: SDEMode = "mixed", device=None,
) -> SampleNoise:
    """Every random draw of :func:`sample` for ``N`` chunks, row ``i``'s drawn from its own keys (``keys``: ints
    or ``[N]`` integer tensors, e.g. an episode's seed and the chunk's index in it) with the counter-based
    generator of :mod:`.keyed_random`: a chunk's draws do not depend on the other rows of the batch, their
    number or order. The initial noise is the same for every method (so the deterministic and the stochastic
    policy start each chunk from the same noise); the ODE sampler draws no step noise (zeros)."""
    shape = (horizon, action_dim)
    initial = keyed_normal(keys, shape, domain="flow/initial", device=device)
    batch = initial.shape[0]
    if method == "ode":
        stochastic = torch.zeros(batch, num_steps, dtype=torch.bool, device=initial.device)
        return SampleNoise(initial, stochastic, torch.zeros(num_steps, *initial.shape, device=initial.device))
    if method == "sde" and sde_mode == "mixed":
        u = keyed_uniform(keys, (1,), domain="flow/mixed", device=initial.device)[:, 0]
        pick = (u * num_steps).long().clamp_(max=num_steps - 1)
        stochastic = torch.nn.functional.one_hot(pick, num_steps).bool()
    else:
        stochastic = torch.ones(batch, num_steps, dtype=torch.bool, device=initial.device)
    steps = keyed_normal(keys, (num_steps, *shape), domain="flow/steps", device=initial.device)
    return SampleNoise(initial, stochastic, steps.transpose(0, 1).contiguous())


def denoise(field: Field, noise: Float[Tensor, "n h a"], *, num_steps: int) -> Float[Tensor, "n h a"]:
    """Deterministic Euler denoising of ``noise`` ``[N, H, A]`` into an action chunk ``[N, H, A]``.

    The deployment / evaluation path: the same actions as ``sample(..., method="ode").actions``, bit for
    bit, without what only training needs (step noise, log-densities, entropies, the stored chain). The
    field may return the velocity alone (cheapest: no std head) or ``(velocity, std)``.
    """
    _check_chunk("noise", noise)
    n = noise.shape[0]
    grid = time_grid(num_steps, device=noise.device)
    x = noise.float()
    for k in range(num_steps):
        v, _ = _eval_field(field, x, grid[k].expand(n), need_std=False)
        x = ode_mean(x, v, grid[k] - grid[k + 1])
    return x


def _masked_log_prob(x_next: Tensor, mean: Tensor, std: Tensor, stoch: Tensor) -> tuple[Tensor, Tensor]:
    # Deterministic steps have no density; they contribute 0 (they do not change with the PPO ratio).
    s3 = stoch[:, None, None]
    safe_std = torch.where(s3, std, torch.ones_like(std))
    lp = torch.where(s3, gaussian_log_prob(x_next, mean, safe_std), torch.zeros_like(x_next))
    ent = torch.where(s3, gaussian_entropy(safe_std), torch.zeros_like(x_next))
    return lp, ent


# ----------------------------------------------------------------------------------------------------
# Likelihood of a stored chain (what PPO's ratio uses)
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainLogProb:
    """Result of :func:`chain_log_prob`: ``log_probs`` / ``entropy`` ``[N, K, H, A]`` (0 on deterministic
    steps), ``init_log_prob`` ``[N, H, A]``, and ``field_evals`` (how many field calls it took)."""

    log_probs: Float[Tensor, "n k h a"]
    entropy: Float[Tensor, "n k h a"]
    init_log_prob: Float[Tensor, "n h a"]
    field_evals: int


def chain_log_prob(
    field: Field,
    chain: Float[Tensor, "n k1 h a"],
    stochastic: Bool[Tensor, "n k"],
    *,
    method: Method,
    noise_level: float = 0.5,
) -> ChainLogProb:
    """Recompute per-step log-densities of a stored ``chain`` ``[N, K+1, H, A]`` under ``field``.

    Only stochastic steps are evaluated. When every sample has exactly one stochastic step (mixed
    Flow-SDE), all samples are evaluated in one batched field call at their own step's time, so the cost
    is one velocity evaluation per chunk instead of K. On meta tensors (the memory plan runs the learner's loss
    on shapes alone) nothing data-dependent can be read: Flow-SDE is taken to be mixed, and every step of the
    other methods is evaluated.
    """
    _check_method(method, "all", noise_level)
    if chain.dim() != 4:
        raise ValueError(f"chain must have shape [N, K+1, H, A], got {tuple(chain.shape)}")
    n, k1 = chain.shape[:2]
    num_steps = k1 - 1
    if stochastic.shape != (n, num_steps) or stochastic.dtype != torch.bool:
        raise ValueError(f"stochastic must be a bool tensor of shape {(n, num_steps)}, "
                         f"got {stochastic.dtype} {tuple(stochastic.shape)}")
    meta = chain.is_meta
    if not meta and not torch.isfinite(chain).all():
        raise ValueError("chain contains NaN or inf")
    device = chain.device
    grid = time_grid(num_steps, device=device)
    t_guard = float((time_grid(num_steps) if meta else grid)[1]) if num_steps > 1 else 0.5
    need_std = method == "noise"
    log_probs = torch.zeros(chain.shape[0], num_steps, *chain.shape[2:], device=device)
    entropy = torch.zeros_like(log_probs)
    counts = stochastic.sum(dim=1)
    evals = 0
    one_each = method == "sde" if meta else bool((counts == 1).all())
    if method != "ode" and n > 0 and one_each:
        k_idx = stochastic.float().argmax(dim=1)                      # [N]
        rows = torch.arange(n, device=device)
        x_t, x_next = chain[rows, k_idx], chain[rows, k_idx + 1]
        t, dt = grid[k_idx], grid[k_idx] - grid[k_idx + 1]
        v, std_head = _eval_field(field, x_t, t, need_std)
        evals = 1
        ones = torch.ones(n, dtype=torch.bool, device=device)
        mean, std = _step(method, x_t, v, std_head, t, dt, ones, noise_level, t_guard)
        lp, ent = _masked_log_prob(x_next, mean, std, ones)
        log_probs[rows, k_idx], entropy[rows, k_idx] = lp, ent
    elif method != "ode":
        for k in range(num_steps):
            if not meta and not bool(stochastic[:, k].any()):
                continue
            t = grid[k].expand(n)
            dt = (grid[k] - grid[k + 1]).expand(n)
            v, std_head = _eval_field(field, chain[:, k], t, need_std)
            evals += 1
            mean, std = _step(method, chain[:, k], v, std_head, t, dt, stochastic[:, k], noise_level, t_guard)
            log_probs[:, k], entropy[:, k] = _masked_log_prob(chain[:, k + 1], mean, std, stochastic[:, k])
    x0 = chain[:, 0].float()
    init = gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
    return ChainLogProb(log_probs=log_probs, entropy=entropy, init_log_prob=init, field_evals=evals)


# ----------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------
def _reduce(x: Tensor, weight: Tensor, dim: int, how: Reduce) -> tuple[Tensor, Tensor]:
    """Weighted sum / mean of ``x`` over ``dim``; returns (value, weight reduced the same way)."""
    if how == "none":
        return x, weight
    total = (x * weight).sum(dim=dim)
    w = weight.sum(dim=dim)
    if how == "sum":
        return total, (w > 0).to(w.dtype)
    if how == "mean":
        return total / w.clamp_min(1.0), (w > 0).to(w.dtype)
    raise ValueError(f"unknown reduction {how!r}; expected 'sum', 'mean' or 'none'")


def aggregate(
    per_element: Float[Tensor, "n k h a"],
    stochastic: Bool[Tensor, "n k"],
    *,
    steps: Reduce = "mean",
    actions: Reduce = "sum",
    dims: Reduce = "sum",
    executed: int | None = None,
    dim_mask: Bool[Tensor, " a"] | None = None,
) -> Float[Tensor, "n ..."]:
    """Reduce a per-step quantity ``[N, K, H, A]`` (log-probs or entropies) to what a loss needs.

    - ``steps``: over the stochastic denoising steps only (``mean`` divides by their count);
    - ``actions``: over chunk positions, only the first ``executed`` (E) actions if given;
    - ``dims``: over action dims, only where ``dim_mask`` ``[A]`` (bool) is True (the real dims).
    Each is ``"sum"``, ``"mean"`` or ``"none"`` (keep the axis). Summing everything over K*H*A makes PPO
    ratios explode; the πRL default is mean over steps, sum over executed actions and real dims.
    Returns ``[N]`` when everything is reduced, else ``[N, ...]`` with the kept axes in order (K, H, A).
    """
    if per_element.dim() != 4:
        raise ValueError(f"expected [N, K, H, A], got {tuple(per_element.shape)}")
    n, k, h, a = per_element.shape
    if stochastic.shape != (n, k):
        raise ValueError(f"stochastic must have shape {(n, k)}, got {tuple(stochastic.shape)}")
    weight = stochastic.to(per_element.dtype)[:, :, None, None].expand(n, k, h, a).clone()
    if executed is not None:
        if not 1 <= executed <= h:
            raise ValueError(f"executed must be in [1, {h}], got {executed}")
        weight[:, :, executed:] = 0.0
    if dim_mask is not None:
        if dim_mask.shape != (a,):
            raise ValueError(f"dim_mask must have shape [{a}], got {tuple(dim_mask.shape)}")
        weight = weight * dim_mask.to(weight)[None, None, None, :]
    x = per_element
    # Reduce innermost first so that the weights of outer axes stay aligned with their values.
    x, weight = _reduce(x, weight, 3, dims)
    x, weight = _reduce(x, weight, 2, actions)
    x, weight = _reduce(x, weight, 1, steps)
    return x


# ----------------------------------------------------------------------------------------------------
# Flow-matching (SFT) objective
# ----------------------------------------------------------------------------------------------------
def sample_flow_time(n: int, *, generator=None, device=None) -> Float[Tensor, " n"]:
    """t ~ Beta(1.5, 1) scaled into (0.001, 1], as in π0 (more weight on noisy times).

    Beta(a, 1) has CDF x^a, so u^(1/a) with u uniform samples it exactly (and takes a generator).
    """
    u = torch.rand(n, generator=generator, device=device)
    return u.pow(1.0 / 1.5) * 0.999 + 0.001


def mean_entropy(entropy: Float[Tensor, "n k h a"], stochastic: Bool[Tensor, "n k"], *, executed: int | None = None,
                 dim_mask: Bool[Tensor, " a"] | None = None) -> Float[Tensor, " n"]:
    """``[N, K, H, A]`` step entropies -> ``[N]``: each chunk's mean Gaussian step entropy over its stochastic steps,
    its first ``executed`` actions and the real dims (``dim_mask``): how much the stochastic policy still explores.
    The rollout records it; the learner's entropy bonus maximises it."""
    return aggregate(entropy, stochastic, steps="mean", actions="mean", dims="mean", executed=executed,
                     dim_mask=dim_mask)


def flow_matching_errors(field: Field, actions: Float[Tensor, "n h a"], t: Float[Tensor, " n"],
                         noise: Float[Tensor, "n h a"]) -> Float[Tensor, "n h a"]:
    """Per-element squared error of the field's velocity at ``x_t = t*eps + (1-t)*a`` against the conditional
    target ``eps - a``: the conditional flow-matching loss before any reduction. SFT averages it
    (:func:`flow_matching_loss`); likelihood-free RL (FPO) compares it per sample across parameters."""
    t3 = t[:, None, None]
    x_t = t3 * noise + (1.0 - t3) * actions
    v, _ = _eval_field(field, x_t, t, need_std=False)
    return (v - (noise - actions)).pow(2)


def flow_matching_loss(
    field: Field,
    actions: Float[Tensor, "n h a"],
    *,
    action_mask: Bool[Tensor, "n h"] | None = None,
    dim_mask: Bool[Tensor, " a"] | None = None,
    generator: torch.Generator | None = None,
    t: Float[Tensor, " n"] | None = None,
    noise: Float[Tensor, "n h a"] | None = None,
) -> tuple[Float[Tensor, ""], dict[str, float]]:
    """Conditional flow-matching loss for target chunks ``actions`` ``[N, H, A]``.

    x_t = t*eps + (1-t)*a, target velocity eps - a; squared error averaged over the real entries:
    ``action_mask`` ``[N, H]`` marks real (not padded) chunk positions, ``dim_mask`` ``[A]`` real dims.
    """
    _check_chunk("actions", actions)
    n, h, a = actions.shape
    if t is None:
        t = sample_flow_time(n, generator=generator, device=actions.device)
    if noise is None:
        noise = torch.randn(actions.shape, generator=generator, device=actions.device)
    err = flow_matching_errors(field, actions, t, noise)
    weight = torch.ones_like(err)
    if action_mask is not None:
        if action_mask.shape != (n, h):
            raise ValueError(f"action_mask must have shape {(n, h)}, got {tuple(action_mask.shape)}")
        weight = weight * action_mask.to(err.dtype)[:, :, None]
    if dim_mask is not None:
        if dim_mask.shape != (a,):
            raise ValueError(f"dim_mask must have shape [{a}], got {tuple(dim_mask.shape)}")
        weight = weight * dim_mask.to(err.dtype)[None, None, :]
    loss = (err * weight).sum() / weight.sum().clamp_min(1.0)
    return loss, {"losses/flow_matching": float(loss.detach())}
