"""The command line: `jaxpar COMMAND ...`, one module a command in this package, each with
`add_parser(sub)` (its arguments) and `run(args)` (raising ConfigError for bad input), and
what they share in `common`. RECIPE is a shipped name, a path to a .py file defining
`recipe() -> Config`, or `package.module[:function]` (jaxpar.recipes.load). A new command is a
module here and a line in COMMANDS; library code never imports a command.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

from jaxpar.commands import explain, export, launch, plan, plot, recipes, sample, schedule, tokenize, train
from jaxpar.commands.common import one_line_warning, report_error
from jaxpar.errors import ConfigError, TrainingStopped
from jaxpar.device_memory import share_gpu_memory

COMMANDS = {"train": train, "explain": explain, "schedule": schedule, "plan": plan, "launch": launch,
            "recipes": recipes, "sample": sample, "export": export, "tokenize": tokenize, "plot": plot}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="JAX SPMD training on a named mesh.")
    p.add_argument("--version", action=_Version, help="print jaxpar's, jax's and jaxlib's versions (and the "
                   "checkout's commit) and exit")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return p


class _Version(argparse.Action):
    """--version, worked out only when asked for (no JAX import, no git process)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """'jaxpar 0.1.0 (commit d6d65bf1b84d) | jax 0.12.0.1 | jaxlib 0.12.0.1 | Python 3.12.3'."""
    import platform

    commit = checkout_commit(pathlib.Path(__file__).resolve().parents[2])
    jaxpar = _installed("jaxpar") + (f" (commit {commit[:12]})" if commit else "")
    return f"jaxpar {jaxpar} | jax {_installed('jax')} | jaxlib {_installed('jaxlib')} | Python {platform.python_version()}"


def _installed(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:  # jaxpar run from a source tree that was never installed
        return "(not installed)"


def checkout_commit(root: pathlib.Path) -> str | None:
    """The commit a git checkout at `root` has out (its HEAD, read from the files under
    .git, a worktree's too), or None where `root` is no checkout (an installed package)."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: PATH"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head  # a detached HEAD is the commit itself
        ref = head.split(":", 1)[1].strip()
        common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").is_file() else git
        for folder in dict.fromkeys((git, common)):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip()
            if (folder / "packed-refs").is_file():
                for line in (folder / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


def check_set_values(argv: list[str]) -> None:
    """`--set mesh.tensor 4` would reach argparse as a stray "4" ("unrecognized arguments"):
    say what --set takes instead."""
    for flag, value, after in zip(argv, argv[1:], [*argv[2:], None]):
        if flag == "--set" and "=" not in value:
            fix = f"--set {value}={after}" if after is not None and not after.startswith("-") else f"--set {value}=VALUE"
            raise ConfigError(f"--set {value}: an override is KEY=VALUE in one word; write {fix}")


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = one_line_warning
    try:
        check_set_values(sys.argv[1:] if argv is None else argv)
        args = parser().parse_args(argv)  # --config reads its file here
        share_gpu_memory()  # before any command starts JAX's backends
        return COMMANDS[args.command].run(args)
    except (ConfigError, TrainingStopped) as e:
        return report_error(e)


if __name__ == "__main__":
    sys.exit(main())
