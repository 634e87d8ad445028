"""A policy folder's LIBERO env settings: which cameras, image size and orientation its observations need.

The official protocol itself is ``vla-rl bench CHECKPOINT --suite libero_spatial`` (:mod:`vla_rl.eval.bench`):
every task, its first 50 fixed initial states, the suite's step limit, through the one evaluation loop.

The checkpoint must fit LIBERO: state D = 8 (``state_mode="robot"``; more with the objects' poses), action
A = 7 (or a model padded wider, with no env dims recorded), no camera, one (``agentview``) or two
(``agentview``, ``wrist``), and the images are rendered at the model's image size.
"""

from __future__ import annotations

from dataclasses import fields

from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.envs.libero.robosuite_env import ACTION_DIM, LiberoConfig
from vla_rl.envs.registry import LIBERO, EnvConfig, same_family

OFFICIAL_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
CAMERA_SETS = {0: (), 1: ("agentview",), 2: ("agentview", "wrist")}   # model cameras -> LIBERO cameras (0: state only)
# Orientation of the images in openpi's LIBERO datasets (and of vla_rl.data.libero_demos recordings).
DATASET_ORIENTATION = "rot180"


PROTOCOL_KEYS = ("suite", "task_ids", "init_state_ids", "episode_order", "init_states")
# Training settings of a LIBERO run that an evaluation does not take over: the protocol's own keys, the step
# limit (official unless overridden) and the reward (success is LIBERO's predicate either way).
NOT_INHERITED = (*PROTOCOL_KEYS, "max_episode_steps", "reward", "shaping_scale")


def libero_env_config(config: dict, model_cfg, env_overrides: dict | None = None,
                      train_env: dict | None = None) -> LiberoConfig:
    """The LIBERO env config for a checkpoint: the ``env.libero`` (or ``env.libero_warp``) settings of the LIBERO env
    it was trained on (``train_env``, else the checkpoint's ``env_config``), else the datasets' orientation ``rot180``;
    then ``env_overrides``; checked against the model's inputs. The protocol's own keys (suite, tasks, init
    states, episode order), the step limit (official unless ``env_overrides`` sets one) and the reward are not
    taken over.

    Raises :class:`CheckpointError` when the checkpoint cannot act in LIBERO (state / action dims,
    number of cameras, image size).
    """
    env_meta = config.get("env") if isinstance(config.get("env"), dict) else {}
    name = env_meta.get("name") or env_meta.get("kind") or "unknown env"
    base: dict = {"image_orientation": DATASET_ORIENTATION}
    train_env = train_env or config.get("env_config")
    kind = train_env.get("kind") if isinstance(train_env, dict) else None
    if same_family(kind, LIBERO):   # a policy trained on either backend sees the same observations
        own = {f.name for f in fields(LiberoConfig)}
        base = {k: v for k, v in (EnvConfig.upgrade(train_env).get(kind) or {}).items()
                if k in own and k not in NOT_INHERITED}
    env_overrides = dict(env_overrides or {})
    fixed = [k for k in PROTOCOL_KEYS if k in env_overrides]
    if fixed:
        raise ConfigError(f"env.{fixed[0]} is set by the protocol; choose suites and tasks with --suite / tasks=, "
                          "init states with episodes=")
    opts = {**base, **env_overrides}
    try:
        probe = from_dict(LiberoConfig, {k: v for k, v in opts.items() if k in ("state_mode", "state_objects")},
                          prefix="env")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    state_dim = probe.state_dim
    dims = env_meta.get("state_dim"), env_meta.get("action_dim")
    if dims != (None, None) and dims != (state_dim, ACTION_DIM):
        raise CheckpointError(f"checkpoint was trained for state {dims[0]} / action {dims[1]} ({name}); LIBERO "
                              f"needs state {state_dim} / action {ACTION_DIM}")
    if model_cfg.state_dim < state_dim or model_cfg.action_dim < ACTION_DIM:
        raise CheckpointError(f"the model has state/action dims {model_cfg.state_dim}/{model_cfg.action_dim}; "
                              f"LIBERO needs at least {state_dim}/{ACTION_DIM}")
    n_cams = model_cfg.num_cameras
    # A model that masks missing camera slots (π0's third, right-wrist slot) takes LIBERO's two in its first ones.
    fits = [k for k in sorted(CAMERA_SETS, reverse=True) if k <= n_cams] if model_cfg.missing_cameras == "mask" \
        else [n_cams] if n_cams in CAMERA_SETS else []
    if "cameras" not in opts:
        if not fits:
            raise CheckpointError(f"the model takes {n_cams} camera(s); LIBERO has 1 (agentview) or 2 "
                                  "(agentview, wrist)")
        opts["cameras"] = list(CAMERA_SETS[fits[0]])
    elif len(opts["cameras"]) != n_cams and not (model_cfg.missing_cameras == "mask"
                                                 and 0 < len(opts["cameras"]) <= n_cams):
        raise CheckpointError(f"env.cameras={list(opts['cameras'])} gives {len(opts['cameras'])} camera(s), the "
                              f"model takes {n_cams}")
    size = model_cfg.vision.image_size
    deploy = config.get("deploy") if isinstance(config.get("deploy"), dict) else {}
    if deploy.get("image_size") and model_cfg.image_resize == "pad":   # an imported policy's training frames
        opts.setdefault("image_size", int(deploy["image_size"]))
    # Frames of another size are resized with padding by a `pad` policy (openpi's LIBERO client renders 256 px for
    # a 224 px model); a `stretch` policy was trained on frames of its own size.
    if n_cams and opts.setdefault("image_size", size) != size and model_cfg.image_resize != "pad":
        raise CheckpointError(f"env.image_size={opts['image_size']}, but the model takes {size}px images")
    try:
        return from_dict(LiberoConfig, opts, prefix="env")
    except ValueError as e:   # LiberoConfig's own validation
        raise ConfigError(str(e)) from None

