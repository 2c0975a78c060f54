"""What `jaxpar explain` flags in a compiled step.

The partitioner's warnings, caught while compiling: XLA reports an involuntary full
rematerialisation (a tensor replicated on every device because no cheaper resharding was
found) on the process's stderr, from C++, where Python logging never sees it. We point file
descriptor 2 at a temporary file for the duration of a compile and read back what was
written (`compiler_warnings`). XLA prints them only while it compiles, so JAX's persistent
compilation cache is off meanwhile: an executable loaded from it prints nothing.

Temporaries larger than a layer (`oversized_temporaries`): under ZeRO-3 / FSDP no buffer
needs to hold more than one layer's parameters at a time (gathered in the compute dtype), so
a parameter-shaped temporary larger than that is a whole-model array kept somewhere: a
gradient of every layer held unreduced, parameters gathered outside the layer scan, a
replicated fp32 copy. (ZeRO 0-1 keep their whole gradient by design; it is flagged all the
same.) Activations are left out: a small model's attention probabilities or a large one's
saved layer inputs are that large too, and expected. The layer is the model contract's
`layer_param_count()` (jaxpar.xla_options.layer_params).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from typing import Iterable, Iterator, Sequence

import jax

from jaxpar.inspect.buffers import Buffer, parameter_shaped
from jaxpar.units import byte_size, params

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


@contextlib.contextmanager
def compiler_warnings() -> Iterator[list[str]]:
    """captured_stderr around compiles that really run: JAX's persistent compilation cache
    (a user's jax_compilation_cache_dir, the test suite's) is off inside the block and as it
    was after it. An executable loaded from the cache prints none of the partitioner's
    warnings, so its findings would be lost without a word. (Nor does a jitted function this
    process already compiled for the same inputs, which JAX keeps in memory: inspect a
    freshly built trainer, as `jaxpar explain` and `jaxpar plan` do.)"""
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether to use it: ask again
    try:
        with captured_stderr() as lines:
            yield lines
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


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


OVERSIZED = "temporary larger than a layer"
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def oversized_temporaries(buffers: Sequence[Buffer], layer_params: int, itemsize: int, dtype: str,
                          parameters: Iterable[Sequence[int]], devices: int, platform: str = "",
                          limit: int = 5) -> list[Finding]:
    """One finding per parameter-shaped temporary buffer (jaxpar.inspect.buffers) larger than
    one layer's parameters in the compute dtype (`layer_params` x `itemsize` bytes), largest
    first: the first `limit` distinct ones (by shape and operation), then one line counting
    the rest. `parameters`: the model's parameter shapes (global), `devices`: the mesh's
    size (see `parameter_shaped`). Left out: what the forward pass stacks for the backward
    pass (`saved_for_backward`), activations whatever their shape."""
    layer_bytes = layer_params * itemsize
    if layer_bytes <= 0:
        return []
    shapes = [tuple(p) for p in parameters]
    seen: dict[tuple[str, str, str], Buffer] = {}
    for b in buffers:
        if b.bytes > layer_bytes and not saved_for_backward(b) and parameter_shaped(b.shape, shapes, devices):
            seen.setdefault((b.shape, b.op_name, b.source), b)
    big = list(seen.values())
    layer = f"one layer's parameters ({params(layer_params)} x {itemsize} B = {byte_size(layer_bytes)} in {dtype})"
    upcast = platform == "cpu" and itemsize < 4  # the CPU backend runs 16-bit collectives in f32

    def detail(b: Buffer) -> str:
        note = " (an f32 collective: the cpu backend runs 16-bit ones in f32, a GPU may hold half)" if (
            upcast and b.dtype == "f32" and b.opcode.split(":")[0] in _COLLECTIVES) else ""
        return (f"{b.shape} ({byte_size(b.bytes)}) from {b.opcode} {b.instruction}" + (f" at {b.source}" if b.source else "")
                + f": {b.bytes / layer_bytes:.1f}x {layer}{note}")

    out = [Finding(OVERSIZED, b.op_name, detail(b)) for b in big[:limit]]
    if len(big) > limit:
        rest = big[limit:]
        out.append(Finding(OVERSIZED, "", f"{len(rest)} more, {byte_size(rest[-1].bytes)} to "
                           f"{byte_size(rest[0].bytes)} each, against {layer}"))
    return out


def saved_for_backward(b: Buffer) -> bool:
    """A stack the forward pass builds for the backward pass (a layer scan's saved inputs or
    residuals: a dynamic-update-slice into it, or its zero initialisation, traced under
    `jvp` and not its `transpose`). jaxpar's remat policies never save a gathered parameter
    (jaxpar.nn), so what is saved is activations, whose size the remat policy chooses: a
    [layers, batch, seq, embed] stack has the shape of a stacked [layers, embed/k, heads x
    head_dim] gradient, so the shape alone cannot tell them apart."""
    op = b.op_name
    return "jvp(" in op and "transpose(" not in op and op.rsplit("/", 1)[-1] in ("dynamic_update_slice", "broadcast_in_dim")
