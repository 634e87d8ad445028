"""LIBERO's goal predicates (the BDDL ``:goal`` of a task), evaluated batched from world state in torch.

LIBERO decides success with Python objects that read one MuJoCo state at a time
(``libero.libero.envs.predicates`` and ``object_states``). :func:`goal_spec` reads a task's goal once from a
LIBERO env into plain numbers (body, site and geom ids, region sizes, joint thresholds), and
:class:`GoalEvaluator` evaluates them for N worlds at once from positions, orientations, joint positions and the
contact list. The semantics are LIBERO's, quirks included:

- ``(On a b)``, b an object: b's body is not above a's, a and b touch, and their bodies' xy distance < 3 cm;
  b a region (site): a's body lies within the site's box in the site frame's rotated coordinates, between
  ``size_z - 5 mm`` and ``size_z + 10 cm`` above it (``SiteObject.under``, which rotates the offset by the site
  matrix, not its transpose), and, for a region of an object, that object touches a;
- ``(In a b)``, b a region: a's body lies inside the site's box ``|R size|`` (its bottom lowered by 1 cm); a
  region counts as always in contact (LIBERO's ``SiteObjectState.check_contact``);
- ``(Open x)`` / ``(Turnon x)``: some joint of x is past the object class's threshold; ``(Close x)`` /
  ``(Turnoff x)``: every joint is (an object without joints is closed).

The predicates the BDDL files of libero_spatial, libero_object, libero_goal, libero_10 and libero_90 use in their
goals are covered; any other goal form is refused when the spec is built, never evaluated as false.

Glossary: N worlds, K goal atoms, P contact queries, C contacts (all worlds), B bodies, S sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Articulated objects' thresholds: per class, predicate -> (comparison, which end of which range), as each class's
# is_open / is_close / turn_on / turn_off methods in libero.libero.envs.objects.articulated_objects compute them.
ARTICULATION_RULES = {
    "Microwave": {"open": ("<", "max", "default_open_ranges"), "close": (">", "min", "default_close_ranges")},
    "WoodenCabinet": {"open": ("<", "max", "default_open_ranges"), "close": (">", "min", "default_close_ranges")},
    "WhiteCabinet": {"open": ("<", "max", "default_open_ranges"), "close": (">", "min", "default_close_ranges")},
    "ShortCabinet": {"open": (">", "min", "default_open_ranges"), "close": ("<", "max", "default_close_ranges")},
    "ShortFridge": {"open": (">", "min", "default_open_ranges"), "close": ("<", "max", "default_close_ranges")},
    "FlatStove": {"turnon": (">=", "min", "default_turnon_ranges"), "turnoff": ("<", "max", "default_turnoff_ranges")},
}
JOINT_PREDICATES = {"open": True, "close": False, "turnon": True, "turnoff": False}   # True: any joint; False: all


class UnsupportedGoal(ValueError):
    """A BDDL goal form the batched predicates do not implement."""


@dataclass(frozen=True)
class Atom:
    """One goal predicate as numbers. ``op``: ``on_object``, ``on_site``, ``in_site`` or ``joint``."""

    op: str
    text: str                          # the atom as LIBERO parsed it, e.g. "on akita_black_bowl_1 plate_1"
    body: int = -1                     # the placed object's body (arg 1 of On / In)
    target_body: int = -1              # on_object: the supporting object's body
    site: int = -1                     # on_site / in_site: the region's site
    size: tuple[float, ...] = ()       # the region's half sizes [3]
    contact: int = -1                  # index of the contact query that must hold, -1: none
    qpos: tuple[int, ...] = ()         # joint: qpos addresses of the object's joints
    cmp: str = ""                      # joint: "<", ">" or ">="
    threshold: float = 0.0
    any_joint: bool = True             # joint: some joint (open, turn on) or every joint (close, turn off)


@dataclass(frozen=True)
class GoalSpec:
    """A task's goal: its atoms (all must hold) and the geom sets of the contact queries they use."""

    atoms: tuple[Atom, ...]
    contacts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


# ------------------------------------------------------------------------------------------------ build (host)
def _articulation(obj, predicate: str) -> tuple[str, float]:
    for cls in type(obj).__mro__:
        rules = ARTICULATION_RULES.get(cls.__name__)
        if rules is not None and predicate in rules:
            cmp, end, key = rules[predicate]
            values = obj.object_properties["articulation"][key]
            return cmp, float(max(values) if end == "max" else min(values))
    raise UnsupportedGoal(f"no {predicate!r} threshold known for {type(obj).__name__}")


def goal_spec(problem, model) -> GoalSpec:
    """Read the goal of a LIBERO problem env (``OffScreenRenderEnv(...).env``) with ``model`` its ``MjModel``."""
    import mujoco
    from libero.libero.envs.object_states.base_object_states import ObjectState, SiteObjectState

    contacts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def geom_ids(names) -> tuple[int, ...]:
        ids = (mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_GEOM, n) for n in names)
        return tuple(sorted(i for i in ids if i >= 0))

    def contact_query(obj_a, obj_b) -> int:
        contacts.append((geom_ids(obj_a.contact_geoms), geom_ids(obj_b.contact_geoms)))
        return len(contacts) - 1

    def site_id(name: str) -> int:
        i = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, name)
        if i < 0:
            raise UnsupportedGoal(f"region {name!r} has no site in the model")
        return i

    def size3(site_obj) -> tuple[float, ...]:
        size = np.asarray(site_obj.size, dtype=np.float64).reshape(-1)
        if size.shape != (3,):
            raise UnsupportedGoal(f"region {site_obj.name!r} has size {size.tolist()}, expected 3 half sizes")
        return tuple(float(v) for v in size)

    def qpos_addrs(joint_names) -> tuple[int, ...]:
        return tuple(int(model.jnt_qposadr[mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, j)])
                     for j in (joint_names or []))

    atoms = []
    for state in problem.parsed_problem["goal_state"]:
        name, args = state[0].lower(), list(state[1:])
        text = " ".join([name, *args])
        states = [problem.object_states_dict[a] for a in args]
        if name in ("on", "in") and len(args) == 2:
            placed, target = states
            if not isinstance(placed, ObjectState) or isinstance(placed, SiteObjectState):
                raise UnsupportedGoal(f"({text}): the placed thing must be an object")
            body = int(problem.obj_body_id[args[0]])
            if isinstance(target, SiteObjectState):
                site_obj = problem.object_sites_dict[args[1]]
                parent = problem.get_object(target.parent_name)
                if name == "on":
                    if not hasattr(site_obj, "under"):   # LIBERO: a region without `under` is always "on"
                        raise UnsupportedGoal(f"({text}): region without an `under` test")
                    query = -1 if parent is None else contact_query(parent, problem.get_object(args[0]))
                    atoms.append(Atom("on_site", text, body=body, site=site_id(args[1]), size=size3(site_obj),
                                      contact=query))
                else:
                    atoms.append(Atom("in_site", text, body=body, site=site_id(args[1]), size=size3(site_obj)))
            elif name == "on":
                query = contact_query(problem.get_object(args[1]), problem.get_object(args[0]))
                atoms.append(Atom("on_object", text, body=body, target_body=int(problem.obj_body_id[args[1]]),
                                  contact=query))
            else:
                raise UnsupportedGoal(f"({text}): In with an object (not a region) as container")
        elif name in JOINT_PREDICATES and len(args) == 1:
            (st,) = states
            if isinstance(st, SiteObjectState):
                if name.startswith("turn"):
                    raise UnsupportedGoal(f"({text}): LIBERO has no {name} for regions")
                obj, joints = problem.get_object(st.parent_name), problem.object_sites_dict[args[0]].joints
            else:
                obj = problem.get_object(args[0])
                joints = obj.joints
            cmp, thr = _articulation(obj, name)
            atoms.append(Atom("joint", text, qpos=qpos_addrs(joints), cmp=cmp, threshold=thr,
                              any_joint=JOINT_PREDICATES[name]))
        else:
            raise UnsupportedGoal(f"goal ({text}) is not one of On / In / Open / Close / TurnOn / TurnOff")
    if not atoms:
        raise UnsupportedGoal("the task has an empty goal")
    return GoalSpec(atoms=tuple(atoms), contacts=tuple(contacts))


# ------------------------------------------------------------------------------------------------ evaluate (device)
def contact_hits(first: Tensor, second: Tensor, geom_a: Tensor, geom_b: Tensor, world: Tensor,
                 num_worlds: int) -> Tensor:
    """``[N, P]`` bool: in each world, whether any contact touches a geom of query p's first set (``first``
    ``[P, G]``) and one of its second (``second``), in either order. ``geom_a`` / ``geom_b`` / ``world`` ``[C]``: the
    active contacts' geoms and worlds."""
    ga, gb = geom_a.clamp(min=0), geom_b.clamp(min=0)   # -1 (flex) never matches: masked below
    valid = (geom_a >= 0) & (geom_b >= 0)
    hit = ((first[:, ga] & second[:, gb]) | (first[:, gb] & second[:, ga])) & valid   # [P, C]
    out = torch.zeros(num_worlds, first.shape[0], dtype=torch.int32, device=world.device)
    out.index_add_(0, world.long(), hit.T.to(torch.int32))
    return out > 0


class GoalEvaluator:
    """Evaluates one task's :class:`GoalSpec` for N worlds on ``device``."""

    def __init__(self, spec: GoalSpec, ngeom: int, device):
        self.spec, self.device = spec, torch.device(device)
        p = len(spec.contacts)
        self.first = torch.zeros(p, ngeom, dtype=torch.bool, device=self.device)
        self.second = torch.zeros_like(self.first)
        for k, (ga, gb) in enumerate(spec.contacts):
            self.first[k, list(ga)] = True
            self.second[k, list(gb)] = True

    def atoms(self, *, xpos: Tensor, site_xpos: Tensor, site_xmat: Tensor, qpos: Tensor, geom_a: Tensor,
              geom_b: Tensor, contact_world: Tensor) -> Tensor:
        """``[N, K]`` bool, one column per goal atom. ``xpos`` ``[N, B, 3]`` body positions, ``site_xpos``
        ``[N, S, 3]``, ``site_xmat`` ``[N, S, 3, 3]``, ``qpos`` ``[N, nq]``, the contacts ``[C]``."""
        n = xpos.shape[0]
        touching = contact_hits(self.first, self.second, geom_a, geom_b, contact_world, n)   # [N, P]
        cols = []
        for atom in self.spec.atoms:
            if atom.op == "on_object":
                a, b = xpos[:, atom.body], xpos[:, atom.target_body]
                ok = (b[:, 2] <= a[:, 2]) & touching[:, atom.contact] & ((b[:, :2] - a[:, :2]).norm(dim=-1) < 0.03)
            elif atom.op in ("on_site", "in_site"):
                pos, mat = site_xpos[:, atom.site], site_xmat[:, atom.site]
                size = torch.tensor(atom.size, dtype=pos.dtype, device=pos.device)
                other = xpos[:, atom.body]
                if atom.op == "on_site":
                    d = (mat @ (other - pos)[..., None])[..., 0]
                    ok = (size[2] - 0.005 < d[:, 2]) & (d[:, 2] < size[2] + 0.10) & (d[:, :2].abs() < size[:2]).all(-1)
                    if atom.contact >= 0:
                        ok = ok & touching[:, atom.contact]
                else:
                    half = (mat @ size).abs()
                    lo, hi = pos - half, pos + half
                    lo = torch.cat([lo[:, :2], lo[:, 2:] - 0.01], dim=-1)
                    ok = ((other > lo) & (other < hi)).all(-1)
            else:  # joint
                if not atom.qpos:
                    ok = torch.full((n,), not atom.any_joint, dtype=torch.bool, device=xpos.device)
                else:
                    q = qpos[:, list(atom.qpos)]
                    past = {"<": q < atom.threshold, ">": q > atom.threshold, ">=": q >= atom.threshold}[atom.cmp]
                    ok = past.any(-1) if atom.any_joint else past.all(-1)
            cols.append(ok)
        return torch.stack(cols, dim=-1)

    def success(self, **state) -> Tensor:
        """``[N]`` bool: every atom holds (LIBERO's ``_check_success``). Arguments: see :meth:`atoms`."""
        return self.atoms(**state).all(-1)
