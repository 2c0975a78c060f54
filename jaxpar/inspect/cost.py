"""A step's time on a GPU, read off the program XLA compiled for it (deviceless is enough).

Each kernel the program launches (a fusion, a library GEMM or attention call, a copy) costs
the larger of its FLOPs over the device's rate and its bytes over the memory's bandwidth,
plus a launch; kernels inside loops count once per trip. What a kernel reads and writes is
what it touches, not its operands' whole buffers: a fusion that dynamic-slices one layer out
of a stacked weight reads that layer, and one that dynamic-update-slices a layer into a
stacked buffer writes that layer in place. Collectives add their bytes over the link's
bandwidth, less the share the scheduler overlapped with compute (jaxpar.inspect.hlo).

The rates are the device's peaks times efficiencies (`GpuCost`): a large GEMM reaches about
80% of the dense peak, fused attention less, streaming kernels about 85% of the HBM's
bandwidth. They are constants of the device, not of a model: docs/performance.md compares
the predictions with measured steps, and benchmarks/results/predictions.json holds
predictions registered before their measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from typing import Any, Sequence

from jaxpar.inspect.buffers import entry_name, running_computations
from jaxpar.inspect.hlo import (ARRAY, BranchShares, callees, closing, done_of, dot_flops, executions, fused_body,
                                fused_outputs, nbytes, parse, split_outside)

# Instructions that launch nothing: views, plumbing, control flow (its bodies are counted),
# and the second half of an async pair (its start is counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id", "reshape",
         "fusion-done", "async-done", "copy-done", "send-done", "recv-done", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "async-update"}
_COLLECTIVE = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
# lax.empty's buffer: the runtime allocates it and XLA emits no kernel (openxla/xla#10638).
_ALLOCATE = 'custom_call_target="AllocateBuffer"'
_SLICES = {"dynamic-slice", "slice", "gather"}


@dataclasses.dataclass(frozen=True)
class GpuCost:
    """What a kernel's time is computed from, per device (defaults: H100 SXM, reference.md)."""

    name: str = "H100 SXM"
    bf16_tflops: float = 989.0  # dense
    fp8_tflops: float = 1979.0
    # float32 operands: XLA's default precision multiplies them as TF32 on Hopper and Ampere
    # (half the bf16 rate; JAX's default matmul precision on GPUs)
    tf32_tflops: float = 494.7
    hbm_gb_per_s: float = 3350.0
    link_gb_per_s: float = 450.0  # NVLink, per direction
    inter_host_gb_per_s: float = 50.0  # one 400 Gb/s NIC per GPU
    gemm_efficiency: float = 0.8
    attention_efficiency: float = 0.5  # cuDNN's fused flash attention, forward
    # and its backward: 0.33 on the H200's profile of the 0.9B step (16.9 ms measured for
    # 11.2 ms at 0.5; the forward measured 4.6 ms for 4.5), profile_step_h200_jax0.11.2.json
    attention_backward_efficiency: float = 0.33
    hbm_efficiency: float = 0.85
    launch_s: float = 3e-6  # per kernel: launch and tail

    @classmethod
    def of(cls, device_kind: str) -> GpuCost | None:
        """The constants for a device kind ("NVIDIA H100 80GB HBM3"), None for one unknown."""
        known = {"H100": cls(), "H200": cls(name="H200", hbm_gb_per_s=4800.0),
                 "A100": cls(name="A100 SXM", bf16_tflops=312.0, fp8_tflops=312.0, tf32_tflops=156.0, hbm_gb_per_s=2039.0,
                             link_gb_per_s=300.0)}
        return next((v for k, v in known.items() if k in device_kind), None)

    def describe(self) -> str:
        return (f"{self.name}: GEMMs at {self.gemm_efficiency:.0%} of {self.bf16_tflops:g} TFLOP/s bf16 "
                f"({self.fp8_tflops:g} fp8, {self.tf32_tflops:g} float32 as TF32), fused attention at "
                f"{self.attention_efficiency:.0%} forward and "
                f"{self.attention_backward_efficiency:.0%} backward, HBM at "
                f"{self.hbm_efficiency:.0%} of {self.hbm_gb_per_s / 1000:g} TB/s, {self.launch_s * 1e6:g} us a kernel")


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # "gemm", "attention", "memory" (by what bounds it), "collective"
    runs: float  # per step
    flops: float  # per run
    bytes: int  # per run
    seconds: float  # per run


@dataclasses.dataclass(frozen=True)
class StepCost:
    kernels: list[Kernel]

    @property
    def seconds(self) -> float:
        return sum(k.seconds * k.runs for k in self.kernels)

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for k in self.kernels:
            out[k.kind] += k.seconds * k.runs
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, n: int = 10) -> list[Kernel]:
        return sorted(self.kernels, key=lambda k: -k.seconds * k.runs)[:n]

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "by_kind": self.by_kind(),
                "flops": sum(k.flops * k.runs for k in self.kernels),
                "bytes": sum(k.bytes * k.runs for k in self.kernels),
                "kernels": sum(k.runs for k in self.kernels if k.kind != "collective"),
                "top": [dataclasses.asdict(k) for k in self.top()]}


def step_cost(hlo_text: str, gpu: GpuCost = GpuCost(), exposed_collective_s: float = 0.0,
              branch_shares: BranchShares | None = None) -> StepCost:
    """The compiled program's kernels (`hlo_text`: `compiled.as_text()`), each timed on
    `gpu`; `exposed_collective_s`: the collectives' time not overlapped (single devices: 0);
    `branch_shares`: how often a device runs each branch of a switch (the pipeline
    executor's ops: jaxpar.inspect.hlo.executions), else every branch counts every time."""
    comps = parse(hlo_text)
    shapes = {ins.name: ins.shape for instrs in comps.values() for ins in instrs}
    runs = executions(comps, branch_shares)
    flops = _flops_per_computation(comps, shapes)
    kernels = []
    for comp in running_computations(comps, entry_name(hlo_text, comps)):
        n = runs.get(comp, (0, True))[0]
        for ins in comps[comp]:
            if _launches_nothing(ins):
                continue
            kernels.append(_kernel(ins, n, comps, shapes, flops, gpu))
    if exposed_collective_s:
        kernels.append(Kernel("collectives (exposed)", "collective", 1, 0.0, 0, exposed_collective_s))
    return StepCost(kernels)


def exposed_collective_seconds(covers: list[Cover]) -> float:
    """Seconds a step waits on collectives: what of each one's transfer no compute the
    scheduler placed between its start and done covers (`collective_covers`)."""
    return sum((c.transfer_s - c.covered_s) * c.collective.trip_count for c in covers)


@dataclasses.dataclass(frozen=True)
class Cover:
    """One collective's transfer, per run, and the share of it compute hides."""

    collective: Any  # jaxpar.inspect.hlo.Collective
    transfer_s: float  # its bytes over the links it crosses
    covered_s: float  # compute scheduled between its start and done, spent while it was the link's to move

    @property
    def share(self) -> float:
        return self.covered_s / self.transfer_s if self.transfer_s else 1.0


def transfer_seconds(c, gpu: GpuCost, host_of: Sequence[int] | None = None) -> float:
    """A collective's bytes per run over NVLink inside a host and the NIC across hosts: an
    all-to-all sends each peer its share, so only the peers on other hosts cost NIC time,
    in parallel with NVLink for the rest; other collectives crossing hosts run at the NIC's
    rate (their ring's slowest hop)."""
    nvlink, nic = gpu.link_gb_per_s * 1e9, gpu.inter_host_gb_per_s * 1e9
    if not c.crosses_hosts:
        return c.link_bytes / nvlink
    if c.kind in ("all-to-all", "ragged-all-to-all") and host_of is not None and c.groups:
        group = max(c.groups, key=len)
        mine = host_of[group[0]]
        away = sum(host_of[p] != mine for p in group) / max(len(group) - 1, 1)
        return max(c.link_bytes * away / nic, c.link_bytes * (1 - away) / nvlink)
    return c.link_bytes / nic


def collective_covers(hlo_text: str, colls, gpu: GpuCost = GpuCost(), host_of: Sequence[int] | None = None
                      ) -> list[Cover]:
    """Each collective's transfer and the compute hiding it, read off the schedule XLA
    compiled: walking each computation in its run order, a kernel's time covers the transfers
    in flight, first started first (the links move one thing at a time), until their done.
    A synchronous collective, or compute outside its window, covers nothing; a done in another
    computation (a transfer pipelined across loop iterations) is credited only the compute
    after its start (a lower bound)."""
    comps = parse(hlo_text)
    shapes = {ins.name: ins.shape for instrs in comps.values() for ins in instrs}
    flops = _flops_per_computation(comps, shapes)
    by_start = {(c.computation, c.name): c for c in colls}
    finishers = {o: ins for instrs in comps.values() for ins in instrs
                 if re.search(r"-(done|update)$", ins.opcode) for o in ins.operands}
    covered: dict[int, float] = {}
    transfer = {id(c): transfer_seconds(c, gpu, host_of) for c in colls}
    for comp, instrs in comps.items():
        waiting: dict[str, Any] = {}  # the name that completes it -> collective, in start order
        left: dict[int, float] = {}
        for ins in instrs:
            c = by_start.get((comp, ins.name))
            if c is not None:
                done = done_of(ins, finishers) if c.is_async else None
                if done is not None:
                    waiting[done.name] = c
                    left[id(c)] = transfer[id(c)]
                continue
            if ins.name in waiting:
                c = waiting.pop(ins.name)
                covered[id(c)] = transfer[id(c)] - left.pop(id(c))
                continue
            if _launches_nothing(ins) or not waiting:
                continue
            spend = _kernel(ins, 1, comps, shapes, flops, gpu).seconds
            for c in waiting.values():
                used = min(spend, left[id(c)])
                left[id(c)] -= used
                spend -= used
                if spend <= 0:
                    break
        for c in waiting.values():
            covered[id(c)] = transfer[id(c)] - left[id(c)]
    return [Cover(c, transfer[id(c)], covered.get(id(c), 0.0)) for c in colls]


def latency_profile(hlo_text: str, colls, gpu: GpuCost = GpuCost(), host_of: Sequence[int] | None = None) -> str:
    """This cost model as XLA's latency profile (a ProfiledInstructionsProto, text): each
    kernel's time and each collective's transfer, by instruction name. Compiled again with
    it (compiler.options=xla_gpu_pgle_profile_file_or_directory_path=FILE), the GPU's
    latency-hiding scheduler knows how long each collective takes and places compute
    beside it accordingly; without, it takes one small constant for every collective
    (benchmarks/expert_overlap.py measures the difference)."""
    comps = parse(hlo_text)
    shapes = {ins.name: ins.shape for instrs in comps.values() for ins in instrs}
    flops = _flops_per_computation(comps, shapes)
    lines = [f'costs {{ name: "{ins.name}" cost_us: {_kernel(ins, 1, comps, shapes, flops, gpu).seconds * 1e6:.3f} }}'
             for instrs in comps.values() for ins in instrs
             if not _launches_nothing(ins)]
    lines += [f'costs {{ name: "{c.name}" cost_us: {transfer_seconds(c, gpu, host_of) * 1e6:.3f} }}' for c in colls]
    return "\n".join(lines) + "\n"


def covered_share(covers: list[Cover], kinds: Sequence[str] | None = ("all-to-all", "ragged-all-to-all")) -> dict:
    """{transfer_s, covered_s a step, share} of the collectives of `kinds` (None: all of `covers`)."""
    mine = [c for c in covers if kinds is None or c.collective.kind in kinds]
    total = sum(c.transfer_s * c.collective.trip_count for c in mine)
    hidden = sum(c.covered_s * c.collective.trip_count for c in mine)
    return {"transfer_s": total, "covered_s": hidden, "share": hidden / total if total else None}


def _launches_nothing(ins) -> bool:
    """No kernel of its own: plumbing, a collective (timed apart), an uninitialised buffer."""
    return (ins.opcode in _FREE or ins.opcode.startswith(_COLLECTIVE)
            or (ins.opcode == "custom-call" and _ALLOCATE in ins.attrs))


def _kernel(ins, runs: float, comps, shapes, flops: dict[str, float], gpu: GpuCost) -> Kernel:
    attention = _ATTENTION.search(ins.attrs) if ins.opcode == "custom-call" else None
    if attention:
        work, kind = _attention_flops(ins, shapes, attention.group(1)), "attention"
        backward = "Backward" in attention.group(1)
        rate = gpu.bf16_tflops * 1e12 * (gpu.attention_backward_efficiency if backward else gpu.attention_efficiency)
    else:
        work = _gemm_flops(ins, shapes) if _cublas(ins) else 0.0
        work += sum(flops.get(c, 0.0) for role, c in callees(ins) if role == "calls")
        if ins.opcode == "dot":
            work += dot_flops(ins, shapes)
        kind = "gemm" if work else "memory"
        operand = _operand_dtype(ins, comps, shapes) if work else ""
        peak = gpu.fp8_tflops if operand == "f8" else gpu.tf32_tflops if operand == "f32" else gpu.bf16_tflops
        rate = peak * 1e12 * gpu.gemm_efficiency
    moved = _bytes(ins, comps, shapes)
    compute_s, memory_s = work / rate if work else 0.0, moved / (gpu.hbm_gb_per_s * 1e9 * gpu.hbm_efficiency)
    if kind == "gemm" and memory_s > compute_s:
        kind = "memory"
    return Kernel(ins.name, kind, runs, work, moved, max(compute_s, memory_s) + gpu.launch_s)


def _flops_per_computation(comps, shapes) -> dict[str, float]:
    """Computation -> the dot FLOPs it runs, nested fusions (a Triton GEMM's) included, and the
    cuBLAS calls inside a custom fusion (XLA's dynamic-slice fusion, whose GEMM reads a layer
    out of a stacked buffer in place)."""
    memo: dict[str, float] = {}

    def own(i) -> float:
        if i.opcode == "dot":
            return dot_flops(i, shapes)
        return _gemm_flops(i, shapes) if _cublas(i) else 0.0

    def total(comp: str) -> float:
        if comp not in memo:
            memo[comp] = 0.0
            memo[comp] = sum(map(own, comps.get(comp, []))) + sum(
                total(c) for i in comps.get(comp, []) for role, c in callees(i) if role == "calls")
        return memo[comp]

    return {c: total(c) for c in comps}


def _dims(shape: str) -> list[int]:
    m = ARRAY.search(shape)
    return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d] if m else []


def _gemm_flops(ins, shapes) -> float:
    """A cuBLAS call: 2 x its result's elements x the contracted size (its backend config's
    dot dimensions)."""
    contracting = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
    lhs = _dims(shapes.get(ins.operands[0], ""))
    if not contracting or not lhs:
        return 0.0
    k = math.prod(lhs[int(d.strip().strip('"'))] for d in contracting.group(1).split(",") if d.strip())
    result = ARRAY.search(ins.shape)  # a tuple (result, workspace): the first array
    return 2.0 * math.prod(_dims(result.group(0))) * k if result else 0.0


def _attention_flops(ins, shapes, variant: str) -> float:
    """cuDNN's fused attention: Q [b, s, h, d] and K [b, t, h_kv, d] multiply into [b, h, s, t]
    scores and back (4 b h s t d FLOPs forward, 2.5x that backward: dQ, dK, dV, dP and the
    recomputed scores), halved under a causal mask."""
    q, k = (_dims(shapes.get(o, "")) for o in ins.operands[:2])
    if len(q) != 4 or len(k) != 4:
        return 0.0
    b, s, h, d = q
    forward = 4.0 * b * h * s * k[1] * d
    config = re.search(r'"mask_type"\s*:\s*"(\w+)"', ins.attrs)
    causal = bool(config) and "CAUSAL" in config.group(1)
    return forward * (2.5 if "Backward" in variant else 1.0) * (0.5 if causal else 1.0)


def _operand_dtype(ins, comps, shapes) -> str:
    """What a GEMM multiplies: "f8" where an operand is an 8-bit float (an FP8 GEMM), "f32"
    where both are float32 (TF32), else "bf16"; read off the dots (or cuBLAS calls) the
    kernel runs, however deeply nested, or the call's own operands."""
    inside = _gemms_inside(ins, comps)
    kinds = {shapes.get(o, "").split("[")[0] for i in (inside or [ins]) for o in i.operands[:2]}
    if any(k.startswith("f8") for k in kinds):
        return "f8"
    return "f32" if kinds == {"f32"} else "bf16"


def _cublas(ins) -> bool:
    """Whether an instruction is a cuBLAS GEMM call."""
    return ins.opcode == "custom-call" and bool(_GEMM.search(ins.attrs))


def _gemms_inside(ins, comps, seen: frozenset = frozenset()) -> list:
    """The dots and cuBLAS calls of the computations `ins` calls, through nested calls."""
    out = []
    for _, c in callees(ins):
        for i in comps.get(c, []) if c not in seen else []:
            if i.opcode == "dot" or _cublas(i):
                out.append(i)
            out += _gemms_inside(i, comps, seen | {c})
    return out


def _bytes(ins, comps, shapes) -> int:
    """Bytes the kernel reads and writes (module docstring)."""
    result = ins.shape
    if ins.opcode.endswith("-start"):  # ((operands...), result, context): the result is element 1
        parts = _tuple_parts(ins.shape)
        result = parts[1] if len(parts) > 1 else ""
    if ins.opcode == "dynamic-slice" or ins.opcode == "slice":
        return 2 * nbytes(result)
    if ins.opcode == "dynamic-update-slice":
        return 2 * nbytes(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else 0
    body = fused_body(ins, comps)
    if not body:
        return nbytes(result) + sum(nbytes(shapes.get(o, "")) for o in ins.operands)
    params = {int(i.operands[0]): i for i in body if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()}
    users = defaultdict(list)
    for i in body:
        for j, o in enumerate(i.operands):
            users[o].append((i, j))
    updated, written = _in_place(body)
    read = 0
    for index, operand in enumerate(ins.operands):
        param = params.get(index)
        if param is None or param.name in updated:
            continue
        sliced = _sliced_bytes(param.name, users)
        read += nbytes(shapes.get(operand, "")) if sliced is None else sliced
    return read + written


def _sliced_bytes(name: str, users) -> int | None:
    """The bytes a fusion reads of a value only slices of which it uses (through bitcasts:
    views, as a stacked layer in another layout), or None if it uses the value whole."""
    uses = users.get(name, [])
    if not uses:
        return None
    read = 0
    for use, operand in uses:
        inner = _sliced_bytes(use.name, users) if use.opcode == "bitcast" else None
        if inner is not None:
            read += inner
        elif use.opcode in _SLICES and operand == 0:
            read += nbytes(use.shape)
        else:
            return None
    return read


def _in_place(body: list) -> tuple[set[str], int]:
    """(parameters the fusion updates in place, bytes it writes): a root, or root tuple
    element, that dynamic-update-slices into a parameter (or a bitcast of one: a view, as
    a scanned layer's stacked residual in another layout) writes only its update."""
    by_name = {i.name: i for i in body}
    updated, written = set(), 0
    for out in fused_outputs(body):
        if out is None:
            continue
        while out.opcode == "bitcast" and out.operands and out.operands[0] in by_name:
            out = by_name[out.operands[0]]
        target = by_name.get(out.operands[0]) if out.opcode == "dynamic-update-slice" and out.operands else None
        while target is not None and target.opcode == "bitcast" and target.operands:
            target = by_name.get(target.operands[0])
        if target is not None and target.opcode == "parameter":
            updated.add(target.name)
            written += nbytes(by_name[out.operands[1]].shape) if out.operands[1] in by_name else 0
        else:
            written += nbytes(out.shape)
    return updated, written


def _tuple_parts(shape: str) -> list[str]:
    if not shape.startswith("("):
        return [shape]
    return [p.strip() for p in split_outside(shape[1:closing(shape, 0) - 1])]


def describe(cost: StepCost) -> str:
    """A few lines: the total, each kind's share, the costliest kernels."""
    total = cost.seconds
    lines = [f"predicted step {total * 1e3:.1f} ms: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in cost.by_kind().items())]
    for k in cost.top(5):
        lines.append(f"  {k.name}: {k.kind}, {k.runs:g} x {k.seconds * 1e6:.0f} us "
                     f"({k.flops / 1e9:.1f} GFLOP, {k.bytes / 2**20:.1f} MiB)")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jaxpar.inspect.cost FILE.hlo: the cost of a dumped program
    import sys

    cost = step_cost(open(sys.argv[1]).read())
    print(describe(cost))
    print(json.dumps(cost.by_kind()))
