"""Gradients per data-parallel replica, so the reduction over `data` is ours to place.

Left to the partitioner, each microbatch's gradient is reduced over every batch axis at once:
one all-reduce over data x fsdp, of the whole layer gradient, across hosts when `data` spans
them. Computing the gradient under `jax.vmap(..., spmd_axis_name="data")` instead gives one
gradient per data replica, stacked on a leading axis sharded over `data`: inside a replica the
partitioner reduce-scatters over `fsdp` only (inside the host), and summing the leading axis
is a separate reduction over `data` of what is left, 1/fsdp of it (hybrid sharding's
two-level reduction). It also lets ZeRO 0-1 accumulate microbatches unreduced and reduce
once per step.

At ZeRO 2-3 (`summed`) the gradient is not held per replica: a replica's gradient is the
whole model's, 1/fsdp of it per device, in the compute dtype and again in float32, where
these stages keep 1/(data x fsdp). Each parameter's gradient is summed over the replicas
where it is used instead (jaxpar.sharding.annotate.sum_over_replicas: inside the layer
scan, one layer at a time, over fsdp and then over data), and comes out of the vmap
already reduced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import Layout, use_layout
from jaxpar.sharding.annotate import REPLICAS, ReplicaSum
from jaxpar.step.state import cast_floats, on_device

AXIS = "data"


def inner_layout(layout: Layout, summed: ReplicaSum | None = None) -> Layout:
    """The layout one replica's computation sees: `data` taken out of every compute rule
    (the vmapped replica axis holds it); `summed`: how parameters' gradients are summed over
    the replicas where they are used (Layout.replica_sum; None: they are not)."""
    return dataclasses.replace(layout, rules=layout.rules.without(AXIS, ("compute",)), replica_axis=AXIS,
                               replica_sum=summed)


def without_data(sharding: NamedSharding) -> NamedSharding:
    return without_axis(sharding, AXIS)


def without_axis(sharding: NamedSharding, axis: str) -> NamedSharding:
    """`sharding` with mesh axis `axis` taken out of its spec (replicated over it)."""

    def drop(entry):
        if entry is None:
            return None
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a != axis)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return NamedSharding(sharding.mesh, P(*(drop(e) for e in sharding.spec)))


def split_replicas(x: jax.Array, names: tuple, layout: Layout) -> jax.Array:
    """[B, ...] -> [data, B/data, ...]: each replica's rows (batch is sharded data-major)."""
    d = layout.mesh.shape[AXIS]
    x = x.reshape(d, x.shape[0] // d, *x.shape[1:])
    spec = inner_layout(layout).rules.spec(names, "compute")
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P(AXIS, *spec)))


def per_replica(grad_fn: Callable, layout: Layout, grad_shardings: Any, summed: ReplicaSum | None = None) -> Callable:
    """(params, replica batch [data, b, ...]) -> (loss sums [data], (weights, other sums)
    each [data, ...], gradients [data, ...]), each replica's gradient reduced inside it only.

    `summed`: the gradients come back summed over the replicas instead (as it says: plain,
    or qgZ's int8), in float32 and in `grad_shardings`, reduced layer by layer inside the
    backward pass."""
    inner = inner_layout(layout, summed)
    inside = jax.tree.map(without_data, grad_shardings)

    def one(params, batch):
        with use_layout(inner):
            (loss, aux), grads = grad_fn(params, batch)
        grads = on_device(grads, layout)
        if summed:
            return loss, aux, jax.tree.map(replica_total, cast_floats(grads, jnp.float32), grad_shardings)
        return loss, aux, jax.lax.with_sharding_constraint(grads, inside)

    if summed:
        return jax.vmap(one, in_axes=(None, 0), out_axes=(0, 0, None), spmd_axis_name=AXIS, axis_name=REPLICAS)
    return jax.vmap(one, in_axes=(None, 0), spmd_axis_name=AXIS)


def replica_total(g: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Inside the summed per-replica vmap: the replicas' sum of a gradient, in `sharding`.
    A gradient summed where its parameter is used arrives unbatched, as the replicas' mean
    (sum_over_replicas), and counts once per replica, like any gradient the replicas share."""
    return jax.lax.with_sharding_constraint(jax.lax.psum(g, REPLICAS), sharding)


def stacked_over_data(sharding: NamedSharding) -> NamedSharding:
    """Sharding of per-replica values [data, ...] of an array sharded like `sharding`."""
    return NamedSharding(sharding.mesh, P(AXIS, *without_data(sharding).spec))
