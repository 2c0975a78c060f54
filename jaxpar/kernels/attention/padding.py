"""One head size for queries, keys and values: kernels that take a single one (cuDNN's fused
attention, the Triton block) run multi-head latent attention, whose values are narrower than
its queries and keys, on zero-padded heads. Exact: zeros added to queries and keys add
nothing to a score (the caller keeps the queries' own scale, 1/sqrt of their size), and
zeros added to values give output columns of zeros, which the caller cuts off."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def same_head_dim(q: jax.Array, k: jax.Array, v: jax.Array, size: int | None = None
                  ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], int]:
    """((q, k, v) padded with zeros on the last axis to `size`, default the larger of the
    two head sizes; the values' own size, to cut the output back to)."""
    size = max(q.shape[-1], v.shape[-1]) if size is None else size
    if size < max(q.shape[-1], v.shape[-1]):
        raise ValueError(f"same_head_dim: size {size} is below the head sizes {q.shape[-1]} and {v.shape[-1]}")
    return tuple(_padded(x, size) for x in (q, k, v)), v.shape[-1]


def _padded(x: jax.Array, size: int) -> jax.Array:
    extra = size - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
