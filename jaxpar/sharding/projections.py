"""The two projections of Megatron tensor parallelism, as models call them.

  column   x [B, S, D] @ w [D, *F] -> [B, S, *F], the first feature dimension sharded over
           `tensor` (QKV, gate/up, the vocabulary head)
  row      y [B, S, *F] @ w [*F, D] -> [B, S, D], contracting the `tensor`-sharded features
           (attention output, down projection)

Under sequence parallelism the sequence is sharded over `tensor` outside these projections
("norm_seq"), so the column projection's input is all-gathered first and the row projection's
partial sums are reduce-scattered after. By default the partitioner places those collectives
from the sharding constraints, and they run before and after the matmul. With
`Layout.projections.collective` set ("ring" or "bidirectional"), the pair runs instead as one
shard_map collective matmul (jaxpar.kernels.collective_matmul), whose ring steps overlap the
transfers with partial matmuls. A column projection with several weights (QKV, gate/up)
gathers its input once.

A weight is either an array the model laid out (`compute_value(param)`) or the parameter
itself, which the projection gathers (a weight with a LoRA adapter, jaxpar.sharding.adapters,
multiplies unmerged: x @ W + scale * (x @ A) @ B): as `compute_value` would, or, when the projection
multiplies in FP8 and the gather moves FSDP / ZeRO-3 shards, in FP8 (its shards quantized
where they rest, one byte an element on the wire: jaxpar.kernels.fp8.fp8_tensordot).

With `Layout.matmul_dtype="fp8"` (train.matmul_dtype) the plain path multiplies in FP8
(jaxpar.kernels.fp8); a projection called with `low_precision=False` (a vocabulary head,
whose logits feed the softmax) stays in the compute dtype.

Like `constrain`, these read the layout entered around tracing: a model names no mesh and
holds no collective. Without a layout they are plain tensordots.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.collective_matmul import allgather_matmuls, matmul_reducescatter
from jaxpar.kernels.fp8 import fp8_tensordot
from jaxpar.kernels.hops import hop_here
from jaxpar.kernels.quantized import entries, gathered_axes
from jaxpar.mesh import manual_rows, mesh_here
from jaxpar.sharding.adapters import LoraWeight, adapter_output, base_value, check_inputs
from jaxpar.sharding.annotate import (Layout, active_layout, compute_value, constrain, repeated_dim, stored_value,
                                     sum_over_replicas)

AXIS = "tensor"
GATHERED = ("batch", "seq", "embed")  # a column projection's input: the whole sequence
SCATTERED = ("batch", "norm_seq", "embed")  # where sequence parallelism keeps it

Names = Sequence[str | None]


def column_project(x_BSD: jax.Array, weights: Sequence[jax.Array | nnx.Variable], out_names: Sequence[Names],
                   low_precision: bool = True) -> list[jax.Array]:
    """[x @ w laid out as names for w, names in zip(weights, out_names)]; x arrives in the
    residual layout (SCATTERED) and each w as `compute_value` gives it, or as the parameter
    (gathered here; in FP8 where it multiplies in FP8). `low_precision`: may run in the
    layout's matmul dtype (FP8)."""
    layout = active_layout()
    if not _collective(layout):
        # SP: the partitioner all-gathers the sequence here. Pinning the scattered layout
        # first keeps the gather after the norm's cast to the compute dtype; otherwise it
        # may gather the float32 norm output and cast after (twice the bytes).
        x_BSD = constrain(constrain(x_BSD, SCATTERED), GATHERED)
        dot = _tensordot(layout, low_precision)
        return [constrain(dot(x_BSD, w, 1), names) for w, names in zip(weights, out_names)]
    weights = [_laid_out(w) for w in weights]
    x_spec = _spec(layout, SCATTERED)
    gathered = _spec(layout, GATHERED)
    out_specs = [_spec(layout, names) for names in out_names]
    for names, spec in zip(out_names, out_specs):
        _expect(spec[:2] == gathered[:2] and spec[2] == AXIS and not any(spec[3:]), names, spec,
                "batch and sequence as the gathered input, the first feature dimension over tensor, no other")
    _expect_scattered(x_spec, gathered)
    bidirectional, hop = layout.projections.collective == "bidirectional", hop_here()

    def body(x, *ws):
        flat = [w.reshape(w.shape[0], -1) for w in ws]  # [D, F/n, ...] -> [D, F/n * ...]
        outs = allgather_matmuls(x, flat, AXIS, bidirectional=bidirectional, hop=hop)
        return tuple(out.reshape(*out.shape[:-1], *w.shape[1:]) for out, w in zip(outs, ws))

    sharded = jax.shard_map(
        body,
        mesh=mesh_here(layout.mesh),
        in_specs=(x_spec, *(P(None, *spec[2:]) for spec in out_specs)),
        out_specs=tuple(out_specs),
    )
    return list(sharded(constrain(x_BSD, SCATTERED), *weights))


def row_project(y: jax.Array, w: jax.Array | nnx.Variable, in_names: Names, low_precision: bool = True) -> jax.Array:
    """y [B, S, *F] laid out as `in_names` @ w [*F, D] -> [B, S, D] in the residual layout
    (SCATTERED): summed over `tensor`, and with sequence parallelism scattered over it; w an
    array or the parameter, as in `column_project`."""
    layout = active_layout()
    features = y.ndim - 2
    if not _collective(layout):
        dot = _tensordot(layout, low_precision)
        return constrain(dot(y, w, features), SCATTERED)  # SP: reduce-scatter, else all-reduce
    w = _laid_out(w)
    y_spec = _spec(layout, in_names)
    out_spec = _spec(layout, SCATTERED)
    gathered = _spec(layout, GATHERED)
    _expect(y_spec[:2] == gathered[:2] and y_spec[2] == AXIS and not any(y_spec[3:]), in_names, y_spec,
            "batch and sequence as the gathered layout, the first feature dimension over tensor, no other")
    _expect_scattered(out_spec, gathered)
    bidirectional, hop = layout.projections.collective == "bidirectional", hop_here()

    def body(y, w):
        flat_y = y.reshape(*y.shape[:2], -1)
        flat_w = w.reshape(math.prod(w.shape[:features]), -1)
        return matmul_reducescatter(flat_y, flat_w, AXIS, bidirectional=bidirectional, hop=hop)

    sharded = jax.shard_map(
        body,
        mesh=mesh_here(layout.mesh),
        in_specs=(y_spec, P(*y_spec[2:], None)),
        out_specs=out_spec,
    )
    return sharded(y, w)


def _tensordot(layout: Layout | None, low_precision: bool):
    """(x, w, axes) -> x . w in the layout's matmul dtype (the checks refuse FP8 with the
    collective matmul, whose ring steps multiply chunks); w an array or a parameter."""
    fp8 = low_precision and layout is not None and layout.projections.dtype == "fp8"

    def dot(x: jax.Array, w, axes: int) -> jax.Array:
        if isinstance(w, LoraWeight):  # unmerged: x @ W + scale * (x @ A) @ B, the adapter in the compute dtype
            check_inputs(w, axes)
            h = jnp.tensordot(x, compute_value(w.lora_a).astype(x.dtype), axes=axes)
            base = w.base if w.base_scale is None else base_value(w, compute_value, x.dtype)  # FP8: dequantized
            return dot(x, base, axes) + adapter_output(h, compute_value(w.lora_b), w.scale)
        moves = fp8 and isinstance(w, nnx.Variable) and _fp8_gather(w, layout)
        if moves:
            value, gather, rest = moves
            return fp8_tensordot(x, value, axes, gather, rest, rows_over=manual_rows())
        w = _laid_out(w)
        return fp8_tensordot(x, w, axes, rows_over=manual_rows()) if fp8 else jnp.tensordot(x, w, axes=axes)

    return dot


def _laid_out(w) -> jax.Array:
    """An array as given; a parameter laid out for use (a LoRA weight merged: the collective
    matmul's ring multiplies one weight)."""
    return compute_value(w) if isinstance(w, (nnx.Variable, LoraWeight)) else w


def _fp8_gather(param: nnx.Variable, layout: Layout):
    """(the stored value, gather, rest): the gather from where the parameter rests to where
    it is computed with, when it moves shards and nothing else sits in it (ZeRO++'s hpZ or
    int8 gathers take `compute_value`'s way); else None. A gradient summed over the
    per-replica vmap's replicas is summed here too, as `compute_value` does."""
    value, names = stored_value(param)
    if layout.params.hpz or layout.params.quantize_block or not jnp.issubdtype(value.dtype, jnp.floating):
        return None
    if repeated_dim(names, layout.params) is not None:  # repeated key/value heads: gathered as compute_value does
        return None
    source, target = layout.param_spec(names, value.shape), layout.rules.spec(names, "compute")
    if not any(gathered_axes(source, target, value.ndim)):
        return None
    if layout.params.from_host:  # parallel.zero.offload_params: fetched as compute_value fetches
        value = jax.device_put(value, jax.memory.Space.Device)
    if layout.replica_sum:
        value = sum_over_replicas(value, names, layout)
    if layout.replica_axis:  # inside the per-replica vmap no constraint may name its axis
        source = P(*(_without(entry, layout.replica_axis) for entry in entries(source, value.ndim)))
    mesh = mesh_here(layout.mesh)
    return (value, lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, target)),
            lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, source)))


def _without(entry: tuple[str, ...], axis: str):
    kept = tuple(a for a in entry if a != axis)
    return kept[0] if len(kept) == 1 else kept or None


def _collective(layout: Layout | None) -> bool:
    """Collective matmul is on and there is a ring to run it on (the config checks refuse
    mesh.tensor=1 with it; a caller's own Layout may still have it)."""
    return layout is not None and layout.projections.collective != "none" and layout.mesh.shape[AXIS] > 1


def _spec(layout: Layout, names: Names) -> P:
    spec = layout.rules.spec(names, "compute")
    return P(*spec, *([None] * (len(names) - len(spec))))


def _without_tensor(entry) -> str | tuple[str, ...] | None:
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != AXIS)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _expect_scattered(spec: P, gathered: P) -> None:
    """The residual layout is the gathered one with tensor added minor-most on the sequence:
    the ring's chunk order (context-major, tensor-minor) is then the sequence's."""
    ok = (spec[0] == gathered[0] and _without_tensor(spec[1]) == gathered[1]
          and entries(spec, 3)[1][-1:] == (AXIS,) and spec[2] is None)
    _expect(ok, SCATTERED, spec, "the sequence over the gathered sequence's axes, then tensor; embed unsharded")


def _expect(ok: bool, names: Names, spec: P, what: str) -> None:
    """Collective matmul needs the Megatron layout; custom compute rules may move it."""
    if not ok:
        raise ValueError(
            f"parallel.tensor.collective_matmul: {tuple(names)} is laid out as {spec} by the compute rules; the collective "
            f"matmul needs {what}. Drop the parallel.rules.compute that move it, or set parallel.tensor.collective_matmul=none"
        )
