"""Building blocks models use to stay parallelism-agnostic: a layer stack run with
`lax.scan` (compile time independent of depth) and remat policies chosen by name."""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

# name -> policy for jax.checkpoint; "none" means no rematerialisation at all.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """`num_layers` independently initialised copies of a layer, parameters stacked on a
    leading axis named "layers"."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    return make(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array, *args: Any, remat: str = "none") -> jax.Array:
    """Run a stack made by `stack_layers`: x = layer_i(x, *args) for each layer in turn.

    Each step sees one layer's parameters, so FSDP gathers (`compute_value`) happen one
    layer at a time, and the remat policy applies per layer.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; use one of {sorted(REMAT_POLICIES)}")
    graphdef, stacked = nnx.split(layers)

    def body(carry: jax.Array, layer_state: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer_state)(carry, *args), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    out, _ = jax.lax.scan(body, x, stacked)
    return out
