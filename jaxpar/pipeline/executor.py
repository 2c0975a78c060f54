"""The SPMD pipeline executor: one program on every device of the `stage` axis, following
a schedule's tick tables (jaxpar.pipeline.program), and its plain reference.

Inside `jax.shard_map`, manual over `stage` and `data` (and `expert`, where the caller
says how the weights lie over it: `Manual`; the other axes stay with the partitioner, so
tensor parallelism and FSDP run inside each chunk as they do without pipelining), each
device loops over the ticks. At each tick it looks up its op, runs it
with `lax.switch` (each device executes only its own branch), and then two `ppermute`s
move what the ops produced: chunk outputs to the next virtual stage, input gradients to the
previous one. A backward recomputes its chunk's forward from the stored chunk input
(stage-level recomputation: one activation per microbatch in flight is kept, not the
chunk's internals) and takes the vector-Jacobian product there.

Weight gradients accumulate on each device for its own chunks, per data replica, in
float32; the caller reduces them over `data` once per step. Manual over `expert`, each
expert-parallel device runs its own rows too: the weights not split over `expert`
(attention, shared experts, router) are summed over it once at the end, not by the
partitioner once per microbatch and layer (across hosts at DeepSeek's scale). Parameters outside the layer
stack (embedding, final norm, head) are replicated over `stage`; their gradients, non-zero
only on the first and last stages, are summed over `stage` once at the end.

The executor knows nothing of the model: it is given three functions of (chunk weights,
other weights, [input,] microbatch):
  first  the first virtual stage: the input comes from the microbatch   -> output
  mid    any stage but the first and last                               -> output
  last   the last virtual stage, head and loss included                 -> (loss sum, weight)
(first and mid must return the same shape and dtype.)

With `Stages.aux`, each of the three also returns what its chunk's layers report (MoE's
load-balancing losses and expert counts): first and mid return (output, aux), last returns
(loss sum, weight, aux), where aux = {"loss": a scalar added to the objective (and
differentiated), "sums": scalars summed over the batch, "per_layer": arrays [chunk layers,
...] summed per layer (those under jaxpar.model.MAXIMA: their largest value kept, QK-clip's
logits)}. Each (microbatch, virtual stage) reports once, from its backward op.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.quantized import entries
from jaxpar.model import FIRST_LAYER, MAXIMA
from jaxpar.pipeline.program import BRANCHES, COLUMNS, Program
from jaxpar.pipeline.split import StageSplit

STAGE, DATA, EXPERT = "stage", "data", "expert"


@dataclasses.dataclass(frozen=True)
class Stages:
    first: Callable[[Any, Any, dict], Any]
    mid: Callable[[Any, Any, jax.Array, dict], Any]
    last: Callable[[Any, Any, jax.Array, dict], tuple]
    aux: bool = False  # the functions also return their layers' reports (above)


@dataclasses.dataclass(frozen=True)
class Manual:
    """How the weights lie over `expert` when the executor is manual over it: for each leaf
    of (layers, other, frozen layers, frozen other), its PartitionSpec over the manual axes
    (`stage` on the stacked layers' first dimension, `expert` where a weight is split over
    the expert-parallel devices, None elsewhere)."""

    layers: Any
    other: Any
    frozen_layers: Any = dataclasses.field(default_factory=dict)
    frozen_other: Any = dataclasses.field(default_factory=dict)


def at_layer(mb: dict, first_layer: Any) -> dict:
    """The microbatch as a stage's layers see it: with "first_layer", the model-order index of
    the first layer of the chunk it runs (jaxpar.model.PipelineStages)."""
    return {**mb, FIRST_LAYER: first_layer}


def no_report() -> dict:
    """The report of layers that report nothing."""
    return {"loss": jnp.zeros((), jnp.float32), "sums": {}, "per_layer": {}}


def _with_aux(stages: Stages) -> Stages:
    """`stages` in the form with reports; functions without any report an empty one."""
    if stages.aux:
        return stages
    return Stages(
        first=lambda c, o, mb, **kw: (stages.first(c, o, mb, **kw), no_report()),
        mid=lambda c, o, x, mb, **kw: (stages.mid(c, o, x, mb, **kw), no_report()),
        last=lambda c, o, x, mb, **kw: (*stages.last(c, o, x, mb, **kw), no_report()),
        aux=True,
    )


def pipeline_grads(
    program: Program, stages: Stages, mesh: Mesh, layers: Any, other: Any, micro: dict, frozen: tuple | None = None,
    manual: Manual | None = None,
) -> tuple[jax.Array, jax.Array, Any, Any]:
    """Loss sums, weights and weight gradients of a whole batch, per data replica.

    layers: the stacked layer weights [p * v * Lc, ...] in pipeline order (device s holds
            its v chunks contiguously, each padded to the widest: jaxpar.pipeline.split), sharded
            over `stage`
    other:  every other weight, replicated over `stage`
    micro:  batch fields [m, B, ...], B sharded over `data`
    frozen: (stacked layers, other) of weights the stages read and nothing differentiates
            (LoRA's frozen base), laid out as `layers` and `other`; each stage function is
            then called with `frozen=(its chunk of them, the other)` (jaxpar.pipeline.stages)
    manual: the weights' specs over `stage` and `expert` to run manual over `expert` too
            (the rows of `micro` then split over data x expert); None: `expert` is left to
            the partitioner
    Returns loss [data], weight [data], d_layers [data, p*v*Lc, ...], d_other [data, ...]:
    sums over the replica's rows of every microbatch (float32); and the layers' reports,
    {"sums": [data], "per_layer": [data, p*v*Lc, ...] in pipeline order} (empty without
    `stages.aux`). The loss includes the reports' losses.
    """
    p, v = program.timeline.p, program.timeline.v
    stages = _with_aux(stages)
    tables = {c: jnp.asarray(program.tables[c]) for c in COLUMNS}
    frozen = frozen or ({}, {})
    by_expert = manual is not None
    manual = manual or Manual(*(jax.tree.map(lambda _: spec, tree) for spec, tree in
                                ((P(STAGE), layers), (P(), other), (P(STAGE), frozen[0]), (P(), frozen[1]))))
    rows = (DATA, EXPERT) if by_expert else DATA
    micro_spec = jax.tree.map(lambda _: P(None, rows), micro)
    report = _report_shapes(stages, layers, other, micro, p * v, frozen)
    report_spec = {"sums": jax.tree.map(lambda _: P(DATA), report["sums"]),
                   "per_layer": jax.tree.map(lambda _: P(DATA, STAGE), report["per_layer"])}
    per_replica = lambda specs: jax.tree.map(lambda s: P(DATA, *s), specs)  # noqa: E731
    body = jax.shard_map(
        lambda t, l, o, mb, f: _run(program, stages, p, v, t, l, o, mb, f, manual if by_expert else None),
        mesh=mesh,
        in_specs=({c: P(None, STAGE) for c in COLUMNS}, manual.layers, manual.other, micro_spec,
                  (manual.frozen_layers, manual.frozen_other)),
        out_specs=(P(DATA), P(DATA), per_replica(manual.layers), per_replica(manual.other), report_spec),
        axis_names={STAGE, DATA, EXPERT} if by_expert else {STAGE, DATA},
        check_vma=False,  # the body is never differentiated: it takes its own VJPs
    )
    # Sharding constraints inside the chunks name the auto axes of the mesh as seen from
    # inside the shard_map (jaxpar.sharding.annotate uses the context's abstract mesh).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return body(tables, layers, other, micro, frozen)


def _summed(grads: Any, specs: Any, axis: str, then: str | None = None) -> Any:
    """Each gradient summed over `axis` where its weight is not split over it, and over
    `then` (every gradient). Both: hierarchically, reduce-scattered over `axis`, its 1/n
    share summed over `then`, all-gathered back. One all-reduce over both (what XLA folds
    two psums into) would move the whole gradient across hosts among all their devices."""
    def one(g, spec):
        if any(axis in dim for dim in entries(spec, len(spec))):
            return jax.lax.psum(g, then) if then else g
        if then is None:
            return jax.lax.psum(g, axis)
        n = jax.lax.axis_size(axis)
        flat = jnp.pad(g.reshape(-1), (0, -g.size % n))
        share = jax.lax.psum(jax.lax.psum_scatter(flat, axis, tiled=True), then)
        return jax.lax.all_gather(share, axis, tiled=True)[: g.size].reshape(g.shape)
    return jax.tree.map(one, grads, specs)


def _with_frozen(stages: Stages, frozen: tuple) -> Stages:
    """`stages` reading `frozen` (a chunk's frozen layers, the other frozen weights) too; none
    when both are empty."""
    if not jax.tree.leaves(frozen):
        return stages
    return Stages(first=lambda c, o, mb: stages.first(c, o, mb, frozen=frozen),
                  mid=lambda c, o, x, mb: stages.mid(c, o, x, mb, frozen=frozen),
                  last=lambda c, o, x, mb: stages.last(c, o, x, mb, frozen=frozen), aux=stages.aux)


def _chunk(tree: Any, start, size: int) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), tree)


def _report_shapes(stages: Stages, layers, other, micro, chunks: int, frozen: tuple) -> dict:
    """The shapes of a chunk's report (outside the shard_map: `chunks` = p * v chunks in the
    stack), its per-layer part stacked over the whole stack."""
    chunk = jax.tree.map(lambda a: a[: a.shape[0] // chunks], layers)
    first_frozen = (jax.tree.map(lambda a: a[: a.shape[0] // chunks], frozen[0]), frozen[1])
    _, report = jax.eval_shape(_with_frozen(stages, first_frozen).first, chunk, other,
                               jax.tree.map(lambda a: a[0], micro))
    per_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] * chunks, *a.shape[1:]), a.dtype),
                             report["per_layer"])
    return {"sums": report["sums"], "per_layer": per_layer}


def _run(program: Program, all_stages: Stages, p: int, v: int, tables, layers, other, micro, frozen,
         manual: Manual | None):
    per_chunk = jax.tree.leaves(layers)[0].shape[0] // v
    zeros = lambda tree, dtype=None: jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)  # noqa: E731
    mb0 = jax.tree.map(lambda a: a[0], micro)
    chunk0 = jax.tree.map(lambda a: a[:per_chunk], layers)
    frozen_layers, frozen_other = frozen
    message, report = jax.eval_shape(_with_frozen(all_stages, (_chunk(frozen_layers, 0, per_chunk), frozen_other)).first,
                                     chunk0, other, mb0)
    zero_message = jnp.zeros(message.shape, message.dtype)
    one, none = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
    seed = (one, none)  # d(loss sum), d(weight)

    def into(a, d, start, combine=jnp.add):  # a[start : start + len(d)] += d (a chunk's layers, its padding untouched)
        return jax.lax.dynamic_update_slice_in_dim(
            a, combine(jax.lax.dynamic_slice_in_dim(a, start, d.shape[0], 0), d.astype(a.dtype)), start, 0)

    def report_only(acc, rep):
        """acc = (d_layers, d_other, chunk offset, report sums, per-layer reports) + a report."""
        d_layers, d_other, start, sums, per_layer = acc
        sums = jax.tree.map(lambda a, r: a + r.astype(a.dtype), sums, rep["sums"])
        per_layer = {k: jax.tree.map(lambda a, r, k=k: into(a, r, start, jnp.maximum if k == MAXIMA else jnp.add),
                                     per_layer[k], rep["per_layer"][k]) for k in per_layer}
        return d_layers, d_other, start, sums, per_layer

    def add(acc, dc, do, rep=None):
        """acc + this op's weight gradients (float32) and, where the op counts it, its report."""
        d_layers, d_other, start, sums, per_layer = acc
        d_layers = jax.tree.map(lambda a, d: into(a, d, start), d_layers, dc)
        d_other = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_other, do)
        acc = (d_layers, d_other, start, sums, per_layer)
        return acc if rep is None else report_only(acc, rep)

    used = set(program.tables["branch"].ravel().tolist())
    fused = any(BRANCHES[b % len(BRANCHES)].startswith("forward_backward") for b in used)
    split = program.layers  # None: every chunk is the device's rows / v
    sizes = split.sizes if split is not None else (per_chunk,)
    offsets = jnp.asarray(split.offsets if split is not None else [vs * per_chunk for vs in range(p * v)], jnp.int32)

    def make_branches(frozen_chunk: Any, size_class: int) -> list:
        """The switch's branches of one size class: each runs the first sizes[size_class] rows
        of the tick's chunk (and of its frozen chunk, if any), the rest being padding
        (jaxpar.pipeline.split)."""
        n, base = sizes[size_class], len(BRANCHES) * size_class
        cut = (lambda c: c) if n == per_chunk else (lambda c: _chunk(c, 0, n))  # noqa: E731
        stages = _with_frozen(all_stages, (cut(frozen_chunk), frozen_other))
        # Each branch: (input, gradient in, microbatch, chunk, other, accumulated) ->
        #   (output sent on, input gradient sent back, accumulated, loss, weight).
        # Gradients are added inside the branches that make them, so other ticks neither build
        # zeros of the embedding's size nor add them. A chunk's report is differentiated (its
        # loss, seeded with 1) wherever the chunk is, and counted once: by the op that returns
        # the loss for the last chunk, by the backward (or input-gradient) op elsewhere.
        def idle(x, g, mb, c, o, acc):
            return zero_message, zero_message, acc, none, none

        def forward_first(x, g, mb, c, o, acc):
            return stages.first(c, o, mb)[0], zero_message, acc, none, none

        def forward_mid(x, g, mb, c, o, acc):
            return stages.mid(c, o, x, mb)[0], zero_message, acc, none, none

        def backward_first(x, g, mb, c, o, acc):  # also the split weight gradient: no input to differentiate
            (_, rep), vjp = jax.vjp(lambda c, o: stages.first(c, o, mb), c, o)
            return zero_message, zero_message, add(acc, *vjp((g, _seed(rep))), rep), rep["loss"], none

        def backward_mid(x, g, mb, c, o, acc):
            (_, rep), vjp = jax.vjp(lambda c, o, x: stages.mid(c, o, x, mb), c, o, x)
            dc, do, dx = vjp((g, _seed(rep)))
            return zero_message, dx, add(acc, dc, do, rep), rep["loss"], none

        def backward_last(x, g, mb, c, o, acc):
            (loss, weight, rep), vjp = jax.vjp(lambda c, o, x: stages.last(c, o, x, mb), c, o, x)
            dc, do, dx = vjp((*seed, _seed(rep)))
            return zero_message, dx, add(acc, dc, do, rep), loss + rep["loss"], weight

        def input_grad_mid(x, g, mb, c, o, acc):
            (_, rep), vjp = jax.vjp(lambda x: stages.mid(c, o, x, mb), x)
            return zero_message, vjp((g, _seed(rep)))[0], report_only(acc, rep), rep["loss"], none

        def input_grad_last(x, g, mb, c, o, acc):
            (loss, weight, rep), vjp = jax.vjp(lambda x: stages.last(c, o, x, mb), x)
            return zero_message, vjp((*seed, _seed(rep)))[0], report_only(acc, rep), loss + rep["loss"], weight

        def weight_grad_mid(x, g, mb, c, o, acc):
            (_, rep), vjp = jax.vjp(lambda c, o: stages.mid(c, o, x, mb), c, o)
            return zero_message, zero_message, add(acc, *vjp((g, _seed(rep)))), none, none

        def weight_grad_last(x, g, mb, c, o, acc):
            (_, _, rep), vjp = jax.vjp(lambda c, o: stages.last(c, o, x, mb), c, o)
            return zero_message, zero_message, add(acc, *vjp((*seed, _seed(rep)))), none, none

        # 1f1b-overlap: one microbatch's forward beside another's backward (xb, mbb), two
        # independent chains XLA may interleave (one's all-to-alls travel while the other computes)
        def forward_backward_first(x, g, mb, c, o, acc, xb, mbb):
            _, _, acc, l, w = backward_first(xb, g, mbb, c, o, acc)
            return forward_first(x, g, mb, c, o, acc)[0], zero_message, acc, l, w

        def forward_backward_mid(x, g, mb, c, o, acc, xb, mbb):
            _, dx, acc, l, w = backward_mid(xb, g, mbb, c, o, acc)
            return forward_mid(x, g, mb, c, o, acc)[0], dx, acc, l, w

        functions = {
            "idle": idle,
            "forward_first": forward_first,
            "forward_mid": forward_mid,
            "backward_first": backward_first,
            "backward_mid": backward_mid,
            "backward_last": backward_last,
            "input_grad_mid": input_grad_mid,
            "input_grad_last": input_grad_last,
            "weight_grad_first": backward_first,
            "weight_grad_mid": weight_grad_mid,
            "weight_grad_last": weight_grad_last,
            "forward_backward_first": forward_backward_first,
            "forward_backward_mid": forward_backward_mid,
        }
        # Ops the schedule never runs become `idle`: the switch keeps its branch count (and the
        # compiled program's accounting its branch shares), and XLA compiles the chunk's forward
        # and backward only as often as the schedule needs (1F1B over two stages runs 3 of the 10
        # ops: PP x ring x TP's step traced in 1.0 s, not 2.5, and compiled in 5.1 s, not 10.9).
        def sized(name):  # every branch takes the backward part's input and microbatch too
            fn = functions[name]
            if name.startswith("forward_backward"):
                return lambda x, g, mb, c, o, acc, xb, mbb: fn(x, g, mb, cut(c), o, acc, xb, mbb)
            return lambda x, g, mb, c, o, acc, xb, mbb: fn(x, g, mb, cut(c), o, acc)

        return [sized(name if base + i in used else "idle") for i, name in enumerate(BRANCHES)]

    send_on = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if v > 1 else [])
    send_back = [(s + 1, s) for s in range(p - 1)] + ([(0, p - 1)] if v > 1 else [])

    def store(buffer, slot, value):
        return jax.lax.cond(
            slot >= 0, lambda b: jax.lax.dynamic_update_index_in_dim(b, value, slot, 0), lambda b: b, buffer
        )

    def tick(carry, row):
        acts, grads, d_layers, d_other, sums, per_layer, loss, weight = carry
        start = row["chunk"] * per_chunk
        chunk, frozen_chunk = _chunk(layers, start, per_chunk), _chunk(frozen_layers, start, per_chunk)
        branches = [b for k in range(len(sizes)) for b in make_branches(frozen_chunk, k)]
        first_layer = offsets[row["chunk"] * p + jax.lax.axis_index(STAGE)]  # chunk c is virtual stage c p + s
        microbatch = lambda k: at_layer(  # noqa: E731
            jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row[k], 0, keepdims=False), micro), first_layer)
        stored = lambda k: jax.lax.dynamic_index_in_dim(acts, jnp.maximum(row[k], 0), 0, keepdims=False)  # noqa: E731
        mb, x = microbatch("microbatch"), stored("act_slot")
        # a forward_backward op's backward reads its own microbatch and input; others, the op's
        mbb, xb = (microbatch("back_microbatch"), stored("back_act_slot")) if fused else (mb, x)
        g = jax.lax.dynamic_index_in_dim(grads, jnp.maximum(row["grad_slot"], 0), 0, keepdims=False)
        out, back, (d_layers, d_other, _, sums, per_layer), l, w = jax.lax.switch(
            row["branch"], branches, x, g, mb, chunk, other, (d_layers, d_other, start, sums, per_layer), xb, mbb
        )
        arrived = jax.lax.ppermute(out, STAGE, send_on)
        returned = jax.lax.ppermute(back, STAGE, send_back)
        acts = store(acts, row["recv_act"], arrived)
        grads = store(grads, row["recv_grad"], returned)
        return (acts, grads, d_layers, d_other, sums, per_layer, loss + l, weight + w), None

    buffers = (
        jnp.zeros((program.act_slots, *message.shape), message.dtype),
        jnp.zeros((program.grad_slots, *message.shape), message.dtype),
    )
    per_layer0 = {k: jax.tree.map(lambda a, k=k: jnp.full((a.shape[0] * v, *a.shape[1:]), -jnp.inf if k == MAXIMA else 0,
                                                          a.dtype), r) for k, r in report["per_layer"].items()}
    carry = (*buffers, zeros(layers, jnp.float32), zeros(other, jnp.float32), zeros(report["sums"]), per_layer0, none, none)
    rows = {c: tables[c][:, 0] for c in COLUMNS}
    (_, _, d_layers, d_other, sums, per_layer, loss, weight), _ = jax.lax.scan(tick, carry, rows)
    # once a step: the weights outside the stack over `stage` (non-zero on the first and last
    # stages only) and, manual over `expert`, what its devices share over `expert` (outside
    # the stack hierarchically: only 1/n crosses hosts where a stage is a host, as DeepSeek's)
    expert = (EXPERT,) if manual is not None else ()
    if manual is not None:
        d_layers = _summed(d_layers, manual.layers, EXPERT)
        d_other = _summed(d_other, manual.other, EXPERT, then=STAGE)
        per_layer = {k: (jax.lax.pmax if k == MAXIMA else jax.lax.psum)(r, EXPERT) for k, r in per_layer.items()}
    else:
        d_other = jax.lax.psum(d_other, STAGE)
    loss, weight, sums = jax.lax.psum((loss, weight, sums), (STAGE, *expert))
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731  the replica axis
    return loss[None], weight[None], lead(d_layers), lead(d_other), lead({"sums": sums, "per_layer": per_layer})


def _seed(report: dict) -> dict:
    """The cotangent of a report: 1 for its loss, nothing for its counts (not differentiated)."""
    ct = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.inexact)
                      else jnp.zeros_like(a), report)
    return {**ct, "loss": jnp.ones_like(report["loss"])}


def reference_grads(stages: Stages, split: StageSplit, layers: Any, other: Any, micro: dict):
    """The plain reference: each microbatch through the p * v chunks in turn on one device,
    differentiated by `jax.grad`; same arguments (pipeline order, padded as `split` says) and
    sums as `pipeline_grads`, without the replica axis (the reports' losses included, the
    reports themselves not returned)."""
    stages = _with_aux(stages)
    n, m = len(split.counts), jax.tree.leaves(micro)[0].shape[0]

    def chunk(tree, vs):  # virtual stage vs lives on device vs % p as its chunk vs // p
        return jax.tree.map(lambda a: a[split.start(vs): split.start(vs) + split.counts[vs]], tree)

    def loss(layers, other):
        total = weight = 0.0
        for i in range(m):
            mb = jax.tree.map(lambda a: a[i], micro)
            x, rep = stages.first(chunk(layers, 0), other, at_layer(mb, 0))
            total = total + rep["loss"]
            for vs in range(1, n - 1):
                x, rep = stages.mid(chunk(layers, vs), other, x, at_layer(mb, split.offsets[vs]))
                total = total + rep["loss"]
            l, w, rep = stages.last(chunk(layers, n - 1), other, x, at_layer(mb, split.offsets[n - 1]))
            total, weight = total + l + rep["loss"], weight + w
        return total, weight

    (total, weight), (d_layers, d_other) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layers, other)
    return total, weight, d_layers, d_other
