"""Compressed gradient averaging with error feedback: top-k sparsification and PowerSGD
(Vogels et al., NeurIPS 2019), each a `shard_map` kernel over one mesh axis with a plain
reference beside it (issue 24: the kernels; the trainer does not call them yet).

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

Arrays carry the replicas on a leading axis sharded over `axis` ([n, ...]); the mean comes
back without it, the same on every device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def topk_count(size: int, fraction: float) -> int:
    """Entries a replica sends: ceil(fraction x size), at least one."""
    if not 0 < fraction <= 1:
        raise ValueError(f"top-k fraction={fraction}; use 0 < fraction <= 1")
    return max(1, math.ceil(fraction * size))


def _topk_sent(c: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, flat indices) of c's k entries of largest magnitude."""
    flat = c.reshape(-1)
    _, indices = jax.lax.top_k(jnp.abs(flat), k)
    return flat[indices], indices


def _dense(values: jax.Array, indices: jax.Array, like: jax.Array) -> jax.Array:
    """The entries (values, flat indices) summed into zeros shaped like `like`."""
    return jnp.zeros(like.size, like.dtype).at[indices].add(values).reshape(like.shape)


def topk_mean(g: jax.Array, residual: jax.Array, fraction: float, mesh: Mesh, axis: str) -> tuple[jax.Array, jax.Array]:
    """(mean over replicas of what each sent [...], new residuals [n, ...])."""
    k = topk_count(math.prod(g.shape[1:]), fraction)

    def body(g, residual):
        c = (g + residual)[0]
        values, indices = _topk_sent(c, k)
        all_values = jax.lax.all_gather(values, axis, to="invarying").reshape(-1)  # n x k pairs on the wire
        all_indices = jax.lax.all_gather(indices, axis, to="invarying").reshape(-1)
        total = _dense(all_values, all_indices, c)
        return total / jax.lax.axis_size(axis), (c - _dense(values, indices, c))[None]

    spec = P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(P(), spec))(g, residual)


def topk_mean_reference(g: jax.Array, residual: jax.Array, fraction: float) -> tuple[jax.Array, jax.Array]:
    """The same numbers from the stacked replicas, no collective."""
    k = topk_count(math.prod(g.shape[1:]), fraction)
    c = g + residual
    sent = jax.vmap(lambda c: _dense(*_topk_sent(c, k), c))(c)
    return jnp.mean(sent, axis=0), c - sent


def orthonormalise(p: jax.Array) -> jax.Array:
    """Orthonormal columns spanning p's (a reduced QR, signs fixed so the result is unique)."""
    q, r = jnp.linalg.qr(p)
    signs = jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(q.dtype)
    return q * signs


def powersgd_mean(m: jax.Array, q: jax.Array, residual: jax.Array, mesh: Mesh, axis: str
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """m, residual [n, a, b] per replica; q [b, r] shared. -> (the rank-r approximation of
    the mean [a, b], the next q, new residuals [n, a, b])."""

    def body(m, q, residual):
        c = (m + residual)[0]
        p = orthonormalise(jax.lax.pmean(c @ q, axis))  # [a, r]: (a x r) floats on the wire
        q_next = jax.lax.pmean(c.T @ p, axis)  # [b, r]: (b x r) floats
        approx = p @ q_next.T
        return approx, q_next, (c - approx)[None]

    spec = P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), spec), out_specs=(P(), P(), spec))(m, q, residual)


def powersgd_mean_reference(m: jax.Array, q: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same numbers from the stacked replicas, no collective (the means are linear)."""
    c = m + residual
    p = orthonormalise(jnp.mean(c @ q, axis=0))
    q_next = jnp.mean(jnp.swapaxes(c, 1, 2) @ p, axis=0)
    approx = p @ q_next.T
    return approx, q_next, c - approx[None]


def powersgd_start(shape: tuple[int, int], rank: int, key: jax.Array) -> jax.Array:
    """The first Q [b, rank] for matrices of `shape` [a, b]: Gaussian, the same on every
    replica (one key). A rank above the shorter side would send more than the matrix."""
    if not 0 < rank <= min(shape):
        raise ValueError(f"PowerSGD rank={rank} for a {shape[0]} x {shape[1]} matrix; use 0 < rank <= {min(shape)}")
    return jax.random.normal(key, (shape[1], rank), jnp.float32)
