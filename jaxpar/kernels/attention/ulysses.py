"""DeepSpeed-Ulysses (arXiv 2309.14509), per device inside `jax.shard_map`.

An all-to-all turns sequence-sharded q, k, v [B, S/n, H, K] into head-sharded [B, S, H/n, K];
each device runs ordinary (blockwise) attention over the whole sequence for its heads, and
a second all-to-all brings the output back to sequence shards. Query and kv heads split the
same way, so grouped-query attention keeps each query head with its kv head; the degree
must divide the kv heads (checked before compile). The backward pass mirrors it: the output
gradient goes to head shards, the q/k/v gradients come back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.attention import blocks
from jaxpar.kernels.attention.flash import grouped, out_shape
from jaxpar.kernels.attention.order import sequence_order


def _to_heads(x, axis):
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x, axis):
    return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def forward(q, k, v, segment, ctx):
    q_h, k_h, v_h = (_to_heads(x, ctx.axis) for x in (q, k, v))
    seg_all = None if segment is None else jax.lax.all_gather(segment, ctx.axis, axis=1, tiled=True)
    index = jnp.asarray(sequence_order(ctx.seq_layout, ctx.degree, q_h.shape[1]), jnp.int32)
    masking = ctx.masking_for(q_h.shape[1])
    o_h, lse, tiles = blocks.forward(grouped(q_h, k_h.shape[2]), k_h, v_h, index, index, seg_all, seg_all, masking)
    o_h = o_h.reshape(out_shape(q_h, v_h)).astype(q.dtype)
    return _to_sequence(o_h, ctx.axis), (q_h, k_h, v_h, seg_all, o_h, lse), tiles


def backward(residuals, do, ctx):
    q_h, k_h, v_h, seg_all, o_h, lse = residuals
    g = k_h.shape[2]
    index = jnp.asarray(sequence_order(ctx.seq_layout, ctx.degree, q_h.shape[1]), jnp.int32)
    do_h = _to_heads(do, ctx.axis)
    dq, dk, dv = blocks.backward(
        grouped(q_h, g), k_h, v_h, grouped(o_h, g), lse, grouped(do_h, g), index, index, seg_all, seg_all,
        ctx.masking_for(q_h.shape[1]),
    )
    return (
        _to_sequence(dq.reshape(q_h.shape).astype(q_h.dtype), ctx.axis),
        _to_sequence(dk.astype(k_h.dtype), ctx.axis),
        _to_sequence(dv.astype(v_h.dtype), ctx.axis),
    )


def residual_specs(q_spec, kv_spec, seg_spec, ctx):
    """Residuals rest head-sharded: heads over (their axes, then the context axes)."""

    def heads(spec):
        held = () if spec[2] is None else (spec[2],) if isinstance(spec[2], str) else tuple(spec[2])
        both = held + ctx.axis
        return P(spec[0], None, both[0] if len(both) == 1 else both, None)

    q_h, kv_h = heads(q_spec), heads(kv_spec)
    lse = P(q_spec[0], kv_h[2], None, None)
    seg = None if seg_spec is None else P(seg_spec[0], None)
    return (q_h, kv_h, kv_h, seg, q_h, lse)
