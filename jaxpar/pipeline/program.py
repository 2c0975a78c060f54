"""A schedule compiled into the tables the SPMD executor reads, one row per tick.

Every device runs one operation per tick (or waits), in lockstep: the timeline is the
schedule's with every op one step long (`build_schedule(..., unit=True)`), so the per-device
orders and their dependencies are the schedule's own. At the end of each tick a device
sends what its op produced: a forward its chunk's output to the device holding the next
virtual stage, a backward the gradient of its chunk's input to the one holding the
previous. What arrives waits in a slot of one of two buffers until the ops that need it
have run:

  activations  the input of (microbatch, virtual stage), from its arrival until the
               backward (the weight gradient, where split) has recomputed it
  gradients    the gradient of that chunk's output, from its arrival until the backward
               (the weight gradient, where split) has used it

The first virtual stage keeps nothing (its input is the token batch, looked up again),
and the last needs no incoming gradient (it starts from its loss). Slots are reused as
soon as they are free, so each buffer holds the most that is ever waiting on one device:
GPipe's grow with m, 1F1B's stay near p.

The loss is computed by the last stage's backward, which recomputes that chunk's forward
anyway, so the last stage's forward only waits (its input is already in its slot).

Where virtual stages hold different numbers of layers (jaxpar.pipeline.split), each distinct
count is a size class and an op's branch is its kind + len(BRANCHES) x its class: the
executor compiles one chunk body per (kind, size) it runs, each over exactly its layers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.pipeline.schedule import Op, Timeline, build_schedule
from jaxpar.pipeline.split import StageSplit

# branch ids, in the order the executor lists its functions
BRANCHES = (
    "idle",
    "forward_first",  # embed, run chunk, send output
    "forward_mid",  # run chunk on the arrived input, send output
    "backward_first",  # recompute and take the gradients of the chunk's (and embedding's) weights
    "backward_mid",  # recompute; weight gradients and the input gradient, sent back
    "backward_last",  # recompute with the head; loss, weight gradients, input gradient sent back
    "input_grad_mid",  # split backward: the input gradient only
    "input_grad_last",  # split backward on the last stage: loss and input gradient
    "weight_grad_first",  # split backward: the weight gradients (recomputed)
    "weight_grad_mid",
    "weight_grad_last",
    "forward_backward_first",  # 1f1b-overlap: one microbatch's forward_first beside another's backward_first
    "forward_backward_mid",  # the same of _mid (on the last stage a pair is its backward: its forward waits)
)
BRANCH = {name: i for i, name in enumerate(BRANCHES)}
# back_microbatch, back_act_slot: what a forward_backward op's backward reads (others: their own)
COLUMNS = ("branch", "microbatch", "chunk", "act_slot", "grad_slot", "recv_act", "recv_grad", "back_microbatch",
           "back_act_slot")


@dataclasses.dataclass(frozen=True)
class Program:
    """tables[column]: int32 [ticks, p]; slot -1 means none."""

    timeline: Timeline
    tables: dict[str, np.ndarray]
    act_slots: int  # buffer slots every device allocates: the most any one needs
    grad_slots: int
    split: bool  # backward split into input gradient and weight gradient (zb-h1)
    act_slots_used: tuple[int, ...]  # what each device needs
    grad_slots_used: tuple[int, ...]
    layers: StageSplit | None = None  # an uneven split's layers per virtual stage (None: equal chunks)

    @property
    def ticks(self) -> int:
        return self.timeline.steps

    @property
    def size_classes(self) -> int:
        return len(self.layers.sizes) if self.layers is not None else 1

    def branch_shares(self, device: int | None = None) -> dict[int, tuple[float, ...]]:
        """For the compiled program's accounting (jaxpar.inspect.hlo): the share of the
        executor's switch runs that take each branch on `device` (None: the average device)."""
        column = self.tables["branch"] if device is None else self.tables["branch"][:, device]
        n = len(BRANCHES) * self.size_classes
        return {n: tuple(float((column == b).sum()) / column.size for b in range(n))}


def compile_schedule(name: str, p: int, m: int, v: int = 1, layers: StageSplit | None = None) -> Program:
    """`layers`: the layers of each virtual stage (None: equal chunks, one size class)."""
    timeline = build_schedule(name, p, m, v, unit=True)
    return program(timeline, layers)


def program(timeline: Timeline, layers: StageSplit | None = None) -> Program:
    p, v = timeline.p, timeline.v
    uneven = layers is not None and not layers.even
    size_class = layers.size_class if uneven else lambda vs: 0
    last = p * v - 1
    split = timeline.split
    when: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    for s, row in enumerate(timeline.grid):
        for t, op in enumerate(row):
            for part in op.parts() if op is not None else ():
                when[(part.kind, part.microbatch, op.chunk * p + s)] = t
    done = "W" if split else "B"  # the op after which a chunk's input and gradient are free

    # What waits on each device: (arrival tick, last tick it is read, key)
    acts: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(p)]
    grads: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(p)]
    for (kind, mb, vs), t in when.items():
        device = vs % p
        if kind == "F" and vs > 0:
            acts[device].append((when[("F", mb, vs - 1)], when[(done, mb, vs)], (mb, vs)))
        if kind == "B" and vs < last:
            grads[device].append((when[("B", mb, vs + 1)], when[(done, mb, vs)], (mb, vs)))
    act_slot, act_used = _allocate(acts)
    grad_slot, grad_used = _allocate(grads)

    ticks = timeline.steps
    zero = ("branch", "microbatch", "chunk", "back_microbatch")
    tables = {c: np.full((ticks, p), 0 if c in zero else -1, np.int32) for c in COLUMNS}
    for s, row in enumerate(timeline.grid):
        for t, op in enumerate(row):
            if op is None:
                continue
            vs = op.chunk * p + s
            back = op.partner if op.kind == "FB" else op.microbatch  # the microbatch a backward part reads
            tables["branch"][t, s] = BRANCH[_branch(op, vs, last, split)] + len(BRANCHES) * size_class(vs)
            tables["microbatch"][t, s] = op.microbatch
            tables["chunk"][t, s] = op.chunk
            tables["act_slot"][t, s] = act_slot.get((s, (op.microbatch, vs)), -1)
            tables["grad_slot"][t, s] = grad_slot.get((s, (back, vs)), -1)
            tables["back_microbatch"][t, s] = back
            tables["back_act_slot"][t, s] = act_slot.get((s, (back, vs)), -1)
            # what this op sends lands on the neighbour at the end of this tick
            for part in op.parts():
                if part.kind == "F" and vs < last:
                    tables["recv_act"][t, (s + 1) % p] = act_slot[((s + 1) % p, (part.microbatch, vs + 1))]
                if part.kind == "B" and vs > 0:
                    tables["recv_grad"][t, (s - 1) % p] = grad_slot[((s - 1) % p, (part.microbatch, vs - 1))]
    return Program(timeline, tables, max(*act_used, 1), max(*grad_used, 1), split, act_used, grad_used,
                   layers if uneven else None)


def _branch(op: Op, vs: int, last: int, split: bool) -> str:
    where = "first" if vs == 0 else "last" if vs == last else "mid"
    if op.kind == "FB":  # the last stage's forward waits for its backward, which recomputes it
        return "backward_last" if where == "last" else f"forward_backward_{where}"
    if op.kind == "F":
        return "idle" if where == "last" else f"forward_{where}"
    if op.kind == "W":
        return f"weight_grad_{where}"
    if not split:
        return f"backward_{where}"
    return "idle" if where == "first" else f"input_grad_{where}"  # the first stage has no input to differentiate


def _allocate(waiting: list[list[tuple[int, int, tuple[int, int]]]]) -> tuple[dict, tuple[int, ...]]:
    """Slots per device, reused greedily: a value written at the end of tick `arrive` and
    last read during tick `leave` frees its slot for a value written at the end of `leave`."""
    slots: dict[tuple[int, tuple[int, int]], int] = {}
    used = []
    for device, items in enumerate(waiting):
        free_at: list[int] = []  # per slot: the tick after whose reads it is free
        for arrive, leave, key in sorted(items):
            slot = next((i for i, f in enumerate(free_at) if f <= arrive), len(free_at))
            if slot == len(free_at):
                free_at.append(leave)
            else:
                free_at[slot] = leave
            slots[(device, key)] = slot
        used.append(len(free_at))
    return slots, tuple(used)
