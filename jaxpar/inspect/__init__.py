"""Seeing what the compiler built: memory, FLOPs and collectives of a compiled step."""

from jaxpar.inspect.findings import Finding, captured_stderr, compiler_warnings, parse_findings
from jaxpar.inspect.hlo import Collective, collectives, summarize
from jaxpar.inspect.report import Memory, StepReport, inspect_step, shard_bytes

__all__ = [
    "Collective",
    "Finding",
    "Memory",
    "StepReport",
    "captured_stderr",
    "collectives",
    "compiler_warnings",
    "inspect_step",
    "parse_findings",
    "shard_bytes",
    "summarize",
]
