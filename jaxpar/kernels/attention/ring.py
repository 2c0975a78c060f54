"""Ring attention (Liu et al., arXiv 2310.01889), per device inside `jax.shard_map`.

Each device keeps its queries and passes its key/value block around the ring: n steps, each
attending to the block in hand while `ppermute` fetches the next, partial results combined
with the online softmax (`blocks.merge`). The backward pass recomputes block by block and
sums the key/value gradients on their way round the ring (one step behind their block), so
they arrive home after n hops. No device holds more than two key/value blocks or one score
tile per head.

Under a causal mask with the zigzag layout, a block from an earlier device is visible to all
of this device's queries but only its first half of keys is (the rest lies in the future),
and a block from a later device is visible only to this device's late half: the tile skip in
`blocks` turns both into half the work, the same on every device.

Under a sliding window over the contiguous layout (`ContextSpec.ring_steps`) only the first
t of the n blocks reach a device's queries: the ring stops after t - 1 hops, and in the
backward pass each block's key/value gradient sum goes home from t - 1 devices on in one
permute. Each query sees at most w keys, so the contiguous layout is balanced there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import blocks
from jaxpar.kernels.attention.flash import grouped, out_shape
from jaxpar.kernels.attention.order import local_index
from jaxpar.kernels.attention.tiles import NEG_INF
from jaxpar.kernels.hops import send


def _pass_on(tree, ctx):
    """Every device sends `tree` to the next device on the ring (`ctx.ring_hop`)."""
    n = ctx.degree
    return send(tree, ctx.axis, [(i, (i + 1) % n) for i in range(n)], ctx.ring_hop)


def _ring(n, step, carry, held, ctx):
    """Run `step(i, carry, held) -> carry` for i = 0..n-1 while the key/value block `held`
    travels the ring: n-1 hops, each sent at the start of a step so the transfer overlaps
    that step's block. A loop, not n unrolled copies: one set of buffers whatever n is, and
    the next hop cannot start before this step's block is done (`optimization_barrier`),
    so no device holds more than two blocks."""

    def hop(i, state):
        carry, held = state
        incoming = _pass_on(held, ctx)
        return jax.lax.optimization_barrier((step(i, carry, held), incoming))

    carry, held = jax.lax.fori_loop(0, n - 1, hop, (carry, held))
    return step(n - 1, carry, held)


def forward(q, k, v, segment, ctx):
    """(o, residuals, tiles computed) for local q [B, S/n, H, K], k/v [B, S/n, G, K]."""
    n, s = ctx.degree, q.shape[1] * ctx.degree
    rank = jax.lax.axis_index(ctx.axis)
    q_index = local_index(ctx.seq_layout, n, s, rank)
    qg = grouped(q, k.shape[2])

    def step(i, carry, held):
        o, lse, tiles = carry
        kv_index = local_index(ctx.seq_layout, n, s, (rank - i) % n)
        o_b, lse_b, t = blocks.forward(
            qg, held[0], held[1], q_index, kv_index, segment, held[2], ctx.masking_for(s)
        )
        return (*blocks.merge(o, lse, o_b, lse_b), tiles + t)

    init = (
        jnp.zeros(out_shape(qg, v), jnp.float32),
        jnp.full((q.shape[0], k.shape[2], qg.shape[3], q.shape[1]), NEG_INF, jnp.float32),
        jnp.int32(0),
    )
    o, lse, tiles = _ring(ctx.ring_steps(s), step, init, (k, v, segment), ctx)
    o = o.reshape(out_shape(q, v)).astype(q.dtype)
    return o, (q, k, v, segment, o, lse), tiles


def backward(residuals, do, ctx):
    """dq, dk, dv. Each block's key/value gradient is summed on its way round the ring: a
    device adds its share to the sum that arrives for the block it holds, and passes it on at
    the start of the next step, beside the next key/value hop, so both transfers overlap that
    step's block; after the last step one more hop takes every sum home (n hops in all, in
    float32: they are sums over every device's queries; t, the last a permute t - 1 devices
    back, when a sliding window stops the ring after t steps)."""
    q, k, v, segment, o, lse = residuals
    n, s, g = ctx.degree, q.shape[1] * ctx.degree, k.shape[2]
    rank = jax.lax.axis_index(ctx.axis)
    q_index = local_index(ctx.seq_layout, n, s, rank)
    qg, og, dog = grouped(q, g), grouped(o, g), grouped(do, g)

    def step(i, dq, held, arrived):
        """This device's share for block `held`, added to the sum `arrived` for it."""
        kv_index = local_index(ctx.seq_layout, n, s, (rank - i) % n)
        dq_b, dk_b, dv_b = blocks.backward(
            qg, held[0], held[1], og, lse, dog, q_index, kv_index, segment, held[2], ctx.masking_for(s)
        )
        return dq + dq_b, (arrived[0] + dk_b, arrived[1] + dv_b)

    def hop(i, state):
        dq, held, sums = state  # sums: for the block held in the step before
        incoming, arrived = _pass_on(held, ctx), _pass_on(sums, ctx)
        dq, sums = step(i, dq, held, arrived)
        return jax.lax.optimization_barrier((dq, incoming, sums))

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    held, dq = (k, v, segment), jnp.zeros(qg.shape, jnp.float32)
    t = ctx.ring_steps(s)
    if t == 1:
        dq, sums = step(0, dq, held, zeros)  # the block seen is the device's own: its sums are home
    else:
        incoming = _pass_on(held, ctx)  # step 0: no sums have arrived yet
        dq, sums = step(0, dq, held, zeros)
        dq, held, sums = jax.lax.fori_loop(1, t - 1, hop, jax.lax.optimization_barrier((dq, incoming, sums)))
        dq, sums = step(t - 1, dq, held, _pass_on(sums, ctx))  # the last step: no block to fetch
        # home: the block held now came from t - 1 devices back (the next device, round a whole ring)
        sums = send(sums, ctx.axis, [(i, (i - (t - 1)) % n) for i in range(n)], ctx.ring_hop)
    return dq.reshape(q.shape).astype(q.dtype), sums[0].astype(k.dtype), sums[1].astype(v.dtype)


def residual_specs(q_spec, kv_spec, seg_spec, ctx):
    from jax.sharding import PartitionSpec as P

    lse = P(q_spec[0], kv_spec[2], None, q_spec[1])
    return (q_spec, kv_spec, kv_spec, seg_spec, q_spec, lse)
