"""Plain attention every kernel is checked against: the whole score matrix on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q_BSHK, k_BTGK, v_BTGK, segment_ids=None, causal: bool = True, q_index=None, kv_index=None,
                        window: int = 0):
    """Grouped-query attention, softmax in float32. `q_index`/`kv_index` give each token's
    place in the sequence for the causal mask (default: the order given); `segment_ids[B, S]`
    keep packed sequences apart (queries and keys are the same tokens); `window` > 0 shows
    each query only the keys i - window < j <= i (a sliding window). Values may have a head
    size of their own (MLA): the output has theirs."""
    b, s, h, kd = q_BSHK.shape
    t, g = k_BTGK.shape[1], k_BTGK.shape[2]
    q = q_BSHK.reshape(b, s, g, h // g, kd)
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k_BTGK).astype(jnp.float32) * kd**-0.5
    q_index = jnp.arange(s) if q_index is None else q_index
    kv_index = jnp.arange(t) if kv_index is None else kv_index
    visible = jnp.ones((1, s, t), bool)
    if causal:
        visible = (kv_index[None, :] <= q_index[:, None])[None]
    if window:  # written out here, not shared with the kernels' mask: the reference checks them
        visible = visible & (kv_index[None, :] > q_index[:, None] - window)[None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BTGK.dtype)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs, v_BTGK)
    return out.reshape(b, s, h, v_BTGK.shape[-1])
