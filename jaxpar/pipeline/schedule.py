"""Pipeline schedules as tables: which operation each stage runs at each time step.

A schedule is, per device, the order in which it runs its operations: F (forward of one
microbatch through one model chunk), B (its backward) and, where the backward is split,
W (the weight gradient, after B). `simulate` turns those orders into a timeline by
running every operation as soon as its device is free and its inputs exist (a forward
needs the previous chunk's forward of the same microbatch; a backward the next chunk's
backward and its own forward). A forward takes one time step, a whole backward two (input
and weight gradients; split, one each), so idle slots / all slots of the timeline is the
bubble fraction the papers give:

  gpipe        all forwards, then all backwards                     (p-1)/(m+p-1)
  1f1b         PipeDream-Flush: p-s-1 warm-up forwards, then one     (p-1)/(m+p-1), with at
               forward / one backward, then the remaining backwards  most p microbatches in
                                                                     flight on stage 0
  interleaved  Megatron's virtual stages: device s holds chunks      (p-1)/(v*m+p-1)
               s, s+p, ..., s+(v-1)p; forwards in groups of p
               microbatches per chunk (m a multiple of p)
  zb-h1        zero bubble (arXiv 2401.10241): 1F1B with the         (p-1)/(3m+p-1) when
               backward split, stage s putting off s weight          F, B, W take the same
               gradients; in flight as 1F1B (p on stage 0)           time
  1f1b-overlap 1F1B with each steady-state forward and backward      (p-1)/(m+p-1), with
               in one op (FB: two microbatches at once, as           2p-1 microbatches in
               DualPipe's and Megatron's overlapped 1F1B): stage     flight on stage 0
               s runs 2(p-s-1) warm-up forwards, so that each tick
               every stage can take a forward from one side and a
               backward from the other; one microbatch's all-to-
               alls travel while the other computes

p stages (devices), m microbatches, v chunks per device (v = 1 but for interleaved).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, get_args

from jaxpar.choices import PipelineSchedule

SCHEDULES = get_args(PipelineSchedule)
DURATION = {"F": 1, "B": 2, "W": 1, "FB": 3}  # time steps; B is 1 when a W follows it (split backward)


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W" or "FB" (a forward and a backward, of two microbatches, together)
    microbatch: int  # FB: the forward's
    chunk: int  # virtual stage: chunk c of device s is model piece c * p + s
    partner: int = -1  # FB: the backward's microbatch

    def parts(self) -> tuple[Op, ...]:
        """The single ops this one runs: itself, or an FB's forward and backward."""
        if self.kind != "FB":
            return (self,)
        return Op("F", self.microbatch, self.chunk), Op("B", self.partner, self.chunk)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """grid[device][time]: the op run there, or None (idle)."""

    p: int
    m: int
    v: int
    grid: tuple[tuple[Op | None, ...], ...]

    @property
    def steps(self) -> int:
        return len(self.grid[0])

    @property
    def split(self) -> bool:
        """The backward split into input gradient (B) and weight gradient (W) ops (zb-h1)."""
        return any(op is not None and op.kind == "W" for row in self.grid for op in row)


def build_schedule(name: str, p: int, m: int, v: int = 1, unit: bool = False) -> Timeline:
    """The timeline of schedule `name`; `unit`: every op one time step (the executor's
    lockstep ticks, jaxpar.pipeline.program) instead of the papers' F 1, B 2 (or B 1, W 1)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be positive, not p={p}, m={m}, v={v}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"{name} runs one chunk per device, not v={v}; use interleaved")
    if name in ("1f1b", "zb-h1") and m < p:
        raise ValueError(f"{name} needs at least as many microbatches as stages: m={m} < p={p}")
    if name == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches in groups of the stages: m={m} is not a multiple of p={p}")
    orders = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zero_bubble_h1,
              "1f1b-overlap": _overlapped}[name]
    return simulate([orders(s, p, m, v) for s in range(p)], p, m, v, unit)


def _gpipe(s: int, p: int, m: int, v: int) -> list[Op]:
    return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]


def _one_f_one_b(s: int, p: int, m: int, v: int) -> list[Op]:
    warmup = min(p - s - 1, m)
    order = [Op("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Op("F", warmup + i, 0), Op("B", i, 0)]
    return order + [Op("B", i, 0) for i in range(m - warmup, m)]


def _overlapped(s: int, p: int, m: int, v: int) -> list[Op]:
    """1F1B with 2(p - s - 1) warm-up forwards and each steady-state pair in one op: stage s
    then runs forward i at tick i + s and backward j at j + 2(p - 1) - s (unit ticks), a
    forward arriving from one side and a gradient from the other each tick."""
    warmup = min(2 * (p - s - 1), m)
    order = [Op("F", i, 0) for i in range(warmup)]
    order += [Op("FB", warmup + i, 0, partner=i) for i in range(m - warmup)]
    return order + [Op("B", i, 0) for i in range(m - warmup, m)]


def _zero_bubble_h1(s: int, p: int, m: int, v: int) -> list[Op]:
    """1F1B's order with each backward split: stage s runs W(i) after B(i + s), its last s
    weight gradients after the final backward. Later stages put off more, so the chain of
    input gradients back to stage 0 (the critical path) never waits behind a W."""
    late = s
    order = []
    for op in _one_f_one_b(s, p, m, v):
        order.append(op)
        if op.kind == "B" and op.microbatch >= late:
            order.append(Op("W", op.microbatch - late, 0))
    return order + [Op("W", i, 0) for i in range(m - late, m)]


def _interleaved(s: int, p: int, m: int, v: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B order for device s (its k-th forward runs chunk
    (k // p) % v of microbatch (k // (p v)) p + k % p; backwards walk the chunks in reverse)."""
    total = m * v

    def nth(k: int, kind: str) -> Op:
        chunk = (k // p) % v
        return Op(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [nth(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth(warmup + k, "F"), nth(k, "B")]
    return order + [nth(k, "B") for k in range(total - warmup, total)]


def simulate(orders: list[list[Op]], p: int, m: int, v: int, unit: bool = False) -> Timeline:
    """Run each device's ops in order, each as early as its dependencies allow (each for
    one time step if `unit`, else for its DURATION)."""
    last = p * v - 1  # the last virtual stage
    split = any(op.kind == "W" for order in orders for op in order)
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> finish time
    grid: list[list[Op | None]] = [[] for _ in range(p)]
    cursor = [0] * p
    busy_until = [0] * p
    t = 0
    while any(cursor[s] < len(orders[s]) for s in range(p)) or any(b > t for b in busy_until):
        started = False
        running = any(b > t for b in busy_until)
        for s in range(p):
            if busy_until[s] > t:  # still running a longer op
                grid[s].append(grid[s][-1])
                continue
            if cursor[s] == len(orders[s]):
                grid[s].append(None)
                continue
            op = orders[s][cursor[s]]
            vs = op.chunk * p + s
            runs = {(part.kind, part.microbatch, vs) for part in op.parts()}
            needs = [n for part in op.parts() for n in _needs(part, vs, last) if n not in runs]
            if all(done.get(n, t + 1) <= t for n in needs):
                length = 1 if unit or (split and op.kind == "B") else DURATION[op.kind]
                busy_until[s] = t + length
                done.update({key: t + length for key in runs})
                grid[s].append(op)
                cursor[s] += 1
                started = True
            else:
                grid[s].append(None)
        if not started and not running:  # nothing ran and nothing will: an order waits on itself
            pending = [orders[s][cursor[s]] for s in range(p) if cursor[s] < len(orders[s])]
            raise RuntimeError(f"schedule deadlocks at time {t}: {pending}")
        t += 1
    return Timeline(p, m, v, tuple(tuple(row) for row in grid))


def _needs(op: Op, vs: int, last: int) -> list[tuple[str, int, int]]:
    """What a single op on virtual stage vs waits for: (kind, microbatch, virtual stage)."""
    if op.kind == "F":
        return [("F", op.microbatch, vs - 1)] if vs > 0 else []
    if op.kind == "B":
        return [("F", op.microbatch, vs)] + ([("B", op.microbatch, vs + 1)] if vs < last else [])
    return [("B", op.microbatch, vs)]


def published_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The papers' bubble fraction for a schedule (the table at the top of this module)."""
    return (p - 1) / ({"interleaved": v * m, "zb-h1": 3 * m}.get(name, m) + p - 1)


def bubble_fraction(timeline: Timeline) -> float:
    """Idle slots / all slots of the executed timeline."""
    slots = timeline.p * timeline.steps
    return sum(op is None for row in timeline.grid for op in row) / slots


def peak_in_flight(timeline: Timeline, device: int = 0) -> int:
    """Most microbatch chunks whose forward has started on `device` and whose backward
    (its weight gradient, where split) has not finished: the activations it holds at once."""
    frees = "W" if timeline.split else "B"
    live = peak = 0
    previous = None
    for op in timeline.grid[device]:
        if op is not None and op is not previous:  # the first step of an op
            for part in op.parts():  # an FB's forward first: both chunks' inputs are held at once
                if part.kind == "F":
                    live += 1
                    peak = max(peak, live)
                elif part.kind == frees:
                    live -= 1
        previous = op
    return peak


def render(timeline: Timeline, label: Callable[[Op], str] | None = None) -> str:
    """A text picture: one row per device, one column per time step; forwards as the
    microbatch number, backwards as lower-case letters (a = microbatch 0), weight
    gradients as upper-case letters, a forward beside a backward (FB) as the backward's
    letter, idle as '.'."""
    def default(op: Op) -> str:
        letter = "abcdefghijklmnopqrstuvwxyz"[(op.partner if op.kind == "FB" else op.microbatch) % 26]
        return str(op.microbatch % 10) if op.kind == "F" else letter.upper() if op.kind == "W" else letter

    label = label or default
    rows = [f"stage {s}  " + "".join("." if op is None else label(op) for op in row) for s, row in enumerate(timeline.grid)]
    return "\n".join(rows)
