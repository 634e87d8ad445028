"""A shaped reward for LIBERO's pick-and-place goals: a progress potential of the privileged state.

LIBERO rewards only success. ``LiberoConfig(reward="shaped")`` adds ``shaping_scale * (phi(s') - phi(s))``
to it, with ``phi`` in [0, 1] from :func:`progress`: potential-based shaping, so over an episode the shaping
sums to ``phi(end) - phi(start)`` and no behaviour short of success (hovering near the object, holding it
over the target) earns more than reaching that state once. Success stays LIBERO's own goal predicate.

For one pick-and-place primitive (object O, target T), as ManiSkill's dense pick rewards are built:
``phi = (reach + held + held * over) / 3``, with ``reach = 1 - tanh(10 d)`` (d: grip site to O's collision
box), ``held`` = 1 while the fingers are closed on O (opening above 2 mm and below O's width, the grip site
within 1 cm of O's box), ``over = 1 - tanh(5 d_xy)`` (d_xy: O's body to its place in the table plane: T's centre, or
its slot of a region several objects share, as the expert sets them down); a pushed object (never held)
``phi = (reach + 2 over) / 3``; and ``phi = 1`` once O rests at T (:func:`placed`), so letting go there costs
nothing. Several primitives (LIBERO-Long): ``(primitives done + phi of the next one) / their number``.
"""

from __future__ import annotations

import math

import numpy as np

from vla_rl.envs.libero.expert import (
    MAX_OPENING,
    PickPlace,
    Push,
    Scene,
    plan_goal,
    read_scene,
    slot_xy,
    support_height,
    upright_axes,
)


def box_distance(point: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Euclidean distance from ``point`` to the axis-aligned box ``[lo, hi]`` (0 inside)."""
    return float(np.linalg.norm(np.maximum(0.0, np.maximum(lo - point, point - hi))))


def placed(scene: Scene, p: PickPlace | Push) -> bool:
    """O rests at T: its bottom within 3 cm of T's surface and its body within 3 cm of T's centre or, for a
    region, inside the region's box in the table plane (where LIBERO's ``In`` looks), so an object set down at its
    slot of a shared region counts."""
    body = scene.bodies[p.obj]
    xy, support = support_height(scene, p.target, p.relation)
    if body.lo[2] >= support + 0.03:
        return False
    if float(np.linalg.norm(body.pos[:2] - xy)) < 0.03:
        return True
    site = scene.sites.get(p.target)
    return site is not None and bool(np.all(np.abs((site.mat.T @ (body.pos - site.pos))[:2]) <= site.size[:2]))


def held(scene: Scene, obj: str) -> bool:
    """The fingers are closed on ``obj`` (an approximation from the fingers' opening and the grip site's place)."""
    body = scene.bodies[obj]
    _, horiz = upright_axes(body)
    width = min(2.0 * float(body.local_half[horiz].min()), MAX_OPENING)
    return 0.002 < scene.gripper_opening < width + 0.01 and box_distance(scene.eef_pos, body.lo, body.hi) < 0.01


def pick_place_progress(scene: Scene, p: PickPlace) -> float:
    if placed(scene, p):
        return 1.0
    body = scene.bodies[p.obj]
    reach = 1.0 - math.tanh(10.0 * box_distance(scene.eef_pos, body.lo, body.hi))
    if not held(scene, p.obj):
        return reach / 3.0
    xy, _ = slot_xy(scene, p.target, p.relation, p.slot)
    over = 1.0 - math.tanh(5.0 * float(np.linalg.norm(body.pos[:2] - xy)))
    return (reach + 1.0 + over) / 3.0


def push_progress(scene: Scene, p: Push) -> float:
    """A pushed object is never held: reaching it counts a third, its distance to the target the rest."""
    if placed(scene, p):
        return 1.0
    body = scene.bodies[p.obj]
    reach = 1.0 - math.tanh(10.0 * box_distance(scene.eef_pos, body.lo, body.hi))
    xy, _ = support_height(scene, p.target, p.relation)
    over = 1.0 - math.tanh(5.0 * float(np.linalg.norm(body.pos[:2] - xy)))
    return (reach + 2.0 * over) / 3.0


def progress(scene: Scene, primitives: list[PickPlace | Push]) -> float:
    """The potential ``phi`` in [0, 1] of ``scene`` for ``primitives`` (see the module docstring)."""
    for k, p in enumerate(primitives):
        if not isinstance(p, (PickPlace, Push)):   # a drawer or a knob: no potential, LIBERO's success alone
            return k / len(primitives)
        if not placed(scene, p):
            part = push_progress(scene, p) if isinstance(p, Push) else pick_place_progress(scene, p)
            return (k + part) / len(primitives)
    return 1.0


class Shaping:
    """The shaping term of one episode of a robosuite LIBERO env: ``step()`` returns ``phi(now) - phi(before)``."""

    def __init__(self, env):
        self.env = getattr(env, "env", env)
        scene = read_scene(self.env)
        self.primitives = plan_goal(self.env.parsed_problem["goal_state"], scene)
        self.names = {n for p in self.primitives for n in (getattr(p, "obj", None), getattr(p, "target", None))
                      if n in scene.bodies}
        self.phi = progress(scene, self.primitives)

    def step(self) -> float:
        phi = progress(read_scene(self.env, self.names), self.primitives)
        delta, self.phi = phi - self.phi, phi
        return delta
