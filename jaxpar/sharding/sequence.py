"""Looking ahead along the sequence, whatever order the layout laid it out in.

For context parallelism the trainer permutes each batch's sequences (the zigzag layout,
jaxpar.kernels.attention.order), so "the token k places later" is not the slot k places
later. `ahead` reads the layout entered around tracing, as `attend` does, so a model that
predicts further than the next token (DeepSeek-V3's multi-token prediction) names no
layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.kernels.attention import sequence_order
from jaxpar.sharding.annotate import active_layout
from jaxpar.sharding.attend import sequence_degree


def ahead(x_BS: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(x at the token k places later in each sequence's original order, at every slot;
    [S] whether that token is inside the sequence). Slots past the end hold x's own value.
    A plain shift when the sequence is in order; under a permuted layout a gather along the
    (sharded) sequence, which the partitioner turns into a collective."""
    seq = x_BS.shape[1]
    layout = active_layout()
    n = 1 if layout is None else sequence_degree(layout)
    order = sequence_order(layout.context.layout if layout is not None else "contiguous", n, seq)
    slot_of = np.argsort(order)  # original position -> slot
    later = order + k
    inside = later < seq
    source = np.where(inside, slot_of[np.minimum(later, seq - 1)], np.arange(seq))
    return jnp.take(x_BS, jnp.asarray(source, jnp.int32), axis=1), jnp.asarray(inside)
