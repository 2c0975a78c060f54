"""Compressed gradient averaging with error feedback: top-k sparsification and PowerSGD
(Vogels et al., NeurIPS 2019), each a `shard_map` kernel over one mesh axis with a plain
reference beside it. The trainer applies them to the reduction over `data` across hosts
(jaxpar.step.compression).

Each replica r holds its own gradient g_r and a residual e_r, what compression left out of
its earlier steps. It compresses c_r = g_r + e_r, and keeps e_r' = c_r - sent_r, so that
over any number of steps what it sent plus its residual is exactly what it had to send:

    sum_t sent_r(t) + e_r(T) = sum_t g_r(t) + e_r(0)

  topk       each replica sends the k = ceil(fraction x size) entries of c_r of largest
             magnitude, as (value, index) pairs; one all-gather of n x k pairs, then each
             device scatters them into a dense sum. 8k bytes per replica instead of 4 x size.
  powersgd   one power-iteration step of rank r on each matrix [a, b]: P = mean_r(c_r Q),
             orthonormalised; Q' = mean_r(c_r^T P); every replica then holds the same
             approximation P Q'^T of the mean, and sent_r is that approximation. Two
             all-reduces of (a + b) x r floats instead of a x b. Q' warm-starts the next step.

Arrays carry the replicas on a leading axis sharded over `axis`: [n, ...] sharded
P(axis, *spec), `spec` the sharding of one replica's array over the devices of its host.
Top-k picks the largest entries of each device's block, so nothing moves inside the host
and a device sends only its block's pairs across (the reference cuts the stacked arrays
into the same blocks, `to_blocks`). PowerSGD factors the whole matrix whatever `spec`
does: the partial products of the blocks are summed in the host (reduce-scattered, so
each device sends only its share across) and gathered back, and its numbers do not depend
on the layout (the reference takes the whole arrays). The mean comes back sharded as
`spec`, the same on every replica. References use no collective.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.quantized import entries


def topk_count(size: int, fraction: float) -> int:
    """Entries a block sends: ceil(fraction x size), at least one."""
    if not 0 < fraction <= 1:
        raise ValueError(f"top-k fraction={fraction}; use 0 < fraction <= 1")
    return max(1, math.ceil(fraction * size))


def shard_counts(spec: P, mesh_shape: dict, ndim: int) -> tuple[int, ...]:
    """How many blocks `spec` cuts each of `ndim` dimensions into."""
    return tuple(math.prod(mesh_shape[a] for a in axes) for axes in entries(spec, ndim))


def to_blocks(x: jax.Array, shards: Sequence[int]) -> jax.Array:
    """[n, d0, d1, ...] -> [n, S, d0/s0, d1/s1, ...]: the blocks `shards` cut, numbered
    row-major over (dimension, then its mesh axes in order) as the devices hold them."""
    n, dims = x.shape[0], x.shape[1:]
    x = x.reshape(n, *(v for s, d in zip(shards, dims) for v in (s, d // s)))
    k = len(dims)
    x = x.transpose(0, *(1 + 2 * i for i in range(k)), *(2 + 2 * i for i in range(k)))
    return x.reshape(n, math.prod(shards), *(d // s for s, d in zip(shards, dims)))


def from_blocks(x: jax.Array, shards: Sequence[int]) -> jax.Array:
    """The inverse of `to_blocks`: [n, S, b0, b1, ...] -> [n, s0 x b0, s1 x b1, ...]."""
    n, blocks = x.shape[0], x.shape[2:]
    k = len(blocks)
    x = x.reshape(n, *shards, *blocks)
    x = x.transpose(0, *(v for i in range(k) for v in (1 + i, 1 + k + i)))
    return x.reshape(n, *(s * b for s, b in zip(shards, blocks)))


def _topk_sent(c: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, flat indices) of c's k entries of largest magnitude."""
    flat = c.reshape(-1)
    _, indices = jax.lax.top_k(jnp.abs(flat), k)
    return flat[indices], indices


def _dense(values: jax.Array, indices: jax.Array, like: jax.Array) -> jax.Array:
    """The entries (values, flat indices) summed into zeros shaped like `like`."""
    return jnp.zeros(like.size, like.dtype).at[indices].add(values).reshape(like.shape)


def topk_mean(g: jax.Array, residual: jax.Array, fraction: float, mesh: Mesh, axis: str, spec: P = P()
              ) -> tuple[jax.Array, jax.Array]:
    """g, residual [n, ...] sharded P(axis, *spec) -> (mean over replicas of what each
    sent [...] sharded `spec`, new residuals [n, ...])."""

    def body(g, residual):
        c = (g + residual)[0]
        values, indices = _topk_sent(c, topk_count(c.size, fraction))
        all_values = jax.lax.all_gather(values, axis, to="invarying").reshape(-1)  # n x k pairs on the wire
        all_indices = jax.lax.all_gather(indices, axis, to="invarying").reshape(-1)
        total = _dense(all_values, all_indices, c)
        return total / jax.lax.axis_size(axis), (c - _dense(values, indices, c))[None]

    full = P(axis, *spec)
    return jax.shard_map(body, mesh=mesh, in_specs=(full, full), out_specs=(spec, full))(g, residual)


def topk_mean_reference(g: jax.Array, residual: jax.Array, fraction: float, shards: Sequence[int] | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """The same numbers from the stacked replicas cut into `shards` blocks per dimension
    (default: one block), no collective."""
    shards = tuple(shards or (1,) * (g.ndim - 1))
    c = to_blocks(g + residual, shards)
    k = topk_count(math.prod(c.shape[2:]), fraction)
    sent = jax.vmap(jax.vmap(lambda block: _dense(*_topk_sent(block, k), block)))(c)
    mean = from_blocks(jnp.mean(sent, axis=0, keepdims=True), shards)[0]
    return mean, from_blocks(c - sent, shards)


def orthonormalise(p: jax.Array) -> jax.Array:
    """Orthonormal columns spanning p's, for each matrix of a batch [..., a, r] (a reduced
    QR, signs fixed so the result is unique)."""
    q, r = jnp.linalg.qr(p)
    signs = jnp.where(jnp.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0).astype(q.dtype)
    return q * signs[..., None, :]


def matrix_split(shape: Sequence[int], batch_dims: int) -> int:
    """How many dimensions after the batch make PowerSGD's rows: the split where the matrix
    is closest to square (an attention output [heads, head_dim, embed] is [heads x
    head_dim, embed], not [heads, head_dim x embed])."""
    dims = shape[batch_dims:]
    return max(range(1, len(dims)), key=lambda i: min(math.prod(dims[:i]), math.prod(dims[i:])))


def matrix_shape(shape: Sequence[int], batch_dims: int, split: int | None = None) -> tuple[int, ...]:
    """How PowerSGD sees an array: [*batch, a, b], `split` dimensions after the batch
    making the rows (default: `matrix_split`)."""
    split = matrix_split(shape, batch_dims) if split is None else split
    rows = shape[batch_dims:batch_dims + split]
    return (*shape[:batch_dims], math.prod(rows), math.prod(shape[batch_dims + split:]))


def _power_step(c: jax.Array, q: jax.Array, mean) -> tuple[jax.Array, jax.Array]:
    """(rank-r approximation of mean(c), next q) for c [..., a, b], q [..., b, r]."""
    p = orthonormalise(mean(c @ q))  # [..., a, r]
    q_next = mean(jnp.swapaxes(c, -1, -2) @ p)  # [..., b, r]
    return p @ jnp.swapaxes(q_next, -1, -2), q_next


def factor_spec(spec: P, ndim: int, batch_dims: int, split: int) -> P:
    """Sharding of q [*batch, b, r] for a gradient sharded `spec`: the batch as the
    gradient's, the columns over the axes that shard the column dimensions."""
    batch = (axes or None for axes in entries(spec, ndim)[:batch_dims])
    return P(*batch, _sides(spec, ndim, batch_dims, split)[1] or None, None)


def _sides(spec: P, ndim: int, batch_dims: int, split: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes sharding the rows, axes sharding the columns) of the matrix view."""
    dims = entries(spec, ndim)
    rows, cols = dims[batch_dims:batch_dims + split], dims[batch_dims + split:]
    return tuple(a for axes in rows for a in axes), tuple(a for axes in cols for a in axes)


def _replica_mean(x: jax.Array, partial: tuple[str, ...], axis: str) -> jax.Array:
    """Mean over `axis` (the replicas, across hosts) of x summed over `partial` (devices of
    one replica, each holding a partial sum): reduce-scattered over `partial` first, so
    each device sends 1/|partial| of x across, then gathered back (in the host)."""
    if not partial:
        return jax.lax.pmean(x, axis)
    if x.shape[-2] % jax.lax.axis_size(partial):
        return jax.lax.pmean(jax.lax.psum(x, partial), axis)
    piece = jax.lax.psum_scatter(x, partial, scatter_dimension=x.ndim - 2, tiled=True)
    return jax.lax.all_gather(jax.lax.pmean(piece, axis), partial, axis=x.ndim - 2, tiled=True, to="invarying")


def powersgd_mean(m: jax.Array, q: jax.Array, residual: jax.Array, mesh: Mesh, axis: str, spec: P = P(),
                  batch_dims: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """m, residual [n, ...] sharded P(axis, *spec); q [*batch, b, r] sharded `factor_spec`
    -> (the rank-r approximation of the mean [...] sharded `spec`, the next q, new
    residuals [n, ...]). Each replica's array is one matrix per batch entry
    (`matrix_shape`), however `spec` cuts it: a device multiplies its block, the partial
    products are summed in the host and averaged across, each device sending
    r x (a + b) / (devices of a replica) floats when the sides divide."""
    ndim, split = m.ndim - 1, matrix_split(m.shape[1:], batch_dims)
    rows, cols = _sides(spec, ndim, batch_dims, split)

    def body(m, q, residual):
        c = (m + residual)[0]
        matrix = c.reshape(matrix_shape(c.shape, batch_dims, split))  # this device's block
        p_local = _replica_mean(matrix @ q, cols, axis)  # [..., a_block, r]
        p_whole = jax.lax.all_gather(p_local, rows, axis=p_local.ndim - 2, tiled=True) if rows else p_local
        a = p_local.shape[-2]
        start = (jax.lax.axis_index(rows) if rows else 0) * a
        p_local = jax.lax.dynamic_slice_in_dim(orthonormalise(p_whole), start, a, axis=p_local.ndim - 2)
        q_next = _replica_mean(jnp.swapaxes(matrix, -1, -2) @ p_local, rows, axis)  # [..., b_block, r]
        approx = (p_local @ jnp.swapaxes(q_next, -1, -2)).reshape(c.shape)
        return approx, q_next, (c - approx)[None]

    full, factors = P(axis, *spec), factor_spec(spec, ndim, batch_dims, split)
    return jax.shard_map(body, mesh=mesh, in_specs=(full, factors, full), out_specs=(spec, factors, full))(m, q, residual)


def powersgd_cross_host_floats(shape: Sequence[int], rank: int, spec: P, mesh_shape: dict, batch_dims: int) -> float:
    """Floats one device sends across per `powersgd_mean` call, before the ring factor:
    its share of P's and of Q's all-reduce."""
    split = matrix_split(shape, batch_dims)
    *batch, a, b = matrix_shape(shape, batch_dims, split)
    rows, cols = (math.prod(mesh_shape[x] for x in side) for side in _sides(spec, len(shape), batch_dims, split))
    batch_shards = math.prod(shard_counts(spec, mesh_shape, len(shape))[:batch_dims])
    a_block, b_block = a // rows, b // cols
    p = a_block / cols if a_block % cols == 0 else a_block
    q = b_block / rows if b_block % rows == 0 else b_block
    return math.prod(batch) / batch_shards * rank * (p + q)


def powersgd_mean_reference(m: jax.Array, q: jax.Array, residual: jax.Array, batch_dims: int = 0
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same numbers from the stacked replicas, whole, no collective (the means are
    linear)."""
    c = m + residual
    matrix = c.reshape(c.shape[0], *matrix_shape(c.shape[1:], batch_dims))
    approx, q_next = _power_step(matrix, q, lambda x: jnp.mean(x, axis=0))
    return approx.reshape(c.shape[1:]), q_next, c - approx.reshape(c.shape[1:])[None]


def powersgd_start(shape: Sequence[int], rank: int, key: jax.Array, batch_dims: int = 0) -> jax.Array:
    """The first q [*batch, b, rank] for arrays shaped `shape` (`matrix_shape`): Gaussian,
    orthonormalised (so c q is as well conditioned as c), the same on every replica (one
    key). A rank above the shorter side would send more than the matrix."""
    *batch, a, b = matrix_shape(shape, batch_dims)
    if not 0 < rank <= min(a, b):
        raise ValueError(f"PowerSGD rank={rank} for a {a} x {b} matrix; use 0 < rank <= {min(a, b)}")
    return orthonormalise(jax.random.normal(key, (*batch, b, rank), jnp.float32))
