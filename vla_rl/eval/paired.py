"""Paired comparison of two policies' evaluations on the same initial states (``vla-rl compare``).

Why paired: on PickCube some seeds are hard for every policy and some easy, so two 200-episode success
rates each carry ~3.4 points of standard error, and their difference ~4.8, mostly from which seeds were
drawn. Scoring both policies on the *same* episodes and averaging the per-episode differences removes the
seeds' share of that spread: the standard error of a paired difference is ``sd(d) / sqrt(n)`` with
``d_i = new_i - base_i``, smaller than the unpaired one whenever the two policies' outcomes are positively
correlated over seeds. The exact sign test (McNemar's, on the discordant episodes) gives a p-value that
assumes nothing about the size of the spread.

Episodes pair by ``episode_seed``, which names an episode (its initial state and sampler noise) whatever the
``num_envs`` it ran with (:func:`vla_rl.eval.evaluate.evaluate_episodes`).
Files are ``vla-rl eval CKPT out=FILE.json`` outputs; several files per side pool (e.g. the 10k and 20k
seed blocks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from vla_rl.envs.base import EPISODE_METRICS
from vla_rl.eval.evaluate import EPISODE_FILE_FORMAT


class EpisodeFileError(ValueError):
    """An evaluation file that cannot be read or cannot be paired; the message names the file and why."""


@dataclass(frozen=True)
class EpisodeSet:
    """One side of a comparison: episodes keyed by their episode seed, and the env."""

    episodes: dict[int, dict[str, float]]
    env: dict


def read_episode_file(path: str | Path) -> dict:
    """A ``vla-rl eval ... out=FILE`` JSON document, checked: format tag, header fields, every record's keys."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise EpisodeFileError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EpisodeFileError(f"{path}: not a JSON evaluation file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != EPISODE_FILE_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        old = " (an older file, whose episodes are not named by their seeds)" if got == "vla-rl-eval-episodes/1" else ""
        raise EpisodeFileError(f"{path}: format is {got!r}{old}, expected {EPISODE_FILE_FORMAT!r} "
                               f"(write one with `vla-rl eval CKPT out={path.name}`)")
    for key, kind in (("config", dict), ("env", dict), ("episodes", list)):
        if not isinstance(doc.get(key), kind):
            raise EpisodeFileError(f"{path}: {key!r} is missing or not a {kind.__name__}")
    need = ("episode_seed", *EPISODE_METRICS)
    for i, rec in enumerate(doc["episodes"]):
        if not isinstance(rec, dict) or any(k not in rec for k in need):
            raise EpisodeFileError(f"{path}: episode {i} lacks one of {need}")
        if any(not isinstance(rec[k], (int, float)) or isinstance(rec[k], bool) or not math.isfinite(rec[k])
               for k in need):
            raise EpisodeFileError(f"{path}: episode {i} has a non-numeric or non-finite value: {rec}")
    return doc


def load_side(paths: list[str | Path]) -> EpisodeSet:
    """Pool the episodes of several evaluation files of one policy; they must share the env and must not repeat
    an episode."""
    if not paths:
        raise EpisodeFileError("no evaluation files given")
    episodes: dict[int, dict[str, float]] = {}
    env = None
    for p in paths:
        doc = read_episode_file(p)
        if env is None:
            env = doc["env"]
        elif doc["env"] != env:
            raise EpisodeFileError(f"{p}: its env differs from {paths[0]}'s; pool only evaluations of the same task")
        for rec in doc["episodes"]:
            key = int(rec["episode_seed"])
            if key in episodes:
                raise EpisodeFileError(f"{p}: episode seed {key} is already in an earlier file of this side; each "
                                       "episode may count once")
            episodes[key] = {k: float(rec[k]) for k in EPISODE_METRICS}
    return EpisodeSet(episodes, env)


@dataclass(frozen=True)
class PairedResult:
    metric: str
    n: int
    base_mean: float
    new_mean: float
    diff: float            # new - base, over the paired episodes
    se_paired: float       # sd(new_i - base_i, ddof=1) / sqrt(n)
    se_unpaired: float     # sqrt(var_base / n + var_new / n): what two independent samples would give
    new_better: int        # episodes where new > base (for success: new succeeded, base failed)
    base_better: int
    sign_test_p: float     # exact two-sided sign test over the episodes that differ
    env_notes: tuple[str, ...] = ()   # env fields that differ but leave the episodes the same


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided binomial p-value of ``wins`` vs ``losses`` under a fair coin (McNemar's exact test
    when they are a success metric's discordant pairs). 1.0 when no episode differs."""
    m = wins + losses
    if m == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2.0**m
    return min(1.0, 2.0 * tail)


def _var(xs: list[float]) -> float:
    """Sample variance (ddof=1); 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)


def paired_difference(base: list[float], new: list[float], metric: str = "success_once") -> PairedResult:
    """The paired difference ``new - base`` of two equally long, aligned lists of per-episode values."""
    if len(base) != len(new):
        raise ValueError(f"paired lists differ in length: {len(base)} vs {len(new)}")
    n = len(base)
    if n == 0:
        raise ValueError("no paired episodes")
    d = [b - a for a, b in zip(base, new)]
    wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
    return PairedResult(
        metric=metric, n=n, base_mean=sum(base) / n, new_mean=sum(new) / n, diff=sum(d) / n,
        se_paired=math.sqrt(_var(d) / n), se_unpaired=math.sqrt(_var(base) / n + _var(new) / n),
        new_better=wins, base_better=losses, sign_test_p=sign_test_p(wins, losses))


# Env fields that change neither an episode's initial state nor whether it succeeds: what the policy is
# shown (a state policy and an image policy can be compared on the same seeds). Differences here are noted.
# Of these, what a camera's frames look like: without a camera on either side they do not reach the policy, so
# their differences are not worth a note (a state policy's SFT and RL configs may carry different image defaults).
IMAGE_FIELDS = frozenset({"options.image_size", "options.render_size", "options.image_orientation",
                          "options.reflections"})
VIEW_FIELDS = IMAGE_FIELDS | {"options.obs_mode", "options.instruction", "options.cameras", "builtin.image_size"}
# Fields that change how an episode is computed, not what it is: LIBERO's model cache, its soft reset and its
# substep loop, each checked to give the same episodes bit for bit. Noted. A file written before a field existed
# lacks it (None).
COMPUTE_FIELDS = frozenset({"options.max_cached_envs", "options.soft_reset", "options.fast_substeps",
                            "options.direct_step"})
# Reward fields: the same episodes, the same success, other returns; noted, and refused for --metric return.
REWARD_FIELDS = frozenset({"options.reward", "builtin.reward", "builtin.success_bonus", "builtin.progress_scale"})


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def env_differences(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """Dotted env fields whose values differ between two evaluation files' ``env`` (missing: None)."""
    fa, fb = _flat(a), _flat(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def compare(base: EpisodeSet, new: EpisodeSet, metric: str = "success_once") -> PairedResult:
    """Pair two sides' episodes; every episode must be on both sides (else the seeds were not the same), and
    the envs may differ only in what the policy is shown or (for success and length) in the reward."""
    if metric not in EPISODE_METRICS:
        raise EpisodeFileError(f"unknown metric {metric!r}; one of {EPISODE_METRICS}")
    diffs = env_differences(base.env, new.env)
    allowed = VIEW_FIELDS | COMPUTE_FIELDS | (REWARD_FIELDS if metric != "return" else frozenset())
    bad = {k: v for k, v in diffs.items() if k not in allowed}
    if bad:
        why = "; returns under different rewards do not compare" if set(bad) & REWARD_FIELDS else ""
        raise EpisodeFileError("the two sides evaluated different envs: " + ", ".join(
            f"{k} {a!r} vs {b!r}" for k, (a, b) in bad.items()) + why)
    only_base = sorted(set(base.episodes) - set(new.episodes))
    only_new = sorted(set(new.episodes) - set(base.episodes))
    if only_base or only_new:
        raise EpisodeFileError(f"{len(only_base)} episodes only in the base side (e.g. {only_base[:3]}) and "
                               f"{len(only_new)} only in the new side (e.g. {only_new[:3]}), as episode seeds: "
                               "evaluate both with the same seed and episodes")
    keys = sorted(base.episodes)
    r = paired_difference([base.episodes[k][metric] for k in keys], [new.episodes[k][metric] for k in keys],
                          metric)
    no_cameras = base.env.get("options", {}).get("cameras") == [] == new.env.get("options", {}).get("cameras")
    notes = tuple(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diffs.items()
                  if not (no_cameras and k in IMAGE_FIELDS))
    return replace(r, env_notes=notes)


def format_result(r: PairedResult, base_name: str, new_name: str) -> str:
    return "\n".join([
        f"{r.metric} over {r.n} paired episodes",
        f"  base {base_name}: {r.base_mean:.4g}",
        f"  new  {new_name}: {r.new_mean:.4g}",
        f"  difference (new - base): {r.diff:+.4g} +- {r.se_paired:.2g} (paired SE; unpaired would be "
        f"+- {r.se_unpaired:.2g})",
        f"  episodes where new is better: {r.new_better}, base is better: {r.base_better}; "
        f"sign test p = {r.sign_test_p:.3g}",
        *(f"  note: the envs differ in {n} (same initial states and success)" for n in r.env_notes),
    ])
