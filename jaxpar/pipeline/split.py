"""How many layers each virtual stage of a pipeline holds, and where they rest.

A stage holds any number of layers (`parallel.pipeline.layers`, or the rule
`parallel.pipeline.balance`). The stacked layers still rest as one array sharded over
`stage`, so every device's share must be the same size: each virtual stage's rows are
padded to the largest count, `widest`. The pipeline-order stack has `rows = p * v * widest`
rows; device s's chunk c (virtual stage vs = c * p + s) starts at row (s * v + c) * widest
and holds its `counts[vs]` layers there, then zero rows that nothing reads (the executor
runs each chunk on its own count of rows: jaxpar.pipeline.executor).

Counts are written in whole-model layers, as Megatron's pipeline layout lists them
(DeepSeek-V3's 61 = 3 dense + 58 MoE): a model's `leading_layers()` run with the
embedding on the first stage, outside the stack, so the stack's counts are the whole
model's with the first one less by them.

With equal counts the orders are today's reshapes (`even`); otherwise they are static
gathers (`pipeline_rows`, `model_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model import declared

BALANCES = ("even", "balanced")


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """counts[vs]: the stack's layers on virtual stage vs (c * p + s: device s's chunk c)."""

    p: int
    v: int
    counts: tuple[int, ...]

    @property
    def layers(self) -> int:
        return sum(self.counts)

    @property
    def widest(self) -> int:
        return max(self.counts)

    @property
    def rows(self) -> int:
        """The stored stack's rows, padding included."""
        return self.p * self.v * self.widest

    @property
    def even(self) -> bool:
        return len(set(self.counts)) == 1

    @property
    def offsets(self) -> tuple[int, ...]:
        """The model-order index of each virtual stage's first layer."""
        return tuple(int(x) for x in np.cumsum((0, *self.counts[:-1])))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The distinct counts, each a compiled chunk size (the executor's size classes)."""
        return tuple(sorted(set(self.counts), reverse=True))

    def size_class(self, vs: int) -> int:
        return self.sizes.index(self.counts[vs])

    def start(self, vs: int) -> int:
        """The first row of virtual stage vs in pipeline order."""
        return ((vs % self.p) * self.v + vs // self.p) * self.widest

    @functools.cached_property
    def pipeline_rows(self) -> np.ndarray:
        """[rows]: the model-order layer each pipeline-order row holds, or -1 (padding)."""
        out = np.full(self.rows, -1, np.int32)
        for vs, (n, first) in enumerate(zip(self.counts, self.offsets)):
            out[self.start(vs): self.start(vs) + n] = np.arange(first, first + n)
        return out

    @functools.cached_property
    def model_rows(self) -> np.ndarray:
        """[layers]: the pipeline-order row of each model-order layer."""
        out = np.zeros(self.layers, np.int32)
        rows = self.pipeline_rows
        out[rows[rows >= 0]] = np.nonzero(rows >= 0)[0]
        return out

    def padding(self) -> np.ndarray:
        """[rows] bool: which pipeline-order rows are padding."""
        return self.pipeline_rows < 0

    def to_pipeline_order(self, x: jax.Array) -> jax.Array:
        """Stacked layers [layers, ...] in model order -> [rows, ...] in pipeline order: device
        s's chunks contiguous, padded, so sharding the leading axis over `stage` gives each
        device its own. Identity for one chunk per device, evenly split."""
        if self.even:
            if self.v == 1:
                return x
            return x.reshape(self.v, self.p, x.shape[0] // (self.p * self.v), *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        padded = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)]) if isinstance(x, jax.Array) else \
            np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])
        return _take(padded, np.where(self.pipeline_rows < 0, self.layers, self.pipeline_rows))

    def to_model_order(self, x: jax.Array) -> jax.Array:
        """The inverse of `to_pipeline_order` (the padding dropped)."""
        if self.even:
            if self.v == 1:
                return x
            return x.reshape(self.p, self.v, x.shape[0] // (self.p * self.v), *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return _take(x, self.model_rows)

    def whole_model(self, leading: int) -> tuple[int, ...]:
        """The counts in whole-model layers (the first with the `leading` ones)."""
        return (self.counts[0] + leading, *self.counts[1:])


def model_order_rows(tree, split: StageSplit):
    """The arrays of `tree` stacked over the stored rows (per-layer reports in pipeline order)
    in model order, the padding dropped."""
    return jax.tree.map(lambda a: split.to_model_order(a) if a.ndim and a.shape[0] == split.rows else a, tree)


def _take(x, rows: np.ndarray):
    return jnp.take(x, jnp.asarray(rows), axis=0) if isinstance(x, jax.Array) else np.take(x, rows, axis=0)


def parse_layers(text: str) -> tuple[int, ...]:
    """'3,4*14,2' -> (3, 4, ..., 4, 2): comma-separated counts, N*K for K of N. Raises
    ValueError naming the bad piece."""
    counts: list[int] = []
    for piece in text.replace(" ", "").split(","):
        count, star, times = piece.partition("*")
        if not count.isdigit() or star and (not times.isdigit() or int(times) == 0):
            raise ValueError(f"{piece!r} is not a count N or N*K (K >= 1 stages of N layers)")
        counts += [int(count)] * (int(times) if times else 1)
    return tuple(counts)


def compact(counts: tuple[int, ...]) -> str:
    """The inverse of `parse_layers`, runs of one count written N*K: (4, 4, 4, 1) -> '4*3,1'."""
    pieces, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        pieces.append(f"{counts[i]}*{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(pieces)


def leading_layers(model) -> int:
    """The layers the model's `embed` runs on the first stage, outside the stack."""
    own = declared(model, "leading_layers")
    return int(own()) if own is not None else 0


def head_layers(model, seq_len: int) -> float:
    """The output's cost (head and loss: 6 x head_param_count() FLOPs a token) in layers."""
    head = declared(model, "head_param_count")
    head = head() if head is not None else (declared(model, "vocab_size") or 0) * (declared(model, "embed") or 0)
    total = leading_layers(model) + model.num_layers
    per_layer = (model.flops_per_token(seq_len) - 6 * head) / total
    return 6 * head / per_layer if per_layer > 0 else 0.0


def balanced(total: int, stages: int, leading: int = 0, last_extra: float = 0.0) -> tuple[int, ...]:
    """Whole-model counts over `stages` virtual stages that make the busiest one the least
    busy, a stage's cost its layers plus `last_extra` (the head and loss, in layers) on the
    last one; the first holds at least `leading`, the middle ones at least one. Ties: the
    fewest distinct middle sizes (each a compiled chunk), then the evenest (least sum of
    squared costs: no stage left idle that could share the work), then the lighter first."""
    if stages == 1:
        return (total,)
    best = None
    for first in range(leading, total + 1):
        for last in range(0, total - first + 1):
            rest, mids = total - first - last, stages - 2
            if mids == 0 and rest or mids and rest < mids:
                continue
            big = math.ceil(rest / mids) if mids else 0
            cost = max(first, last + last_extra, big)
            distinct = len({rest // mids, big}) if mids and rest % mids else 1
            spread = first ** 2 + (last + last_extra) ** 2 + (big ** 2 * (rest % mids) + (rest // mids) ** 2 * (
                mids - rest % mids) if mids else 0)
            key = (cost, distinct, spread, first)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        raise ValueError(f"{total} layers cannot fill {stages} virtual stages (the first with at least {leading}, "
                         f"the {stages - 2} middle ones with one each)")
    _, first, last = best
    rest, mids = total - first - last, stages - 2
    middle = [rest // mids + (1 if i < rest % mids else 0) for i in range(mids)] if mids else []
    return (first, *middle, last)


def balanced_layers(model, stages: int, seq_len: int) -> tuple[int, ...]:
    """`balanced`'s whole-model counts of `model` over `stages` virtual stages: its leading
    layers on the first, its head and loss counted on the last. Raises ValueError where the
    layers cannot fill them."""
    leading = leading_layers(model)
    return balanced(model.num_layers + leading, stages, leading, head_layers(model, seq_len))


def stage_split(model, pipeline, p: int, seq_len: int) -> StageSplit:
    """The split `pipeline` (a jaxpar.specs.PipelineConfig) asks for of `model`'s stack over p
    stages: its `layers` list, else `balance`'s rule (even: today's equal chunks). Assumes
    the checks passed (jaxpar.checks.pipeline)."""
    v, leading = pipeline.chunks, leading_layers(model)
    if pipeline.layers:
        whole = parse_layers(pipeline.layers)
    elif pipeline.balance == "balanced":
        whole = balanced_layers(model, p * v, seq_len)
    else:
        return StageSplit(p, v, (model.num_layers // (p * v),) * (p * v))
    return StageSplit(p, v, (whole[0] - leading, *whole[1:]))
