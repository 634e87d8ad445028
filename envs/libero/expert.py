"""A scripted expert for LIBERO's tasks: privileged simulator state in, a 7-d OSC_POSE action out.

The expert reads the task's goal (the BDDL problem's goal predicates, ``parsed_problem["goal_state"]``) and
the scene (end-effector pose, gripper fingers, every object's pose and collision bounding box, the
regions' sites, the articulated objects' joints), turns the goal into primitives (pick-and-place into or
onto a target; push a flat object too wide to grasp along the table; open / close a cabinet's drawer, with the
fingers pitched along its slide; turn a stove's knob on by grasping and twisting it; hinged doors have none yet:
:class:`UnsupportedGoal`) and follows each primitive as a sequence of waypoints
through LIBERO's own controller: robosuite's OSC_POSE with delta commands, ``[dx, dy, dz]`` scaled by 0.05 m
and ``[rx, ry, rz]`` (axis-angle, world frame) by 0.5 rad per step, gripper -1 open / +1 close.

It is split so that other simulators of the same scenes can reuse it:

- :class:`Scene` is plain numpy (world frame): :func:`read_scene` fills it from a robosuite LIBERO env,
  another backend (MuJoCo Warp) can fill it from its own arrays.
- :func:`plan_goal` maps goal predicates to primitives, :class:`LiberoExpert` maps (primitive, scene) to an
  action. Both are pure given their inputs; the expert's only state is the phase it is in and a step
  counter, and its random draws (waypoint jitter, for varied demonstrations) come from its own seed.

Glossary: world frame z up; the grip site is the point between the fingertips; the closing axis is the
direction the fingers move along (the grip site's x axis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from vla_rl.core.ranges import check_ranges, nonneg, positive

POS_SCALE, ROT_SCALE = 0.05, 0.5      # OSC_POSE output_max: metres / radians per unit action
OPEN, CLOSE = -1.0, 1.0
CORNERS = np.array([[i, j, k] for i in (-1, 1) for j in (-1, 1) for k in (-1, 1)], dtype=float)
MAX_OPENING = 0.075                   # the Panda's fingers open ~8 cm; wider objects are grasped by a rim
FINGER_BELOW = 0.005                  # the finger pads reach ~4.5 mm below the grip site


# ---------------------------------------------------------------------------------------------- scene
@dataclass(frozen=True)
class Body:
    """An object (or fixture) of the scene: its root body's pose and its collision geometry's world box."""

    pos: np.ndarray                  # [3] root body position
    mat: np.ndarray                  # [3, 3] root body orientation
    lo: np.ndarray                   # [3] world axis-aligned bounding box of its collision geoms
    hi: np.ndarray
    local_half: np.ndarray           # [3] half extents of that box in the body's own frame

    @property
    def center(self) -> np.ndarray:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class Site:
    """A region of the scene (LIBERO's sites: a box of half-size ``size`` at ``pos``, oriented by ``mat``)."""

    pos: np.ndarray
    mat: np.ndarray
    size: np.ndarray
    parent: str | None = None        # the object the region belongs to (basket_1_contain_region -> basket_1)


@dataclass(frozen=True)
class Drawer:
    """A region that slides with its drawer (``wooden_cabinet_1_bottom_region``): the drawer's slide joint and the
    box of its front-most collision geom (the handle), world frame."""

    q: float                         # the slide joint's position
    axis: np.ndarray                 # [3] world direction the drawer moves as q grows
    closes_with_q: bool              # closing raises q (LIBERO's wooden / white cabinets) or lowers it
    handle_lo: np.ndarray            # [3] the geom furthest out along the opening direction
    handle_hi: np.ndarray
    is_open: bool = False            # LIBERO's own predicate of the cabinet (its is_open(q))
    room: float = 0.0                # how much further it opens (m) before its joint's limit

    @property
    def closing(self) -> np.ndarray:
        """World direction that pushes the drawer in."""
        return self.axis if self.closes_with_q else -self.axis

    @property
    def handle_center(self) -> np.ndarray:
        return (self.handle_lo + self.handle_hi) / 2

    @property
    def handle_depth(self) -> float:
        """Half the handle's extent along the slide."""
        return 0.5 * float(np.abs(self.handle_hi - self.handle_lo) @ np.abs(self.closing))


@dataclass(frozen=True)
class Knob:
    """A stove's control knob (LIBERO's ``FlatStove`` button): a hinge turned by grasping its bar and twisting."""

    q: float                         # the hinge's angle
    pivot: np.ndarray                # [3] the hinge's anchor, world frame
    axis: np.ndarray                 # [3] world direction of the hinge (turning on raises q)
    bar_lo: np.ndarray               # [3] world box of the knob's bar (its largest collision geom)
    bar_hi: np.ndarray
    is_on: bool = False              # LIBERO's own predicate (turn_on(q))


@dataclass(frozen=True)
class Scene:
    """Privileged state of one LIBERO scene, world frame."""

    eef_pos: np.ndarray              # [3] grip site
    eef_mat: np.ndarray              # [3, 3] grip site orientation (the OSC controller's frame)
    gripper_qpos: np.ndarray         # [2] finger joints (open ~ +-0.04, closed on nothing ~ 0)
    bodies: dict[str, Body] = field(default_factory=dict)
    sites: dict[str, Site] = field(default_factory=dict)
    joints: dict[str, np.ndarray] = field(default_factory=dict)   # articulated object -> its joints' qpos
    # World boxes of every collision geom of the objects and fixtures (not the robot, not the table), and the
    # object each belongs to: what a gripper must not run into. Empty when read for a few objects only.
    geom_lo: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    geom_hi: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    geom_owner: tuple[str, ...] = ()
    drawers: dict[str, Drawer] = field(default_factory=dict)   # region site -> its drawer (full scene reads only)
    knobs: dict[str, Knob] = field(default_factory=dict)       # stove -> its knob (full scene reads only)

    @property
    def gripper_opening(self) -> float:
        return float(self.gripper_qpos[0] - self.gripper_qpos[1])


def read_scene(env, names=None) -> Scene:
    """The :class:`Scene` of a LIBERO robosuite env (``OffScreenRenderEnv(...).env`` or the env itself); with
    ``names``, only those objects (and no joints)."""
    import mujoco

    env = getattr(env, "env", env)
    m, d = env.sim.model._model, env.sim.data._data
    site = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, "gripper0_grip_site")
    fingers = [m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, f"gripper0_finger_joint{i}")]
               for i in (1, 2)]
    wanted = {bid: name for name, bid in env.obj_body_id.items() if names is None or name in names}
    collide = (m.geom_contype != 0) | (m.geom_conaffinity != 0)
    root_of_geom = m.body_rootid[m.geom_bodyid]
    geoms = np.flatnonzero(collide & np.isin(root_of_geom, list(wanted)))
    roots = root_of_geom[geoms]
    # the 8 corners of every such geom's box, in the world: [G, 8, 3]
    pts = d.geom_xpos[geoms, None, :] + np.einsum(
        "gkj,gij->gki", m.geom_aabb[geoms, None, :3] + m.geom_aabb[geoms, None, 3:] * CORNERS[None],
        d.geom_xmat[geoms].reshape(-1, 3, 3))
    bodies = {}
    for bid, name in wanted.items():
        pos, mat = d.xpos[bid].copy(), d.xmat[bid].reshape(3, 3).copy()
        mine = pts[roots == bid].reshape(-1, 3)
        if len(mine):
            local = (mine - pos) @ mat
            lo, hi, half = mine.min(0), mine.max(0), (local.max(0) - local.min(0)) / 2
        else:
            lo = hi = pos
            half = np.zeros(3)
        bodies[name] = Body(pos=pos, mat=mat, lo=lo, hi=hi, local_half=half)
    sites = {}
    for name, obj in env.object_sites_dict.items():
        sid = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, name)
        if sid < 0 or obj.size is None:
            continue
        sites[name] = Site(pos=d.site_xpos[sid].copy(), mat=d.site_xmat[sid].reshape(3, 3).copy(),
                           size=np.asarray(obj.size, dtype=float), parent=getattr(obj, "parent_name", None))
    joints = {}
    for name in env.obj_body_id if names is None else ():
        qpos = []
        for joint in getattr(env.get_object(name), "joints", None) or []:
            jid = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, joint)
            if jid >= 0 and m.jnt_type[jid] != mujoco.mjtJoint.mjJNT_FREE:
                qpos.append(d.qpos[m.jnt_qposadr[jid]])
        if qpos:
            joints[name] = np.asarray(qpos, dtype=float)
    geom_lo = geom_hi = np.zeros((0, 3))
    owners: tuple[str, ...] = ()
    drawers, knobs = {}, {}
    if names is None:
        geom_lo, geom_hi = pts.min(1), pts.max(1)
        owners = tuple(wanted[r] for r in roots)
        drawers, knobs = read_drawers(env, m, d, sites), read_knobs(env, m, d)
    return Scene(eef_pos=d.site_xpos[site].copy(), eef_mat=d.site_xmat[site].reshape(3, 3).copy(),
                 gripper_qpos=np.array([d.qpos[a] for a in fingers]), bodies=bodies, sites=sites, joints=joints,
                 geom_lo=geom_lo, geom_hi=geom_hi, geom_owner=owners, drawers=drawers, knobs=knobs)


def _geom_boxes(m, d, body: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """World boxes (lo, hi) of the collision geoms of ``body``."""
    out = []
    for g in np.flatnonzero(m.geom_bodyid == body):
        if not (m.geom_contype[g] or m.geom_conaffinity[g]):
            continue
        mat = d.geom_xmat[g].reshape(3, 3)
        center = d.geom_xpos[g] + mat @ m.geom_aabb[g, :3]
        half = np.abs(mat) @ m.geom_aabb[g, 3:]
        out.append((center - half, center + half))
    return out


def read_knobs(env, m, d) -> dict:
    """:class:`Knob` of every LIBERO ``FlatStove`` in the scene (its one hinge joint)."""
    import mujoco

    out = {}
    for name in env.obj_body_id:
        obj = env.get_object(name)
        if type(obj).__name__ != "FlatStove":
            continue
        for joint in getattr(obj, "joints", None) or []:
            j = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, joint)
            if j < 0 or m.jnt_type[j] != mujoco.mjtJoint.mjJNT_HINGE:
                continue
            body = m.jnt_bodyid[j]
            mat = d.xmat[body].reshape(3, 3)
            boxes = _geom_boxes(m, d, body)
            if not boxes:
                continue
            lo, hi = max(boxes, key=lambda b: float(np.prod(b[1] - b[0])))
            q = float(d.qpos[m.jnt_qposadr[j]])
            out[name] = Knob(q=q, pivot=d.xpos[body] + mat @ m.jnt_pos[j], axis=mat @ m.jnt_axis[j], bar_lo=lo,
                             bar_hi=hi, is_on=bool(obj.turn_on(q)))
    return out


# LIBERO's cabinets (libero.libero.envs.objects.articulated_objects): "open" is q below a threshold for these
# (closing raises q), above one for the short cabinet and the fridge (closing lowers it).
CLOSES_WITH_Q = {"WoodenCabinet": True, "WhiteCabinet": True, "ShortCabinet": False, "ShortFridge": False}


def read_drawers(env, m, d, sites: dict) -> dict:
    """:class:`Drawer` of every region site whose body slides on a joint of a known cabinet."""
    import mujoco

    out = {}
    for name, site in sites.items():
        obj = env.get_object(site.parent) if site.parent in env.obj_body_id else None
        if type(obj).__name__ not in CLOSES_WITH_Q:
            continue
        body = m.site_bodyid[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, name)]
        joints = [j for j in range(m.njnt) if m.jnt_bodyid[j] == body and m.jnt_type[j] == mujoco.mjtJoint.mjJNT_SLIDE]
        if len(joints) != 1:
            continue
        j = joints[0]
        axis = d.xmat[body].reshape(3, 3) @ m.jnt_axis[j]
        closing = axis if CLOSES_WITH_Q[type(obj).__name__] else -axis
        boxes = _geom_boxes(m, d, body)
        if not boxes:
            continue
        # the handle: the geom reaching furthest against the closing direction
        lo, hi = min(boxes, key=lambda b: float(np.minimum(b[0] * closing, b[1] * closing).sum()))
        q = float(d.qpos[m.jnt_qposadr[j]])
        lo_q, hi_q = (float(v) for v in m.jnt_range[j])
        room = q - lo_q if CLOSES_WITH_Q[type(obj).__name__] else hi_q - q
        out[name] = Drawer(q=q, axis=axis, closes_with_q=CLOSES_WITH_Q[type(obj).__name__], handle_lo=lo,
                           handle_hi=hi, is_open=bool(obj.is_open(q)), room=room)
    return out


# ---------------------------------------------------------------------------------------------- rotations
def rot_z(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def rotation_log(r: np.ndarray) -> np.ndarray:
    """Axis * angle ``[3]`` of a rotation matrix (angle in [0, pi])."""
    cos = min(max((np.trace(r) - 1.0) / 2.0, -1.0), 1.0)
    angle = math.acos(cos)
    if angle < 1e-9:
        return np.zeros(3)
    anti = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])   # 2 sin(angle) axis
    if math.pi - angle < 1e-4:       # near a half turn: the axis from the symmetric part, its sign from anti
        axis = np.sqrt(np.clip((np.diag(r) + 1.0) / 2.0, 0.0, None))
        k = int(np.argmax(axis))
        axis = axis * np.sign(np.where(np.arange(3) == k, 1.0, r[k] + r[:, k]))
        if axis @ anti < 0:
            axis = -axis
        return axis / np.linalg.norm(axis) * angle
    return anti / (2.0 * math.sin(angle)) * angle


def down_orientation(yaw: float) -> np.ndarray:
    """Grip-site orientation pointing straight down whose closing axis (x) points along ``yaw`` in the
    table plane."""
    x = np.array([math.cos(yaw), math.sin(yaw), 0.0])
    z = np.array([0.0, 0.0, -1.0])
    return np.stack([x, np.cross(z, x), z], axis=1)


def closing_yaw(mat: np.ndarray) -> float:
    """The yaw of the closing axis (grip site x) of orientation ``mat``."""
    return math.atan2(mat[1, 0], mat[0, 0])


def nearest_yaw(yaw: float, reference: float, period: float = math.pi) -> float:
    """``yaw`` shifted by a multiple of ``period`` to lie closest to ``reference`` (a parallel gripper is
    symmetric under half turns)."""
    return yaw + period * round((reference - yaw) / period)


def pose_action(eef_pos: np.ndarray, eef_mat: np.ndarray, target_pos: np.ndarray, target_mat: np.ndarray,
                gripper: float, *, gain: float = 1.0, rot_gain: float = 1.0, max_pos: float = 1.0,
                max_rot: float = 1.0) -> np.ndarray:
    """The OSC_POSE delta action ``[7]`` moving the grip site towards ``(target_pos, target_mat)``: the
    position error in units of the controller's 0.05 m step, times ``gain``, limited to ``max_pos`` per axis
    (per axis, so that a blocked descent does not stall a sideways correction); the rotation error
    (world-frame axis-angle, as the controller applies it: ``R_goal = R(delta) R``) in units of 0.5 rad,
    times ``rot_gain``, limited to ``max_rot`` per axis."""
    dp = np.clip(gain * (np.asarray(target_pos) - eef_pos) / POS_SCALE, -max_pos, max_pos)
    dr = np.clip(rot_gain * rotation_log(np.asarray(target_mat) @ eef_mat.T) / ROT_SCALE, -max_rot, max_rot)
    return np.concatenate([np.clip(dp, -1.0, 1.0), np.clip(dr, -1.0, 1.0), [gripper]])


# ---------------------------------------------------------------------------------------------- goals
@dataclass(frozen=True)
class PickPlace:
    """Pick ``obj`` up and put it ``relation`` (``on`` / ``in``) ``target`` (an object or a region). ``slot`` =
    (k, n): the k-th of n objects the plan puts on one region, set down apart in it, not on each other
    (LIBERO-10's "put both moka pots on the stove", "both ... in the basket")."""

    obj: str
    target: str
    relation: str = "on"
    slot: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class Push:
    """Push ``obj`` along the table until its centre is over ``target``'s (``relation`` as in :class:`PickPlace`):
    for a flat object wider than the fingers open (LIBERO-Goal's "push the plate to the front of the stove")."""

    obj: str
    target: str
    relation: str = "on"


@dataclass(frozen=True)
class CloseDrawer:
    """Push the drawer that ``region`` slides with all the way in: closed fingers against its handle from the
    front, along the slide (LIBERO-10's "put the black bowl in the bottom drawer and close it")."""

    region: str


@dataclass(frozen=True)
class OpenDrawer:
    """Pull the drawer that ``region`` slides with open: fingertips hooked behind its handle bar (between the bar
    and the drawer's face), pulled along the slide (LIBERO-Goal's "open the middle drawer of the cabinet")."""

    region: str


@dataclass(frozen=True)
class TurnOn:
    """Turn ``stove``'s knob on: grasp its bar across, twist the wrist about the hinge (LIBERO's "turn on the
    stove"; a push on the bar stalls against the hinge's damping, and its long arm is out of reach)."""

    stove: str


Primitive = PickPlace | Push | CloseDrawer | OpenDrawer | TurnOn
FLAT = 0.03                           # thinner than this and wider than MAX_OPENING both ways: pushed, not picked


def pushable(body: Body) -> bool:
    """Flat and wider than the gripper opens in every horizontal direction: a plate."""
    vert, horiz = upright_axes(body)
    return 2.0 * float(body.local_half[vert]) < FLAT and 2.0 * float(body.local_half[horiz].min()) > MAX_OPENING


class UnsupportedGoal(ValueError):
    """A goal predicate the expert has no primitive for."""


def plan_goal(goal: list, scene: Scene) -> list[Primitive]:
    """Primitives achieving the BDDL goal ``goal`` (``parsed_problem["goal_state"]``: a list of predicates
    such as ``["on", "akita_black_bowl_1", "plate_1"]``), in the order given."""
    out: list[Primitive] = []
    closes: list[Primitive] = []   # after every placement: a drawer is closed on what was put in it
    for pred in goal:
        name = str(pred[0]).lower()
        if name == "close" and len(pred) == 2 and str(pred[1]) in scene.drawers:
            closes.append(CloseDrawer(str(pred[1])))
        elif name == "turnon" and len(pred) == 2 and str(pred[1]) in scene.knobs:
            if not scene.knobs[str(pred[1])].is_on:
                out.append(TurnOn(str(pred[1])))
        elif name == "open" and len(pred) == 2 and str(pred[1]) in scene.drawers:
            if OpenDrawer(str(pred[1])) not in out:
                out.insert(0, OpenDrawer(str(pred[1])))   # before anything is put in it
        elif name in ("on", "in") and len(pred) == 3:
            obj, target = str(pred[1]), str(pred[2])
            if obj not in scene.bodies:
                raise UnsupportedGoal(f"{name} {obj} {target}: {obj} is not a movable object of the scene")
            if target not in scene.bodies and target not in scene.sites:
                raise UnsupportedGoal(f"{name} {obj} {target}: unknown target {target}")
            drawer = scene.drawers.get(target)
            # "put the bowl in the top drawer" of a closed one, or of one not open all the way (LIBERO-10's bottom
            # drawer starts 1.4 cm short: a bowl then lands on its front wall)
            if name == "in" and drawer is not None and drawer.room > 0.005 and OpenDrawer(target) not in out:
                out.append(OpenDrawer(target))
            out.append(Push(obj, target, name) if pushable(scene.bodies[obj]) else PickPlace(obj, target, name))
        else:
            raise UnsupportedGoal(f"no primitive for the goal predicate {pred}")
    return spread(out) + closes


def spread(plan: list[Primitive]) -> list[Primitive]:
    """The plan with each target that several pick-and-places share given out as slots (:func:`place_xy` spreads
    them over a region; on an object they stay where they were)."""
    shared: dict[str, list[int]] = {}
    for i, p in enumerate(plan):
        if isinstance(p, PickPlace):
            shared.setdefault(p.target, []).append(i)
    out = list(plan)
    for idx in shared.values():
        if len(idx) > 1:
            for k, i in enumerate(idx):
                out[i] = replace(plan[i], slot=(k, len(idx)))
    return out


# ---------------------------------------------------------------------------------------------- grasps
def upright_axes(body: Body) -> tuple[int, list[int]]:
    """(index of the body axis closest to vertical, the two other axes)."""
    vert = int(np.argmax(np.abs(body.mat[2])))
    return vert, [i for i in range(3) if i != vert]


def gripper_boxes(pos: np.ndarray, yaw: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """World boxes (lo, hi) around the fingers and the hand of a downward gripper with its grip site at
    ``pos`` and closing axis at ``yaw``, up to the pre-grasp height: what must be free to grasp there."""
    u = np.array([math.cos(yaw), math.sin(yaw), 0.0])
    v = np.array([-u[1], u[0], 0.0])
    out = []
    for along, across, z0, z1 in ((0.045, 0.012, -FINGER_BELOW, 0.03), (0.10, 0.035, 0.03, 0.15)):
        corners = np.array([pos + a * along * u + b * across * v for a in (-1, 1) for b in (-1, 1)])
        lo, hi = corners.min(0), corners.max(0)
        out.append((np.r_[lo[:2], pos[2] + z0], np.r_[hi[:2], pos[2] + z1]))
    return out


def collisions(scene: Scene, boxes, skip: str) -> int:
    """How many of the scene's obstacle geoms (except those of ``skip``) overlap any of ``boxes``."""
    if not len(scene.geom_owner):
        return 0
    mine = np.array([o == skip for o in scene.geom_owner])
    hit = np.zeros(len(mine), dtype=bool)
    for lo, hi in boxes:
        hit |= np.all((scene.geom_lo < hi) & (scene.geom_hi > lo), axis=1)
    return int((hit & ~mine).sum())


def grasp_pose(body: Body, eef_pos: np.ndarray, eef_yaw: float, scene: Scene | None = None,
               name: str = "", place: tuple[np.ndarray, float] | None = None) -> tuple[np.ndarray, float]:
    """Where the grip site goes to grasp ``body`` (called ``name`` in ``scene``) from above, and the closing
    axis' yaw there.

    An object narrower than the fingers' opening is grasped at its box centre, closing across its narrow
    horizontal side, near its top (at most 3 cm down, not below 1 cm above its bottom). A wider one (a bowl)
    is grasped by its rim, closing radially, on the side facing the gripper among those where the fingers and
    the hand run into no other geom of ``scene`` (a bowl in a drawer is taken from the open side), there and, given
    ``place`` (the xy the object goes to and the surface it is set on), where it is set down (a bowl put on a plate
    beside the cabinet is held on the side away from the cabinet's handles)."""
    if name.startswith("moka_pot"):
        return handle_grasp(body, eef_yaw)
    _, horiz = upright_axes(body)
    widths = 2.0 * body.local_half[horiz]
    height = float(body.hi[2] - body.lo[2])
    center = body.center
    if widths.min() <= MAX_OPENING - 0.012:
        axis = body.mat[:, horiz[int(np.argmin(widths))]]
        yaw = math.atan2(axis[1], axis[0])
        z = max(body.lo[2] + FINGER_BELOW + 0.005, body.hi[2] - min(0.03, 0.5 * height))
        return np.array([center[0], center[1], z]), nearest_yaw(yaw, eef_yaw)
    radius = float(widths.min()) / 2.0
    z = max(body.lo[2] + FINGER_BELOW + 0.005, body.hi[2] - 0.02)
    toward = eef_pos[:2] - center[:2]
    facing = math.atan2(toward[1], toward[0]) if np.linalg.norm(toward) > 1e-6 else math.pi
    best = None
    for k in range(16):
        yaw = facing + (math.pi / 8) * ((k + 1) // 2) * (1 if k % 2 else -1)
        pos = np.r_[center[:2] + (radius - 0.015) * np.array([math.cos(yaw), math.sin(yaw)]), z]
        hits = collisions(scene, gripper_boxes(pos, yaw), name) if scene is not None else 0
        if place is not None and scene is not None:
            moved = np.r_[place[0] - center[:2], place[1] + 0.015 - body.lo[2]]
            hits += collisions(scene, gripper_boxes(pos + moved, yaw), name)
        if best is None or hits < best[0]:
            best = (hits, pos, yaw)
        if hits == 0:
            break
    _, pos, yaw = best
    return pos, nearest_yaw(yaw, eef_yaw)


# LIBERO's moka pot, in its body frame: a 6.8 x 7 x 13.4 cm column (its top 6.7 cm above the body origin), a lid
# knob on top, and a handle loop on +y whose outer bar stands at y = 7.2 cm from z = 0 to 5.6 cm. Across the column
# the fingers have 3 mm to spare and a pinch below the top leaves the pads a centimetre of it; the handle's bar is
# 1.4 cm across, with room on both sides.
MOKA_HANDLE = np.array([0.0, 0.072, 0.045])   # pinch point: the bar's top, the hand clear of the loop above it


def handle_grasp(body: Body, eef_yaw: float) -> tuple[np.ndarray, float]:
    """Grasp a moka pot by its handle's outer bar from above, closing across the bar (the body's x axis)."""
    pos = body.pos + body.mat @ MOKA_HANDLE
    yaw = math.atan2(body.mat[1, 0], body.mat[0, 0])
    return pos, nearest_yaw(yaw, eef_yaw)


def support_height(scene: Scene, target: str, relation: str) -> tuple[np.ndarray, float]:
    """(xy the object's body must reach, height of the surface it is put down on) for ``target``."""
    if target in scene.sites:
        site = scene.sites[target]
        half = np.abs(site.mat @ site.size)
        if relation == "in":    # a container's region: its floor
            return site.pos[:2].copy(), float(site.pos[2] - half[2])
        return site.pos[:2].copy(), float(site.pos[2] + half[2])
    body = scene.bodies[target]
    return body.pos[:2].copy(), float(body.hi[2])


def slot_xy(scene: Scene, target: str, relation: str, slot: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, float]:
    """:func:`support_height` at ``slot`` (this one's place ``slot[0]`` of ``slot[1]`` objects sharing the region):
    spread along the region's diagonal within 40 % of its half-sizes of the centre; an object target, or a
    region that is not shared, keeps its centre."""
    xy, support = support_height(scene, target, relation)
    k, n = slot
    if n > 1 and target in scene.sites:
        site = scene.sites[target]
        half = np.abs(site.mat @ site.size)[:2]
        xy = xy + half * 0.8 * (k / (n - 1) - 0.5)
    return xy, support


def place_xy(scene: Scene, target: str, relation: str, body: Body,
             slot: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, float]:
    """:func:`slot_xy` for putting ``body`` down, moved out from under the cabinet for an open drawer's
    region while the object is as high as the cabinet's other handles: its far side passes them in front (a bowl
    lowered at the region's centre hit the handle of the drawer above), then goes in under them. A shared region
    is given out along its diagonal: two cans 6.3 cm across fit LIBERO-10's basket (12 cm inside) only corner to
    corner."""
    xy, support = slot_xy(scene, target, relation, slot)
    drawer = scene.drawers.get(target)
    if drawer is None:
        return xy, support
    c = drawer.closing[:2] / max(float(np.linalg.norm(drawer.closing[:2])), 1e-9)
    parent = scene.sites[target].parent
    # the handles an object lowered into this drawer passes: the drawers above it in the same cabinet
    others = [d for name, d in scene.drawers.items() if name != target and scene.sites[name].parent == parent
              and d.handle_lo[2] > drawer.handle_hi[2]]
    if not others:
        return xy, support
    if body.hi[2] < min(float(d.handle_lo[2]) for d in others) - 0.005:
        return xy, support   # below the handles: in under them, to the region's centre
    limit = min(float(np.minimum(d.handle_lo[:2] * c, d.handle_hi[:2] * c).sum()) for d in others)
    _, horiz = upright_axes(body)
    reach = float(body.local_half[horiz].max()) + 0.015
    along = float(xy @ c)
    return xy + c * (min(along, limit - reach) - along), support


def corridor_top(scene: Scene, start: np.ndarray, end: np.ndarray, margin: float, skip: set[str]) -> float:
    """The highest top of the bodies (except ``skip``) whose boxes, widened by ``margin``, lie on the straight
    path from ``start`` to ``end`` (xy)."""
    top = -np.inf
    pts = start[None, :2] + np.linspace(0.0, 1.0, 25)[:, None] * (end[:2] - start[:2])[None]
    for name, b in scene.bodies.items():
        if name in skip:
            continue
        inside = np.all((pts > b.lo[:2] - margin) & (pts < b.hi[:2] + margin), axis=1)
        if inside.any():
            top = max(top, float(b.hi[2]))
    return top


# ---------------------------------------------------------------------------------------------- expert
@dataclass(frozen=True)
class ExpertConfig:
    """Gains, heights and tolerances of :class:`LiberoExpert`."""

    gain: float = positive(4.0)          # position P gain (error in 5 cm units)
    max_speed: float = positive(1.0)     # norm limit of the position action
    hover: float = nonneg(0.08)          # pre-grasp height above the grasp point
    clearance: float = nonneg(0.05)      # carried object's bottom above the obstacles on its path
    release_gap: float = nonneg(0.015)   # object bottom above the support surface when it is let go
    pos_tol: float = positive(0.008)     # waypoint reached (m)
    yaw_tol: float = positive(0.08)      # rad
    grasp_steps: int = positive(12)      # steps with the gripper closing before lifting
    release_steps: int = positive(8)
    max_phase_steps: int = positive(80)  # a waypoint not reached by then is given up
    max_retries: int = nonneg(2)         # new grasps after one that did not lift the object
    max_push_retries: int = nonneg(8)    # new starts of a push whose object slid off the fingers' line
    # closing a drawer, the fingers point along the slide pitched down by this (rad): pointing down, the forearm
    # hits the cabinet above a low drawer; level, the wrist hits what stands behind the hand
    close_pitch: float = nonneg(0.8)
    twist: float = positive(0.9)         # how far the wrist turns a knob (rad; LIBERO's stove is on from 0.5)
    jitter: float = nonneg(0.0)          # std of seeded waypoint offsets (m), for varied demonstrations

    def __post_init__(self):
        check_ranges(self)


class LiberoExpert:
    """Waypoint expert for a list of primitives (see :func:`plan_goal`).

    ``act(scene)`` returns the next 7-d action; ``status`` is ``running``, ``done`` (every primitive
    finished) or ``failed`` (a grasp did not hold after ``max_retries`` new tries). Deterministic given the
    scenes it is shown and ``seed``."""

    def __init__(self, primitives: list[Primitive], config: ExpertConfig | None = None, seed: int = 0):
        self.primitives = list(primitives)
        self.cfg = config or ExpertConfig()
        self.rng = np.random.default_rng(seed)
        self.status = "running"
        self.index = 0
        self.retries = 0
        self._start("approach")

    # -- bookkeeping
    def _start(self, phase: str) -> None:
        self.phase, self.steps = phase, 0
        self.mem: dict = getattr(self, "mem", {}) if phase != "approach" else {}

    def _jitter(self, n: int) -> np.ndarray:
        return self.cfg.jitter * self.rng.standard_normal(n) if self.cfg.jitter > 0 else np.zeros(n)

    def _move(self, scene: Scene, pos: np.ndarray, yaw: float, grip: float, max_speed: float | None = None):
        return pose_action(scene.eef_pos, scene.eef_mat, pos, down_orientation(yaw), grip, gain=self.cfg.gain,
                           max_pos=self.cfg.max_speed if max_speed is None else max_speed)

    def _move_to_pose(self, scene: Scene, pos: np.ndarray, mat: np.ndarray, grip: float,
                      max_speed: float | None = None) -> np.ndarray:
        """:meth:`_move` for a grip-site orientation other than pointing down (the drawers' pitched fingers)."""
        return pose_action(scene.eef_pos, scene.eef_mat, pos, mat, grip, gain=self.cfg.gain,
                           max_pos=self.cfg.max_speed if max_speed is None else max_speed)

    def _turned(self, scene: Scene, mat: np.ndarray) -> bool:
        return abs(rotation_log(mat @ scene.eef_mat.T)).max() < 2 * self.cfg.yaw_tol

    def _drawer_stopped(self, drawer: Drawer, after: int, span: int) -> bool:
        """The drawer's joint, logged every step of the phase, moved less than 0.1 mm over the last ``span``
        steps (once more than ``after`` are logged): it hit its end stop, or something holds it."""
        qs = self.mem.setdefault("q", [])
        qs.append(drawer.q)
        return len(qs) > after and abs(qs[-1] - qs[-span]) < 1e-4

    def _reached(self, scene: Scene, pos: np.ndarray, yaw: float | None = None, tol: float | None = None) -> bool:
        ok = float(np.linalg.norm(scene.eef_pos - pos)) < (tol or self.cfg.pos_tol)
        if yaw is not None:
            ok = ok and abs(rotation_log(down_orientation(yaw) @ scene.eef_mat.T)).max() < self.cfg.yaw_tol
        return ok

    # -- the policy
    def act(self, scene: Scene) -> np.ndarray:
        if self.status != "running":
            return np.array([0.0] * 6 + [OPEN if self.status == "done" else CLOSE])
        self.steps += 1
        p = self.primitives[self.index]
        act = {Push: self._push, CloseDrawer: self._close_drawer, OpenDrawer: self._open_drawer,
               TurnOn: self._turn_on}.get(type(p), self._pick_place)
        action = act(scene, p)
        return np.clip(action, -1.0, 1.0)

    def _next_primitive(self) -> None:
        self.index += 1
        self.retries = 0
        if self.index >= len(self.primitives):
            self.status = "done"
        self._start("approach")

    def _pick_place(self, scene: Scene, p: PickPlace) -> np.ndarray:
        cfg, mem = self.cfg, self.mem
        body = scene.bodies[p.obj]
        yaw_now = closing_yaw(scene.eef_mat)
        if self.phase == "approach":
            if "offset" not in mem:
                mem["offset"] = np.r_[self._jitter(2), 0.0]
                mem["hover"] = cfg.hover + abs(float(self._jitter(1)[0]))
                mem["yaw"] = None
            if "rim" not in mem:     # choose the grasp once, from the scene before any motion
                mem["rim"] = grasp_pose(body, scene.eef_pos, yaw_now, scene, p.obj,
                                        place=place_xy(scene, p.target, p.relation, body, p.slot))
            grasp, yaw = self._grasp(scene, body, mem)
            mem["yaw"] = yaw
            above = grasp + mem["offset"] + [0.0, 0.0, mem["hover"]]
            # From low down (after a failed grasp), rise first so the fingers do not sweep the object.
            low = scene.eef_pos[2] < grasp[2] + 0.5 * mem["hover"]
            if low and np.linalg.norm(scene.eef_pos[:2] - above[:2]) > 0.02:
                above = np.r_[scene.eef_pos[:2], above[2]]
            if self._reached(scene, above, yaw, tol=0.006) or self.steps > cfg.max_phase_steps:
                self._start("descend")
            return self._move(scene, above, yaw, OPEN)
        if self.phase == "descend":
            grasp, _ = self._grasp(scene, body, mem)
            target = grasp + mem["offset"]
            if np.linalg.norm(scene.eef_pos[:2] - target[:2]) > 0.01:    # off to the side: hold the height
                target = np.r_[target[:2], max(target[2], scene.eef_pos[2])]
            elif self._reached(scene, target, tol=0.006) or self.steps > 40:
                mem["grasp_target"] = target
                self._start("close")
            return self._move(scene, target, mem["yaw"], OPEN, max_speed=0.6)
        if self.phase == "close":
            if self.steps >= cfg.grasp_steps:
                mem["lift_from"] = body.lo[2]
                self._start("lift")
            return self._move(scene, mem["grasp_target"], mem["yaw"], CLOSE)
        if self.phase == "lift":
            if "carry_z" not in mem:
                xy, _ = place_xy(scene, p.target, p.relation, body, p.slot)
                top = corridor_top(scene, body.pos, np.r_[xy, 0.0], 0.5 * float(body.hi[0] - body.lo[0]) + 0.02,
                                   {p.obj})
                target_top = scene.bodies[p.target].hi[2] if p.target in scene.bodies else \
                    support_height(scene, p.target, "on")[1]
                parent = scene.sites[p.target].parent if p.target in scene.sites else None
                if parent in scene.bodies:
                    target_top = max(target_top, float(scene.bodies[parent].hi[2]))
                top = max(top, target_top)
                below = scene.eef_pos[2] - body.lo[2]         # grip site above the object's bottom
                mem["carry_z"] = max(top + cfg.clearance + below, scene.eef_pos[2] + 0.08)
            target = np.r_[mem["grasp_target"][:2], mem["carry_z"]]
            lifted = body.lo[2] > mem["lift_from"] + 0.03
            if self.steps > 12 and not lifted and scene.gripper_opening < 0.002:
                return self._retry(scene)
            if self._reached(scene, target, tol=0.02) or self.steps > cfg.max_phase_steps:
                if not lifted:
                    return self._retry(scene)
                self._start("carry")
                mem["carry_z"] = mem["carry_z"]
            return self._move(scene, target, mem["yaw"], CLOSE)
        xy, support = place_xy(scene, p.target, p.relation, body, p.slot)
        shift = xy - body.pos[:2]                          # move the object's body, not the gripper, over xy
        if self.phase == "carry":
            target = np.r_[scene.eef_pos[:2] + shift, mem["carry_z"]]
            over = np.linalg.norm(shift) < 0.008 and abs(scene.eef_pos[2] - mem["carry_z"]) < 0.03
            if over or self.steps > 2 * cfg.max_phase_steps:
                self._start("lower")
            if body.lo[2] < mem["lift_from"] + 0.01:     # dropped on the way
                return self._retry(scene)
            return self._move(scene, target, mem["yaw"], CLOSE, max_speed=0.8)
        if self.phase == "lower":
            below = scene.eef_pos[2] - body.lo[2]
            z = support + cfg.release_gap + below
            target = np.r_[scene.eef_pos[:2] + shift, z]
            mem.setdefault("z_hist", []).append(float(body.lo[2]))
            stalled = len(mem["z_hist"]) > 8 and mem["z_hist"][-8] - mem["z_hist"][-1] < 0.002
            if (abs(scene.eef_pos[2] - z) < 0.006 and np.linalg.norm(shift) < 0.01) or stalled or \
                    self.steps > cfg.max_phase_steps:
                mem["release_at"] = scene.eef_pos.copy()
                self._start("release")
            return self._move(scene, target, mem["yaw"], CLOSE, max_speed=0.5)
        if self.phase == "release":
            if self.steps >= cfg.release_steps:
                self._start("retreat")
            return self._move(scene, mem["release_at"], mem["yaw"], OPEN)
        if self.phase == "retreat":
            # up and clear of the container before moving on: 8 cm above the release point left the open
            # fingers in the basket's handle, and the next approach dragged the basket onto the next object
            parent = scene.sites[p.target].parent if p.target in scene.sites else p.target
            top = float(scene.bodies[parent].hi[2]) if parent in scene.bodies else -np.inf
            target = np.r_[mem["release_at"][:2], max(mem["release_at"][2] + 0.08, top + 0.05)]
            if self._reached(scene, target, tol=0.02) or self.steps > 40:
                self._next_primitive()
            return self._move(scene, target, mem["yaw"], OPEN)
        raise AssertionError(self.phase)

    def _push(self, scene: Scene, p: Push) -> np.ndarray:
        """Closed fingers down inside the object's rim on the far side from the target, then along the line
        through its centre to the target, pressing on the rim from inside, re-aimed every step; back to the
        start when they have slid off the line. From inside, the hand stays over the object, clear of what
        stands behind it (LIBERO-Goal's plate lies 3 cm from the cabinet's handles)."""
        cfg, mem = self.cfg, self.mem
        body = scene.bodies[p.obj]
        goal, _ = support_height(scene, p.target, p.relation)
        center = body.center[:2]
        to_goal = goal - center
        dist = float(np.linalg.norm(to_goal))
        d = to_goal / max(dist, 1e-9)
        _, horiz = upright_axes(body)
        radius = float(body.local_half[horiz].max())
        z = float(body.lo[2]) + FINGER_BELOW + 0.007      # fingertips ~7 mm above the object's bottom
        if "yaw" not in mem:
            mem["yaw"] = nearest_yaw(math.atan2(d[1], d[0]) + math.pi / 2, closing_yaw(scene.eef_mat))
        behind = center - d * (radius - 0.025)
        if dist < 0.012 and self.phase in ("push", "descend"):
            mem["release_at"] = scene.eef_pos.copy()
            self._start("retreat")
        if self.phase == "approach":
            above = np.r_[behind, float(body.hi[2]) + cfg.hover]
            if self._reached(scene, above, tol=0.01) or self.steps > cfg.max_phase_steps:
                self._start("descend")
            return self._move(scene, above, mem["yaw"], CLOSE)
        if self.phase == "descend":
            target = np.r_[behind, z]
            if self._reached(scene, target, tol=0.006) or self.steps > 40:
                self._start("push")
            return self._move(scene, target, mem["yaw"], CLOSE, max_speed=0.6)
        if self.phase == "push":
            rel = scene.eef_pos[:2] - center
            off_line = abs(float(rel[0] * d[1] - rel[1] * d[0]))     # distance from the line centre -> goal
            if off_line > 0.03 or float(rel @ d) > 0.0 or self.steps > 3 * cfg.max_phase_steps:
                return self._retry(scene, limit=cfg.max_push_retries)   # slid off or got ahead: start again
            # well past the rim the fingers press on: the OSC's force grows with the distance to its goal
            target = np.r_[center - d * (radius - 0.08), z]
            return self._move(scene, target, mem["yaw"], CLOSE, max_speed=float(np.clip(dist / 0.06, 0.3, 1.0)))
        if self.phase == "retreat":
            target = mem["release_at"] + [0.0, 0.0, 0.08]
            if self._reached(scene, target, tol=0.02) or self.steps > 30:
                self._next_primitive()
            return self._move(scene, target, mem["yaw"], CLOSE)
        raise AssertionError(self.phase)

    def _close_drawer(self, scene: Scene, p: CloseDrawer) -> np.ndarray:
        """The hand turned to point along the slide (fingers closed, level with the handle), then pushed along
        it until the drawer stops. Pointing down, the forearm ran into the cabinet above a low drawer before the
        fingers reached its handle."""
        cfg, mem = self.cfg, self.mem
        drawer = scene.drawers[p.region]
        c, center = drawer.closing, drawer.handle_center
        # the grip site sits ~1 cm behind the fingertips along the hand's axis
        front = center - c * (drawer.handle_depth + 0.03)
        if "mat" not in mem:   # once a primitive: the slide does not turn
            mem["mat"] = self._slide_pose(c, scene.eef_mat)
        mat = mem["mat"]

        def move(pos, max_speed=None):
            return self._move_to_pose(scene, pos, mat, CLOSE, max_speed)

        turned = self._turned(scene, mat)
        if self.phase == "approach":   # back from the handle and up, turning on the way
            start = front - c * 0.08 + [0.0, 0.0, 0.05]
            # from over the drawer (what was just put in it), up first: moving out low, the hand pulled the handle
            beyond = float((scene.eef_pos - front) @ c) > -0.02
            if beyond and scene.eef_pos[2] < center[2] + 0.12:
                return move(np.r_[scene.eef_pos[:2], center[2] + 0.15])
            if (self._reached(scene, start, tol=0.015) and turned) or self.steps > cfg.max_phase_steps:
                self._start("descend")
            return move(start)
        if self.phase == "descend":
            if self._reached(scene, front, tol=0.008) or self.steps > 40:
                self._start("push")
            return move(front, max_speed=0.6)
        if self.phase == "push":
            if self._drawer_stopped(drawer, after=12, span=10) or self.steps > 2 * cfg.max_phase_steps:
                mem["release_at"] = scene.eef_pos.copy()
                self._start("retreat")
            return move(center + c * 0.05, max_speed=0.6)
        if self.phase == "retreat":
            target = mem["release_at"] - c * 0.08
            if self._reached(scene, target, tol=0.02) or self.steps > 30:
                self._next_primitive()
            return move(target)
        raise AssertionError(self.phase)

    def _slide_pose(self, c: np.ndarray, eef_mat: np.ndarray) -> np.ndarray:
        """Grip-site orientation with the fingers (grip z) along the slide direction ``c``, pitched down by
        ``close_pitch``, closing axis level and across the slide, on the side of the current closing axis
        ``eef_mat[:, 0]`` (the closed fingers are symmetric under a half turn: the other side was a half turn of a
        wrist already near its joint limit, which the arm never finished)."""
        across = np.array([-c[1], c[0], 0.0]) / max(float(np.linalg.norm(c[:2])), 1e-9)
        if float(across @ eef_mat[:, 0]) < 0.0:
            across = -across
        a = self.cfg.close_pitch
        z = math.cos(a) * c + math.sin(a) * np.array([0.0, 0.0, -1.0])
        z /= np.linalg.norm(z)
        return np.stack([across, np.cross(z, across), z], axis=1)

    def _open_drawer(self, scene: Scene, p: OpenDrawer) -> np.ndarray:
        """Fingertips pitched along the slide, over the gap behind the handle bar, down into it, then pulled out
        along the slide until the drawer stops or is open; then up off the bar."""
        cfg, mem = self.cfg, self.mem
        drawer = scene.drawers[p.region]
        c = drawer.closing
        # the middle of the ~2 cm gap behind the bar
        hook = drawer.handle_center + c * (drawer.handle_depth + 0.0105)
        if "mat" not in mem:   # once a primitive: the slide does not turn
            mem["mat"] = self._slide_pose(c, scene.eef_mat)
        mat = mem["mat"]

        def move(pos, max_speed=None):
            return self._move_to_pose(scene, pos, mat, CLOSE, max_speed)

        turned = self._turned(scene, mat)
        over = hook + [0.0, 0.0, 0.03]
        if self.phase == "approach":
            start = over - c * 0.06 + [0.0, 0.0, 0.02]
            if (self._reached(scene, start, tol=0.015) and turned) or self.steps > cfg.max_phase_steps:
                self._start("over")
            return move(start)
        if self.phase == "over":
            if self._reached(scene, over, tol=0.012) or self.steps > 40:
                self._start("descend")
            return move(over, max_speed=0.5)
        if self.phase == "descend":   # as far as the gap lets the fingers in
            if self._reached(scene, hook, tol=0.005) or self.steps > 12:
                self._start("pull")
            return move(hook, max_speed=0.4)
        if self.phase == "pull":
            if self._drawer_stopped(drawer, after=15, span=12) or self.steps > 2 * cfg.max_phase_steps:
                mem["release_at"] = scene.eef_pos.copy()
                self._start("retreat")
            return move(hook - c * 0.06, max_speed=0.6)      # ahead of the hook: the bar follows the fingers
        if self.phase == "retreat":
            target = mem["release_at"] + [0.0, 0.0, 0.06] - c * 0.03
            if self._reached(scene, target, tol=0.02) or self.steps > 30:
                self._next_primitive()
            return move(target)
        raise AssertionError(self.phase)

    def _turn_on(self, scene: Scene, p: TurnOn) -> np.ndarray:
        """Open fingers down across the knob's bar at its middle, 1.5 cm below its top; close; twist the grip
        about the hinge (the grip site on its circle round the pivot) until the knob is on; let go, up."""
        cfg, mem = self.cfg, self.mem
        knob = scene.knobs[p.stove]
        if "grip" not in mem:   # from the scene before any motion: where the bar is, and across it
            size = knob.bar_hi - knob.bar_lo
            along = np.array([1.0, 0.0, 0.0]) if size[0] >= size[1] else np.array([0.0, 1.0, 0.0])
            center = (knob.bar_lo + knob.bar_hi) / 2
            mem["grip"] = np.r_[center[:2], knob.bar_hi[2] - 0.015]
            mem["yaw"] = nearest_yaw(math.atan2(along[1], along[0]) + math.pi / 2, closing_yaw(scene.eef_mat))
            mem["sign"] = 1.0 if knob.axis[2] >= 0 else -1.0   # turning on raises q: twist about the hinge's axis
            mem["q0"] = knob.q
        grip, yaw = mem["grip"], mem["yaw"]
        if self.phase == "approach":
            above = grip + [0.0, 0.0, cfg.hover]
            if self._reached(scene, above, yaw, tol=0.01) or self.steps > cfg.max_phase_steps:
                self._start("descend")
            return self._move(scene, above, yaw, OPEN)
        if self.phase == "descend":
            if self._reached(scene, grip, tol=0.006) or self.steps > 40:
                self._start("close")
            return self._move(scene, grip, yaw, OPEN, max_speed=0.5)
        if self.phase == "close":
            if self.steps >= cfg.grasp_steps:
                self._start("twist")
            return self._move(scene, grip, yaw, CLOSE)
        if self.phase == "twist":
            angle = min(cfg.twist, 0.03 * self.steps)            # ramped, ~1.7 degrees a step
            turned = mem["sign"] * angle
            offset = grip - knob.pivot
            c, s_ = math.cos(turned), math.sin(turned)
            target = knob.pivot + np.array([c * offset[0] - s_ * offset[1], s_ * offset[0] + c * offset[1], offset[2]])
            if knob.is_on or self.steps > cfg.max_phase_steps:
                mem["release_at"] = scene.eef_pos.copy()
                mem["release_yaw"] = yaw + turned
                self._start("release")
            return self._move(scene, target, yaw + turned, CLOSE)
        if self.phase == "release":
            if self.steps >= cfg.release_steps:
                self._start("retreat")
            return self._move(scene, mem["release_at"], mem["release_yaw"], OPEN)
        if self.phase == "retreat":
            target = mem["release_at"] + [0.0, 0.0, 0.08]
            if self._reached(scene, target, tol=0.02) or self.steps > 30:
                self._next_primitive()
            return self._move(scene, target, mem["release_yaw"], OPEN)
        raise AssertionError(self.phase)

    @staticmethod
    def _grasp(scene: Scene, body: Body, mem: dict) -> tuple[np.ndarray, float]:
        """The grasp chosen at the approach, following the object if it moved since (same place relative to
        its box centre, same yaw)."""
        pos, yaw = mem["rim"]
        if "rim_center" not in mem:
            mem["rim_center"] = body.center.copy()
        return pos + (body.center - mem["rim_center"]) * np.array([1.0, 1.0, 0.0]), yaw

    def _retry(self, scene: Scene, limit: int | None = None) -> np.ndarray:
        self.retries += 1
        if self.retries > (self.cfg.max_retries if limit is None else limit):
            self.status = "failed"
            return np.array([0.0] * 6 + [OPEN])
        self._start("approach")
        return np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, OPEN])
