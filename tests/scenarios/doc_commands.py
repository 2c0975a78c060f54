"""The `jaxpar` commands the README and docs/*.md show, so drift between the docs and the
command line is caught:

  python tests/scenarios/doc_commands.py            # check every one without running it (seconds)
  python tests/scenarios/doc_commands.py --run      # run them, in the order the docs give (long)

A check parses the command as `jaxpar` would and, for `train`, `explain` and `plan` on a
recipe, builds its config with the overrides and runs the config checks
(`jaxpar.checks.validate`, 8 devices) without compiling: an unknown flag, recipe, key or
value, or a layout the checks refuse, fails it. tests/scenarios/test_doc_commands.py checks
them all in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/models/ too
ENTRY = ".venv/bin/jaxpar"
# what a check cannot know: paths earlier commands of the same page create
MADE_BY_EARLIER_COMMANDS = re.compile(r"runs/")


@dataclasses.dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: list[str]  # after `jaxpar`

    def where(self) -> str:
        return f"{self.page}:{self.line}: jaxpar {shlex.join(self.argv)}"


def commands(pages=PAGES) -> list[Command]:
    """Every `.venv/bin/jaxpar ...` command in the pages' ```bash blocks (continued lines
    joined, comments dropped, `a && b` split)."""
    out = []
    for page in pages:
        in_block, pending, start = False, "", 0
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                in_block, pending = line.strip() == "```bash" and not in_block, ""
                continue
            if not in_block:
                continue
            if not pending:
                start = number
            pending += line.rstrip("\\").strip() + " "
            if line.rstrip().endswith("\\"):
                continue
            out += [Command(page.name, start, words[1:]) for words in _parts(pending) if words and words[0] == ENTRY]
            pending = ""
    return out


def _parts(text: str) -> list[list[str]]:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return []
    parts, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            parts.append(current)
            current = []
        elif word.startswith((">", "<", "2>")):
            break  # a redirection: the rest is its target
        else:
            current.append(word)
    return parts + [current]


def check(command: Command) -> str | None:
    """None if the command parses and its config passes the checks, else why not."""
    from jaxpar.commands import parser
    from jaxpar.errors import ConfigError

    if any("$" in word for word in command.argv):
        return None  # shell variables: run it to know
    try:
        args = parser().parse_args(command.argv)
    except SystemExit:
        return "the command line does not parse"
    except ConfigError as e:  # --config FILE
        return None if MADE_BY_EARLIER_COMMANDS.search(str(e)) else str(e)
    recipe = getattr(args, "recipe", None) or (getattr(args, "model", None) if args.command == "plan" else None)
    if args.command not in ("train", "explain", "plan") or recipe is None or recipe.endswith("jsonl"):
        return None
    from jaxpar.checks import validate
    from jaxpar.recipes import resolve_config

    try:
        config = resolve_config(recipe, getattr(args, "overrides", []), getattr(args, "cpu_devices", 8) or 8)
        if args.command != "plan":
            validate(config, getattr(args, "devices", None) or getattr(args, "cpu_devices", 8) or 8)
    except ConfigError as e:
        return None if MADE_BY_EARLIER_COMMANDS.search(str(e)) else str(e)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run each command (from the repository root) instead of checking it")
    args = p.parse_args()
    failed = 0
    for command in commands():
        if args.run:
            done = subprocess.run([str(ROOT / ENTRY), *command.argv], cwd=ROOT, capture_output=True, text=True)
            why = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        else:
            why = check(command)
        failed += why is not None
        print(f"{'FAIL' if why else 'ok  '} {command.where()}" + (f"\n     {why}" if why else ""), flush=True)
    print(f"{failed} of {len(commands())} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
