"""Normalisation statistics for states and actions (computed from data, saved with checkpoints).

Two modes, as in openpi: ``mean_std`` (π0: (x - mean) / std) and ``quantile`` (π0.5: q01..q99 mapped
linearly to [-1, 1]). Dims with (near) zero spread are left centred but unscaled, so a constant
dimension (a padded or unused one) does not blow up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Mode = Literal["mean_std", "quantile"]
_EPS = 1e-6


@dataclass
class Stats:
    """Per-dimension statistics ``[D]`` of one quantity."""

    mean: Tensor
    std: Tensor
    q01: Tensor
    q99: Tensor

    @staticmethod
    def of(x: Tensor) -> Stats:
        """Statistics of samples ``[M, D]`` (any leading shape is flattened)."""
        x = x.reshape(-1, x.shape[-1]).double()
        if x.shape[0] == 0:
            raise ValueError("cannot compute statistics of an empty tensor")
        if not torch.isfinite(x).all():
            raise ValueError("data contains NaN or inf; cannot compute normalisation statistics")
        q = torch.quantile(x, torch.tensor([0.01, 0.99], dtype=x.dtype), dim=0)
        return Stats(x.mean(0).float(), x.std(0, unbiased=False).float(), q[0].float(), q[1].float())

    @staticmethod
    def identity(dim: int) -> Stats:
        """Statistics under which normalising changes nothing (mean 0, std 1, quantiles -1 / 1)."""
        return Stats(torch.zeros(dim), torch.ones(dim), -torch.ones(dim), torch.ones(dim))

    def to_dict(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.{k}": getattr(self, k).contiguous() for k in ("mean", "std", "q01", "q99")}

    @staticmethod
    def from_dict(d: dict[str, Tensor], prefix: str) -> Stats:
        try:
            return Stats(*(d[f"{prefix}.{k}"].float() for k in ("mean", "std", "q01", "q99")))
        except KeyError as e:
            raise ValueError(f"normalisation statistics are missing {e.args[0]!r}") from None

    def _scale_shift(self, mode: Mode) -> tuple[Tensor, Tensor]:
        if mode == "mean_std":
            center, scale = self.mean, self.std
        elif mode == "quantile":
            center, scale = (self.q99 + self.q01) / 2, (self.q99 - self.q01) / 2
        else:
            raise ValueError(f"unknown normalisation mode {mode!r}")
        scale = torch.where(scale > _EPS, scale, torch.ones_like(scale))
        return center, scale

    def normalize(self, x: Tensor, mode: Mode) -> Tensor:
        center, scale = self._scale_shift(mode)
        return (x - center.to(x.device)) / scale.to(x.device)

    def unnormalize(self, x: Tensor, mode: Mode) -> Tensor:
        center, scale = self._scale_shift(mode)
        return x * scale.to(x.device) + center.to(x.device)


@dataclass
class NormStats:
    """Statistics of the state and the action, the mode they are applied in, and the state dims the policy
    does not see.

    ``hidden_state`` lists env state dims that normalising sets to 0, in SFT, RL and evaluation alike (it
    travels with the checkpoint). Why: a cloned policy can read the demonstrator's next action off its
    current velocity (the "copycat" shortcut of imitation learning). On ManiSkill's PickCube the planner's
    carry starts slowly, so a policy that sees joint velocities learns "slow -> stay slow" and crawls;
    hiding the 9 joint velocities removes that stall (docs/notes.md).
    """

    state: Stats
    action: Stats
    mode: Mode = "mean_std"
    hidden_state: tuple[int, ...] = ()
    relative_actions: tuple[int, ...] = ()

    def __post_init__(self):
        dim = self.state.mean.shape[0]
        bad = [i for i in self.hidden_state if not 0 <= i < dim]
        if bad:
            raise ValueError(f"hidden state dims {bad} are outside the state's {dim} dims")
        self.hidden_state = tuple(sorted(set(int(i) for i in self.hidden_state)))
        adim = self.action.mean.shape[0]
        bad = [i for i in self.relative_actions if not 0 <= i < min(dim, adim)]
        if bad:
            raise ValueError(f"relative action dims {bad} must be both action dims (0..{adim - 1}) and state dims "
                             f"(0..{dim - 1})")
        self.relative_actions = tuple(sorted(set(int(i) for i in self.relative_actions)))

    def normalize_state(self, x: Tensor) -> Tensor:
        """Normalised state, with the hidden dims set to 0 (the mean of a normalised dim)."""
        x = self.state.normalize(x, self.mode)   # a new tensor: zeroing it in place touches no caller's data
        if self.hidden_state:
            x[..., list(self.hidden_state)] = 0
        return x

    def to_tensors(self) -> dict[str, Tensor]:
        return {**self.state.to_dict("state"), **self.action.to_dict("action")}

    @staticmethod
    def from_tensors(d: dict[str, Tensor], mode: Mode, hidden_state: tuple[int, ...] = (),
                     relative_actions: tuple[int, ...] = ()) -> NormStats:
        return NormStats(Stats.from_dict(d, "state"), Stats.from_dict(d, "action"), mode, tuple(hidden_state),
                         tuple(relative_actions))

    def meta(self) -> dict:
        """What ``config.yaml``'s ``normalization`` section records (:func:`read_meta` reads it back)."""
        out = {"mode": self.mode, "hidden_state_dims": list(self.hidden_state)}
        if self.relative_actions:
            out["relative_action_dims"] = list(self.relative_actions)
        return out


def _int_list(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"normalization.{name} must be a list of ints, got {value!r}")
    return tuple(value)


def read_meta(meta: dict) -> tuple[Mode, tuple[int, ...], tuple[int, ...]]:
    """(mode, hidden state dims, relative action dims) of a ``normalization`` section (:meth:`NormStats.meta`);
    ValueError / KeyError name what is wrong."""
    if not isinstance(meta, dict):
        raise ValueError(f"normalization must be a mapping, got {meta!r}")
    unknown = sorted(set(meta) - {"mode", "hidden_state_dims", "relative_action_dims"})
    if unknown:
        raise ValueError(f"normalization has unknown key(s) {unknown}")
    mode = meta["mode"]
    if mode not in ("mean_std", "quantile"):
        raise ValueError(f"normalization.mode {mode!r} is not 'mean_std' or 'quantile'")
    return (mode, _int_list(meta.get("hidden_state_dims") or [], "hidden_state_dims"),
            _int_list(meta.get("relative_action_dims") or [], "relative_action_dims"))


def parse_dims(spec: str | int | list | tuple | None, dim: int) -> tuple[int, ...]:
    """State dims from a user's spec: ``"9-17"`` (inclusive range), ``"9-17,20"``, ``[9, 10]`` or ``12``.

    Ranges use ``-``, not python's ``9:18``: YAML (the CLI's override syntax) reads an unquoted ``9:18`` as
    the base-60 number 558."""
    if spec is None or spec == "" or (isinstance(spec, (list, tuple)) and not spec):
        return ()
    parts = spec.split(",") if isinstance(spec, str) else spec if isinstance(spec, (list, tuple)) else [spec]
    dims: list[int] = []
    for part in parts:
        text = part.strip() if isinstance(part, str) else part
        try:
            if isinstance(text, bool):
                raise ValueError
            if isinstance(text, str) and "-" in text.lstrip("-"):
                lo, hi = (int(x) for x in text.split("-"))
                if lo > hi:
                    raise ValueError
                dims.extend(range(lo, hi + 1))
            else:
                dims.append(int(text))
        except (TypeError, ValueError):
            raise ValueError(f"bad state dim {part!r} in {spec!r}: use ints or inclusive 'a-b' ranges, "
                             "e.g. '9-17'") from None
    bad = sorted(d for d in dims if not 0 <= d < dim)
    if bad:
        raise ValueError(f"state dims {bad} are outside the state's {dim} dims (0..{dim - 1}); note that YAML "
                         "reads an unquoted a:b as a base-60 number, write a range as 'a-b'")
    return tuple(sorted(set(dims)))


# ----------------------------------------------------------------------------------------------------
# Robot units <-> model units. The model may have more state / action dims than the robot or env (π0 pads
# to 32): states are padded with zeros after normalising, actions cut to the robot's dims before
# unnormalising. The actor (training, evaluation) and an exported policy (deployment) both use these.
# ----------------------------------------------------------------------------------------------------
def state_to_model(norm: NormStats, state: Tensor, model_dim: int) -> Tensor:
    """Robot state ``[..., s]`` -> normalised model state ``[..., S]`` (hidden dims 0, zero-padded to S)."""
    dim = state.shape[-1]
    if dim != norm.state.mean.shape[0] or dim > model_dim:
        raise ValueError(f"state has {dim} dims; the statistics have {norm.state.mean.shape[0]}, the model "
                         f"takes at most {model_dim}")
    x = norm.normalize_state(state)
    return torch.nn.functional.pad(x, (0, model_dim - dim)) if model_dim > dim else x


def _offset(norm: NormStats, actions: Tensor, state: Tensor | None, sign: float) -> Tensor:
    """``actions`` ``[..., a]`` (or ``[N, H, a]`` for a state ``[N, s]``) with ``sign`` * the robot state added on
    the relative action dims (openpi's ``DeltaActions`` / ``AbsoluteActions``: pi0_libero's arm dims are offsets from
    the state of the observation the chunk was sampled for)."""
    if not norm.relative_actions:
        return actions
    if state is None:
        raise ValueError(f"this policy's action dims {list(norm.relative_actions)} are offsets from the state: "
                         "the state is needed to convert its actions")
    idx = list(norm.relative_actions)
    s = state.to(actions.device, actions.dtype)[..., idx]
    if actions.dim() == state.dim() + 1:   # a chunk per state: the same offset for every step
        s = s.unsqueeze(-2)
    out = actions.clone()
    out[..., idx] = out[..., idx] + sign * s
    return out


def actions_to_model(norm: NormStats, actions: Tensor, model_dim: int, state: Tensor | None = None) -> Tensor:
    """Robot-unit actions ``[..., a]`` -> normalised model actions ``[..., A]`` (zero-padded to A); ``state``: the
    robot state the actions are relative to, for a policy with relative action dims."""
    dim = actions.shape[-1]
    if dim > model_dim:
        raise ValueError(f"actions have {dim} dims, more than the model's {model_dim}")
    x = norm.action.normalize(_offset(norm, actions, state, -1.0), norm.mode)
    return torch.nn.functional.pad(x, (0, model_dim - dim)) if model_dim > dim else x


def actions_from_model(norm: NormStats, x: Tensor, dim: int, low: float | Tensor, high: float | Tensor,
                       state: Tensor | None = None) -> Tensor:
    """Model actions ``[..., A]`` -> robot units ``[..., a]`` (the first ``dim`` dims), clipped to [low, high];
    ``state``: the robot state, for a policy with relative action dims."""
    a = _offset(norm, norm.action.unnormalize(x[..., :dim], norm.mode), state, 1.0)
    return a.clamp(low, high)
