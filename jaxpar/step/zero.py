"""ZeRO stages: how much of the model state the `data` axis shards.

  stage   parameters   gradients (accumulated)   fp32 master + optimizer state
  0       replicated   replicated                replicated
  1       replicated   replicated                sharded
  2       replicated   sharded                   sharded
  3       sharded      sharded                   sharded

The `fsdp` axis always shards all three (it is ZeRO-3 by construction, through the storage
rules); `parallel.zero.stage` says what the `data` axis adds on top. So `mesh.fsdp=8` inside a
host with `mesh.data=4` across hosts is hybrid sharding (HSDP) at stage 0, and stage 1 there
also spreads the optimizer state over every device.

ZeRO shards whole-model state, not one named dimension: each array gets the data axis on the
dimension with the largest shard that the data degree still divides (never the stacked
`layers` dimension, which the layer scan slices). Arrays no dimension fits stay replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding

from jaxpar.sharding import Layout, shardings_for
from jaxpar.sharding.annotate import ParamNames, add_axes


@dataclasses.dataclass(frozen=True)
class StateShardings:
    """Trees of NamedShardings, one per role a parameter-shaped array plays."""

    params: Any  # the parameters the forward pass reads (compute dtype)
    grads: Any  # the gradient accumulator across microbatches
    optimizer: Any  # fp32 master weights and optimizer moments


def state_shardings(names: Any, shapes: Any, layout: Layout, axes: Sequence[str] = ("data",)) -> StateShardings:
    """The shardings of parameters, gradients and optimizer state at the layout's ZeRO stage."""
    stage = layout.zero.stage
    storage = shardings_for(names, shapes, layout, "storage")
    axes = tuple(a for a in axes if layout.mesh.shape[a] > 1)
    if not axes:
        return StateShardings(storage, storage, storage)

    def widen(sharding: NamedSharding, names_: ParamNames, shape) -> NamedSharding:
        return NamedSharding(layout.mesh, add_axes(sharding.spec, shape.shape, names_.names, layout.mesh, axes))

    sharded = jax.tree.map(widen, storage, names, shapes, is_leaf=lambda x: isinstance(x, (ParamNames, NamedSharding)))
    return StateShardings(
        params=sharded if stage >= 3 else storage,
        grads=sharded if stage >= 2 else storage,
        optimizer=sharded if stage >= 1 else storage,
    )
