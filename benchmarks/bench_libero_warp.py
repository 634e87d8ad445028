"""LIBERO on MuJoCo Warp (``env.kind: libero_warp``): speed against the number of worlds, and fidelity to
robosuite-LIBERO (the CPU adapter) on the same states.

    python benchmarks/bench_libero_warp.py [speed] [--device cpu|cuda] [--worlds 1,4,16] [--cameras 0,2]
        [--image-size 128] [--horizon 8] [--chunks 2] [--policy both|off|on] [--out FILE.json] [--smoke]
    python benchmarks/bench_libero_warp.py fidelity [--suites libero_spatial,...] [--tasks 0,1] [--steps 20]
        [--seeds 0,1] [--parts predicates,torques,trajectory,images] [--out FILE.json]

``speed``: env-steps/s (worlds x actions / wall seconds) of ``LiberoWarpEnv`` on libero_spatial task 0, per world
count, without cameras and with two cameras (agentview + wrist), physics alone (random actions) and with a policy in
the loop (the ``tiny`` preset, 4 ODE steps, on the same device; one chunk sampled per ``--horizon`` actions). One
warm-up chunk first (kernels load), then ``--chunks`` timed chunks. Also CPU seconds of this process and, on a GPU,
peak memory (torch's allocator and Warp's mempool). The CPU backend runs Warp's kernels on one thread; its numbers
show the backend works, not how fast it is on a GPU (where the same command with ``--device cuda --worlds
1,64,320,1024,4096`` is the measurement to make). ``speed`` is the default: ``--device cuda`` alone measures 320 and
4096 worlds (what benchmarks/gpu_acceptance.py runs). ``--smoke`` runs the speed code paths on the CPU (physics alone;
two 16 px cameras with the policy; one world, one physics substep per action; ~30 CPU-seconds, most of it building
the renderer): a check that the script works, no numbers. It reports a skip, not a failure, where MuJoCo Warp is
not installed or ``VLA_RL_SKIP_SIMULATORS=1``.

``fidelity``: per task, (1) LIBERO's predicates vs the batched ones on generated goal states (objects put on / in
their targets and settled by robosuite, articulations moved past their thresholds), fed MuJoCo's float64 state
(``host``: the predicate logic) and Warp's own kinematics and contacts (``warp``); (2) OSC torques from Warp's state
vs robosuite's over 4 random actions; (3) end-effector and object divergence over ``--steps`` random actions from
init state 0, per step; (4) PSNR of the two cameras at the episode start (128 px), raw and after a per-channel
linear colour fit (what is left once the renderers' lighting difference is taken out); (5) ``success``: a
scripted pick-and-place policy on privileged state (``envs.libero.fidelity.PickPlaceExpert``, closed loop) from the same
``--success-episodes`` init states on both simulators: success rates and episode-by-episode agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("MUJOCO_GL", "egl")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vla_rl.envs.libero.warp_env import LiberoWarpConfig, LiberoWarpEnv  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ speed
def tiny_actor(num_cameras: int, image_size: int, device: torch.device):
    from vla_rl.policies.actor import Actor
    from vla_rl.policies.architectures import make_policy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    cfg = policy_preset("tiny", {"num_cameras": num_cameras, "action_dim": 7, "state_dim": 8,
                                 "vision": {"image_size": image_size}})
    model = make_policy(cfg).to(device).eval()
    return Actor(model, NormStats(Stats.identity(8), Stats.identity(7)))


def speed_case(scenes, n: int, cameras: int, policy: bool, args, device: torch.device) -> dict:
    from vla_rl.policies.actor import SamplerConfig

    cams = ("agentview", "wrist")[:cameras]
    cfg = LiberoWarpConfig(suite="libero_spatial", task_ids=[0], init_state_ids=[0, 1], cameras=cams,
                           image_size=args.image_size)
    t0 = time.perf_counter()
    env = LiberoWarpEnv(cfg, n, device=device, seed=0, scenes=scenes)
    build = time.perf_counter() - t0
    actor = tiny_actor(cameras, args.image_size, device) if policy else None
    gen = torch.Generator(device=device).manual_seed(0)
    sampler = SamplerConfig(4, "ode")
    obs = env.reset(seed=0)

    def chunk(k: int) -> None:
        nonlocal obs
        if actor is not None:
            with torch.inference_mode():
                actions = actor.chunk(obs, sampler, generator=gen)[:, :args.horizon]
        else:
            g = torch.Generator().manual_seed(k)
            actions = (torch.rand(n, args.horizon, 7, generator=g) * 2 - 1).to(device)
        obs = env.step(actions).obs

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    chunk(0)   # warm-up: kernels load, first renders
    sync(device)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for k in range(args.chunks):
        chunk(k + 1)
    sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = n * args.horizon * args.chunks
    row = {"worlds": n, "cameras": cameras, "image_size": args.image_size if cameras else 0, "policy": policy,
           "env_steps": steps, "seconds": round(wall, 2), "env_steps_per_s": round(steps / wall, 2),
           "env_steps_per_cpu_s": round(steps / cpu, 2), "build_s": round(build, 1)}
    if device.type == "cuda":
        import warp as wp

        row["peak_torch_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        row["peak_warp_gib"] = round(wp.get_mempool_used_mem_high(f"cuda:{device.index or 0}") / 2**30, 2)
    env.close()
    return row


def run_speed(args) -> dict:
    from vla_rl.envs.libero.scene import load_task_scene

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing measured (use --device cpu)")
        return {"device": args.device, "rows": [], "note": "not measured: no GPU available"}
    scenes = [load_task_scene("libero_spatial", 0, [0, 1])]
    if args.smoke:   # the code paths, not the physics: one substep per action
        import dataclasses

        scenes = [dataclasses.replace(scenes[0], substeps=1)]
    policies = {"both": (False, True), "off": (False,), "on": (True,)}[args.policy]
    rows = []
    for cameras in [int(c) for c in args.cameras.split(",")]:
        for n in [int(w) for w in args.worlds.split(",")]:
            for policy in policies:
                if args.smoke and policy != bool(cameras):   # each code path once: physics alone, all of it
                    continue
                row = speed_case(scenes, n, cameras, policy, args, device)
                log(json.dumps(row))
                rows.append(row)
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "rows": rows}


# ------------------------------------------------------------------------------------------------ fidelity
def psnr_affine(ours: np.ndarray, ref: np.ndarray) -> float:
    """PSNR after fitting ``a * ours + b`` to ``ref`` per channel (least squares): the lighting taken out."""
    from vla_rl.envs.libero.fidelity import psnr

    fitted = np.empty(ours.shape, dtype=np.float64)
    for c in range(3):
        x, y = ours[..., c].astype(np.float64).ravel(), ref[..., c].astype(np.float64).ravel()
        a, b = np.polyfit(x, y, 1) if x.std() > 0 else (0.0, y.mean())
        fitted[..., c] = (a * x + b).reshape(ours.shape[:-1])
    return psnr(np.clip(fitted, 0, 255).round().astype(np.uint8), ref)


def fidelity_task(single, suite: str, task: int, args) -> dict:
    from vla_rl.envs.libero import fidelity as F
    from vla_rl.envs.libero.scene import load_task_scene
    from vla_rl.envs.libero.warp_env import CAMERAS, TaskWorlds

    parts = set(args.parts.split(","))
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    inits = list(range(args.success_episodes)) if "success" in parts else [0]
    scene = load_task_scene(suite, task, sorted(set(inits) | {0}), single=single)
    out: dict = {"suite": suite, "task": task, "instruction": scene.instruction,
                 "goal": [a.text for a in scene.goal.atoms]}
    if "predicates" in parts:
        states = F.goal_states(single, task, 0)
        ref, host = F.libero_atoms(single, task, states, goal=scene.goal)
        warp = F.warp_atoms(TaskWorlds(scene, len(states), device=cpu), states)
        ops = [a.op for a in scene.goal.atoms]
        settled = F.warp_settled_atoms(TaskWorlds(scene, len(states), device=cpu, success_substeps=5), states)
        k, n = settled["qpos"].shape[:2]
        # LIBERO judges the very states Warp reached (each of the action's last substeps, MuJoCo's own contacts).
        flat = [np.concatenate([[0.0], settled["qpos"][j, i], settled["qvel"][j, i]])
                for j in range(k) for i in range(n)]
        judged, _ = F.libero_atoms(single, task, flat)
        judged = judged.reshape(k, n, -1)
        out["predicates_settled_in_warp"] = {
            "substeps": k, "atom_agree_per_substep": (judged == settled["warp"]).all(-1).mean().round(3).item(),
            "success_warp": settled["success"].astype(int).tolist(),
            "success_libero_any_substep": judged.all(-1).any(0).astype(int).tolist(),
            "success_libero_last_substep": judged[-1].all(-1).astype(int).tolist()}
        out["predicates"] = {
            "states": len(states), "libero_true": ref.sum(0).tolist(), "ops": ops,
            "host_agree": int((ref == host).all(1).sum()), "warp_agree_per_atom": (ref == warp).sum(0).tolist(),
            "success_libero": int(ref.all(1).sum()), "success_host_agree": int((ref.all(1) == host.all(1)).sum()),
            "success_warp_agree": int((ref.all(1) == warp.all(1)).sum())}
    if "torques" in parts:
        single.reset_to(task, 0)
        actions = F.random_actions(4, seed=3, scale=1.0, hold=1)
        with F.record_controller(single) as records:
            for a in actions:
                single.step(a)
        picked = records[::5]
        ours, ref = F.warp_torques(TaskWorlds(scene, len(picked), device=cpu), picked)
        out["torques"] = {"substeps": len(picked), "max_abs_err_Nm": float(np.abs(ours - ref).max()),
                          "max_abs_torque_Nm": float(np.abs(ref).max())}
    if "trajectory" in parts:
        bodies = F.object_bodies(scene)
        runs = []
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            actions = F.random_actions(args.steps, seed=seed)
            c = F.rollout_cpu(single, task, 0, actions, bodies)
            w = F.rollout_warp(TaskWorlds(scene, 1, device=cpu), 0, actions, bodies)
            runs.append({"seed": seed,
                         "eef_mm": (1e3 * np.linalg.norm(w["eef"][:, 0] - c["eef"], axis=-1)).round(4).tolist(),
                         "objects_mm": (1e3 * np.linalg.norm(w["bodies"][:, 0] - c["bodies"], axis=-1).max(-1))
                         .round(4).tolist(),
                         "success_cpu": int(c["success"].any()), "success_warp": int(w["success"][:, 0].any())})
        if args.expert_init is not None:   # contact-rich: the scripted expert's actions, replayed open loop
            actions = F.expert_actions_cpu(single, task, args.expert_init, args.steps)
            scene_e = load_task_scene(suite, task, [args.expert_init], single=single)
            c = F.rollout_cpu(single, task, args.expert_init, actions, bodies)
            w = F.rollout_warp(TaskWorlds(scene_e, 1, device=cpu), args.expert_init, actions, bodies)
            runs.append({"expert_init": args.expert_init, "steps": len(actions),
                         "eef_mm": (1e3 * np.linalg.norm(w["eef"][:, 0] - c["eef"], axis=-1)).round(4).tolist(),
                         "objects_mm": (1e3 * np.linalg.norm(w["bodies"][:, 0] - c["bodies"], axis=-1).max(-1))
                         .round(4).tolist(),
                         "success_cpu": int(c["success"].any()), "success_warp": int(w["success"][:, 0].any())})
        out["trajectory"] = {"steps": args.steps, "bodies": len(bodies), "runs": runs}
    if "images" in parts:
        s = 128
        single.reset_to(task, 0)
        single.render_frame()   # a state-only env opens its render context on demand
        worlds = TaskWorlds(scene, 1, device=cpu, cameras=("agentview", "wrist"), image_size=s)
        worlds.load_starts(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        worlds.kinematics()
        images = worlds.render()[0].numpy()
        out["images"] = {}
        for name, ours in zip(("agentview", "wrist"), images):
            ref = single._orient(single._env.sim.render(width=s, height=s, camera_name=CAMERAS[name][0]))
            out["images"][name] = {"psnr_db": round(F.psnr(ours, ref), 2),
                                   "psnr_after_colour_fit_db": round(psnr_affine(ours, ref), 2),
                                   "mean_abs_diff": round(float(np.abs(ours.astype(float) - ref).mean()), 1)}
            if args.save_images:
                from PIL import Image

                path = Path(args.save_images) / f"{suite}_{task}_{name}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.concatenate([ref, ours], axis=1)).save(path)
    if "success" in parts and scene.goal.atoms[0].op != "joint":
        max_steps = args.max_steps or LiberoWarpConfig(suite=suite).episode_steps
        c = F.expert_episodes_cpu(single, task, inits, max_steps)
        w = F.expert_episodes_warp(TaskWorlds(scene, len(inits), device=cpu, success_substeps=5), inits, max_steps)
        out["success"] = {"policy": "PickPlaceExpert (scripted, privileged state)", "max_steps": max_steps,
                          "cpu": [r["success"] for r in c], "warp": [r["success"] for r in w],
                          "cpu_steps": [r["steps"] for r in c], "warp_steps": [r["steps"] for r in w],
                          "cpu_rate": sum(r["success"] for r in c) / len(c),
                          "warp_rate": sum(r["success"] for r in w) / len(w),
                          "same_outcome": sum(a["success"] == b["success"] for a, b in zip(c, w))}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def run_fidelity(args) -> dict:
    from vla_rl.envs.libero.robosuite_env import SUITE_NUM_TASKS, LiberoConfig, LiberoSingleEnv

    results = []
    for suite in args.suites.split(","):
        tasks = list(range(SUITE_NUM_TASKS[suite])) if args.tasks is None else [int(t) for t in args.tasks.split(",")]
        single = LiberoSingleEnv(LiberoConfig(suite=suite, task_ids=tasks, cameras=(), max_cached_envs=1))
        try:
            for t in tasks:
                row = fidelity_task(single, suite, t, args)
                log(json.dumps(row))
                results.append(row)
        finally:
            single.close()
    return {"host": platform.node(), "cpus": os.cpu_count(), "tasks": results}


def smoke_skip() -> str | None:
    """Why the smoke run cannot run here (None: it can)."""
    if os.environ.get("VLA_RL_SKIP_SIMULATORS") == "1":
        return "VLA_RL_SKIP_SIMULATORS=1"
    from vla_rl.envs.libero.warp_env import LiberoWarpNotInstalled, import_warp

    try:
        import_warp()
    except LiberoWarpNotInstalled as e:
        return str(e)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("speed")
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--worlds", default=None, help="world counts (default: 1,4,16 on cpu, 320,4096 on cuda)")
    sp.add_argument("--cameras", default="0,2")
    sp.add_argument("--image-size", type=int, default=128)
    sp.add_argument("--horizon", type=int, default=8)
    sp.add_argument("--chunks", type=int, default=2)
    sp.add_argument("--policy", choices=("both", "off", "on"), default="both")
    sp.add_argument("--out", default=None)
    sp.add_argument("--smoke", action="store_true", help="CPU, one world, tiny sizes: checks the script, no numbers")
    fp = sub.add_parser("fidelity")
    fp.add_argument("--suites", default="libero_spatial")
    fp.add_argument("--tasks", default=None, help="task ids (default: all of each suite)")
    fp.add_argument("--steps", type=int, default=20)
    fp.add_argument("--seeds", default="0", help="trajectory: seeds of random action sequences ('' for none)")
    fp.add_argument("--expert-init", type=int, default=None,
                    help="trajectory: also replay the scripted expert's actions from this init state")
    fp.add_argument("--parts", default="predicates,torques,trajectory,images",
                    help="any of predicates,torques,trajectory,images,success")
    fp.add_argument("--success-episodes", type=int, default=10, help="success: init states 0..K-1 on both")
    fp.add_argument("--max-steps", type=int, default=None, help="success: step limit (default: the suite's)")
    fp.add_argument("--save-images", default=None, help="folder for side-by-side PNGs (robosuite | warp)")
    fp.add_argument("--out", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("speed", "fidelity", "-h", "--help"):
        argv = ["speed", *argv]
    args = p.parse_args(argv)
    if args.what == "speed":
        if args.smoke:
            args.device, args.worlds, args.cameras, args.image_size, args.horizon, args.chunks = \
                "cpu", "1", "0,2", 16, 1, 1
            skip = smoke_skip()
            if skip:
                log(f"skipped: {skip}")
                return 0
        args.worlds = args.worlds or ("320,4096" if args.device.startswith("cuda") else "1,4,16")
    torch.set_num_threads(1)
    doc = run_speed(args) if args.what == "speed" else run_fidelity(args)
    doc["command"] = " ".join(["python", "benchmarks/bench_libero_warp.py", *argv])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
