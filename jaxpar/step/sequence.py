"""Laying a batch's sequences out for context parallelism.

With the zigzag layout (jaxpar.kernels.attention.order) each device's shard of the sequence
is two chunks from opposite ends. The step permutes every [B, S] field of the batch into that
order once, before the model, and adds the RoPE positions of the permuted tokens; losses
are sums over tokens, so the order does not change them. The inputs are not sharded along
the sequence when this runs, so the permutation moves no data between devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import sequence_order
from jaxpar.sharding import Layout, sequence_degree

SEQUENCE_FIELDS = ("inputs", "targets", "weights", "positions", "segment_ids")


def sequence_permutation(layout: Layout, seq_len: int) -> jax.Array | None:
    """The order `lay_out_sequences` puts a sequence of `seq_len` in, or None where it keeps it."""
    n = sequence_degree(layout)
    if n == 1 or layout.context.layout == "contiguous":
        return None
    return jnp.asarray(sequence_order(layout.context.layout, n, seq_len), jnp.int32)


def lay_out_sequences(batch: dict, layout: Layout) -> dict:
    """`batch` with its [B, S] fields in the layout's sequence order, plus "positions"."""
    seq_len = batch["inputs"].shape[1]
    order = sequence_permutation(layout, seq_len)
    if order is None:
        return batch
    out = dict(batch)
    out.setdefault("positions", jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), batch["inputs"].shape))
    for name in SEQUENCE_FIELDS:
        if name in out:
            out[name] = jnp.take(out[name], order, axis=1)
    return out
