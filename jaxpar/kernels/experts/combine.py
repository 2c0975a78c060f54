"""The experts' combine: each token's output, the weighted sum of the rows its choices came
back in (float32 sums, in the tokens' dtype); and its mirror, the dispatch into a buffer of
rows (`placed_rows`).

Written as autodiff sees it (`reference_weighted_rows`), the picked rows [..., k, D] are a
float32 residual of the backward pass (the weights' gradient reads them): at DeepSeek-V3's
width 4 bytes x k x D a token, more than the layer's expert buffers themselves. Here the
backward pass keeps the rows it picked from ([N, D], in their own dtype, alive anyway) and
picks again; the forward pass, which saves nothing, fuses the pick into the sum. The
values and both gradients are the reference's, operation for operation.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def weighted_rows(rows_ND: jax.Array, index_TK: jax.Array, weights_TK: jax.Array, dtype) -> jax.Array:
    """y [..., D] = sum over k of weights[..., k] x rows[index[..., k]], in float32, cast to
    `dtype`; an index of N or more adds nothing."""
    return _weighted_rows(rows_ND, index_TK, weights_TK.astype(jnp.float32), jnp.dtype(dtype))


def reference_weighted_rows(rows_ND, index_TK, weights_TK, dtype) -> jax.Array:
    """The same, left to autodiff."""
    picked = rows_ND.at[index_TK].get(mode="fill", fill_value=0)
    return jnp.einsum("...kd,...k->...d", picked.astype(jnp.float32), weights_TK.astype(jnp.float32)).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _weighted_rows(rows, index, weights, dtype):
    return reference_weighted_rows(rows, index, weights, dtype)


def _forward(rows, index, weights, dtype):
    return reference_weighted_rows(rows, index, weights, dtype), (rows, index, weights)


def _backward(dtype, residuals, dy):
    rows, index, weights = residuals
    dy = dy.astype(jnp.float32)
    picked = rows.at[index].get(mode="fill", fill_value=0).astype(jnp.float32)
    d_weights = jnp.einsum("...kd,...d->...k", picked, dy)
    d_pairs = (dy[..., None, :] * weights[..., None]).astype(rows.dtype)
    d_rows = jnp.zeros_like(rows).at[index].add(d_pairs, mode="drop")
    return d_rows, None, d_weights


_weighted_rows.defvjp(_forward, _backward)


def placed_rows(x_TD: jax.Array, index_TK: jax.Array, rows: int) -> jax.Array:
    """A buffer [rows, D] whose row index[t, k] holds x[t] (rows no pair lands on: zero; an
    index of `rows` or more: the pair is dropped). Where the indices are distinct, as the
    slots of capacity routing are. Each row is written once, by a gather from the token it
    came from (no zero-filled buffer scattered into, no [T, k, D] copies of the tokens); the
    gradient is each token's k rows summed (`weighted_rows` with weights 1, float32 sums)."""
    return _placed_rows(x_TD, index_TK, rows)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _placed_rows(x, index, rows):
    token = jnp.broadcast_to(jnp.arange(x.shape[0], dtype=jnp.int32)[:, None], index.shape)
    return rows_at(x, row_sources((rows,), (index,), token))


def _placed_forward(x, index, rows):
    return _placed_rows(x, index, rows), index


def _placed_backward(rows, index, d_buffer):
    return weighted_rows(d_buffer, index, jnp.ones(index.shape, jnp.float32), d_buffer.dtype), None


_placed_rows.defvjp(_placed_forward, _placed_backward)


def row_sources(shape: tuple[int, ...], index: tuple[jax.Array, ...], source: jax.Array) -> jax.Array:
    """For each slot of a buffer of `shape`, the row of the source that lands there, or -1
    (empty): `source` scattered to `index` (out-of-range places dropped). Placing rows by
    their index and then gathering them (`rows_at`) moves each row once, where scattering
    the rows themselves would first spread every row over a token's k choices."""
    return jnp.full(shape, -1, jnp.int32).at[index].set(source.astype(jnp.int32), mode="drop")


def rows_at(x: jax.Array, sources: jax.Array) -> jax.Array:
    """x's rows at `sources` (-1: zeros)."""
    return jnp.where((sources >= 0)[..., None], x[jnp.maximum(sources, 0)], 0).astype(x.dtype)
