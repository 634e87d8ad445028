"""ManiSkill3 demonstrations: motion-planner demos and their control-mode conversion, collected as a dataset.

The pipeline behind ``vla-rl collect maniskill`` (each step a function, so each can be used alone):

1. :func:`plan_demos` runs ManiSkill's own motion-planning solution for the task (``mplib`` on the
   ``pd_joint_pos`` controller, as ManiSkill's ``motionplanning/panda/run.py`` does), keeps successful
   episodes only, and records them with ManiSkill's ``RecordEpisode`` as ``<task>.h5`` + ``.json``.
2. :func:`convert_demos` replays them with ManiSkill's ``replay_trajectory`` into the control mode and
   observation mode the policy uses (default ``pd_ee_delta_pose``, ``state``): the converter tracks the
   joint-space plan closed-loop with the target controller and keeps the replays that still succeed.
3. :func:`~vla_rl.data.maniskill_h5.read_maniskill_h5` turns such a file into a
   :class:`~vla_rl.data.dataset.DemoDataset`; :func:`collect_maniskill` writes it as a LeRobot v3.0 dataset.

A bad demonstration never costs the collection: :func:`collect_maniskill` drops an episode whose plan,
conversion, frames or first observation is wrong (reporting its seed and why), plans more seeds until it
has the episodes asked for or has tried ``max_tries`` seeds, and writes what it has.

Reading trajectory files (ManiSkill's format) is :mod:`vla_rl.data.maniskill_h5`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import vla_rl
from vla_rl.core.progress import progress as progress_bar
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.data.dataset import DemoDataset, concat_episodes, select_episodes
from vla_rl.data.lerobot import read_lerobot_dataset, read_lerobot_info, write_lerobot_dataset
from vla_rl.data.maniskill_h5 import (
    DroppedEpisode,
    ManiSkillDemoError,
    episode_seed,
    kept_episodes,
    read_maniskill_episodes,
    read_maniskill_h5,
    read_trajectory_info,
)
from vla_rl.envs.maniskill import (
    ManiSkillConfig,
    ManiSkillSingleEnv,
    ensure_vulkan,
    make_task,
    task_max_episode_steps,
)
from vla_rl.envs.registry import MANISKILL

# The tasks ManiSkill 3.0.1 ships a Panda motion-planning solution for (``...panda.solutions``).
PLANNED_TASKS = ("PickCube-v1", "PushCube-v1", "StackCube-v1", "PullCube-v1", "LiftPegUpright-v1",
                 "PegInsertionSide-v1", "PlugCharger-v1", "PlaceSphere-v1", "PullCubeTool-v1",
                 "StackPyramid-v1", "DrawTriangle-v1", "DrawSVG-v1")


def _solver(task: str):
    if task not in PLANNED_TASKS:
        raise ValueError(f"ManiSkill has no motion-planning solution for {task!r}; it has one for: "
                         f"{', '.join(PLANNED_TASKS)}")
    ensure_vulkan()
    try:
        from mani_skill.examples.motionplanning.panda import solutions
    except ImportError as e:  # mplib missing (scripts/setup_maniskill.sh installs mplib 0.1.1)
        raise ManiSkillDemoError(f"ManiSkill's motion planners need mplib==0.1.1 ({e}); run "
                                 "`make sims` or `pip install mplib==0.1.1`") from e
    return getattr(solutions, "solve" + task.split("-")[0])


def plan_demos(task: str, num_episodes: int, out_dir: str | Path, *, seed: int = 0,
               max_tries: int | None = None, log=print) -> Path:
    """Record ``num_episodes`` successful motion-planner episodes of ``task`` (reset seeds ``seed``,
    ``seed + 1``, ...; failed plans are skipped) into ``out_dir/<task>.h5``; returns that path.

    Gives up with an error after ``max_tries`` seeds (default ``3 * num_episodes + 10``)."""
    max_tries = max_tries or 3 * num_episodes + 10
    path, kept, tries, _ = _plan(task, num_episodes, out_dir, seed=seed, max_tries=max_tries, log=log)
    if kept < num_episodes:
        raise ManiSkillDemoError(f"{task}: only {kept} of {tries} motion plans succeeded; wanted {num_episodes}")
    return path


def _plan(task: str, num_episodes: int, out_dir: str | Path, *, seed: int, max_tries: int,
          log=print, progress: bool = False) -> tuple[Path, int, int, list[DroppedEpisode]]:
    """Plan seeds ``seed, seed + 1, ...`` until ``num_episodes`` plans succeed or ``max_tries`` seeds were
    tried; returns (the ``.h5``, plans kept, seeds tried, the failed seeds and why)."""
    from mani_skill.utils.wrappers.record import RecordEpisode

    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    solve = _solver(task)
    # The env first: a task that cannot start (a package its scene needs) leaves no folder behind.
    env = make_task(task, obs_mode="none", control_mode="pd_joint_pos", render_mode="rgb_array",
                    sim_backend="physx_cpu")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (out_dir / f"{task}.h5", out_dir / f"{task}.json"):
        stale.unlink(missing_ok=True)
    env = RecordEpisode(env, output_dir=str(out_dir), trajectory_name=task, save_video=False,
                        source_type="motionplanning", source_desc="ManiSkill's motion-planning solution",
                        record_reward=False, save_on_reset=False)
    kept, tries, s, failed = 0, 0, seed, []
    bar = progress_bar(total=num_episodes, desc=f"{task} motion plans", unit="plans", enabled=progress)
    try:
        while kept < num_episodes and tries < max_tries:
            reason = None
            try:
                res = solve(env, seed=s)
            except Exception as e:  # the solutions raise on unreachable poses; count as a failed plan
                res, reason = -1, f"planning failed ({type(e).__name__}: {e})"
            ok = res != -1 and bool(np.asarray(res[-1]["success"]).reshape(-1)[0])
            if not ok:
                failed.append(DroppedEpisode(s, reason or "the motion plan did not reach success"))
                log(f"{task} seed {s}: dropped, {failed[-1].reason}")
            env.flush_trajectory(save=ok)
            kept, tries, s = kept + ok, tries + 1, s + 1
            bar.update(int(ok))
    finally:
        bar.close()
        env.close()
    log(f"{task}: {kept} successful motion plans from {tries} seeds")
    return out_dir / f"{task}.h5", kept, tries, failed


def convert_demos(h5: str | Path, *, control_mode: str = "pd_ee_delta_pose", obs_mode: str = "state",
                  image_size: int | None = None, log=print) -> Path:
    """Replay ``h5`` into ``control_mode`` / ``obs_mode`` (``state`` or ``rgb``) with ManiSkill's converter
    (a subprocess, its output in ``<h5>.replay.log``); returns the new file. Replays that fail after
    conversion are dropped. ``image_size`` sets the cameras' resolution (``rgb``; default: the task's),
    written into the ``.json`` beside ``h5``, which the converter builds its env from."""
    h5 = Path(h5)
    if obs_mode not in ("state", "rgb"):
        raise ValueError(f"obs_mode must be 'state' or 'rgb', got {obs_mode!r}")
    out = h5.with_name(f"{h5.stem}.{obs_mode}.{control_mode}.physx_cpu.h5")
    out.unlink(missing_ok=True)
    if image_size is not None:
        meta_path = h5.with_suffix(".json")
        meta = json.loads(meta_path.read_text())
        meta["env_info"]["env_kwargs"]["sensor_configs"] = {"width": image_size, "height": image_size}
        meta_path.write_text(json.dumps(meta, indent=2))
    ensure_vulkan()  # sets VK_ICD_FILENAMES for the child too
    # ManiSkill's converter, run through vla_rl.data.maniskill_replay (a failed replay is discarded, not joined
    # to the next episode); the child imports this very vla_rl, wherever it is run from.
    cmd = [sys.executable, "-m", "vla_rl.data.maniskill_replay", "--traj-path", str(h5),
           "-c", control_mode, "-o", obs_mode, "--save-traj", "-b", "physx_cpu"]
    root = str(Path(vla_rl.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    log_path = h5.with_suffix(".replay.log")
    with open(log_path, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not out.is_file():
        tail = log_path.read_text()[-1500:]
        raise ManiSkillDemoError(f"converting {h5} to {control_mode}/{obs_mode} failed (exit {rc}); "
                                 f"log {log_path}:\n{tail}")
    summary = [ln for ln in log_path.read_text().splitlines() if ln.startswith("Replayed")]
    if summary:
        log(f"{h5.name} -> {out.name}: {summary[-1]}")
    return out


def first_frame_check(data: DemoDataset, seeds: list[int | None], env_cfg) -> tuple[torch.Tensor, list, int]:
    """Each episode's first state as the live adapter (:class:`~vla_rl.envs.maniskill.ManiSkillSingleEnv` with
    ``env_cfg``) observes it after a reset with the episode's seed.

    Returns (``data.state`` with those first rows replaced, ``[(episode, seed, reason)]`` of the episodes whose
    recorded first frame is not that seed's, the number of episodes whose first frame changed)."""
    first_rows = (data.frame_index == 0).nonzero().flatten().tolist()   # episode order, as stored
    if len(first_rows) != len(seeds):
        raise ManiSkillDemoError(f"{len(first_rows)} episodes but {len(seeds)} seeds")
    state = data.state.clone()
    dim = state.shape[1]
    bad, changed = [], 0
    env = ManiSkillSingleEnv(env_cfg)
    try:
        for e, (row, seed) in enumerate(zip(first_rows, seeds)):
            if seed is None:
                bad.append((e, seed, "its .json entry names no reset seed"))
                continue
            fresh = torch.from_numpy(env.reset(int(seed))["state"])
            differs = (fresh - state[row]).abs() > 1e-4
            if int(differs.sum()) > max(2, dim // 20):
                bad.append((e, seed, f"its first observation differs from a reset with seed {seed} in "
                                     f"{int(differs.sum())} of {dim} entries; the seed does not give this episode"))
                continue
            changed += bool(differs.any())
            state[row] = fresh
    finally:
        env.close()
    return state, bad, changed


def reobserve_first_frames(data: DemoDataset, h5: str | Path, env_cfg, *, log=print) -> DemoDataset:
    """``data`` (read from ``h5``) with each episode's first state taken from the live adapter
    (:class:`~vla_rl.envs.maniskill.ManiSkillSingleEnv` with ``env_cfg``) reset with the episode's seed.

    Why: ManiSkill's converter records each episode's first observation right after a reset, which reports
    the previous episode's contacts (see :func:`vla_rl.envs.maniskill.observe_after_reset`): 299 of 300
    PickCube planner demos began with ``is_grasped = 1``, a state the adapter never shows at a reset, so
    SFT learned its first chunk from an input RL and evaluation never give it. The recorded and the
    re-observed frame must agree on all but a few entries (the contact flags); more differences mean the
    seed does not give the recorded episode, and that is an error."""
    info = read_trajectory_info(h5)
    episodes = kept_episodes(info, data.num_episodes)
    seeds = [episode_seed(ep) for ep in episodes]
    state, bad, changed = first_frame_check(data, seeds, env_cfg)
    if bad:
        e, _, reason = bad[0]
        raise ManiSkillDemoError(f"{h5}: episode {episodes[e].get('episode_id')}: {reason}")
    log(f"{info.task}: first observation re-read at reset for {len(episodes)} episodes; {changed} had stale "
        "contact entries")
    return replace(data, state=state)


def refresh_dataset_first_frames(dataset: str | Path, out: str | Path, *, log=print) -> Path:
    """Rewrite a dataset ``vla-rl collect maniskill`` wrote before :func:`reobserve_first_frames` existed
    into ``out``, from the ManiSkill file it names (info.json ``vla_rl.source``), first frames re-observed.
    State datasets only; the actions and every later frame must equal the dataset's, else an error."""
    info = read_lerobot_info(dataset)
    meta = info.get("vla_rl") or {}
    if meta.get("env") != MANISKILL or not meta.get("source") or not meta.get("env_config"):
        raise ManiSkillDemoError(f"{dataset} was not written by `vla-rl collect maniskill` (its info.json "
                                 "names no ManiSkill source file and env)")
    if not isinstance(meta["source"], str):
        raise ManiSkillDemoError(f"{dataset} was collected from several ManiSkill files; its first frames were "
                                 "re-observed when it was collected")
    env_cfg = from_dict(ManiSkillConfig, meta["env_config"], prefix="env_config")
    if env_cfg.obs_mode != "state":
        raise ManiSkillDemoError(f"{dataset} has {env_cfg.obs_mode!r} observations; only state datasets are "
                                 "refreshed here (collect rgb demos again instead)")
    old = read_lerobot_dataset(dataset)
    data = read_maniskill_h5(meta["source"], max_episodes=old.num_episodes)
    later = data.frame_index > 0
    if data.state.shape != old.state.shape or not torch.equal(data.action, old.action) \
            or not torch.equal(data.state[later], old.state[later]):
        raise ManiSkillDemoError(f"{meta['source']} does not hold {dataset}'s frames")
    data = reobserve_first_frames(data, meta["source"], env_cfg, log=log)
    extra = {"vla_rl": {**meta, "first_frames": "re-observed at reset", "refreshed_from": str(dataset)}}
    return write_lerobot_dataset(out, data, fps=info["fps"], camera_names=[], robot_type=info.get("robot_type"),
                                 extra_info=extra)


def episode_limit(task: str, demo_lengths: list[int], given: int | None) -> int:
    """The time limit evaluations and RL use for a demo-trained policy: ``given``, else the task's
    registered limit, raised to 1.5 x the longest demo (rounded up to 10) where the planner's demos are
    longer than the limit (PushCube: limit 50, planner demos 64-74 steps) -- a policy that imitates them
    would otherwise time out by construction."""
    if given is not None:
        return given
    longest = max(demo_lengths) if demo_lengths else 0
    return max(task_max_episode_steps(task), -(-int(1.5 * longest) // 10) * 10)


def demo_env_config(data: DemoDataset, *, task: str, control_mode: str, obs_mode: str,
                    max_episode_steps: int | None = None):
    """The ``ManiSkillConfig`` a policy trained on ``data`` is evaluated / fine-tuned in: the demos' task,
    controller and observations (camera size: the demos' images), episode limit from :func:`episode_limit`."""
    rgb = obs_mode == "rgb"
    lengths = torch.bincount(data.episode_index).tolist()
    return ManiSkillConfig(task=task, control_mode=control_mode, obs_mode="rgb" if rgb else "state",
                           image_size=data.images.shape[2] if rgb else ManiSkillConfig.image_size,
                           max_episode_steps=episode_limit(task, lengths, max_episode_steps))


def _good_episodes(planned: Path, converted: Path, *, task: str, control_mode: str, obs_mode: str,
                   log=print) -> tuple[DemoDataset | None, list[DroppedEpisode]]:
    """The converted episodes that are whole and start where their seed starts, and the planned episodes left
    out: replays that did not succeed in ``control_mode``, frames that are missing or not finite, a first
    observation that is not its seed's (e.g. a failed replay's frames joined to it)."""
    planned_seeds = [episode_seed(ep) for ep in read_trajectory_info(planned).episodes]
    data, seeds, dropped = read_maniskill_episodes(converted, drop_bad=True)
    converted_seeds = {episode_seed(ep) for ep in read_trajectory_info(converted).episodes}
    dropped += [DroppedEpisode(s, f"its replay in {control_mode} did not succeed")
                for s in planned_seeds if s not in converted_seeds]
    if data is not None:
        env_cfg = demo_env_config(data, task=task, control_mode=control_mode, obs_mode=obs_mode)
        state, bad, changed = first_frame_check(data, seeds, env_cfg)
        dropped += [DroppedEpisode(seed, reason) for _, seed, reason in bad]
        good = [e for e in range(len(seeds)) if e not in {b[0] for b in bad}]
        log(f"{task}: first observation re-read at reset for {len(good)} episodes; {changed} had stale contact "
            "entries")
        data = select_episodes(replace(data, state=state), good) if good else None
    return data, dropped


def collect_maniskill(out: str | Path, *, task: str, episodes: int, seed: int = 0,
                      control_mode: str = "pd_ee_delta_pose", obs_mode: str = "state", image_size: int = 64,
                      max_episode_steps: int | None = None, fps: int = 20, video: bool = False,
                      max_tries: int | None = None, extra_info: dict | None = None, log=print,
                      progress: bool = False) -> Path:
    """Motion-planner demos of ``task`` -> ``control_mode`` + ``obs_mode`` (``state``, or ``rgb``: camera
    images of ``image_size`` + proprioception) -> a LeRobot v3.0 dataset at ``out``. ManiSkill's own
    ``.h5`` files are kept in ``<out>.maniskill/``. info.json records the env (``"vla_rl": {"env":
    "maniskill", "env_config": ManiSkillConfig fields}``) for ``vla-rl sft``'s evaluation, and the seeds
    left out and why (``dropped``).

    Seeds ``seed, seed + 1, ...`` are planned and converted in rounds until ``episodes`` good episodes are in
    hand or ``max_tries`` seeds were tried (default ``3 * episodes + 10``). A bad episode (failed plan, failed
    or corrupt conversion, a first frame that is not its seed's) is dropped and reported with its seed and the
    reason; a conversion that fails as a whole drops that round's episodes only. Whatever good episodes there
    are at the end are written (fewer than asked for: said so); none at all is an error."""
    import h5py

    max_tries = max_tries or 3 * episodes + 10
    out = Path(out)
    raw_dir = out.with_name(out.name + ".maniskill")
    parts, sources, dropped = [], [], []
    next_seed, tried, kept, rounds = seed, 0, 0, 0
    while kept < episodes and tried < max_tries:
        round_dir = raw_dir if rounds == 0 else raw_dir / f"more-{rounds}"
        rounds += 1
        planned, n_plans, tries, failed = _plan(task, episodes - kept, round_dir, seed=next_seed,
                                                   max_tries=max_tries - tried, log=log, progress=progress)
        dropped += failed
        tried, next_seed = tried + tries, next_seed + tries
        if n_plans == 0:
            continue
        try:
            converted = convert_demos(planned, control_mode=control_mode, obs_mode=obs_mode,
                                      image_size=image_size if obs_mode == "rgb" else None, log=log)
            data, bad = _good_episodes(planned, converted, task=task, control_mode=control_mode,
                                       obs_mode=obs_mode, log=log)
        except ManiSkillDemoError as e:   # this round is lost; the earlier rounds' episodes are kept
            reason = f"the conversion of its round failed ({str(e).splitlines()[0]})"
            data, bad = None, [DroppedEpisode(episode_seed(ep), reason)
                               for ep in read_trajectory_info(planned).episodes]
        for d in bad:
            log(f"{task} seed {d.seed}: dropped, {d.reason}")
        dropped += bad
        if data is not None:
            parts.append(data)
            sources.append(str(converted))
            kept += data.num_episodes
    if not parts:
        raise ManiSkillDemoError(f"{task}: no usable episode from {tried} seeds (max_tries={max_tries}); "
                                 f"{len(dropped)} dropped, e.g. seed {dropped[0].seed}: {dropped[0].reason}"
                                 if dropped else f"{task}: no usable episode from {tried} seeds")
    if kept < episodes:
        log(f"{task}: only {kept} of {episodes} episodes are good after trying {tried} seeds (max_tries="
            f"{max_tries}); writing those")
    log(f"{task}: {kept} episodes from {tried} seeds; {len(dropped)} dropped")
    data = concat_episodes(parts)
    lengths = torch.bincount(data.episode_index).tolist()
    env_cfg = demo_env_config(data, task=task, control_mode=control_mode, obs_mode=obs_mode,
                              max_episode_steps=max_episode_steps)
    log(f"{task}: demo lengths {min(lengths)}-{max(lengths)} steps; episode limit {env_cfg.max_episode_steps}")
    cameras = [f"camera{c}" for c in range(data.images.shape[1])]
    if obs_mode == "rgb":   # ManiSkill's camera names, in the order the adapter stacks them
        with h5py.File(sources[0]) as f:
            sensors = f[next(iter(f))]["obs"]["sensor_data"]
            cameras = [c for c in sensors if "rgb" in sensors[c]]
    return write_lerobot_dataset(out, data, fps=fps, camera_names=cameras, robot_type="panda", video=video,
                                 extra_info={"vla_rl": {
                                     "env": MANISKILL, "env_config": to_dict(env_cfg),
                                     "source": sources[0] if len(sources) == 1 else sources,
                                     "first_frames": "re-observed at reset",
                                     "dropped": [{"seed": d.seed, "reason": d.reason} for d in dropped],
                                     **(extra_info or {})}})
