"""The embedding lookup models make: `table[ids]`, written so the partitioner can split it
whatever the layout.

A gather from a table sharded over its rows (vocab-parallel embedding, `vocab` on `tensor`)
is what XLA's SPMD partitioner aborts on inside a shard_map that is manual over some mesh
axes (the pipeline executor, manual over stage, data and perhaps expert) once a microbatch holds as many
ids as the table has rows (`spmd_partitioner_util.cc:498 Check failed:
partition_group_list.num_replica_groups() * ...`, jaxlib 0.12). There the lookup runs as
a one-hot matmul instead: each tensor rank multiplies by its rows and the partial sums are
reduced, as Megatron's vocab-parallel embedding does by hand. Its cost, 2 x ids x rows x
width flops forward and as much for the table's gradient, is about two thirds of the
vocabulary head's; elsewhere the lookup stays a gather. Values are equal either way (a
one-hot product adds one row and zeros); the table's gradient sums the same terms.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxpar.sharding.annotate import Layout, active_layout


def lookup(table: jax.Array, ids: jax.Array, table_names: Sequence[str | None] = ("vocab", "embed")) -> jax.Array:
    """table[ids] ([*ids.shape, width]) for a table [rows, width] whose dimensions carry
    `table_names`, as `compute_value` gives it."""
    if not one_hot_needed(table_names):
        return jnp.take(table, ids, axis=0)
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype)
    return jnp.einsum("...v,vd->...d", one_hot, table)


def one_hot_needed(table_names: Sequence[str | None]) -> bool:
    """Inside a partly manual shard_map, with the table's rows sharded by the compute rules."""
    layout = active_layout()
    return layout is not None and bool(jax.sharding.get_abstract_mesh().manual_axes) and rows_sharded(layout, table_names)


def rows_sharded(layout: Layout, table_names: Sequence[str | None] = ("vocab", "embed")) -> bool:
    """Whether the compute rules shard a table's rows (vocab-parallel)."""
    spec = layout.rules.spec(table_names, "compute")
    return len(spec) > 0 and spec[0] is not None
