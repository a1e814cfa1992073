"""`packtrain` command line: one subcommand per job. User errors print one message and exit 2, no traceback."""

from __future__ import annotations

import argparse
import sys


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable); the value is parsed as YAML")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packtrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan packs for a config's training data and print the statistics")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            from packtrain.commands.plan import run_plan

            return run_plan(args)
    except ValueError as e:  # user errors: config, data, CLI arguments
        print(f"packtrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
