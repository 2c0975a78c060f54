"""What a schedule costs in the lockstep executor (jaxpar.pipeline.executor), in layers.

Every device runs one op a tick and the tick ends in a ppermute, so a tick lasts as long as
its slowest op, and a step is the sum over ticks of the max over devices. An op on virtual
stage vs costs, in units of one layer's forward, with w = counts[vs] (+ `first_extra` on
the first virtual stage, + `last_extra`, the head and loss, on the last):

  F  w; 0 on the last virtual stage (its backward recomputes the forward with the loss)
  B  fused: 3w (recompute, input and weight gradients); split: 2w (recompute, input
     gradient), 0 on the first virtual stage (no input to differentiate)
  W  3w (recompute, then the weight gradients through the chunk)
  FB its forward's and its backward's

(jaxpar.pipeline.program's `_branch`.) Pure Python: nothing here imports jax.
"""

from __future__ import annotations

import functools

from jaxpar.pipeline.schedule import build_schedule


@functools.lru_cache(maxsize=4096)
def lockstep_cost(name: str, p: int, m: int, v: int, counts: tuple[int, ...], first_extra: float = 0.0,
                  last_extra: float = 0.0) -> tuple[float, float]:
    """(the step's cost: the sum over ticks of the costliest op, the ideal: the mean
    device's work, all ops spread evenly with no tick waiting) for schedule `name` with
    `counts[vs]` layers on virtual stage vs (vs = c * p + s: device s's chunk c). cost /
    ideal stretches the mean device's compute (a model's FLOPs / devices) to the step; it
    counts both the ticks' idle time and the stages' imbalance."""
    if len(counts) != p * v:
        raise ValueError(f"{len(counts)} layer counts for {p} x {v} virtual stages")
    timeline = build_schedule(name, p, m, v, unit=True)
    last = p * v - 1
    split = timeline.split
    work = [c + (first_extra if vs == 0 else 0.0) + (last_extra if vs == last else 0.0) for vs, c in enumerate(counts)]

    def cost(op, s: int) -> float:
        if op is None:
            return 0.0
        if op.kind == "FB":
            return sum(cost(part, s) for part in op.parts())
        vs = op.chunk * p + s
        if op.kind == "F":
            return 0.0 if vs == last else work[vs]
        if op.kind == "W":
            return 3 * work[vs]
        if split:
            return 0.0 if vs == 0 else 2 * work[vs]
        return 3 * work[vs]

    each = [[cost(op, s) for op in row] for s, row in enumerate(timeline.grid)]
    return float(sum(map(max, zip(*each)))), float(sum(map(sum, each)) / p)
