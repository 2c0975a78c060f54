"""Pipeline schedules as tables: which operation each stage runs at each time step.

A schedule is, per device, the order in which it runs its operations: F (forward of one
microbatch through one model chunk) and B (its backward). `simulate` turns those orders
into a timeline by running every operation as soon as its device is free and its inputs
exist (a forward needs the previous chunk's forward of the same microbatch; a backward the
next chunk's backward and its own forward). Every operation takes one time step, so idle
slots / all slots of the timeline is the bubble fraction the papers give:

  gpipe        all forwards, then all backwards                     (p-1)/(m+p-1)
  1f1b         PipeDream-Flush: p-s-1 warm-up forwards, then one     (p-1)/(m+p-1), with at
               forward / one backward, then the remaining backwards  most p microbatches in
                                                                     flight on stage 0
  interleaved  Megatron's virtual stages: device s holds chunks      (p-1)/(v*m+p-1)
               s, s+p, ..., s+(v-1)p; forwards in groups of p
               microbatches per chunk (m a multiple of p)

p stages (devices), m microbatches, v chunks per device (v = 1 but for interleaved).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int  # virtual stage: chunk c of device s is model piece c * p + s


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


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Timeline:
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be positive, not p={p}, m={m}, v={v}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"{name} runs one chunk per device, not v={v}; use interleaved")
    if name == "1f1b" and m < p:
        raise ValueError(f"1f1b needs at least as many microbatches as stages: m={m} < p={p}")
    if name == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches in groups of the stages: m={m} is not a multiple of p={p}")
    orders = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[name]
    return simulate([orders(s, p, m, v) for s in range(p)], p, m, v)


def _gpipe(s: int, p: int, m: int, v: int) -> list[Op]:
    return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]


def _one_f_one_b(s: int, p: int, m: int, v: int) -> list[Op]:
    warmup = min(p - s - 1, m)
    order = [Op("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Op("F", warmup + i, 0), Op("B", i, 0)]
    return order + [Op("B", i, 0) for i in range(m - warmup, m)]


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


def simulate(orders: list[list[Op]], p: int, m: int, v: int) -> Timeline:
    """Run each device's ops in order, each as early as its dependencies allow."""
    last = p * v - 1  # the last virtual stage
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> finish time
    grid: list[list[Op | None]] = [[] for _ in range(p)]
    cursor = [0] * p
    t = 0
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        ran = False
        for s in range(p):
            if cursor[s] == len(orders[s]):
                grid[s].append(None)
                continue
            op = orders[s][cursor[s]]
            vs = op.chunk * p + s
            if op.kind == "F":
                needs = [("F", op.microbatch, vs - 1)] if vs > 0 else []
            else:
                needs = [("F", op.microbatch, vs)] + ([("B", op.microbatch, vs + 1)] if vs < last else [])
            if all(done.get(n, t + 1) <= t for n in needs):
                grid[s].append(op)
                cursor[s] += 1
                ran = True
            else:
                grid[s].append(None)
        for s in range(p):
            op = grid[s][-1]
            if op is not None:
                done[(op.kind, op.microbatch, op.chunk * p + s)] = t + 1
        if not ran:
            raise RuntimeError(f"schedule deadlocks at time {t}: {[orders[s][cursor[s]] for s in range(p) if cursor[s] < len(orders[s])]}")
        t += 1
    return Timeline(p, m, v, tuple(tuple(row) for row in grid))


def bubble_fraction(timeline: Timeline) -> float:
    """Idle slots / all slots of the executed timeline."""
    slots = timeline.p * timeline.steps
    return sum(op is None for row in timeline.grid for op in row) / slots


def peak_in_flight(timeline: Timeline, device: int = 0) -> int:
    """Most microbatch chunks whose forward has run on `device` and whose backward has not:
    the activations it holds at once."""
    live = peak = 0
    for op in timeline.grid[device]:
        if op is not None:
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
    return peak


def render(timeline: Timeline, label: Callable[[Op], str] | None = None) -> str:
    """A text picture: one row per device, one column per time step; forwards as the
    microbatch number, backwards as letters (a = microbatch 0), idle as '.'."""
    def default(op: Op) -> str:
        return str(op.microbatch % 10) if op.kind == "F" else "abcdefghijklmnopqrstuvwxyz"[op.microbatch % 26]

    label = label or default
    rows = [f"stage {s}  " + "".join("." if op is None else label(op) for op in row) for s, row in enumerate(timeline.grid)]
    return "\n".join(rows)
