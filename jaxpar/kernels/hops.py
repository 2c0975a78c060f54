"""How ring kernels pass a block to a neighbour: `jax.lax.ppermute`, or, inside pipeline
stages, an all-to-all between the two devices of a ring of two.

The pipeline executor runs each tick's op with `lax.switch`, and devices of different stages
run different branches. XLA emits a ppermute as one collective-permute whose source-target
pairs hold every ring of every stage, and each device waits in it for all the others:
devices in another branch never arrive (on CPU, a rendezvous timeout and an abort). Grouped
collectives (all-to-all, all-gather, reduce-scatter) have replica groups inside one ring,
so only that ring's devices meet. In a ring of two, passing a block on is a swap, which an
all-to-all does with the same bytes; longer rings inside stages are refused before compile
(jaxpar.checks: pipeline-ring-of-two, pipeline-collective-matmul-pairs).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

def hop_here() -> str:
    """The hop for a ring kernel about to be called here: "swap" inside a shard_map that is
    already manual over some mesh axes (the pipeline executor), else "permute". Call it
    outside the kernel's own shard_map (inside one, some axes are always manual)."""
    return "swap" if jax.sharding.get_abstract_mesh().manual_axes else "permute"


def send(tree: Any, axis: str | Sequence[str], perm: list[tuple[int, int]], hop: str = "permute") -> Any:
    """`jax.lax.ppermute(tree, axis, perm)`, or with hop="swap" the same for a ring of two."""
    if hop == "permute":
        return jax.lax.ppermute(tree, axis, perm)
    n = jax.lax.axis_size(axis)
    if hop != "swap" or n != 2:  # refused before compile (jaxpar.checks); a caller's own call lands here
        raise ValueError(f"hop={hop!r} on a ring of {n}: use 'permute', or 'swap' on a ring of two")
    return jax.tree.map(lambda x: _swap(x, axis), tree)


def _swap(x: jax.Array, axis) -> jax.Array:
    """The other device's x: each device sends the other one copy, as a permute would."""
    both = jax.lax.all_to_all(jnp.stack([x, x]), axis, 0, 0, tiled=True)  # [x of device 0, x of device 1]
    return both[1 - jax.lax.axis_index(axis)]
