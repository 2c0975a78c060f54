"""What each memory-bound kernel of a compiled step computes, largest first.

The cost model (jaxpar.inspect.cost) times every kernel; this names the memory-bound ones
(element-wise loop fusions, reductions, copies, slices), which on one GPU are the step's
time beyond its matmuls and attention. Each kernel is labelled by:

- its **phase**, read off the op's name JAX wrote into the program: `forward` (jvp),
  `backward` (transpose), `recompute` (a remat policy's rematted computation), or `step`
  (outside the differentiated function: the optimizer's update, the loss's casts);
- its **source**: the innermost Python function and line that traced it (the program's
  stack frames), e.g. `RMSNorm.__call__ llama.py:210`, `scale_by_adam`;
- its **role** where the source says nothing: `zero fill` (a loop's stacked outputs
  written with zeros before the loop: jax.lax.scan's saved activations and gradient
  accumulators), `stack write` (one layer's value written into such a stack), `stack read`
  (one layer's value read back out of it).

`kernel_rows` sums the kernels of one label; `totals` gives the memory-bound seconds and
bytes the table covers (benchmarks/step_kernels.py prints both, before and after a change).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from jaxpar.inspect.cost import GpuCost, StepCost, step_cost
from jaxpar.inspect.hlo import fused_body, fused_outputs, parse

_FRAME = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Row:
    phase: str
    what: str  # the source function (file:line) or the role
    kernels: int  # distinct kernels of this label
    runs: float  # launches per step
    bytes: float  # per step
    seconds: float  # per step


def sources(hlo_text: str) -> dict[int, str]:
    """Stack frame id -> 'function file:line' of its innermost call (the program's
    FileNames, FunctionNames, FileLocations and StackFrames tables)."""

    def table(name: str) -> list[str]:
        parts = hlo_text.split(f"\n{name}\n", 1)
        return parts[1].split("\n\n", 1)[0].splitlines() if len(parts) == 2 else []

    def numbered(name: str) -> dict[int, str]:
        return {int(line.split()[0]): line.split(None, 1)[1] for line in table(name) if line.strip()}

    files = {k: v.strip('"').rsplit("/", 1)[-1] for k, v in numbered("FileNames").items()}
    funcs = {k: v.strip('"') for k, v in numbered("FunctionNames").items()}
    where = {}
    for k, v in numbered("FileLocations").items():
        m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        if m:
            where[k] = f"{funcs.get(int(m[2]), '?')} {files.get(int(m[1]), '?')}:{m[3]}"
    out = {}
    for k, v in numbered("StackFrames").items():
        m = re.search(r"file_location_id=(\d+)", v)
        if m and int(m[1]) in where:
            out[k] = where[int(m[1])]
    return out


def phase_of(attrs: str) -> str:
    """forward, backward, recompute or step, from the op name JAX gave the instruction."""
    m = _OP_NAME.search(attrs)
    name = m.group(1) if m else ""
    if "rematted_computation" in name:
        return "recompute"
    if "transpose(" in name:
        return "backward"
    if "jvp(" in name:
        return "forward"
    return "step"


def role_of(ins, comps) -> str | None:
    """zero fill, stack write or stack read, from what the kernel's fused body does; None
    for any other kernel (labelled by its source instead)."""
    body = fused_body(ins, comps)
    opcodes = {i.opcode for i in body}
    if body and not ins.operands and opcodes <= {"constant", "broadcast", "copy", "tuple", "bitcast"}:
        return "zero fill"
    outs = fused_outputs(body) if body else []
    if outs and all(o is not None and o.opcode == "dynamic-update-slice" for o in outs):
        return "stack write"
    if outs and all(o is not None and o.opcode in ("dynamic-slice", "bitcast", "copy") for o in outs) and \
            "dynamic-slice" in opcodes and opcodes <= {"parameter", "dynamic-slice", "bitcast", "copy", "tuple",
                                                       "constant", "compare", "select", "add", "subtract"}:
        return "stack read"
    if ins.opcode == "dynamic-update-slice":
        return "stack write"
    if ins.opcode == "dynamic-slice":
        return "stack read"
    return None


def kernel_rows(hlo_text: str, gpu: GpuCost = GpuCost(), cost: StepCost | None = None) -> list[Row]:
    """The memory-bound kernels of a compiled program, summed by (phase, what), costliest
    first; `cost`: its step_cost on `gpu`, where the caller has it already."""
    comps = parse(hlo_text)
    by_name = {i.name: i for instrs in comps.values() for i in instrs}
    frames = sources(hlo_text)
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for k in (cost or step_cost(hlo_text, gpu)).kernels:
        if k.kind != "memory":
            continue
        ins = by_name[k.name]
        role = role_of(ins, comps)
        m = _FRAME.search(ins.attrs)
        source = frames.get(int(m.group(1)), "?") if m else "(no source)"
        groups[(phase_of(ins.attrs), role or source)].append(k)
    rows = [Row(phase, what, len(ks), sum(k.runs for k in ks), sum(k.bytes * k.runs for k in ks),
                sum(k.seconds * k.runs for k in ks)) for (phase, what), ks in groups.items()]
    return sorted(rows, key=lambda r: -r.seconds)


def totals(rows: list[Row]) -> dict:
    """Seconds, bytes and launches per step of the memory-bound kernels, and of the three
    roles a scanned layer stack adds (zero fills, stack writes, stack reads)."""
    stack = [r for r in rows if r.what in ("zero fill", "stack write", "stack read")]
    return {"seconds": sum(r.seconds for r in rows), "bytes": sum(r.bytes for r in rows),
            "launches": sum(r.runs for r in rows),
            "stack_seconds": sum(r.seconds for r in stack), "stack_bytes": sum(r.bytes for r in stack)}


def describe(rows: list[Row], top: int = 25, total: dict | None = None) -> str:
    """The `top` rows as a table, then the totals of all (`total`: `totals` of the rows
    these were cut from, where `rows` is a cut)."""
    lines = [f"{'ms':>7s} {'GB':>7s} {'runs':>5s}  {'phase':9s} what"]
    for r in rows[:top]:
        lines.append(f"{r.seconds * 1e3:7.2f} {r.bytes / 1e9:7.2f} {r.runs:5.0f}  {r.phase:9s} {r.what}")
    t = total or totals(rows)
    lines.append(f"{t['seconds'] * 1e3:7.2f} {t['bytes'] / 1e9:7.2f} {t['launches']:5.0f}  total (scan stacks: "
                 f"{t['stack_seconds'] * 1e3:.2f} ms, {t['stack_bytes'] / 1e9:.2f} GB)")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jaxpar.inspect.kernel_table FILE.hlo
    import sys

    print(describe(kernel_rows(open(sys.argv[1]).read()), top=int(sys.argv[2]) if len(sys.argv) > 2 else 25))
