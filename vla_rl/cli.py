"""``vla-rl`` command line: parses arguments and calls the library, nothing else.

A user mistake or an environmental fault (bad config value, occupied output folder, corrupt checkpoint or
dataset, dead env worker, full disk, missing CUDA) ends in one line ``vla-rl: <kind> error: ...`` and exit
status 2; ``--debug`` (or ``VLA_RL_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import config_help, from_dict
from vla_rl.presets import merge, parse_overrides, preset_path, read_yaml, resolve_device

# (module, exception class, kind) of the errors that are the user's or the machine's, not a bug. Looked up in
# sys.modules when an error is reported, so the CLI imports none of those modules to start.
USER_ERRORS = [
    ("vla_rl.core.ranges", "ConfigError", "config"),
    ("vla_rl.core.outputs", "OutputExistsError", "output"),
    ("vla_rl.core.errors", "CheckpointError", "checkpoint"),
    ("vla_rl.data.lerobot", "LeRobotDatasetError", "dataset"),
    ("vla_rl.data.maniskill_h5", "ManiSkillDemoError", "dataset"),
    ("vla_rl.data.lerobot_video", "VideoError", "dataset"),
    ("vla_rl.eval.paired", "EpisodeFileError", "input"),
    ("vla_rl.train.trainer", "TrainingError", "training"),
    ("vla_rl.envs.worker_pool", "WorkerError", "env"),
    ("vla_rl.envs.base", "SimulatorUnavailable", "env"),   # LIBERO, libero_warp, ManiSkill missing
    ("vla_rl.policies.tokenizer", "TokenizerError", "tokenizer"),
    ("vla_rl.distributed.runtime", "ClusterError", "cluster"),
    ("vla_rl.eval.bench", "BenchError", "bench"),
    ("vla_rl.eval.report", "ReportError", "report"),
    ("vla_rl.policies.exported", "ExportError", "export"),
]

# The `train` extra of pyproject.toml by import name (-> distribution name). The commands that train, evaluate, read
# or write datasets and plot need it; a robot's install (the base and `serve`: `export`, `serve`) does not.
TRAIN_PACKAGES = {"tqdm": "tqdm", "tensorboard": "tensorboard", "imageio": "imageio",
                  "imageio_ffmpeg": "imageio-ffmpeg", "pyarrow": "pyarrow", "matplotlib": "matplotlib", "av": "av"}
TRAIN_COMMANDS = ("demo", "train", "sft", "collect", "eval", "bench", "report")


class MissingPackages(RuntimeError):
    """A command needs packages of an extra that is not installed."""


class ServeError(OSError):
    """The policy server cannot listen on its address (taken, not this machine's, not permitted)."""


def check_train_packages(command: str) -> None:
    """Refuse ``command`` (one of TRAIN_COMMANDS) in one line when the `train` extra is not installed."""
    missing = [dist for name, dist in TRAIN_PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackages(f"`vla-rl {command}` needs the training packages, and {', '.join(missing)} "
                              "are not installed: pip install 'vla-rl[train]'")


# Each command imports its job's modules when it runs (torch and the job's packages), so `vla-rl --help`, a
# parse error or `serve` on a robot starts without them.
def _demo(args) -> int:
    from vla_rl.train.demo import DemoConfig, run_demo

    cfg = from_dict(DemoConfig, parse_overrides(args.overrides))
    run_demo(cfg, progress=not args.no_progress, overwrite=args.overwrite)
    return 0


def _train(args) -> int:
    from vla_rl.train.trainer import TrainConfig, Trainer, resume_trainer

    overrides = parse_overrides(args.overrides)
    if args.no_progress:
        overrides["progress"] = False
    if args.resume:
        args.run_dir = args.resume
        if args.config:
            raise ConfigError(f"give either a CONFIG ({args.config}) or --resume {args.resume}, not both: a resumed "
                              "run keeps its own config (change settings with key=value overrides)")
        if args.overwrite:
            raise ConfigError(f"--overwrite starts a run over and --resume {args.resume} continues it: give one")
        if args.plan:
            from vla_rl.checkpoint.training import latest_checkpoint
            from vla_rl.train.trainer import resumed_config

            saved = read_yaml(latest_checkpoint(args.resume) / "train_config.yaml")
            return _plan(from_dict(TrainConfig, resumed_config(saved, overrides)), args.gpu_memory)
        trainer = resume_trainer(args.resume, overrides=overrides)
        print(f"resuming {args.resume} at iteration {trainer.iteration}")
    else:
        if not args.config:
            raise ConfigError("give a CONFIG (a preset name from configs/experiment or a YAML path), or --resume")
        base = read_yaml(preset_path("experiment", args.config))
        cfg = from_dict(TrainConfig, merge(base, overrides))
        args.run_dir = cfg.out
        if args.plan:
            return _plan(cfg, args.gpu_memory)
        trainer = Trainer(cfg, overwrite=args.overwrite)
    with trainer:   # closes the envs' worker processes however the run ends
        history = trainer.run()
    evals = [h for h in history if "eval/success_once" in h]
    if evals:
        print(f"eval success: {evals[0]['eval/success_once']:.3f} (iteration {evals[0]['iteration']}) -> "
              f"{evals[-1]['eval/success_once']:.3f} (iteration {evals[-1]['iteration']})")
    print(f"run folder: {trainer.run_dir}")
    return 0


def _plan(cfg, gpu_memory: float | None) -> int:
    """``vla-rl train ... --plan``: the memory plan per GPU against ``gpu_memory`` GB (default: this machine's CUDA
    device's free memory; none: the table alone). Exit 0 if it fits (or no device to compare), else a config error."""
    import torch

    from vla_rl.train.lengths import resolve_lengths
    from vla_rl.train.memory_plan import GIB, check_plan, device_memory

    cfg, _ = resolve_lengths(cfg)   # rollout_chunks: auto sizes the rollout the plan holds
    # planning for a GPU this machine does not have: --gpu-memory with device=cuda plans without one
    device = torch.device(cfg.device) if gpu_memory is not None else resolve_device(cfg.device)
    found = device_memory(device) if gpu_memory is None else (int(gpu_memory * 1e9), f"a {gpu_memory:g} GB GPU")
    cuda = device.type == "cuda"
    plan = check_plan(cfg, device_bytes=found[0] if found else None, device_name=found[1] if found else "",
                      cuda=cuda)
    if found is None:
        print(f"(no CUDA device here: give --gpu-memory GB to check it against a card; total "
              f"{plan.total / GIB:.1f} GiB + reserve)")
    return 0


def _eval(args) -> int:
    from vla_rl.eval.evaluate import evaluate_checkpoint

    if args.libero:
        raise ConfigError(f"the LIBERO protocol is `vla-rl bench {args.checkpoint} --suite {args.libero}` "
                          "(episodes=, tasks=, workers=, out=)")
    metrics = evaluate_checkpoint(args.checkpoint, parse_overrides(args.overrides), overwrite=args.overwrite)
    for k, v in metrics.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _compare(args) -> int:
    from vla_rl.eval.paired import compare, format_result, load_side

    base = load_side([f for f in args.base.split(",") if f])
    new = load_side([f for f in args.new.split(",") if f])
    result = compare(base, new, args.metric)
    print(format_result(result, args.base, args.new))
    return 0


def _bench(args) -> int:
    from vla_rl.eval.bench import BenchError, bench_from_cli, bench_markdown, compare_benches, compare_markdown

    if args.compare:
        if args.checkpoint or args.suite or args.overrides:
            raise BenchError("--compare takes two bench folders and nothing else")
        a, b = args.compare
        print(compare_markdown(compare_benches(a, b), a, b))
        return 0
    if not args.checkpoint or not args.suite:
        raise BenchError("give a CHECKPOINT and --suite (e.g. --suite libero_spatial or --suite maniskill:mp), "
                         "or --compare BENCH_A BENCH_B")
    res = bench_from_cli(args.checkpoint, args.suite, parse_overrides(args.overrides), argv=args.argv,
                         overwrite=args.overwrite)
    print(bench_markdown(res))
    print(f"results in {res['settings']['out']}")
    return 0


def _collect(args) -> int:
    from vla_rl.data.collect import CollectConfig, collect_dataset
    from vla_rl.envs.registry import LIBERO

    if args.kind == LIBERO:
        from vla_rl.data.libero_demos import (
            CAMERA_FEATURES,
            LiberoRecordConfig,
            record_libero_dataset,
            report_table,
        )

        lcfg = from_dict(LiberoRecordConfig, parse_overrides(args.overrides))
        path, report = record_libero_dataset(args.out, lcfg, overwrite=args.overwrite, progress=not args.no_progress)
        kept = sum(r["succeeded"] for r in report)
        if lcfg.policy == "expert":
            print(report_table(report))
        short = f" (of {len(lcfg.task_ids) * lcfg.episodes_per_task} asked for)" if \
            kept < len(lcfg.task_ids) * lcfg.episodes_per_task else ""
        features = ", ".join([*(CAMERA_FEATURES[c] for c in lcfg.cameras), "state", "actions"])
        print(f"wrote {kept} LIBERO {lcfg.policy}-policy episodes{short} as a LeRobot v3.0 dataset (LIBERO "
              f"layout: {features}) to {path}")
        return 0
    cfg = from_dict(CollectConfig, parse_overrides(args.overrides))
    from vla_rl.data.lerobot import read_lerobot_info

    path = collect_dataset(args.kind, args.out, cfg, overwrite=args.overwrite, progress=not args.no_progress)
    kept = read_lerobot_info(path)["total_episodes"]
    short = f" (of {cfg.episodes} asked for: see the dropped episodes above)" if kept < cfg.episodes else ""
    print(f"wrote {kept} {args.kind} expert episodes{short} as a LeRobot v3.0 dataset to {path}")
    return 0


def _sft(args) -> int:
    from vla_rl.train.sft import SFTRunConfig, run_sft

    cfg = from_dict(SFTRunConfig, parse_overrides(args.overrides))
    run_sft(args.dataset, cfg, progress=not args.no_progress, overwrite=args.overwrite)
    return 0


def _export(args) -> int:
    from vla_rl.interop.export import export_policy, summary, unknown_note

    if args.format == "lerobot":
        from vla_rl.interop.export_lerobot import NOTES_FILE, export_lerobot

        if args.overrides or args.asset_id is not None:
            raise ConfigError("robot spec overrides and --asset-id are for other formats; LeRobot's layout has neither")
        path = export_lerobot(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite)
        print(f"exported to {path} as a LeRobot 0.6 policy folder ({args.dtype}): config.json, model.safetensors, "
              "pre/post-processors, tokenizer.model; our RL heads (Flow-Noise std, value) are not part of it")
        for note in json.loads((path / NOTES_FILE).read_text()).get("not_in_stock_lerobot") or []:
            print(f"note: {note}")
        return 0
    if args.format == "openpi":
        from vla_rl.interop.export_openpi import export_openpi

        if args.overrides:
            raise ConfigError("robot spec overrides are for --format vla-rl; openpi's layout has no robot spec")
        path = export_openpi(args.src, args.out, dtype=args.dtype, asset_id=args.asset_id, overwrite=args.overwrite)
        print(f"exported to {path} in openpi's PyTorch layout ({args.dtype}): model.safetensors, config.json, "
              f"assets/.../norm_stats.json; our RL heads (Flow-Noise std, value) are not part of it")
        return 0
    if args.asset_id is not None:
        raise ConfigError("--asset-id is for --format openpi")

    path = export_policy(args.src, args.out, dtype=args.dtype, overrides=parse_overrides(args.overrides),
                         overwrite=args.overwrite)
    s = summary(path)
    print(f"exported to {s['path']}: {s['bytes'] / 2**20:.1f} MiB of {args.dtype} weights; {s['control_mode']}, "
          f"state {s['state_dim']}, action {s['action_dim']}, chunk H={s['action_horizon']} (execute "
          f"{s['execute']}), K={s['num_steps']}, cameras {s['cameras'] or 'none'}")
    if s["unknown"]:
        print(f"note: {unknown_note(s['unknown'])}")
    return 0


def _import(args) -> int:
    from vla_rl.checkpoint.lerobot import import_lerobot
    from vla_rl.checkpoint.openpi import import_openpi
    from vla_rl.core.outputs import POLICY, check_output

    source = {"lerobot": "LeRobot", "openpi": "openpi", "rlinf": "RLinf"}[args.kind] + " checkpoint"
    check_output(args.out, overwrite=args.overwrite, kind=POLICY, elsewhere="another OUT folder",
                 inputs={source: args.src, "tokenizer": args.tokenizer, "norm stats": args.norm_stats})
    overrides = parse_overrides(args.overrides)
    if args.kind == "lerobot":
        for flag in ("config", "asset_id", "norm_stats"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} is for openpi / rlinf checkpoints, not LeRobot folders")
        report = import_lerobot(args.src, args.out, tokenizer=args.tokenizer, dtype=args.dtype, overrides=overrides)
        what = f"a LeRobot {report.kind}"
    else:
        report = import_openpi(args.src, args.out, fmt=args.kind, tokenizer=args.tokenizer, config=args.config,
                               asset_id=args.asset_id, norm_stats=args.norm_stats, dtype=args.dtype,
                               overrides=overrides)
        what = f"an {report.kind}" if report.kind.startswith(("openpi", "RLinf")) else report.kind
    cfg = report.config
    print(f"imported {what} ({report.parameters / 1e6:.1f}M parameters, {args.dtype}) to {args.out}: "
          f"{cfg.num_cameras} camera slot(s) {list(cfg.camera_names)} at {cfg.vision.image_size}px, state "
          f"{cfg.state_dim}, action {cfg.action_dim}, chunk {cfg.action_horizon}; normalisation state "
          f"{report.normalization['state']}, action {report.normalization['action']}; tokenizer {report.tokenizer}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _serve(args) -> int:
    from vla_rl.interop.serve import ServeConfig, run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServeConfig(host=args.host, port=args.port, token=args.token, max_message_mb=args.max_message_mb,
                      max_connections=args.max_connections, max_memory_mb=args.max_memory_mb,
                      device=args.device, dtype=args.dtype,
                      compile=args.compile)
    try:
        return run_server(args.export, cfg)
    except OSError as e:   # e.g. the port is taken: say which address
        raise ServeError(f"cannot serve on {args.host}:{args.port}: {e}") from e


def _report(args) -> int:
    from vla_rl.eval.report import ReportError, write_report

    # The other commands take out=... as a key=value setting, so report reads out= / names= among its run folders
    # the same way, instead of looking for metrics in a folder named "out=runs/x".
    runs, given = [], {"out": args.out, "names": args.names}
    for arg in args.runs:
        key, sep, value = arg.partition("=")
        if sep and key in given:
            if given[key] is not None:
                raise ReportError(f"{key} is given twice (--{key} and {key}=, or {key}= twice): give it once")
            given[key] = value
        else:
            runs.append(arg)
    names = given["names"].split(",") if given["names"] else None
    path, table = write_report(runs, given["out"] or "runs/report", names=names, overwrite=args.overwrite)
    print(table)
    print(f"figures and report: {path.parent}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run its command, and report any error in one line: a user's or the machine's
    (:data:`USER_ERRORS`) exits 2, a bug 1, Ctrl-C 130; ``--debug`` / ``VLA_RL_DEBUG=1`` raise it instead."""
    args = parse_args(argv)
    before = _stop_once()
    try:
        if args.command in TRAIN_COMMANDS:
            check_train_packages(args.command)
        return args.func(args)
    except (KeyboardInterrupt, Exception) as e:
        if args.debug or os.environ.get("VLA_RL_DEBUG", "") not in ("", "0"):
            raise
        return report_error(e, args)
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)


def _stop_once():
    """Make Ctrl-C stop a command once: the first raises KeyboardInterrupt (the command tidies up: workers closed,
    partial files removed); later ones only say that it is stopping, so they cannot cut the tidy-up short or print
    a traceback from wherever it was (Ctrl-\\ still ends the process at once). Returns the handler to restore
    (None where Python's own handler is not installed, e.g. outside the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def again(signum, frame):
        print("vla-rl: already stopping, tidying up (Ctrl-\\ ends it at once)", file=sys.stderr, flush=True)

    def first(signum, frame):
        signal.signal(signal.SIGINT, again)
        raise KeyboardInterrupt

    return signal.signal(signal.SIGINT, first)


def report_error(e: BaseException, args) -> int:
    """Print the one line for an error that ended a command; its exit status."""
    if isinstance(e, KeyboardInterrupt):
        resume = f" (continue with `vla-rl train --resume {run_dir(args)}`)" if args.command == "train" else ""
        print(f"vla-rl: interrupted{resume}", file=sys.stderr)
        return 130
    kind = error_kind(e)
    if kind is None:
        print(f"vla-rl: internal error: {type(e).__name__}: {one_line(str(e))} (a bug; run again with --debug "
              "or VLA_RL_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    print(f"vla-rl: {kind} error: {one_line(str(e))}{advice(kind, args, e)}", file=sys.stderr)
    return 2


def gigabytes(text: str) -> float:
    """An ``argparse`` type: a finite number of GB > 0 (``nan`` / ``inf`` / ``0`` would plan against no card)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a GPU's memory as a finite number of GB > 0, e.g. 80")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (default: ``sys.argv``) as the command's arguments, overrides after flags included."""
    parser = build_parser()
    # argparse stops collecting positionals at the first flag; overrides after a flag
    # (`vla-rl train preset --no-progress learner.lr_actor=1e-4`) come back as extras and are taken here.
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    args.argv = argv   # the command line as given (recorded by commands that write results)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        if not hasattr(args, "overrides"):   # `compare` takes no key=value overrides
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides.extend(extra)
    # `vla-rl train key=value --resume DIR`: a first positional with '=' is an override, not a config.
    if getattr(args, "config", None) and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def build_parser() -> argparse.ArgumentParser:
    """Every command's arguments; each subcommand's ``func`` runs it."""
    parser = argparse.ArgumentParser(prog="vla-rl", description="RL fine-tuning of flow-matching VLA policies")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="few-shot SFT on the built-in task, then sampling with each method",
                          description="Overrides: key=value, e.g. demos=10 sft.steps=500 model=tiny_pi05")
    demo.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="online RL (PPO with Flow-Noise or Flow-SDE)",
                           description="CONFIG is a preset of configs/experiment or a YAML file; overrides "
                                       "are key.sub=value, e.g. learner.lr_actor=1e-4 sampler.method=sde")
    train.add_argument("config", nargs="?", help="experiment preset or YAML path")
    train.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.add_argument("--plan", action="store_true",
                       help="print the memory plan per GPU (weights, gradients, optimizer, rollout, activations) "
                            "and exit; a config that cannot fit is an error naming settings that would")
    train.add_argument("--gpu-memory", type=gigabytes, metavar="GB",
                       help="with --plan: check against a GPU of this many GB (default: this machine's GPU)")
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint folder with the deterministic ODE sampler",
                        description="Overrides: episodes=200 seed=5 sampler.num_steps=10 execute=4 num_envs=50 "
                                    "sampler.method=noise (--help-config lists them all)")
    ev.add_argument("checkpoint", help="a policy or training checkpoint folder")
    ev.add_argument("--libero", metavar="SUITES", help=argparse.SUPPRESS)   # moved to `vla-rl bench`
    ev.add_argument("overrides", nargs="*", help="key=value overrides")
    ev.set_defaults(func=_eval)

    cmp_ = sub.add_parser("compare", help="paired difference of two policies' evaluations on the same episodes",
                          description="BASE and NEW are `vla-rl eval CKPT out=FILE.json` files (comma-separated "
                                      "to pool several, e.g. the 10k and 20k seed blocks); episodes pair by "
                                      "(reset seed, env index). Prints both rates, the difference with its "
                                      "paired standard error, and an exact sign test.")
    cmp_.add_argument("base", help="evaluation file(s) of the reference policy, e.g. the SFT checkpoint")
    cmp_.add_argument("new", help="evaluation file(s) of the policy to compare, e.g. after RL")
    cmp_.add_argument("--metric", default="success_once",
                      help="success_once (default), success_at_end, return or length")
    cmp_.set_defaults(func=_compare)

    col = sub.add_parser("collect", help="record scripted-expert demos as a LeRobot v3.0 dataset",
                         description="KIND builtin: the scripted expert; overrides episodes=50 seed=0 noise=0.1 "
                                     "env.layout=shuffled env.control=delta ... KIND maniskill: ManiSkill's "
                                     "motion planner, converted to pd_ee_delta_pose; overrides task=PushCube-v1 "
                                     "episodes=100 seed=0 obs_mode=state|rgb image_size=64 max_episode_steps=... "
                                     "KIND libero: LIBERO episodes in the LIBERO layout of the scripted expert "
                                     "(policy=expert: successes only) or a random policy; overrides "
                                     "suite=libero_spatial task_ids=[0] episodes_per_task=2 policy=expert|random "
                                     "init_states=fixed|sampled cameras=[agentview,wrist] image_size=256 "
                                     "state_mode=robot|robot+objects max_episode_steps=...")
    col.add_argument("kind", help="builtin (scripted expert), maniskill (motion planner), libero (scripted expert "
                                  "or random policy)")
    col.add_argument("out", help="dataset folder to write; one that holds anything is refused unless --overwrite "
                                 "(an earlier dataset is then replaced atomically once the new one is complete)")
    col.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    col.add_argument("--no-progress", action="store_true", help="no progress bars")
    col.set_defaults(func=_collect)

    sft = sub.add_parser("sft", help="flow-matching SFT of a policy on a LeRobot dataset (v3.0, v2.x) or ManiSkill .h5",
                         description="Overrides: model=tiny steps=500 out=runs/sft eval_episodes=100 "
                                     "policy.depth=2 norm=quantile ...")
    sft.add_argument("dataset", help="LeRobot dataset folder (v3.0 or v2.0/v2.1; PNG or MP4 camera features, "
                                     "or none) or a ManiSkill trajectory .h5")
    sft.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    sft.add_argument("--no-progress", action="store_true", help="no progress bars")
    sft.set_defaults(func=_sft)

    exp = sub.add_parser("export", help="write a self-contained policy folder for a robot (loads with vla_rl.policies)",
                         description="SRC: a policy folder, a training run (its best checkpoint, else the newest), "
                                     "a checkpoint folder or an imported checkpoint. Overrides set fields of the "
                                     "robot spec, e.g. execute=4 num_steps=10 action_low=null "
                                     "'cameras=[{name: top, height: 224, width: 224}]' (see docs/deploy.md)")
    exp.add_argument("src", help="policy folder, training run or checkpoint")
    exp.add_argument("out", help="folder to write (an earlier export there is replaced with --overwrite)")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="weight dtype (default bf16)")
    exp.add_argument("--format", choices=["vla-rl", "openpi", "lerobot"], default="vla-rl",
                     help="vla-rl: a self-contained folder for vla_rl.policies / vla-rl serve (default); openpi: "
                          "openpi's PyTorch layout (model.safetensors, config.json, assets/<asset_id>/norm_stats.json) "
                          "for openpi's and RLinf's loaders; lerobot: a LeRobot 0.6 policy folder with its processors "
                          "(π0 / π0.5 only, both)")
    exp.add_argument("--asset-id", help="--format openpi: the norm stats' asset id (default: the imported "
                                        "checkpoint's, else vla-rl)")
    exp.add_argument("overrides", nargs="*", help="robot spec overrides key=value")
    exp.set_defaults(func=_export)

    imp = sub.add_parser("import", help="import a π0 / π0.5 / SmolVLA checkpoint (LeRobot, openpi, RLinf) as a vla-rl "
                                        "policy folder",
                         description=(
                             "KIND lerobot: a LeRobot PI0Policy / PI05Policy / SmolVLAPolicy folder (config.json, "
                             "model.safetensors, policy_pre/postprocessor files). KIND openpi: an openpi checkpoint "
                             "folder (JAX: params/ + assets/; PyTorch: model.safetensors + assets/). KIND rlinf: "
                             "RLinf's full_weights.pt (or a folder holding actor/model_state_dict/full_weights.pt). "
                             "Overrides set PolicyConfig fields the weights cannot tell, e.g. vision.num_heads=16, "
                             "action_horizon=10, or the RL heads' noise_std_min=0.08 (see docs/pretrained.md)"))
    imp.add_argument("kind", choices=["lerobot", "openpi", "rlinf"])
    imp.add_argument("src", help="the checkpoint folder (or RLinf's .pt file)")
    imp.add_argument("out", help="policy folder to write")
    imp.add_argument("--tokenizer", help="π0 / π0.5: PaliGemma's SentencePiece tokenizer.model (default: next to SRC, "
                                         "openpi's cache ~/.cache/openpi/big_vision, or the Hugging Face cache of "
                                         "google/paligemma-3b-pt-224). SmolVLA: the "
                                         "folder of SmolVLM2's tokenizer.json and config.json (default: SRC/vlm, "
                                         "vlm_model_name, the Hugging Face cache)")
    imp.add_argument("--config", help="openpi / rlinf: the openpi training config the checkpoint was made with "
                                      "(pi0_base, pi05_base, pi0_libero, pi05_libero, pi0_droid, pi05_droid, "
                                      "pi0_maniskill, pi05_maniskill): chunk length, prompt length, state input. "
                                      "Default: recognised by the norm stats' asset id, else openpi's defaults")
    imp.add_argument("--asset-id", help="openpi / rlinf: which assets/<asset_id>/norm_stats.json, when several exist")
    imp.add_argument("--norm-stats", help="openpi / rlinf: a norm_stats.json (or its folder) to use instead")
    imp.add_argument("--dtype", choices=["fp32", "bf16", "keep"], default="fp32",
                     help="weight dtype of the written policy (default fp32; keep: as in SRC)")
    imp.add_argument("overrides", nargs="*", help="PolicyConfig overrides key.sub=value")
    imp.set_defaults(func=_import)

    srv = sub.add_parser("serve", help="serve an exported policy over openpi's websocket protocol",
                         description="Robots connect with openpi-client's WebsocketClientPolicy. Binds 127.0.0.1 "
                                     "unless --host says otherwise; with a token (--token or $VLA_RL_SERVE_TOKEN) "
                                     "clients must send it as api_key. Stops cleanly on SIGINT / SIGTERM.")
    srv.add_argument("export", help="an exported policy folder (vla-rl export)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    srv.add_argument("--token", default=None,
                     help="shared secret clients must send (visible in ps; prefer $VLA_RL_SERVE_TOKEN)")
    srv.add_argument("--max-message-mb", type=float, default=16.0, help="largest request accepted (default 16)")
    srv.add_argument("--max-connections", type=int, default=8, help="most clients at once (default 8)")
    srv.add_argument("--max-memory-mb", type=float, default=1024.0,
                     help="the most memory messages may take, checked at start against the two limits above "
                          "(default 1024; docs/deploy.md)")
    srv.add_argument("--device", default="cpu", help="cpu or cuda")
    srv.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                     help="compute dtype (auto: bf16 weights run in bf16 on a GPU, fp32 on a CPU)")
    srv.add_argument("--compile", choices=["none", "compile", "cudagraph"], default="none",
                     help="how the denoising loop runs: eagerly (default), torch.compile'd, or as one CUDA graph "
                          "(cudagraph needs --device cuda; docs/speed.md)")
    srv.set_defaults(func=_serve)
    be = sub.add_parser("bench", help="evaluate a policy on a whole benchmark suite (LIBERO, ManiSkill task lists)",
                        description="Suites: libero_spatial, libero_object, libero_goal, libero_10, libero_90, "
                                    "libero_4 (the four the πRL paper averages), maniskill:mp (tasks with motion-"
                                    "planner demos) or maniskill:PickCube-v1,PushCube-v1. Overrides: episodes=50 "
                                    "tasks=[0,3] workers=4 sampler.num_steps=4 execute=8 seed=10000 videos=1 "
                                    "out=runs/bench device=cpu env.image_orientation=rot180 ... An interrupted "
                                    "bench resumes (finished tasks are kept).")
    be.add_argument("checkpoint", nargs="?", help="a policy or training checkpoint folder")
    be.add_argument("overrides", nargs="*", help="key=value overrides")
    be.add_argument("--suite", help="the benchmark suite (see above)")
    be.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"),
                    help="pair two bench folders episode by episode per task instead of running one")
    be.set_defaults(func=_bench)

    rep = sub.add_parser("report", help="learning curves (PNG) and a summary of training runs",
                         description="Reads each RUN_DIR's metrics.jsonl; writes success_vs_steps.png, "
                                     "success_vs_time.png, diagnostics.png and report.md into --out.")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training run folders (vla-rl train out=...)")
    rep.add_argument("--out", help="output folder (default runs/report; out=DIR works too)")
    rep.add_argument("--names", help="comma-separated names for the runs (default: the folder names; names=a,b "
                                      "works too)")
    rep.set_defaults(func=_report)

    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error "
                                                              "(also: VLA_RL_DEBUG=1)")
    for name, p in sub.choices.items():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        if name in CONFIGS:
            p.add_argument("--help-config", action=HelpConfig, command=name,
                           help="list every key=value setting: type, default, valid range, what it does")
        if name in WRITERS:
            p.add_argument("--overwrite", action="store_true",
                           help=f"replace {WRITERS[name]} if it already holds something (refused otherwise)")

    return parser


# The config class of each command's key=value overrides (module, class), imported only when its fields are listed.
CONFIGS = {"demo": ("vla_rl.train.demo", "DemoConfig"), "train": ("vla_rl.train.trainer", "TrainConfig"),
           "eval": ("vla_rl.eval.evaluate", "EvalConfig"), "sft": ("vla_rl.train.sft", "SFTRunConfig"),
           "collect": ("vla_rl.data.collect", "CollectConfig"), "bench": ("vla_rl.eval.bench", "BenchConfig"),
           "import": ("vla_rl.policies.policy_config", "PolicyConfig"),
           "export": ("vla_rl.policies.exported", "ExportSpec")}


class HelpConfig(argparse.Action):
    """``--help-config``: print every key=value setting of the command (key, type, default, range, doc) and exit."""

    def __init__(self, option_strings, dest, command: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.command = command

    def __call__(self, parser, namespace, values, option_string=None):
        module, name = CONFIGS[self.command]
        command = self.command
        if command == "collect":   # `collect libero` records with its own settings
            from vla_rl.envs.registry import LIBERO

            kind = getattr(namespace, "kind", None)
            command = f"collect {kind}" if kind else command
            if kind == LIBERO:
                module, name = "vla_rl.data.libero_demos", "LiberoRecordConfig"
            elif kind is None:
                print(f"(`vla-rl collect {LIBERO} --help-config` lists LIBERO's settings)\n")
        print(f"`vla-rl {command}` settings (key=value overrides; {name}):\n")
        print(config_help(getattr(importlib.import_module(module), name)))
        parser.exit()


# What each writing command writes (``--overwrite`` replaces it; without, an output that holds anything is refused).
# Another kind of data there (a run, a dataset, ...) is never replaced, and an output inside an input is refused
# (vla_rl.core.outputs).
WRITERS = {"demo": "the demo folder (out=)", "train": "the run folder (out=)", "sft": "the policy folder (out=)",
           "collect": "the dataset folder OUT", "eval": "the results file (out=)",
           "import": "the policy folder OUT", "export": "the export folder OUT",
           "bench": "an earlier bench in out= (start over)", "report": "the files in --out"}


def error_kind(e: BaseException) -> str | None:
    """The kind of a user's or the machine's error (``config``, ``checkpoint``, ...), None for a bug."""
    for module, name, kind in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return kind
    if isinstance(e, MissingPackages):
        return "install"
    if isinstance(e, ServeError):
        return "serve"
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return "memory"
    if isinstance(e, OSError):   # a full disk, a missing or unreadable file, no permission
        return "file"
    return None


def one_line(msg: str) -> str:
    """A message in one line: the first line and, for a multi-line one (a worker's traceback), its last."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


def run_dir(args) -> str:
    """The folder of the run ``vla-rl train`` was working on (for advice that names it)."""
    return str(getattr(args, "run_dir", None) or "<run folder>")


def advice(kind: str, args, e: BaseException | None = None) -> str:
    """What a CLI user can do next, where the error's message cannot know it."""
    # A simulator that is not installed: its message says what to install; resuming would not help.
    unavailable = getattr(sys.modules.get("vla_rl.envs.base"), "SimulatorUnavailable", None)
    missing = unavailable is not None and isinstance(e, unavailable)
    if kind == "env" and args.command == "train" and not missing:
        return (f"; the run's checkpoints are intact: continue it with `vla-rl train --resume {run_dir(args)} "
                "env.restart_dead_workers=2`, which also restarts env workers that die")
    if kind == "training":
        return f"; resume from that checkpoint with other settings: `vla-rl train --resume {run_dir(args)} key=value`"
    return ""


if __name__ == "__main__":
    sys.exit(main())
