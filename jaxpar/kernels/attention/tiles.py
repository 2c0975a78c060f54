"""What every attention kernel shares about tiles: which keys a query may see and how the
sequence is cut (`Masking`), tile lengths that divide the sequence, and how many tile pairs
the causal skip lets through. The block forwards (jaxpar.kernels.attention.blocks in pure
JAX, .pallas as one fused kernel) and the context-parallel kernels build on it."""

from __future__ import annotations

import dataclasses
import math
from typing import get_args

import jax
import jax.numpy as jnp

from jaxpar.choices import AttentionKernel

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Masking:
    """What a query may see (keys at or before it when causal, the last `window` of them
    when window > 0, and in its segment), the tile lengths, and which block forward runs:
    "jax" (jaxpar.kernels.attention.blocks, everywhere), "pallas" (one fused Triton kernel,
    GPUs) or "pallas_interpret" (the same kernel in the Pallas interpreter;
    jaxpar.kernels.attention.pallas).

    A window w is Mistral's and Gemma's sliding window as Hugging Face masks it: the query at
    position i sees keys i - w < j <= i, w of them with itself (0: every earlier key)."""

    causal: bool = True
    block_q: int = 512
    block_kv: int = 512
    kernel: str = "jax"
    window: int = 0

    def __post_init__(self):
        if self.kernel not in get_args(AttentionKernel):
            raise ValueError(f"attention kernel {self.kernel!r}; use one of {', '.join(get_args(AttentionKernel))}")
        if min(self.block_q, self.block_kv) < 1:
            raise ValueError(f"attention tiles must hold at least one token, not {self.block_q} x {self.block_kv}")
        if self.window < 0 or (self.window and not self.causal):
            raise ValueError(f"attention window {self.window}: a causal mask's window is a positive number of keys "
                             "(0: none)")


def visible(q_index: jax.Array, kv_index: jax.Array, causal: bool, window: int = 0) -> jax.Array:
    """[Sq, Sk] whether each key is visible to each query, by their places in the sequence."""
    shown = jnp.ones((q_index.shape[0], kv_index.shape[0]), bool)
    if causal:
        shown = kv_index[None, :] <= q_index[:, None]
    if window:
        shown = shown & (kv_index[None, :] > q_index[:, None] - window)
    return shown


def tile_visible(q_index: jax.Array, kv_index: jax.Array, causal: bool, window: int = 0) -> jax.Array:
    """Whether a tile of queries sees any key of a tile of keys, each tile a run of
    neighbouring places (as `tile` cuts them): the test the block kernels skip a tile by."""
    seen = jnp.bool_(True)
    if causal:
        seen = jnp.min(kv_index) <= jnp.max(q_index)
    if window:
        seen = seen & (jnp.max(kv_index) > jnp.min(q_index) - window)
    return seen


def tile(n: int, block: int) -> int:
    """The largest divisor of n not above `block`: tiles never straddle the sequence end."""
    best = 1
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= block:
                    best = c
    return best


def needed_tiles(q_index: jax.Array, kv_index: jax.Array, bq: int, bk: int, causal: bool, window: int = 0) -> jax.Array:
    """How many (query tile, key tile) pairs the causal and window skips let through."""
    if not causal:
        return jnp.int32((q_index.shape[0] // bq) * (kv_index.shape[0] // bk))
    q_first, q_last = q_index.reshape(-1, bq).min(1), q_index.reshape(-1, bq).max(1)
    kv_first, kv_last = kv_index.reshape(-1, bk).min(1), kv_index.reshape(-1, bk).max(1)
    seen = kv_first[None, :] <= q_last[:, None]
    if window:
        seen = seen & (kv_last[None, :] > q_first[:, None] - window)
    return jnp.sum(seen).astype(jnp.int32)
