"""The largest temporary buffers of a compiled program, read from its HLO text.

XLA's buffer assignment (which values share an allocation, which are temporaries) is not
exposed by jaxlib's Python API; it is only written out by a compile with `xla_dump_to`. So
this reads the scheduled HLO after optimisation (`compiled.as_text()`) instead: every
instruction that XLA materialises gets a buffer of its result shape, per device. Counted as
temporaries: the results of instructions in the entry computation and in the computations
control flow runs (while bodies and conditions, conditional branches, called computations),
less those that define no buffer of their own (parameters, constants, tuples, get-tuple-element,
bitcasts, while and call results, the start of an async pair) and the entry's outputs.
Each element of a tuple-shaped result (a multi-output fusion, a combined all-reduce) is its
own buffer. What this cannot see: buffers XLA shares between values whose lives do not
overlap (so the sum of these is not the compiler's temporary total), and the aliasing of
in-place updates (a dynamic-update-slice into a loop's stacked output is one buffer, listed
once per instruction that writes it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Sequence

from jaxpar.inspect.hlo import ARRAY, callees, closing, nbytes, parse, split_outside

# Opcodes whose result is no buffer of their own (an alias, a view, or another's buffer).
_NO_BUFFER = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
              "after-all", "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id",
              "async-start", "async-update", "copy-start", "send", "recv"}
_RUN_ROLES = {"body", "condition", "true_computation", "false_computation", "branch"}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer an instruction defines, per device."""

    instruction: str  # the HLO instruction (with {i} for a tuple element)
    opcode: str  # its opcode; fusions say their kind of root (`fusion:convert`)
    shape: str  # e.g. f32[16,128,512]
    bytes: int
    op_name: str  # the JAX operation (HLO metadata), '' if none
    source: str  # file:line (function) of the innermost frame that traced it, '' if unknown

    @property
    def dtype(self) -> str:
        return self.shape.split("[", 1)[0]

    def describe(self) -> str:
        made = f"{self.opcode} {self.instruction}"
        if self.op_name:
            made += f" ({self.op_name})"
        return f"{self.shape} from {made}" + (f" at {self.source}" if self.source else "")


def temporaries(hlo_text: str) -> list[Buffer]:
    """Every temporary buffer of the program (see the module docstring), largest first."""
    comps = parse(hlo_text)
    entry = entry_name(hlo_text, comps)
    if entry is None:
        return []
    running = running_computations(comps, entry)
    outputs = _outputs(comps[entry])
    sources = _sources(hlo_text)
    fused_roots = {name: instrs[-1].opcode for name, instrs in comps.items() if instrs}
    out = []
    for comp in running:
        for ins in comps[comp]:
            if ins.opcode in _NO_BUFFER or ins.opcode.endswith("-start") or (comp == entry and ins.name in outputs):
                continue
            opcode = ins.opcode
            if opcode == "fusion":
                callee = next((c for role, c in callees(ins) if role == "calls"), None)
                opcode = f"fusion:{fused_roots.get(callee, '?')}"
            op_name = _OP_NAME.search(ins.attrs)
            frame = _FRAME.search(ins.attrs)
            common = dict(opcode=opcode, op_name=op_name.group(1) if op_name else "",
                          source=sources.get(int(frame.group(1)), "") if frame else "")
            for index, shape in _elements(ins.shape):
                size = nbytes(shape)
                name = ins.name if index is None else f"{ins.name}{{{index}}}"
                if size and not (comp == entry and name in outputs):
                    out.append(Buffer(instruction=name, shape=_plain(shape), bytes=size, **common))
    return sorted(out, key=lambda b: (-b.bytes, b.instruction))


def _outputs(entry: list) -> set[str]:
    """The entry's outputs: the root, or its tuple's operands; an element of a multi-output
    fusion that an output reads through get-tuple-element is named `fusion{i}`."""
    if not entry:
        return set()
    root = entry[-1]
    outputs = set(root.operands) if root.opcode == "tuple" else {root.name}
    for ins in entry:
        index = re.search(r"index=(\d+)", ins.attrs)
        if ins.opcode == "get-tuple-element" and ins.name in outputs and index:
            outputs.add(f"{ins.operands[0]}{{{index.group(1)}}}")
    return outputs


def entry_name(text: str, comps: dict) -> str | None:
    m = re.search(r"^\s*ENTRY\s+%?([\w.\-]+)", text, re.M)
    return m.group(1) if m and m.group(1) in comps else None


def running_computations(comps: dict, entry: str) -> list[str]:
    """The entry and every computation control flow runs from it (not fusions' or
    reductions' bodies, which define no buffers of their own)."""
    seen, todo = [entry], [entry]
    while todo:
        for ins in comps.get(todo.pop(), []):
            for role, callee in callees(ins):
                run = role in _RUN_ROLES or (role == "to_apply" and ins.opcode == "call")
                if run and callee in comps and callee not in seen:
                    seen.append(callee)
                    todo.append(callee)
    return seen


def _elements(shape: str) -> list[tuple[int | None, str]]:
    """[(None, shape)] for an array, [(i, element)] for each array of a (flat) tuple."""
    if not shape.startswith("("):
        return [(None, shape)]
    inner = re.sub(r"/\*.*?\*/", "", shape[1:closing(shape, 0) - 1])
    return [(i, part.strip()) for i, part in enumerate(split_outside(inner)) if ARRAY.match(part.strip())]


def _plain(shape: str) -> str:
    """f32[4,256]{1,0} -> f32[4,256] (the layout is not the reader's business)."""
    m = ARRAY.match(shape)
    return f"{m.group(1)}[{m.group(2)}]" if m else shape


def _sources(text: str) -> dict[int, str]:
    """stack_frame_id -> 'file:line (function)' of that frame, from the module's tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(head, {})
            continue
        m = re.match(r"^(\d+)\s+(.*)$", head) if current is not None else None
        if not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locations = tables.get("FileLocations", {})
    out = {}
    for frame, text_ in tables.get("StackFrames", {}).items():
        where = re.search(r"file_location_id=(\d+)", text_)
        location = locations.get(int(where.group(1)), "") if where else ""
        ids = dict(re.findall(r"(\w+)=(\d+)", location))
        if "file_name_id" not in ids:
            continue
        path = files.get(int(ids["file_name_id"]), "").strip('"')
        function = functions.get(int(ids.get("function_name_id", 0)), "").strip('"')
        short = "/".join(path.split("/")[-2:])
        out[frame] = f"{short}:{ids.get('line', '?')}" + (f" ({function})" if function else "")
    return out


def parameter_shaped(shape: str, parameters: Iterable[Sequence[int]], devices: int) -> bool:
    """Whether an HLO array `shape` looks like (part of) one of `parameters` (global shapes):
    each of its dimensions above 1 stands for a distinct run of adjacent parameter
    dimensions, in order, whole or split over a divisor of `devices` (so a shard, a layer's
    slice, a gathered copy, a gradient stacked over layers or replicas, a bitcast that
    merged dimensions). Activations carry batch and sequence dimensions no parameter has."""
    m = ARRAY.match(shape)
    if not m:
        return False
    dims = [int(d.lstrip("<=")) for d in m.group(2).split(",") if d]
    dims = [d for d in dims if d > 1]
    return bool(dims) and any(_fits(dims, [g for g in p if g > 1], devices) for p in parameters)


def _fits(dims: list[int], param: list[int], devices: int) -> bool:
    """`dims` match disjoint runs of `param`'s dimensions in order (runs between them may be
    left out: sliced away or sharded to 1)."""
    if not dims:
        return True
    for start in range(len(param)):
        for end in range(start + 1, len(param) + 1):
            whole = math.prod(param[start:end])
            if whole % dims[0] == 0 and devices % (whole // dims[0]) == 0 and _fits(dims[1:], param[end:], devices):
                return True
    return False
