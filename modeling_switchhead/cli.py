"""The `switchhead` command line: one entry point, one subcommand per job.

Each subpackage that adds a subcommand exposes `register(subparsers)` in its `cli` module; the subcommand's
handler returns an exit code. Bad input ends with a non-zero exit and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# subcommand providers, imported lazily so that `switchhead --help` works whatever extras are installed
PROVIDERS = ("switchhead.training.cli", "switchhead.evaluation.cli", "switchhead.conversion.cli",
             "switchhead.generate_cli")
PROVIDERS += ("switchhead.training.finetune_cli",)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def parse_field_assignments(items: list[str]) -> dict:
    """`--set FIELD=VALUE` options -> {field: value}; values are JSON (numbers, booleans) or bare strings."""
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value  # a bare string such as --set position_encoding=xl
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchhead", description="SwitchHead / SwitchAll models: train, "
                                     "evaluate, convert, generate, count MACs and publish.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in PROVIDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name and name.startswith(error.name):  # that part of the package is not there
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (UsageError, FileNotFoundError, ValueError) as error:
        print(f"switchhead {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"switchhead {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
