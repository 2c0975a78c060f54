"""A user's own batches as a batch source, so `jaxpar.train.run(..., data=...)` keeps the
progress bar, metrics file, checkpoints and preemption handling.

`data` is either
  - a function step -> host-local batch: exact resume (a resumed run asks for the steps it
    has not done), like the built-in sources; or
  - an iterable of host-local batches: taken in order; a resumed run continues from wherever
    the iterable is (skip the steps already done yourself, or use a function).
A host-local batch is a dict of numpy arrays holding this process's rows of the global batch
(all of them with one process): the fields and trailing shapes of the run's batch layout
(jaxpar.data.batch.BatchLayout).
The first batch is checked against them before the step is compiled.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import numpy as np

from jaxpar.data.batch import BatchLayout
from jaxpar.data.sources import counted
from jaxpar.errors import ConfigError

UserData = Callable[[int], dict] | Iterable[dict]


class UserBatches:
    """`source(step)` -> the global batch, from `data` (see the module docstring)."""

    def __init__(self, batch: BatchLayout, data: UserData):
        self.batch = batch
        self.expected = {k: (batch.shapes[k], np.dtype(f.dtype)) for k, f in batch.fields.items()}
        self.ids_below = {k: f.ids_below for k, f in batch.fields.items() if f.ids_below is not None}
        rows = batch.rows
        self.rows = rows.stop - rows.start
        self.by_step = data if callable(data) else None
        self.stream = None if callable(data) else iter(data)
        self.first: dict | None = None

    def describe(self, steps: int) -> str:
        """One line: what the run trains on (the data's own, which jaxpar cannot count)."""
        given = "a function step -> batch" if self.by_step is not None else "an iterable, batches taken in order"
        return (f"data: your own batches (jaxpar.train.run(data=...): {given}) | {counted(steps, 'step')} x "
                f"{self.batch.global_batch:,} rows")

    def peek(self, step: int) -> None:
        """Fetch and check the first batch now (before the compile), keep it for `step`."""
        self.first = self._next(step)
        check_batch(self.first, self.expected, self.rows, self.ids_below)

    def __call__(self, step: int) -> dict[str, jax.Array]:
        local = self.first if self.first is not None else self._next(step)
        self.first = None
        rows = {k: np.asarray(local[k], dtype) for k, (_, dtype) in self.expected.items()}
        return self.batch.to_global(rows)

    def _next(self, step: int) -> dict:
        if self.by_step is not None:
            return self.by_step(step)
        try:
            return next(self.stream)
        except StopIteration:
            raise ConfigError(f"data: the iterable ran out at step {step}; give at least train.steps batches, "
                              "or a function step -> batch") from None


def check_batch(batch: Any, expected: dict[str, tuple[tuple[int, ...], np.dtype]], rows: int,
                ids_below: dict[str, int] | None = None) -> None:
    """One line naming the field, what came and what the step takes. `ids_below`: fields of
    integer ids and the bound they stay below (an lm's inputs: the vocabulary)."""
    if not isinstance(batch, dict):
        raise ConfigError(f"data: a batch is a dict of arrays, not {type(batch).__name__}; "
                          f"give fields {', '.join(expected)}")
    missing = [k for k in expected if k not in batch]
    if missing:
        raise ConfigError(f"data: the batch has no {', '.join(missing)}; the step takes {', '.join(expected)} "
                          f"(it has {', '.join(batch) or 'nothing'})")
    for name, (shape, dtype) in expected.items():
        value = np.asarray(batch[name])
        want = (rows, *shape[1:])
        if value.shape != want:
            raise ConfigError(f"data: field {name!r} has shape {value.shape}; this process takes {want} "
                              f"(its {rows} rows of the global batch {shape})")
        if not np.can_cast(value.dtype, dtype, casting="same_kind"):
            raise ConfigError(f"data: field {name!r} is {value.dtype}; the step takes {np.dtype(dtype).name}")
        bound = (ids_below or {}).get(name)
        if bound is None or not value.size:
            continue
        low, high = value.min(), value.max()  # one pass each over the batch
        if low < 0 or high >= bound:
            bad = low if low < 0 else high
            raise ConfigError(f"data: field {name!r} holds id {bad}; ids index the model's vocabulary and lie in "
                              f"[0, {bound}) (vocab_size={bound}): fix the data or give the model a larger vocabulary")


__all__ = ["UserBatches", "UserData", "check_batch"]
