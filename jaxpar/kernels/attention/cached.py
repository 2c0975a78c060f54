"""Attention over a key/value cache, for sampling: new tokens' queries against every key
written so far, each row at positions of its own (prompts of different lengths).

A cache holds L places a row, [B, L, kv_heads, K]. A call writes the S new tokens' keys and
values at places start[b] .. start[b] + S - 1 of row b, then lets the query at place p see the
places j <= p (and j > p - window under a sliding window). Places past a row's last written
one hold whatever was there (zeros, or a longer prompt's padding): the causal mask keeps
them out, so they never need clearing. The plain reference is
`reference_attention` over the whole sequence: a query's output is the same however its
keys arrived (tests/equivalence/test_kv_cache.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write(cache_BLGK: jax.Array, new_BSGK: jax.Array, start_B: jax.Array) -> jax.Array:
    """The cache with row b's places start[b] .. start[b] + S - 1 replaced by new[b]."""
    put = lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), at, axis=0)
    return jax.vmap(put)(cache_BLGK, new_BSGK, start_B)


def cached_attention(q_BSHK: jax.Array, k_BLGK: jax.Array, v_BLGV: jax.Array, positions_BS: jax.Array,
                     window: int = 0) -> jax.Array:
    """Grouped-query causal attention of queries at `positions[b, s]` over the cache's places,
    softmax in float32 (as the reference). Values may have a head size of their own (MLA)."""
    b, s, h, kd = q_BSHK.shape
    length, g = k_BLGK.shape[1], k_BLGK.shape[2]
    q = q_BSHK.reshape(b, s, g, h // g, kd)
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k_BLGK).astype(jnp.float32) * kd**-0.5
    places = jnp.arange(length)
    visible = places[None, None, :] <= positions_BS[:, :, None]  # [B, S, L]
    if window:
        visible = visible & (places[None, None, :] > positions_BS[:, :, None] - window)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BLGV.dtype)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs, v_BLGV)
    return out.reshape(b, s, h, v_BLGV.shape[-1])
