"""Ring attention (Liu et al., arXiv 2310.01889), per device inside `jax.shard_map`.

Each device keeps its queries and passes its key/value block around the ring: n steps, each
attending to the block in hand while `ppermute` fetches the next, partial results combined
with the online softmax (`blocks.merge`). The backward pass recomputes block by block and
sends the key/value gradients around the ring with their block, so they arrive home after n
hops. No device holds more than two key/value blocks or one score tile per head.

Under a causal mask with the zigzag layout, a block from an earlier device is visible to all
of this device's queries but only its first half of keys is (the rest lies in the future),
and a block from a later device is visible only to this device's late half: the tile skip in
`blocks` turns both into half the work, the same on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import blocks
from jaxpar.kernels.attention.flash import grouped
from jaxpar.kernels.attention.order import local_index


def _pass_on(tree, axis, n):
    """Every device sends `tree` to the next device on the ring."""
    return jax.lax.ppermute(tree, axis, perm=[(i, (i + 1) % n) for i in range(n)])


def forward(q, k, v, segment, ctx):
    """(o, residuals, tiles computed) for local q [B, S/n, H, K], k/v [B, S/n, G, K]."""
    n, s = ctx.degree, q.shape[1] * ctx.degree
    rank = jax.lax.axis_index(ctx.axis)
    q_index = local_index(ctx.seq_layout, n, s, rank)
    qg = grouped(q, k.shape[2])
    o = jnp.zeros(qg.shape, jnp.float32)
    lse = jnp.full((q.shape[0], k.shape[2], qg.shape[3], q.shape[1]), blocks.NEG_INF, jnp.float32)
    tiles = jnp.int32(0)
    held = (k, v, segment)
    for step in range(n):
        incoming = _pass_on(held, ctx.axis, n) if step < n - 1 else None  # overlaps the block below
        kv_index = local_index(ctx.seq_layout, n, s, (rank - step) % n)
        o_b, lse_b, t = blocks.forward(qg, held[0], held[1], q_index, kv_index, segment, held[2], ctx.masking)
        o, lse = blocks.merge(o, lse, o_b, lse_b)
        tiles += t
        held = incoming
    o = o.reshape(q.shape).astype(q.dtype)
    return o, (q, k, v, segment, o, lse), tiles


def backward(residuals, do, ctx):
    q, k, v, segment, o, lse = residuals
    n, s, g = ctx.degree, q.shape[1] * ctx.degree, k.shape[2]
    rank = jax.lax.axis_index(ctx.axis)
    q_index = local_index(ctx.seq_layout, n, s, rank)
    qg, og, dog = grouped(q, g), grouped(o, g), grouped(do, g)
    dq = jnp.zeros(qg.shape, jnp.float32)
    held = (k, v, segment)
    # float32 on the wire: these are sums over every device's queries
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(n):
        incoming = _pass_on(held, ctx.axis, n) if step < n - 1 else None
        kv_index = local_index(ctx.seq_layout, n, s, (rank - step) % n)
        dq_b, dk_b, dv_b = blocks.backward(qg, held[0], held[1], og, lse, dog, q_index, kv_index, segment, held[2], ctx.masking)
        dq = dq + dq_b
        grads = _pass_on((grads[0] + dk_b, grads[1] + dv_b), ctx.axis, n)  # travels with its block
        held = incoming
    return dq.reshape(q.shape).astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype)


def residual_specs(q_spec, kv_spec, seg_spec, ctx):
    from jax.sharding import PartitionSpec as P

    lse = P(q_spec[0], kv_spec[2], None, q_spec[1])
    return (q_spec, kv_spec, kv_spec, seg_spec, q_spec, lse)
