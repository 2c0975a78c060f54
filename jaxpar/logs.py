"""Reading what a process printed before it died: the C++ (absl) log lines of XLA and its
runtime, and the one line that says why. Used where jaxpar runs processes it may lose
(`jaxpar launch`, `jaxpar plan`'s compiles) and by benchmarks/matrix.py."""

from __future__ import annotations

import re

ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ \S+:\d+\] (.*)")  # a C++ log message's first line: level, text
CRASH_NOISE = re.compile(r"^(\*\*\* Check failure stack trace|@ +0x|Fatal Python error|Current thread|Thread 0x|"
                         r"File \"|Extension modules:|<no Python frame>|Traceback \(most recent call last\))")


def last_words(output: str) -> str:
    """The line that says why a process died: the last C++ fatal error's message, else the
    last line that is not a stack frame or a crash banner."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    fatal = [m.group(2) for m in map(ABSL.match, lines) if m and m.group(1) == "F"]
    said = fatal[-1] if fatal else next((line for line in reversed(lines) if not CRASH_NOISE.match(line)), "")
    return said if len(said) <= 300 else said[:297] + "..."
