"""What collectives a compiled program runs, over which mesh axes, and how many bytes per step.

Input is `jax.jit(f).lower(...).compile().as_text()`: scheduled HLO after SPMD partitioning,
so every collective the program will really execute is there, with its per-device shapes.
Replica-group ids are partition ids, and partition p runs on `mesh.devices.flat[p]` (jit's
device assignment is the mesh in flat order; checked in tests/unit/test_hlo.py), so a group's mesh
axes are read off `np.unravel_index(p, mesh.devices.shape)`.

Group syntaxes understood: explicit lists `{{0,1},{2,3}}`, `{}` (all partitions), iota
`[2,4]<=[4,2]T(1,0)`, and the mesh form jaxlib 0.12 prints by default,
`mesh['a'=2,'b'=4] {'b'}`, with sub-axes `'x':(pre)size` and an optional `device_ids=(...)`.
The mesh form is expanded to ids rather than trusted by name: its axis names are sometimes
XLA's own (`'axis_0'`). Bytes use the ring model, per device, from the result shape alone
(operands are printed by name only): all-gather V = result, reduce-scatter V = n * result,
others V = result. On CPU, a reduce-scatter made by the partitioner stays an all-reduce plus a
dynamic-slice, and bf16 all-reduces and all-gathers run in f32: CPU numbers overstate GPU traffic.

Async forms (`all-gather-start`/`-done`, `all-reduce-start`, `collective-permute-start`,
sugared `reduce-scatter-start`, and `async-start ... calls=%wrapped` around a collective) are
counted once, at the start. The GPU-only async path was exercised on hand-written HLO text in
real XLA syntax only: no GPU was available when this was written.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

# A conditional's branch count (the pipeline executor's switch), or the named scope it was traced
# under (jaxpar.nn.KIND_SCOPE: a layer's switch over its kinds) -> the share of its runs per branch.
BranchShares = Mapping[int | str, Sequence[float]]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast", "ragged-all-to-all")

# Scheduled between a start and its done, these do no work worth hiding a transfer behind.
_TRIVIAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
            "copy-done", "partition-id", "replica-id", "after-all", "opt-barrier",
            "add-dependency", "domain", "send", "recv", "send-done", "recv-done", *KINDS}

_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?=\(|[a-z][a-z0-9]*\[)(.*)$")
ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLEE = re.compile(r"(?:^|[\s,])(body|condition|to_apply|calls|true_computation|"
                     r"false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?"
                          r"\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclasses.dataclass(frozen=True)
class _Instr:
    """One HLO instruction: enough of it to find collectives and walk the call graph."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str


@dataclasses.dataclass(frozen=True)
class Collective:
    """One logical collective of the compiled program, with its cost per device."""

    kind: str
    name: str  # the instruction that runs it (the *-start / async-start one when async)
    computation: str
    dtype: str  # the element type holding most of the result's bytes (combined collectives mix)
    buffer_bytes: int  # per device: all-gather result, reduce-scatter operand, else result
    group_size: int  # devices per group; collective-permute: largest connected set of pairs
    groups: tuple[tuple[int, ...], ...]  # partition ids; collective-permute: the pairs' sets
    axes: tuple[str, ...]  # mesh axes whose coordinate varies inside a group, mesh order
    trip_count: float  # executions per step of the enclosing computation (loop trip products; averaged
    # over devices inside the pipeline's switch)
    trip_count_known: bool  # False if some enclosing while loop had no known trip count
    link_bytes: int  # bytes each device sends per execution (ring model)
    is_async: bool
    overlapped: bool  # async with real compute scheduled between start and done
    crosses_hosts: bool | None  # some group spans hosts; None when no host map was given
    lowered_as: str = ""  # set when the backend ran this as something else (see _split_scatter)
    op_name: str = ""  # the JAX name stack it was traced under (metadata op_name; jax.named_scope shows here)

    @property
    def bytes_per_step(self) -> int:
        return self.link_bytes * self.trip_count


def collectives(
    hlo_text: str, mesh: Mesh, host_of: Sequence[int] | None = None, branch_shares: BranchShares | None = None
) -> list[Collective]:
    """Every collective in `hlo_text`, in computation and schedule order.

    `host_of[p]` is the host of partition p; give it to learn which collectives cross hosts.
    `branch_shares`: see `executions`.
    """
    comps = parse(hlo_text)
    header = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(header.group(1)) if header else mesh.devices.size
    wrapped = {c for ins in _all(comps) if ins.opcode.startswith("async-")
               for _, c in callees(ins)}
    execs = executions(comps, branch_shares)
    users = _users(comps)
    finishers = {o: ins for ins in _all(comps) if re.search(r"-(done|update)$", ins.opcode)
                 for o in ins.operands}
    out = []
    for comp, instrs in comps.items():
        if comp in wrapped or comp not in execs:
            continue
        for i, ins in enumerate(instrs):
            if (found := _collective_at(ins, comps)) is None:
                continue
            kind, spec, is_async = found
            done = done_of(ins, finishers) if is_async else None
            result = (done or spec).shape  # a start's own shape also holds its operands
            groups = _groups(kind, spec.attrs, num_devices)
            n = max(map(len, groups), default=1)
            v = nbytes(result) * (n if kind == "reduce-scatter" else 1)
            runs, known = execs[comp]
            common = dict(
                name=ins.name, computation=comp, dtype=_main_dtype(result), group_size=n, groups=groups,
                axes=_axes(groups, mesh), trip_count=runs, trip_count_known=known, is_async=is_async,
                overlapped=is_async and _overlapped(instrs, i, done),
                crosses_hosts=None if host_of is None else any(len({host_of[p] for p in g}) > 1 for g in groups),
                op_name=_op_name(spec.attrs))
            scattered = _scattered_bytes(ins, comps, users, n) if kind == "all-reduce" and not is_async else 0
            if scattered:
                out.append(Collective(kind="reduce-scatter", buffer_bytes=scattered, lowered_as="all-reduce + dynamic-slice",
                                      link_bytes=_link_bytes("reduce-scatter", scattered, n), **common))
            if v - scattered:
                out.append(Collective(kind=kind, buffer_bytes=v - scattered,
                                      link_bytes=_link_bytes(kind, v - scattered, n), **common))
    return out


# A partitioner-made reduce-scatter is an all-reduce whose result each device only slices
# its 1/n of. XLA's GPU pipeline rewrites that into a reduce-scatter (ReduceScatterCreator);
# the CPU pipeline leaves it, so we recognise it and count the reduce-scatter the GPU runs.
_SAME_SIZE = {"convert", "bitcast", "copy", "transpose", "reshape", "get-tuple-element"}


def _users(comps: dict[str, list[_Instr]]) -> dict[str, list[tuple[_Instr, int]]]:
    out: dict[str, list[tuple[_Instr, int]]] = defaultdict(list)
    for ins in _all(comps):
        for j, operand in enumerate(ins.operands):
            out[operand].append((ins, j))
    return out


def _scattered_bytes(ins: _Instr, comps, users, n: int) -> int:
    """Bytes of the all-reduce's result (tuple elements counted apart) that every user only
    slices to 1/n of: reduce-scatter work done as all-reduce plus dynamic-slice."""
    arrays = ARRAY.findall(ins.shape)
    if n <= 1 or not arrays:
        return 0
    if not ins.shape.startswith("("):
        return nbytes(ins.shape) if _only_sliced(ins.name, _elements(ins.shape), comps, users, n, 0) else 0
    total = 0
    for gte, _ in users.get(ins.name, []):
        index = re.search(r"index=(\d+)", gte.attrs)
        if gte.opcode == "get-tuple-element" and index and _only_sliced(gte.name, _elements(gte.shape), comps, users, n, 0):
            total += nbytes(gte.shape)
    return total


def _only_sliced(name: str, elements: int, comps, users, n: int, depth: int, exit_: tuple = ()) -> bool:
    """Every path from `name` ends in a dynamic-slice of elements/n, through size-keeping ops
    and across fusion boundaries. `exit_` is (root of the fused computation we are in, the
    fusion): reaching that root whole means the fusion's output carries the value on."""
    if depth > 12:
        return False
    if exit_ and name == exit_[0]:
        return _only_sliced(exit_[1].name, elements, comps, users, n, depth + 1, exit_[2])
    uses = users.get(name, [])
    if not uses:
        return False
    for user, j in uses:
        if user.opcode == "dynamic-slice":
            ok = j == 0 and _elements(user.shape) * n == elements
        elif user.opcode in _SAME_SIZE:
            ok = _only_sliced(user.name, elements, comps, users, n, depth + 1, exit_)
        elif user.opcode == "fusion":
            callee = next((c for role, c in callees(user) if role == "calls"), None)
            body = comps.get(callee, [])
            param = next((i for i in body if i.opcode == "parameter" and i.operands == (str(j),)), None)
            ok = param is not None and bool(body) and _only_sliced(
                param.name, elements, comps, users, n, depth + 1, (body[-1].name, user, exit_))
        else:
            ok = False
        if not ok:
            return False
    return True


def _elements(shape: str) -> int:
    return sum(math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d) for _, dims in ARRAY.findall(shape))


def dot_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    """A `dot`'s FLOPs: 2 x its result's elements x the contracted size (0 if unreadable).
    `shapes`: instruction name -> its shape text."""
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    lhs = ARRAY.search(shapes.get(ins.operands[0], "")) if ins.operands else None
    if not dims or not lhs:
        return 0.0
    lhs_dims = [int(d.lstrip("<=")) for d in lhs.group(2).split(",") if d]
    contracted = math.prod(lhs_dims[int(k)] for k in dims.group(1).split(",") if k)
    return 2.0 * _elements(ins.shape) * contracted


def matmul_flops(hlo_text: str, branch_shares: BranchShares | None = None) -> tuple[float, bool]:
    """FLOPs of every dot in the program, 2 x result elements x contracted size, times how
    often its computation runs per step (XLA's cost analysis counts a loop body once).
    Returns (flops, all trip counts known). `branch_shares`: see `executions`."""
    return matmul_flops_each(hlo_text, [branch_shares])[0]


def matmul_flops_each(hlo_text: str, shares_each: Sequence[BranchShares | None]) -> list[tuple[float, bool]]:
    """`matmul_flops` under each of several branch shares (a pipeline's average device and
    each stage's), the program parsed once."""
    comps = parse(hlo_text)
    shapes = {ins.name: ins.shape for ins in _all(comps)}
    dots = [(comp, dot_flops(ins, shapes)) for comp, instrs in comps.items() for ins in instrs if ins.opcode == "dot"]
    out = []
    for shares in shares_each:
        execs = executions(comps, shares)
        total, known = 0.0, True
        for comp, flops in dots:
            runs, comp_known = execs.get(comp, (0, True))
            if runs:
                total += flops * runs
                known = known and comp_known
        out.append((total, known))
    return out


@dataclasses.dataclass(frozen=True)
class Dot:
    """One matrix multiply of a program, with the shapes its multiply really reads: a `dot`
    (inside a fusion too: a fusion that converts FP8 to bf16 before its dot is a bf16 GEMM)
    or a cuBLAS GEMM call (its first two operands are the matrices; scales follow)."""

    lhs: str  # shape text, e.g. "f8e4m3fn[512,32]{1,0}"
    rhs: str
    result: str
    computation: str

    @property
    def types(self) -> str:
        """"lhs x rhs" element types, e.g. "f8e4m3fn x f8e5m2"."""
        return f"{_dtype(self.lhs)} x {_dtype(self.rhs)}"

    def dims(self) -> set[int]:
        """Every dimension size either operand has."""
        return {int(d.lstrip("<=")) for shape in (self.lhs, self.rhs) for _, ds in ARRAY.findall(shape)
                for d in ds.split(",") if d}


_GEMM_CALL = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')


def dots(hlo_text: str) -> list[Dot]:
    """Every matrix multiply in an HLO module's text (lowered or compiled), once each."""
    comps = parse(hlo_text)
    shapes = {ins.name: ins.shape for ins in _all(comps)}
    def is_gemm(ins: _Instr) -> bool:
        return ins.opcode == "dot" or (ins.opcode == "custom-call" and bool(_GEMM_CALL.search(ins.attrs)))

    return [Dot(shapes.get(ins.operands[0], ""), shapes.get(ins.operands[1], ""), ins.shape, ins.computation)
            for ins in _all(comps) if len(ins.operands) >= 2 and is_gemm(ins)]


def dot_types(hlo_text: str) -> dict[str, int]:
    """How many matrix multiplies read each pair of operand types: {"bf16 x bf16": 40, ...}."""
    counts: dict[str, int] = defaultdict(int)
    for d in dots(hlo_text):
        counts[d.types] += 1
    return dict(sorted(counts.items()))


def summarize(colls: Iterable[Collective]) -> list[dict]:
    """Totals per (kind, axes, dtype), largest bytes per step first: where the network time goes."""
    rows: dict[tuple, dict] = {}
    for c in colls:
        row = rows.setdefault((c.kind, c.axes, c.dtype), dict(
            kind=c.kind, axes=c.axes, dtype=c.dtype, count=0, executions=0, bytes_per_step=0,
            trip_count_known=True, crosses_hosts=None))
        row["count"] += 1
        row["executions"] += c.trip_count
        row["bytes_per_step"] += c.bytes_per_step
        row["trip_count_known"] &= c.trip_count_known
        row["crosses_hosts"] = row["crosses_hosts"] or c.crosses_hosts
    return sorted(rows.values(), key=lambda r: (-r["bytes_per_step"], r["kind"], r["axes"]))


def parse(text: str) -> dict[str, list[_Instr]]:
    """Computation name -> its instructions, in printed order (the run order once scheduled)."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                current = m.group(1)
                comps[current] = []
        elif line.lstrip().startswith("}"):
            current = None
        elif _INSTR.match(line) or not comps[current]:
            comps[current].append(line.strip())
        else:  # hand-written HLO may wrap an instruction over several lines
            comps[current][-1] += " " + line.strip()
    return {c: [i for i in (_instr(line, c) for line in lines) if i] for c, lines in comps.items()}


def _instr(line: str, comp: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rhs = m.groups()
    if rhs.startswith("("):
        end = closing(rhs, 0)
    else:
        end = re.match(r"[a-z0-9]+\[[^\]]*\](\{[^}]*\})?", rhs).end()
    shape, rest = rhs[:end], rhs[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = closing(rest, op.end() - 1)
    listed = re.sub(r"/\*.*?\*/", " ", rest[op.end():close - 1])  # every fifth operand has an /*index=5*/ note
    operands = tuple(a.split()[-1].lstrip("%") for a in split_outside(listed) if a.split())
    return _Instr(name, shape, op.group(1), operands, rest[close:], comp)


def closing(s: str, i: int) -> int:
    """Index just past the bracket that closes the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] in "([{"
        depth -= s[j] in ")]}"
        if depth == 0:
            return j + 1
    return len(s)


def split_outside(s: str) -> list[str]:
    """Split at commas that sit outside every bracket."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    return parts + [s[start:]]


def _all(comps: dict[str, list[_Instr]]) -> Iterable[_Instr]:
    return (ins for instrs in comps.values() for ins in instrs)


def callees(ins: _Instr) -> list[tuple[str, str]]:
    """(role, computation) for every computation this instruction calls."""
    found = [(role, comp) for role, comp in _CALLEE.findall(ins.attrs)]
    for group in _CALLEE_LIST.findall(ins.attrs):
        found += [("branch", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
    return found


def fused_body(ins: _Instr, comps: dict[str, list[_Instr]]) -> list[_Instr]:
    """The instructions of the computation a fusion calls (empty for any other instruction)."""
    return next((comps.get(c, []) for role, c in callees(ins) if role == "calls"), [])


def fused_outputs(body: list[_Instr]) -> list[_Instr | None]:
    """A fused body's outputs: its root tuple's elements (None where not in the body), or the root."""
    by_name = {i.name: i for i in body}
    root = body[-1]
    return [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]


def _shares_of(ins: _Instr, count: int, branch_shares: BranchShares | None) -> Sequence[float] | None:
    """The share of runs of each of the `count` branches of `ins`, where `branch_shares` knows
    them: by the scope the conditional itself was traced under (not one it sits inside), else
    by its branch count."""
    if ins.opcode != "conditional" or not branch_shares:
        return None
    name = _op_name(ins.attrs)
    for key, shares in branch_shares.items():
        if isinstance(key, str) and name.endswith(f"/{key}/cond") and len(shares) == count:
            return shares
    return branch_shares.get(count)


def executions(comps: dict[str, list[_Instr]], branch_shares: BranchShares | None = None) -> dict[str, tuple[float, bool]]:
    """Computation -> (runs per step, all trip counts known), for those reachable from a root.

    A while body runs n times and its condition n + 1 (n from `known_trip_count`, 1 if absent);
    conditional branches each count once (an upper bound), unless `branch_shares` gives the
    fraction of runs each branch takes, for conditionals with that many branches (the
    pipeline executor's switch: how often the average device runs each op) or traced under
    that scope (a layer's switch over its kinds: the share of layers of each); several call
    sites add up.
    """
    callers: dict[str, list[tuple[str, float, bool]]] = defaultdict(list)
    for ins in _all(comps):
        trip = _TRIP.search(ins.attrs)
        n = int(trip.group(1)) if trip else 1
        called = callees(ins)
        shares = _shares_of(ins, sum(role == "branch" for role, _ in called), branch_shares)
        branch = 0
        for role, callee in called:
            mult = {"body": n, "condition": n + 1}.get(role, 1) if trip else 1
            if role == "branch" and shares is not None:
                mult, branch = shares[branch], branch + 1
            callers[callee].append((ins.computation, mult, bool(trip) or ins.opcode != "while"))
    memo: dict[str, tuple[float, bool]] = {}

    def runs(comp: str) -> tuple[float, bool]:
        if comp in memo:
            return memo[comp]
        memo[comp] = (0, True)  # a (malformed) call cycle adds nothing instead of recursing
        total, known = 0 if callers[comp] else 1, True
        for caller, mult, edge_known in callers[comp]:
            caller_runs, caller_known = runs(caller)
            total += caller_runs * mult
            known = known and caller_known and edge_known
        memo[comp] = (total, known)
        return memo[comp]

    return {c: runs(c) for c in comps if runs(c)[0] > 0}


def _collective_at(ins: _Instr, comps: dict[str, list[_Instr]]) -> tuple[str, _Instr, bool] | None:
    """(kind, instruction holding its groups and result shape, is async) if `ins` starts one."""
    if ins.opcode in KINDS:
        return ins.opcode, ins, False
    if ins.opcode.endswith("-start") and ins.opcode[:-6] in KINDS:
        return ins.opcode[:-6], ins, True
    if ins.opcode == "async-start":
        for _, callee in callees(ins):
            inner = [i for i in comps.get(callee, []) if i.opcode in KINDS]
            if inner:
                return inner[-1].opcode, inner[-1], True
    return None


def _op_name(attrs: str) -> str:
    found = re.search(r'op_name="([^"]*)"', attrs)
    return found.group(1) if found else ""


def done_of(start: _Instr, finishers: dict[str, _Instr]) -> _Instr | None:
    """The *-done that completes `start`, following any *-update in between."""
    nxt = finishers.get(start.name)
    while nxt is not None and nxt.opcode.endswith("-update"):
        nxt = finishers.get(nxt.name)
    return nxt


def _overlapped(instrs: list[_Instr], i: int, done: _Instr | None) -> bool:
    """Real compute sits between start and done; a done in another computation means the
    collective was pipelined across a loop iteration, which overlaps by construction."""
    if done is None:
        return False
    if done.computation != instrs[i].computation:
        return True
    j = next(k for k, ins in enumerate(instrs) if ins.name == done.name)
    return any(ins.opcode not in _TRIVIAL and not re.search(r"^async-|-(start|done|update)$", ins.opcode)
               for ins in instrs[i + 1:j])


def _groups(kind: str, attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups as partition ids, whichever syntax the printer chose."""
    if kind == "collective-permute":
        return _components(_int_lists(attrs, "source_target_pairs"))
    if m := _MESH_GROUPS.search(attrs):
        return _mesh_groups(*m.groups())
    if m := _IOTA_GROUPS.search(attrs):
        dims, reshape, perm = ([int(x) for x in g.split(",")] if g else None for g in m.groups())
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        ids = ids.transpose(perm) if perm else ids
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(dims[0], -1))
    lists = _int_lists(attrs, "replica_groups")
    return tuple(lists) or (tuple(range(num_devices)),)


def _int_lists(attrs: str, key: str) -> list[tuple[int, ...]]:
    """`key={{0,1},{2,3}}` as [(0, 1), (2, 3)]; [] when absent or empty."""
    if not (m := re.search(rf"(?:^|[\s,]){key}=\{{", attrs)):
        return []
    text = attrs[m.end() - 1:closing(attrs, m.end() - 1)]
    return [tuple(int(x) for x in g.split(",")) for g in re.findall(r"\{([\d,\s]+)\}", text)]


def _components(pairs: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """Sets of devices linked by source->target pairs: a ring shift gives its whole ring."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in (p for p in pairs if len(p) == 2):
        parent[root(a)] = root(b)
    sets: dict[int, list[int]] = defaultdict(list)
    for x in list(parent):
        sets[root(x)].append(x)
    return tuple(sorted(tuple(sorted(s)) for s in sets.values()))


def _mesh_groups(axes_text: str, ids_text: str | None, refs_text: str) -> tuple[tuple[int, ...], ...]:
    """Expand `mesh['a'=2,'b'=4] {'b','x':(1)2}`: a sub-axis (pre)size splits its axis into
    [pre, size, rest] major to minor and varies the middle; groups ordered like XLA's."""
    named = [(n, int(s)) for n, s in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", axes_text)]
    names, sizes = [n for n, _ in named], [s for _, s in named]
    ids = np.array([int(x) for x in re.findall(r"\d+", ids_text)]) if ids_text else np.arange(math.prod(sizes))
    coords = np.indices(sizes).reshape(len(sizes), -1)
    resid, rank = coords.copy(), np.zeros(coords.shape[1], dtype=np.int64)
    for name, pre, size in re.findall(r"'?([^',:\s(]+)'?(?::\((\d+)\)(\d+))?", refs_text):
        k = names.index(name)
        pre, size = (int(pre), int(size)) if size else (1, sizes[k])
        rest = sizes[k] // (pre * size)
        part = (coords[k] // rest) % size
        resid[k] -= part * rest
        rank = rank * size + part
    key = np.ravel_multi_index(tuple(resid), sizes)
    order = np.lexsort((rank, key))
    group = len(order) // len(set(key.tolist()))
    return tuple(tuple(int(x) for x in row) for row in ids[order].reshape(-1, group))


def nbytes(shape: str) -> int:
    """Bytes of an array or tuple shape; sub-byte types (s4, f4e2m1fn...) pack and round up."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        width = re.search(r"\d+", dtype)  # bf16 -> 16, f8e4m3fn -> 8, c64 -> 64; token -> none
        bits = 8 if dtype == "pred" else int(width.group()) if width else 0
        elements = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)  # `<=8`: dynamic bound
        total += math.ceil(elements * bits / 8)
    return total


def _main_dtype(shape: str) -> str:
    """The element type holding most of a (tuple) shape's bytes: a combined all-gather of
    FP8 weights and a bf16 norm scale is an FP8 gather."""
    held: dict[str, int] = defaultdict(int)
    for dtype, dims in ARRAY.findall(shape):
        held[dtype] += nbytes(f"{dtype}[{dims}]")
    return max(held, key=held.get) if held else ""


def _dtype(shape: str) -> str:
    first = ARRAY.search(shape)
    return first.group(1) if first else ""


def _link_bytes(kind: str, v: int, n: int) -> int:
    """Per-device bytes sent under the ring model for a V-byte buffer over n devices."""
    if n <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * v * (n - 1) // n
    if kind in ("collective-permute", "collective-broadcast"):
        return v
    return v * (n - 1) // n


def _axes(groups, mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes along which the members of some group differ."""
    size = mesh.devices.size
    bad = [p for g in groups for p in g if p >= size]
    if bad:
        raise ValueError(f"partition id {bad[0]} is outside a mesh of {size} devices: wrong mesh?")
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(list(g), mesh.devices.shape))
        varying |= {k for k in range(coords.shape[0]) if len(set(coords[k].tolist())) > 1}
    return tuple(mesh.axis_names[k] for k in sorted(varying))


def loop_stacks(hlo_text: str, length: int) -> list[int]:
    """Per-device bytes of the stacks each while loop of the entry computation carries, in
    run order: the arrays in its state whose leading dimension is `length` (a scan's stacked
    inputs and outputs over that many layers: their weights, the activations remat keeps,
    the weights' gradients). Not the trip count: XLA:GPU may run two layers an iteration.
    Their growth with the batch is what the layer loop keeps of the activations
    (benchmarks/memory_comm.py)."""
    entry = next((line for line in hlo_text.splitlines() if line.startswith("ENTRY")), None)
    if entry is None:
        raise ValueError("loop_stacks reads a whole module's HLO text (compiled.as_text()); this has no ENTRY computation")
    loops = [ins for ins in parse(hlo_text)[_HEADER.match(entry).group(1)] if ins.opcode == "while"]
    return [sum(nbytes(f"{t}[{dims}]") for t, dims in ARRAY.findall(ins.shape) if dims.split(",")[0] == str(length))
            for ins in loops]
