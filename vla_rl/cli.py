"""``vla-rl`` command line: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import sys

from vla_rl.config import ConfigError, from_dict, parse_overrides


def _demo(args) -> int:
    from vla_rl.demo import DemoConfig, run_demo

    cfg = from_dict(DemoConfig, parse_overrides(args.overrides))
    run_demo(cfg, progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vla-rl", description="RL fine-tuning of flow-matching VLA policies")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="few-shot SFT on the built-in task, then sampling with each method",
                          description="Overrides: key=value, e.g. demos=10 sft.steps=500 model=tiny_pi05")
    demo.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"vla-rl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
