"""Training-health signals: what a run's metrics say about whether RL can learn, checked every iteration and
said in the log with a one-line hint; the cost of the exploration noise, measured before RL; and whether
success rose over a run (a trend test over its evaluations).

Each signal is a 0/1 metric per iteration (``health/no_signal``, ``health/collapse``,
``health/value_blind``), raised once its condition has held for ``patience`` iterations in a row:

- **no signal**: no rollout episode succeeded, or the advantages are all ~0 before normalisation (raw std
  below ``min_advantage_std``), or every sample was dropped (GRPO groups that all succeeded or all failed):
  PPO has nothing to reinforce.
- **collapse**: approx-KL above ``max_kl``, clip fraction above ``max_clipfrac``, every update step skipped as
  non-finite, or the Flow-Noise std pinned to its lower bound (``rollout/entropy`` within ``entropy_floor``
  nats of that bound's entropy: the policy has stopped exploring).
- **value blind**: explained variance below ``min_explained_variance``: the critic predicts the returns no
  better than a constant, so the advantages are mostly noise.

Glossary: an evaluation point is ``(iteration, success)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vla_rl.core.ranges import check_ranges, nonneg, positive, ranged

SIGNALS = ("no_signal", "collapse", "value_blind")
HINTS = {
    "no_signal": "no rollout succeeds or the advantages are ~0, so PPO has nothing to reinforce: start from a "
                 "better SFT policy, lower the exploration noise (sampler.noise_level; the Flow-Noise std bounds "
                 "at SFT), or give the task a denser reward",
    "collapse": "the updates move the policy too far (approx-KL / clip fraction high, updates skipped, or the "
                "Flow-Noise std at its floor): lower learner.lr_actor, set learner.target_kl, or add "
                "learner.actor_lr_warmup_iters",
    "value_blind": "the value function explains none of the returns' variance, so advantages are mostly noise: "
                   "raise learner.lr_critic, add learner.critic_warmup_iters, or scale the rewards "
                   "(algorithm.<name>.reward_scale)",
}


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the training-health signals (docs/training.md#training-health)."""

    patience: int = ranged(3, 1)                 # iterations in a row a condition must hold
    max_kl: float = positive(0.5)
    max_clipfrac: float = ranged(0.6, 0, 1)
    min_explained_variance: float = ranged(0.0, None, 1)
    min_advantage_std: float = nonneg(1e-4)
    entropy_floor: float = nonneg(0.02)          # nats above the entropy of the Flow-Noise std's lower bound
    # Before RL: the rollout sampler's success against the ODE sampler's on the evaluation episodes. A relative
    # cost (1 - noisy / deterministic) above max_noise_cost is reported with a hint to lower the noise.
    measure_noise_cost: bool = True
    max_noise_cost: float = ranged(0.5, 0, 1)

    def __post_init__(self):
        check_ranges(self)


def capped(m: dict, cap: int | None, official: int | None) -> str | None:
    """Why the episodes may be too short to succeed, or None: they all ran into a step cap ``cap`` below the task's
    own limit ``official`` (a recipe's cap fitted to another task's demos)."""
    length = m.get("rollout/episode_length")
    if cap is None or official is None or cap >= official or length is None or length < 0.98 * cap:
        return None
    return (f"every episode ran to the run's {cap}-step cap, shorter than the task's own limit of {official}: "
            "it may need longer (raise the env's max_episode_steps)")


def conditions(m: dict, cfg: HealthConfig, *, entropy_min: float | None = None, episode_cap: int | None = None,
               official_steps: int | None = None) -> dict[str, str | None]:
    """Which signals' conditions hold in one iteration's metrics ``m``: signal -> the reason (None: it does not
    hold). ``entropy_min``: the rollout entropy of the Flow-Noise std's lower bound (None: not Flow-Noise);
    ``episode_cap`` / ``official_steps``: the run's episode step limit and the task's own (:func:`capped`)."""
    out: dict[str, str | None] = dict.fromkeys(SIGNALS)
    successes = m.get("rollout/success_once")
    if m.get("train/samples", 1) == 0:
        out["no_signal"] = "no sample took part in the update"
    elif successes is not None and successes == 0:
        out["no_signal"] = f"no success in {int(m.get('rollout/episodes', 0))} rollout episodes"
        short = capped(m, episode_cap, official_steps)
        if short:
            out["no_signal"] += f"; {short}"
    elif m.get("train/advantage_std_raw", math.inf) < cfg.min_advantage_std:
        out["no_signal"] = f"raw advantage std {m['train/advantage_std_raw']:.2g}"
    reasons = []
    kl, clip = m.get("losses/approx_kl"), m.get("losses/clipfrac")
    if kl is not None and kl > cfg.max_kl:
        reasons.append(f"approx-KL {kl:.3g} > {cfg.max_kl:g}")
    if clip is not None and clip > cfg.max_clipfrac:
        reasons.append(f"clip fraction {clip:.2f} > {cfg.max_clipfrac:g}")
    if m.get("train/samples", 0) > 0 and m.get("train/applied_steps", 1) == 0:
        reasons.append("every update step was skipped")
    ent = m.get("rollout/entropy")
    if entropy_min is not None and ent is not None and ent < entropy_min + cfg.entropy_floor:
        reasons.append(f"Flow-Noise std at its lower bound (entropy {ent:.3f})")
    out["collapse"] = "; ".join(reasons) or None
    ev = m.get("losses/explained_variance")
    if ev is not None and math.isfinite(ev) and ev < cfg.min_explained_variance:
        out["value_blind"] = f"explained variance {ev:.2f}"
    return out


class HealthMonitor:
    """Raises each signal once its condition held ``patience`` iterations in a row; :meth:`update` adds the
    ``health/*`` metrics to an iteration's metrics and returns the log lines of signals that started or ended."""

    def __init__(self, cfg: HealthConfig, *, entropy_min: float | None = None, episode_cap: int | None = None,
                 official_steps: int | None = None):
        self.cfg, self.entropy_min = cfg, entropy_min
        self.episode_cap, self.official_steps = episode_cap, official_steps
        self.streak = dict.fromkeys(SIGNALS, 0)
        self.raised = dict.fromkeys(SIGNALS, False)

    def update(self, m: dict) -> list[str]:
        lines = []
        for name, why in conditions(m, self.cfg, entropy_min=self.entropy_min, episode_cap=self.episode_cap,
                                    official_steps=self.official_steps).items():
            self.streak[name] = self.streak[name] + 1 if why else 0
            up = self.streak[name] >= self.cfg.patience
            if up and not self.raised[name]:
                lines.append(f"health: {name.replace('_', ' ')} for {self.streak[name]} iterations ({why}): "
                             f"{HINTS[name]}")
            elif self.raised[name] and not up:
                lines.append(f"health: {name.replace('_', ' ')} cleared at iteration {m['iteration']}")
            self.raised[name] = up
            m[f"health/{name}"] = float(up)
        return lines

    def replay(self, history: list[dict]) -> None:
        """Rebuild the streaks from earlier iterations' metrics (a resumed run), saying nothing."""
        for m in history:
            if m.get("iteration", 0) > 0:
                self.update(dict(m))


def flow_noise_entropy_floor(std_min: float) -> float:
    """The Gaussian entropy per element at the Flow-Noise std's lower bound: ``log std + 0.5 log(2 pi e)``."""
    return math.log(std_min) + 0.5 * (math.log(2 * math.pi) + 1.0)


# ----------------------------------------------------------------------------------------------------
# The exploration noise's cost
# ----------------------------------------------------------------------------------------------------
def noise_cost(deterministic: float, noisy: float) -> float:
    """Relative success lost to the exploration noise: ``1 - noisy / deterministic``, at least -1 (0 when neither
    succeeds; -1 when only the noisy policy does)."""
    if deterministic <= 0:
        return 0.0 if noisy <= 0 else -1.0
    return max(-1.0, 1.0 - noisy / deterministic)


def noise_cost_line(deterministic: float, noisy: float, *, episodes: int, sampler_text: str,
                    max_cost: float) -> str:
    """The log line of the measurement, with the rule's hint when the cost is above ``max_cost``."""
    cost = noise_cost(deterministic, noisy)
    line = (f"exploration noise: the rollout sampler ({sampler_text}) succeeds on {noisy:.3f} of {episodes} "
            f"evaluation episodes, the deterministic ODE sampler on {deterministic:.3f} (cost {100 * cost:.0f} %)")
    if cost > max_cost:
        line += (f"; above {100 * max_cost:.0f} %, exploration throws away most successes and PPO sees few: lower "
                 "the noise until the cost is below that (Flow-SDE: sampler.noise_level, e.g. halved; Flow-Noise: "
                 "the policy's noise_std_min / noise_std_max, set at SFT, e.g. halved; docs/training.md)")
    return line


# ----------------------------------------------------------------------------------------------------
# Did success rise over the run?
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trend:
    """Mann-Kendall trend test over a run's evaluation points: ``s`` (sum of signs of later minus earlier),
    ``tau`` (s over the number of pairs), ``p`` (two-sided, normal approximation with tie correction and
    continuity correction; None below 4 points), the first success and the mean of the last ``tail``."""

    n: int
    s: int
    tau: float
    p: float | None
    first: float
    last: float
    tail: int


def mann_kendall(values: list[float]) -> tuple[int, float, float | None]:
    """``(S, tau, p)`` of the Mann-Kendall test on ``values`` in time order; p is None below 4 values."""
    n = len(values)
    s = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
    pairs = n * (n - 1) // 2
    tau = s / pairs if pairs else 0.0
    if n < 4:
        return s, tau, None
    ties: dict[float, int] = {}
    for v in values:
        ties[v] = ties.get(v, 0) + 1
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties.values())) / 18
    if var <= 0:
        return s, tau, 1.0
    z = (s - math.copysign(1, s)) / math.sqrt(var) if s else 0.0
    return s, tau, math.erfc(abs(z) / math.sqrt(2))


def success_trend(points: list[tuple[int, float]], *, tail: int = 3) -> Trend:
    """The trend of ``points`` (iteration, success), in iteration order."""
    values = [v for _, v in sorted(points)]
    if not values:
        raise ValueError("no evaluation points")
    s, tau, p = mann_kendall(values)
    k = min(tail, len(values))
    return Trend(len(values), s, tau, p, values[0], sum(values[-k:]) / k, k)


def trend_statement(trend: Trend, alpha: float = 0.05) -> str:
    """One sentence: success at the start and the end, and whether the trend test finds it rose or fell. Where it
    finds neither, the sentence says so and no more (a change that is not significant is not "stayed put"); where
    even a strictly monotone run of ``trend.n`` evaluations could not reach ``alpha`` (n < 5), it says the test
    cannot tell."""
    change = f"{trend.first:.3f} at the start -> {trend.last:.3f} (mean of the last {trend.tail} evaluations)"
    if trend.p is None or mann_kendall(list(range(trend.n)))[2] >= alpha:
        return f"success {change}; {trend.n} evaluations are too few for a trend test to reach p < {alpha:g}"
    test = f"Mann-Kendall over {trend.n} evaluations: tau {trend.tau:+.2f}, p = {trend.p:.2g}"
    if trend.p < alpha and trend.s > 0:
        return f"success rose over the run: {change}; {test}"
    if trend.p < alpha and trend.s < 0:
        return f"success fell over the run: {change}; {test}"
    return f"success {change}; the evaluations show no significant trend ({test})"
