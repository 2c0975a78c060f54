"""How a sequence is laid out over the devices of a context axis.

  contiguous  device r holds tokens [r*s/n, (r+1)*s/n)
  zigzag      the sequence cut into 2n chunks; device r holds chunks r and 2n-1-r, so under a
              causal mask every device has the same number of visible (query, key) pairs
              (the early chunk sees little, the late one much)

The trainer permutes each batch into this order once (tokens, targets, RoPE positions), so
the model sees a plain sharded sequence; the kernels use `local_index` to know which tokens
they hold when masking.
"""

from __future__ import annotations

from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.choices import SequenceLayout


def sequence_order(layout: str, n: int, s: int) -> np.ndarray:
    """[s] original position of the token in each slot of the laid-out sequence."""
    if layout == "contiguous" or n == 1:
        return np.arange(s)
    if layout == "zigzag":
        chunks = np.arange(s).reshape(2 * n, s // (2 * n))
        return np.concatenate([np.concatenate([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])
    raise ValueError(f"sequence layout {layout!r}; use one of {', '.join(get_args(SequenceLayout))}")


def chunk_length(layout: str, n: int, s: int) -> int:
    """Length of the runs of consecutive positions the layout deals out: a tile that stays
    inside one run holds neighbouring tokens, so the causal skip can drop it whole."""
    return s // (2 * n) if layout == "zigzag" and n > 1 else s // n


def local_index(layout: str, n: int, s: int, rank: jax.Array) -> jax.Array:
    """[s/n] original positions of the tokens device `rank` (traced) holds."""
    return jnp.asarray(sequence_order(layout, n, s).reshape(n, s // n), jnp.int32)[rank]


def unpermute(x: jax.Array, layout: str, n: int, axis: int = 1) -> jax.Array:
    """Bring an array laid out by `sequence_order` back to the original order."""
    inverse = np.argsort(sequence_order(layout, n, x.shape[axis]))
    return jnp.take(x, inverse, axis=axis)
