"""Grouped matmul for dropless experts: `jax.lax.ragged_dot`, differentiable under `vmap`.

jax.lax.ragged_dot has no batching rule for unbatched weights, which is the case under the
trainer's per-replica vmap (gradients per data replica, jaxpar.step.replicas). Here the
forward and backward are each one call with a `custom_vmap` rule that runs the replicas one
after another (`lax.map`); unbatched, they are the plain ragged_dot and its transpose.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.custom_batching import custom_vmap


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """y[M, N]: rows of x in consecutive groups, group g multiplied by w[g]; rows past the
    last group are zero (jax.lax.ragged_dot)."""
    return _grouped(x_MK, w_GKN, group_sizes_G)


def _ragged(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes)


def _ragged_transpose(x, w, group_sizes, dy):
    _, pullback = jax.vjp(lambda x, w: _ragged(x, w, group_sizes), x, w)
    return pullback(dy)


def replica_mapped(fn: Callable) -> Callable:
    """`fn`, batched by running it once per batch element (for ops without a vmap rule)."""

    @custom_vmap
    def run(*args):
        return fn(*args)

    @run.def_vmap
    def _(axis_size, in_batched, *args):
        batched = tuple(a for a, b in zip(args, in_batched) if b)

        def one(slices):
            rest = iter(slices)
            return run(*(next(rest) if b else a for a, b in zip(args, in_batched)))

        out = jax.lax.map(one, batched)
        return out, jax.tree.map(lambda _: True, out)

    return run


_forward = replica_mapped(_ragged)
_backward = replica_mapped(_ragged_transpose)


@jax.custom_vjp
def _grouped(x, w, group_sizes):
    return _forward(x, w, group_sizes)


def _grouped_fwd(x, w, group_sizes):
    return _forward(x, w, group_sizes), (x, w, group_sizes)


def _grouped_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = _backward(x, w, group_sizes, dy)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
