"""Splitting a batch into microbatches without moving data between devices."""

from __future__ import annotations

import jax

from jaxpar.sharding import Layout


def split_microbatches(x: jax.Array, m: int, names: tuple, layout: Layout) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking rows i, i+m, i+2m, ... into microbatch i, so each
    device's rows split evenly across microbatches and nothing moves between devices."""
    b = x.shape[0]
    x = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, layout.sharding((None, *names), "compute"))


def split_batch(batch: dict, m: int, names: dict[str, tuple], layout: Layout) -> dict:
    """Every field of a batch, whose dimensions carry `names[field]`, split into m."""
    return {k: split_microbatches(v, m, names[k], layout) for k, v in batch.items()}
