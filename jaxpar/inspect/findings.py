"""The partitioner's warnings, caught while compiling and turned into findings.

XLA reports an involuntary full rematerialisation (a tensor replicated on every device
because no cheaper resharding was found) on the process's stderr, from C++, where Python
logging never sees it. We point file descriptor 2 at a temporary file for the duration of
a compile and read back what was written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from typing import Iterator

_PATTERNS = {
    "involuntary full rematerialization": re.compile(r"Involuntary full rematerialization", re.I),
    "full replication": re.compile(r"fully replicat|will replicate the tensor", re.I),
}
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_FROM_TO = re.compile(r"go from sharding (\{.*?\}) to (\{.*?\}) efficiently")


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # e.g. 'involuntary full rematerialization'
    op: str  # the JAX operation it happened at (op_name metadata), or '' if not given
    detail: str  # source and target shardings, when the message names them

    def __str__(self) -> str:
        where = f" at {self.op}" if self.op else ""
        return f"{self.kind}{where}{': ' + self.detail if self.detail else ''}"


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect what native code writes to fd 2 inside the block (lines, after it ends);
    everything is also passed through to the real stderr afterwards, less our findings."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())
            rest = [line for line in lines if not _classify(line)]
            if rest:
                sys.stderr.write("\n".join(rest) + "\n")


def _classify(line: str) -> str | None:
    for kind, pattern in _PATTERNS.items():
        if pattern.search(line):
            return kind
    return None


def parse_findings(lines: list[str]) -> list[Finding]:
    """One Finding per distinct (kind, op, shardings) the compiler complained about."""
    seen: dict[tuple[str, str, str], Finding] = {}
    for line in lines:
        kind = _classify(line)
        if kind is None:
            continue
        op = _OP_NAME.search(line)
        moved = _FROM_TO.search(line)
        detail = f"{moved.group(1)} -> {moved.group(2)}" if moved else ""
        finding = Finding(kind, op.group(1) if op else "", detail)
        seen.setdefault((finding.kind, finding.op, finding.detail), finding)
    return list(seen.values())
