"""All-gather context parallelism, per device inside `jax.shard_map`: queries stay sharded,
keys and values are gathered whole (Llama 3's choice for long context, simple and
latency-bound rather than bandwidth-bound). The backward pass gathers them again rather
than keeping them (memory s/n, not s, between passes) and reduce-scatters their gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import blocks
from jaxpar.kernels.attention.flash import grouped, out_shape
from jaxpar.kernels.attention.order import local_index, sequence_order


def _gather(k, v, segment, axis):
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return gather(k), gather(v), gather(segment)


def _indices(q, ctx):
    n = ctx.degree
    s = q.shape[1] * n
    q_index = local_index(ctx.seq_layout, n, s, jax.lax.axis_index(ctx.axis))
    return q_index, jnp.asarray(sequence_order(ctx.seq_layout, n, s), jnp.int32)


def forward(q, k, v, segment, ctx):
    k_all, v_all, seg_all = _gather(k, v, segment, ctx.axis)
    q_index, kv_index = _indices(q, ctx)
    masking = ctx.masking_for(q.shape[1] * ctx.degree)
    o, lse, tiles = blocks.forward(grouped(q, k.shape[2]), k_all, v_all, q_index, kv_index, segment, seg_all, masking)
    o = o.reshape(out_shape(q, v)).astype(q.dtype)
    return o, (q, k, v, segment, o, lse), tiles


def backward(residuals, do, ctx):
    q, k, v, segment, o, lse = residuals
    g = k.shape[2]
    k_all, v_all, seg_all = _gather(k, v, segment, ctx.axis)
    q_index, kv_index = _indices(q, ctx)
    dq, dk, dv = blocks.backward(
        grouped(q, g), k_all, v_all, grouped(o, g), lse, grouped(do, g), q_index, kv_index, segment, seg_all,
        ctx.masking_for(q.shape[1] * ctx.degree),
    )
    scatter = lambda x: jax.lax.psum_scatter(x, ctx.axis, scatter_dimension=1, tiled=True)
    return dq.reshape(q.shape).astype(q.dtype), scatter(dk).astype(k.dtype), scatter(dv).astype(v.dtype)


def residual_specs(q_spec, kv_spec, seg_spec, ctx):
    from jax.sharding import PartitionSpec as P

    lse = P(q_spec[0], kv_spec[2], None, q_spec[1])
    return (q_spec, kv_spec, kv_spec, seg_spec, q_spec, lse)
