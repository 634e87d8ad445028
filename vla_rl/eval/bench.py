"""``vla-rl bench``: a policy on a whole benchmark suite, task by task, with a table to put next to papers.

A bench is a list of *tasks*; each is one :class:`~vla_rl.envs.registry.EnvConfig` and a number of episodes,
evaluated with the one evaluation loop (:func:`vla_rl.eval.evaluate.evaluate_episodes`, deterministic ODE
sampler) on ``workers`` envs:

- LIBERO suites (``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``, ``libero_90``, and
  ``libero_4``: the four the πRL paper averages): every task, its first ``episodes`` fixed initial states (50:
  the official protocol), the suite's step limit, 10 settle steps. The env runs ``episode_order="indexed"``,
  so episode ``k`` of a task is its init state ``k`` whatever the number of workers.
- ManiSkill3 task lists (``maniskill:mp`` = the tasks with motion-planner demos, or ``maniskill:PickCube-v1,
  StackCube-v1``): each task with the checkpoint's ManiSkill settings, reset seeds ``seed + k``.

Output folder: ``tasks/<suite>/<task>.json`` (each task's episodes, written when the task is done, so an
interrupted bench resumes where it stopped and never re-runs a finished task), ``videos/``, and
``results.json`` / ``results.md`` / ``results.csv`` (per task and per suite: success, episodes, binomial
standard error), with the command line and the policy's identity (SHA-256 of its weights).
``compare_benches`` pairs two benches episode by episode per task (:mod:`vla_rl.eval.paired`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from vla_rl.checkpoint.folders import read_yaml_file
from vla_rl.checkpoint.policy import load_any_policy  # ours, or a LeRobot π0 / π0.5 folder
from vla_rl.core.outputs import BENCH, check_output, clear_output
from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, positive, setting
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.core.threads import policy_threads, threads_setting, torch_threads
from vla_rl.data.maniskill_demos import PLANNED_TASKS
from vla_rl.envs.libero.robosuite_env import SUITE_NUM_TASKS, LiberoConfig, episode_of, task_instruction
from vla_rl.envs.libero.settings import libero_env_config
from vla_rl.envs.libero.warp_env import LiberoWarpConfig
from vla_rl.envs.registry import LIBERO, LIBERO_WARP, MANISKILL, EnvConfig, make_env
from vla_rl.envs.video import VIEW_MIN_SECONDS, VIEW_MIN_SIZE, record_video
from vla_rl.envs.worker_pool import WorkerError
from vla_rl.envs.workers import local_worker_processes
from vla_rl.eval.evaluate import checkpoint_env_config, evaluate_episodes
from vla_rl.eval.paired import paired_difference
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.inference import cast_weights

LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
SUITE_SETS = {"libero_4": ("libero_spatial", "libero_object", "libero_goal", "libero_10")}
RESULT_FORMAT = "vla-rl-bench-task/1"


class BenchError(ValueError):
    """A bench that cannot run or be read (mismatched earlier results, unknown suite, policy that does not fit)."""


@dataclass(frozen=True)
class BenchConfig:
    """``vla-rl bench CHECKPOINT --suite S`` settings."""

    MOVED = {"num_steps": "sampler.num_steps"}

    suite: str = setting("libero_4", doc="a LIBERO suite, libero_4 (the four the πRL paper averages), or "
                                         "maniskill:<mp | comma-separated task ids>")
    tasks: list[int | str] | None = setting(None, doc="a subset: LIBERO task ids, ManiSkill task ids")
    episodes: int | None = positive(None, doc="per task; None: 50 (LIBERO's official count; ManiSkill too)")
    workers: int = positive(1, doc="envs stepped together (worker processes for LIBERO / ManiSkill on CPU)")
    sampler: SamplerConfig = setting(default_factory=SamplerConfig,
                                     doc="the deterministic ODE sampler (method ode) and its denoising steps")
    execute: int | None = positive(None, doc="actions run per chunk; None: the whole chunk")
    seed: int = nonneg(10_000, doc="ManiSkill: reset seeds seed + k; both: the sampler's noise seeds")
    device: str = setting("cpu", doc="cpu, cuda or cuda:<index>")
    dtype: Literal["fp32", "bf16"] = setting("fp32", doc="the policy's weights (docs/speed.md)")
    compile: Literal["none", "compile", "cudagraph"] = setting("none", doc="how the denoising loop runs "
                                                                           "(docs/speed.md)")
    videos: int = nonneg(1, doc="episodes recorded per task (one frame per chunk); 0: none")
    video_format: Literal["mp4", "gif"] = "mp4"
    out: str = setting("runs/bench", doc="the bench folder (an interrupted bench resumes there)")
    env: dict[str, Any] = setting(default_factory=dict,
                                  doc="simulator settings (LiberoConfig / ManiSkillConfig fields)")
    backend: Literal["robosuite", "warp"] = setting(
        "robosuite", doc="LIBERO's simulator: robosuite (the official protocol's, CPU worker processes) or warp "
                         "(env.kind libero_warp: the same tasks and init states batched on MuJoCo Warp on `device`; "
                         "results are marked as such and are not the protocol's numbers; env may also set "
                         "LiberoWarpConfig's own fields)")
    progress: bool = setting(True, doc="report each task's episodes as they end")
    threads: int | Literal["auto"] = threads_setting()

    def __post_init__(self):
        check_ranges(self)
        suite_names(self.suite)   # refuses an unknown suite before any work
        if self.sampler.method != "ode":
            raise ConfigError(f"sampler.method={self.sampler.method}: a bench runs the deterministic ODE sampler")

    @property
    def episodes_per_task(self) -> int:
        return 50 if self.episodes is None else self.episodes


def suite_names(suite: str) -> tuple[str, list[str]]:
    """(simulator, suites or task ids) of a ``--suite`` value; an unknown one is a :class:`ConfigError`."""
    if suite.startswith("maniskill:"):
        spec = suite.split(":", 1)[1]
        if spec == "mp":
            return MANISKILL, list(PLANNED_TASKS)
        ids = [s.strip() for s in spec.split(",") if s.strip()]
        if not ids:
            raise ConfigError(f"suite {suite!r}: name ManiSkill tasks, e.g. maniskill:PickCube-v1,PushCube-v1 "
                              "or maniskill:mp")
        return MANISKILL, ids
    names = list(SUITE_SETS.get(suite, (suite,)))
    bad = [s for s in names if s not in LIBERO_SUITES]
    if bad:
        raise ConfigError(f"unknown suite {suite!r}; LIBERO suites: {', '.join((*LIBERO_SUITES, *SUITE_SETS))}; "
                          "ManiSkill: maniskill:mp or maniskill:<task ids>")
    return LIBERO, names


@dataclass(frozen=True)
class BenchTask:
    suite: str            # LIBERO suite, or MANISKILL for ManiSkill tasks
    task: str             # LIBERO task id (as text) or ManiSkill task id
    env: EnvConfig        # num_envs is set when the task runs
    episodes: int
    seed: int             # reset seed of the first episode

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.task}"


def weights_sha256(path: str | Path) -> str:
    """SHA-256 of a policy folder's ``model.safetensors``: the identity of the weights a bench ran."""
    h = hashlib.sha256()
    with open(Path(path) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def plan_tasks(checkpoint: str | Path, cfg: BenchConfig, model_cfg, policy_config: dict) -> list[BenchTask]:
    """The bench's tasks with their env configs, checked against the policy before any simulator starts."""
    simulator, names = suite_names(cfg.suite)
    n = cfg.episodes_per_task
    if simulator == LIBERO:
        train_env = None
        if (Path(checkpoint) / "train_config.yaml").is_file():
            train_env = read_yaml_file(Path(checkpoint) / "train_config.yaml").get("env")
        warp_only = {}
        if cfg.backend == "warp":
            shared = {f.name for f in fields(LiberoConfig)}
            warp_only = {k: v for k, v in cfg.env.items() if k not in shared
                         and k in {f.name for f in fields(LiberoWarpConfig)}}
        base = libero_env_config(policy_config, model_cfg, {k: v for k, v in cfg.env.items() if k not in warp_only},
                                 train_env)
        if n > 50:
            raise ConfigError(f"episodes={n}: LIBERO tasks have 50 fixed initial states")
        out = []
        for suite in names:
            ids = list(range(SUITE_NUM_TASKS[suite])) if cfg.tasks is None else [int(t) for t in cfg.tasks]
            bad = [t for t in ids if not 0 <= t < SUITE_NUM_TASKS[suite]]
            if bad:
                raise ConfigError(f"tasks {bad} out of range: {suite} has {SUITE_NUM_TASKS[suite]} tasks")
            for t in ids:
                lib = replace(base, suite=suite, task_ids=[t], init_state_ids=list(range(n)), episode_order="indexed")
                env = EnvConfig(kind=LIBERO, libero=lib)
                if cfg.backend == "warp":
                    env = EnvConfig(kind=LIBERO_WARP, libero_warp=_warp_config(lib, warp_only))
                out.append(BenchTask(suite, str(t), env, n, 0))
        return out
    if cfg.backend != "robosuite":
        raise ConfigError(f"backend={cfg.backend} is for LIBERO suites; ManiSkill runs its own simulator")
    env_cfg = checkpoint_env_config(checkpoint, {})
    if env_cfg.kind != MANISKILL:
        raise BenchError(f"{checkpoint} was made for a {env_cfg.kind} env, not ManiSkill; a ManiSkill bench needs a "
                         "policy trained on ManiSkill observations")
    tasks = names if cfg.tasks is None else [str(t) for t in cfg.tasks]
    base = from_dict(type(env_cfg.maniskill), {**to_dict(env_cfg.maniskill), **cfg.env}, prefix="env")
    return [BenchTask(MANISKILL, t, EnvConfig(kind=MANISKILL, maniskill=replace(base, task=t)), n, cfg.seed)
            for t in tasks]


def _warp_config(lib, extra: dict):
    """The ``libero_warp`` config of a LIBERO protocol task: the same suite, task, init states, episode order, step
    limit, settle steps and observations, plus Warp's own settings ``extra``."""

    names = {f.name for f in fields(LiberoWarpConfig)}
    shared = {f.name: getattr(lib, f.name) for f in fields(lib) if f.name in names}
    shared = {k: list(v) if isinstance(v, tuple) else v for k, v in shared.items()}
    try:
        return from_dict(LiberoWarpConfig, {**shared, **extra}, prefix="env")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def binomial_se(successes: int, n: int) -> float:
    """Standard error of a success rate from ``n`` independent episodes: sqrt(p (1 - p) / n)."""
    if n == 0:
        return float("nan")
    p = successes / n
    return math.sqrt(p * (1 - p) / n)


def _task_path(out: Path, task: BenchTask) -> Path:
    return out / "tasks" / task.suite / f"{task.task}.json"


def _write_json_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _identity(cfg: BenchConfig, weights: str) -> dict:
    """What must match for an earlier task result to count in this bench (not the workers or the output)."""
    ident = {"weights_sha256": weights, "num_steps": cfg.sampler.num_steps, "execute": cfg.execute, "seed": cfg.seed,
             "episodes": cfg.episodes_per_task, "env": dict(cfg.env),
             # each episode's sampler noise drawn from its seed (a task result made otherwise is run again)
             "noise": "per-episode"}
    if cfg.dtype != "fp32":   # named only when not the default, so benches written before the option still match
        ident["dtype"] = cfg.dtype
    if cfg.backend != "robosuite":
        ident["backend"] = cfg.backend
    return ident


def _last_line(text: str) -> str:
    """The last line of a worker's traceback (the exception), without its module path."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return re.sub(r"^[\w.]+\.(\w+): ", r"\1: ", lines[-1]) if lines else text


def run_task(actor_for, task: BenchTask, cfg: BenchConfig, out: Path, log) -> dict:
    """Evaluate one task and return its result document (videos written under ``out/videos``)."""
    num_envs = min(cfg.workers, task.episodes)
    try:
        env = make_env(task.env, num_envs=num_envs, device=torch.device(cfg.device), seed=task.seed)
    except WorkerError as e:   # the task cannot start here (a package its scene needs): the others still run
        raise BenchError(f"its env did not start: {_last_line(str(e))}") from None
    start = time.perf_counter()
    try:
        actor = actor_for(env.spec)
        limit = env.spec.max_episode_steps
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if cfg.progress and (time.perf_counter() - last[0] > 5 or done == total):
                last[0] = time.perf_counter()
                log(f"  {task.key}: {done}/{total} episodes")

        with torch_threads(policy_threads(cfg.threads, worker_processes=local_worker_processes([env]))):
            records = evaluate_episodes(actor, env, num_episodes=task.episodes,
                                        sampler=cfg.sampler, execute=cfg.execute,
                                        seed=task.seed, videos=cfg.videos, progress=progress)
    finally:
        env.close()
    instruction = ""
    if task.env.info.family == LIBERO:
        lib = task.env.task
        instruction = task_instruction(lib.suite, int(task.task))
        for r in records:   # which fixed initial state each episode was (libero_warp: one task, the same order)
            r["task_id"], r["init_state_id"] = episode_of(r["episode_seed"], lib.task_ids, lib.init_state_ids)
    else:
        instruction = task.env.maniskill.task_instruction
    for r in records:
        frames = r.pop("frames", None)
        if frames:
            tag = "success" if r["success_once"] else "failure"
            name = f"{task.suite}_{task.task}_ep{r['episode_seed']:05d}_{tag}.{cfg.video_format}"
            r["video"] = str(record_video(frames, out / "videos" / name, fps=4, min_size=VIEW_MIN_SIZE,
                                          min_seconds=VIEW_MIN_SECONDS).relative_to(out))
    k = int(sum(r["success_once"] for r in records))
    return {"suite": task.suite, "task": task.task, "instruction": instruction, "episodes": len(records),
            "max_episode_steps": limit,
            "successes": k, "success_rate": k / len(records), "se": binomial_se(k, len(records)),
            "seconds": time.perf_counter() - start, "records": records}


def run_bench(checkpoint: str | Path, cfg: BenchConfig, *, command: list[str] | None = None, log=print,
              overwrite: bool = False, num_steps_given: bool = True) -> dict:
    """Run (or resume) a bench of ``checkpoint`` into ``cfg.out``; returns the results document. ``overwrite``:
    start over in an ``out`` that holds an earlier bench (or other files; never another kind of data)."""
    checkpoint = Path(checkpoint)
    check_output(cfg.out, overwrite=overwrite, kind=BENCH, reuse=True, inputs={"checkpoint": checkpoint})
    model, norm, policy_config = load_any_policy(checkpoint, device=cfg.device)
    deploy = policy_config.get("deploy") if isinstance(policy_config.get("deploy"), dict) else {}
    # An imported policy runs as its framework ran it (openpi: 5 actions a chunk, 10 denoising steps), unless the
    # command says otherwise.
    if cfg.execute is None and deploy.get("execute"):
        cfg = replace(cfg, execute=int(deploy["execute"]))
        log(f"execute={cfg.execute} actions per chunk, as the checkpoint's framework runs it (give execute= to "
            "change)")
    steps = (deploy.get("sampler") or {}).get("num_steps") if isinstance(deploy.get("sampler"), dict) else None
    if not num_steps_given and steps:
        cfg = replace(cfg, sampler=replace(cfg.sampler, num_steps=int(steps)))
        log(f"sampler.num_steps={cfg.sampler.num_steps}, as the checkpoint's framework runs it (give "
            "sampler.num_steps= to change)")
    cast_weights(model, cfg.dtype)
    tasks = plan_tasks(checkpoint, cfg, model.cfg, policy_config)
    weights = weights_sha256(checkpoint)
    ident = _identity(cfg, weights)
    out = Path(cfg.out)
    if overwrite:
        clear_output(out)
    results = []
    # Earlier results are checked before any new work: a bench folder holds one policy's results only.
    for task in tasks:
        path = _task_path(out, task)
        if path.is_file():
            doc = read_task_result(path)
            if doc["identity"] != ident:
                diff = sorted(k for k in set(ident) | set(doc["identity"]) if doc["identity"].get(k) != ident.get(k))
                raise BenchError(f"{path} was made with other settings ({', '.join(diff)}); use another out=, "
                                 "or start over with --overwrite")

    def actor_for(spec):
        try:
            return Actor.for_env(model, norm, spec, compile=cfg.compile)
        except ValueError as e:
            raise BenchError(f"the policy does not fit this task: {e}") from None

    skipped = []
    for i, task in enumerate(tasks):
        path = _task_path(out, task)
        if path.is_file():
            log(f"[{i + 1}/{len(tasks)}] {task.key}: done earlier, kept")
            results.append(read_task_result(path))
            continue
        log(f"[{i + 1}/{len(tasks)}] {task.key}: {task.episodes} episodes on {min(cfg.workers, task.episodes)} env(s)")
        try:
            doc = run_task(actor_for, task, cfg, out, log)
        except BenchError as e:   # this task's env does not fit the policy: the others still run
            log(f"  {task.key}: skipped: {e}")
            skipped.append({"task": task.key, "reason": str(e)})
            continue
        doc.update(format=RESULT_FORMAT, identity=ident)
        _write_json_atomic(path, doc)
        log(f"  {task.key}: {doc['success_rate']:.3f} ± {doc['se']:.3f} ({doc['successes']}/{doc['episodes']}, "
            f"{doc['seconds']:.0f} s)")
        results.append(doc)
    if not results:
        raise BenchError("no task of the suite could run: " + "; ".join(f"{s['task']}: {s['reason']}" for s in skipped))
    summary = summarize_bench(results)
    summary.update(skipped=skipped, checkpoint=str(checkpoint), weights_sha256=weights,
                   command=" ".join(command) if command else equivalent_command(checkpoint, cfg),
                   settings=to_dict(cfg))
    _write_json_atomic(out / "results.json", summary)
    (out / "results.md").write_text(bench_markdown(summary))
    (out / "results.csv").write_text(bench_csv(summary))
    return summary


def equivalent_command(checkpoint: str | Path, cfg: BenchConfig) -> str:
    """The ``vla-rl bench`` command line that runs ``cfg`` (what a bench started from Python records): the
    settings that differ from the defaults, as ``key=value``."""
    default = BenchConfig(suite=cfg.suite)
    words = ["vla-rl", "bench", str(checkpoint), "--suite", cfg.suite]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "suite" or value == getattr(default, f.name):
            continue
        if f.name == "env":
            items = value.items()
        elif f.name == "sampler":   # the section's keys that differ from their defaults
            items = [(k, v) for k, v in to_dict(value).items() if v != getattr(default.sampler, k)]
        else:
            items = [(None, value)]
        for key, v in items:
            text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
            words.append(f"{f.name}.{key}={text}" if key else f"{f.name}={text}")
    return " ".join(shlex.quote(w) for w in words)


def read_task_result(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"{path}: unreadable task result ({e}); remove it to re-run that task") from None
    if not isinstance(doc, dict) or doc.get("format") != RESULT_FORMAT or not isinstance(doc.get("records"), list):
        raise BenchError(f"{path}: not a bench task result (format {RESULT_FORMAT!r})")
    return doc


def summarize_bench(tasks: list[dict]) -> dict:
    """Per-task rows and per-suite pooled success (every task of a suite has the same episode count, so the
    pooled rate is also the mean over tasks), and the average over suites (how the papers report LIBERO)."""
    suites: dict[str, dict] = {}
    for t in tasks:
        s = suites.setdefault(t["suite"], {"tasks": 0, "episodes": 0, "successes": 0})
        s["tasks"] += 1
        s["episodes"] += t["episodes"]
        s["successes"] += t["successes"]
    for s in suites.values():
        s["success_rate"] = s["successes"] / s["episodes"]
        s["se"] = binomial_se(s["successes"], s["episodes"])
    rows = [{k: t[k] for k in ("suite", "task", "instruction", "episodes", "successes", "success_rate", "se")}
            for t in tasks]
    return {"format": "vla-rl-bench/1", "tasks": rows, "suites": suites,
            "average": sum(s["success_rate"] for s in suites.values()) / len(suites) if suites else float("nan")}


def bench_markdown(summary: dict) -> str:
    lines = [f"# Bench of `{summary.get('checkpoint')}`", "",
             f"Weights SHA-256 `{summary.get('weights_sha256', '')[:16]}…`; command: `{summary.get('command')}`", ""]
    if (summary.get("settings") or {}).get("backend") == "warp":
        lines += ["Simulator: **MuJoCo Warp** (`env.kind: libero_warp`), not the official protocol's robosuite: the "
                  "same tasks, init states and step limits on another simulator (docs/envs.md).", ""]
    lines += ["| suite | task | instruction | success | ± SE | episodes |", "|---|---|---|---|---|---|"]
    for t in summary["tasks"]:
        lines.append(f"| {t['suite']} | {t['task']} | {t['instruction']} | {100 * t['success_rate']:.1f} % | "
                     f"{100 * t['se']:.1f} | {t['episodes']} |")
    for name, s in summary["suites"].items():
        lines.append(f"| **{name}** | all {s['tasks']} | | **{100 * s['success_rate']:.1f} %** | {100 * s['se']:.1f} | "
                     f"{s['episodes']} |")
    lines += ["", f"Average over suites: **{100 * summary['average']:.1f} %**", ""]
    for s in summary.get("skipped", []):
        lines.append(f"Skipped {s['task']}: {s['reason']}")
    return "\n".join(lines)


def bench_csv(summary: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["suite", "task", "instruction", "episodes", "successes", "success_rate", "se"])
    for t in summary["tasks"]:
        w.writerow([t[k] for k in ("suite", "task", "instruction", "episodes", "successes", "success_rate", "se")])
    for name, s in summary["suites"].items():
        w.writerow([name, "all", "", s["episodes"], s["successes"], s["success_rate"], s["se"]])
    return buf.getvalue()


def _task_results(bench_dir: Path) -> dict[str, dict]:
    if not (bench_dir / "tasks").is_dir():
        raise BenchError(f"{bench_dir}: no bench results (tasks/) there")
    return {f"{p.parent.name}/{p.stem}": read_task_result(p) for p in sorted((bench_dir / "tasks").glob("*/*.json"))}


def compare_benches(base_dir: str | Path, new_dir: str | Path) -> dict:
    """Pair two benches episode by episode (by episode seed) in every task both ran; per task and pooled:
    both rates, the paired difference with its standard error, and the exact sign test."""
    base, new = _task_results(Path(base_dir)), _task_results(Path(new_dir))
    common = [k for k in base if k in new]
    if not common:
        raise BenchError(f"{base_dir} and {new_dir} share no task")
    rows, pooled_b, pooled_n, notes = [], [], [], []
    for key in common:
        b = {r["episode_seed"]: r["success_once"] for r in base[key]["records"]}
        n = {r["episode_seed"]: r["success_once"] for r in new[key]["records"]}
        seeds = sorted(set(b) & set(n))
        notes += _unlike(key, base[key], new[key], len(seeds))
        if not seeds:
            continue
        res = paired_difference([b[s] for s in seeds], [n[s] for s in seeds])
        rows.append({"task": key, **asdict(res)})
        pooled_b += [b[s] for s in seeds]
        pooled_n += [n[s] for s in seeds]
    pooled = asdict(paired_difference(pooled_b, pooled_n))
    return {"tasks": rows, "pooled": pooled, "only_base": sorted(set(base) - set(new)),
            "only_new": sorted(set(new) - set(base)), "notes": notes}


def _step_limit(doc: dict) -> int | None:
    """A task result's episode step limit; a result that does not record it names it only where
    ``env.max_episode_steps`` set it (None: not known)."""
    limit = doc.get("max_episode_steps")
    return limit if limit is not None else (doc.get("identity") or {}).get("env", {}).get("max_episode_steps")


def _unlike(key: str, base: dict, new: dict, paired: int) -> list[str]:
    """What makes one task's two results other than like for like: episode counts, step limits, settings."""
    out = []
    nb, nn = len(base["records"]), len(new["records"])
    if nb != nn or paired < nb:
        out.append(f"{key}: {nb} episodes in the base bench, {nn} in the new; {paired} paired (same episode seed)")
    lb, ln = _step_limit(base), _step_limit(new)
    if lb is not None and ln is not None and lb != ln:
        out.append(f"{key}: different episode step limits (base {lb}, new {ln}): the two success rates count "
                   "different things")
    ib, i_n = base.get("identity") or {}, new.get("identity") or {}
    skip = ("weights_sha256", "episodes", "env")
    diff = [k for k in sorted(set(ib) | set(i_n)) if k not in skip and ib.get(k) != i_n.get(k)]
    diff += [f"env.{k}" for k in sorted(set(ib.get("env", {})) | set(i_n.get("env", {})))
             if k != "max_episode_steps" and ib.get("env", {}).get(k) != i_n.get("env", {}).get(k)]
    if diff and ib and i_n:
        out.append(f"{key}: other settings differ: " + ", ".join(
            f"{k} (base {_setting(ib, k)}, new {_setting(i_n, k)})" for k in diff))
    return out


def _setting(identity: dict, key: str):
    return identity.get("env", {}).get(key[4:]) if key.startswith("env.") else identity.get(key)


def compare_markdown(cmp: dict, base_name: str, new_name: str) -> str:
    lines = [f"| task | {base_name} | {new_name} | difference ± paired SE | better / worse | sign test p "
             "| episodes paired |", "|---|---|---|---|---|---|---|"]
    for r in [*cmp["tasks"], {"task": "**pooled**", **cmp["pooled"]}]:
        lines.append(f"| {r['task']} | {r['base_mean']:.3f} | {r['new_mean']:.3f} | {100 * r['diff']:+.1f} ± "
                     f"{100 * r['se_paired']:.1f} | {r['new_better']} / {r['base_better']} | {r['sign_test_p']:.3g} "
                     f"| {r['n']} |")
    if cmp.get("notes"):
        lines += ["", "Not like for like:", *[f"- {x}" for x in cmp["notes"]]]
    for side, keys in (("only in the base", cmp["only_base"]), ("only in the new", cmp["only_new"])):
        if keys:
            lines.append(f"\nTasks {side} bench (not compared): {', '.join(keys)}")
    return "\n".join(lines) + "\n"


def bench_from_cli(checkpoint: str, suite: str, overrides: dict, *, argv: list[str] | None = None,
                   overwrite: bool = False) -> dict:
    """Build the config from ``--suite`` and ``key=value`` overrides and run the bench."""
    if "suite" in overrides:
        raise ConfigError("give the suite with --suite, not suite=")
    cfg = from_dict(BenchConfig, {**overrides, "suite": suite})
    sampler = overrides.get("sampler")
    given = "num_steps" in overrides or (isinstance(sampler, dict) and "num_steps" in sampler)
    return run_bench(checkpoint, cfg, command=["vla-rl", *(argv if argv is not None else sys.argv[1:])],
                     overwrite=overwrite, num_steps_given=given)
