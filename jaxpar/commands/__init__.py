"""The command line: `jaxpar COMMAND ...`, one module a command in this package, each with
`add_parser(sub)` (its arguments) and `run(args)` (raising ConfigError for bad input), and
what they share in `common`. RECIPE is a shipped name, a path to a .py file defining
`recipe() -> Config`, or `package.module[:function]` (jaxpar.recipes.load). A new command is a
module here and a line in COMMANDS; library code never imports a command.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from jaxpar.commands import explain, export, launch, plan, plot, recipes, sample, schedule, tokenize, train
from jaxpar.commands.common import one_line_warning, report_error
from jaxpar.errors import ConfigError, TrainingStopped

COMMANDS = {"train": train, "explain": explain, "schedule": schedule, "plan": plan, "launch": launch,
            "recipes": recipes, "sample": sample, "export": export, "tokenize": tokenize, "plot": plot}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="JAX SPMD training on a named mesh.")
    p.add_argument("--version", action="version", version=f"jaxpar {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxpar")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = one_line_warning
    try:
        args = parser().parse_args(argv)  # --config reads its file here
        return COMMANDS[args.command].run(args)
    except (ConfigError, TrainingStopped) as e:
        return report_error(e)


if __name__ == "__main__":
    sys.exit(main())
