"""The largest attention logit each query head gives a key it sees: what QK-clip reads
(Kimi K2's MuonClip: the model's clip_qk after the update). Plain jnp, a block of queries
at a time, so the score matrix is never whole; `attend`'s scale (1 / sqrt(the queries'
head size)), the scores in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 512  # queries a step scores at once: [B, heads, BLOCK, S] float32 scores


def largest_logits(q_BSHK: jax.Array, k_BSGK: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                   causal: bool = True, window: int = 0, block: int = BLOCK) -> jax.Array:
    """[heads] float32: per query head, max over the batch and the (query, key) pairs the
    mask shows of q.k / sqrt(K). Which keys a query sees is read from `positions` ([S] or
    [B, S]) and `segment_ids`, not the order given, so a sequence reordered for context
    parallelism or packed with documents is masked as attention masks it: a key at a later
    position, in another document or (with `window` > 0) window or more positions back is
    not seen. Queries are scored `block` at a time (the last block padded, its padding seeing
    nothing)."""
    b, s, h, kd = q_BSHK.shape
    g = k_BSGK.shape[2]
    block = min(block, s)
    pad = -s % block
    q = jnp.pad(q_BSHK, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, s + pad, g, h // g, kd)
    pos = jnp.broadcast_to(positions, (b, s))
    q_pos = jnp.pad(pos, ((0, 0), (0, pad)))
    real = jnp.arange(s + pad) < s
    q_seg = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad)))

    def scores_from(start: jax.Array) -> jax.Array:
        qc = jax.lax.dynamic_slice_in_dim(q, start, block, axis=1)
        pc = jax.lax.dynamic_slice_in_dim(q_pos, start, block, axis=1)
        scores = jnp.einsum("bsgrk,btgk->bgrst", qc, k_BSGK, preferred_element_type=jnp.float32) * kd**-0.5
        seen = jnp.broadcast_to(jax.lax.dynamic_slice_in_dim(real, start, block)[None, :, None], (b, block, s))
        if causal:
            seen &= pos[:, None, :] <= pc[:, :, None]
        if window:
            seen &= pos[:, None, :] > pc[:, :, None] - window
        if q_seg is not None:
            sc = jax.lax.dynamic_slice_in_dim(q_seg, start, block, axis=1)
            seen &= segment_ids[:, None, :] == sc[:, :, None]
        return jnp.max(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=(0, 3, 4))  # [g, r]

    starts = jnp.arange(0, s + pad, block)
    most = scores_from(starts[0]) if len(starts) == 1 else jnp.max(jax.lax.map(scores_from, starts), axis=0)
    return jax.lax.stop_gradient(most.reshape(h))


def clip_factors(logit_max: jax.Array, threshold: float, groups: int) -> tuple[jax.Array, jax.Array]:
    """QK-clip's scales (Kimi K2, MuonClip) for heads whose largest logit passed `threshold`:
    gamma = min(1, threshold / logit_max) per query head ([..., heads]), so that head h's
    logits scale by exactly gamma_h. With a key head per query head (groups == heads) the
    queries and keys each take sqrt(gamma), as K2 does; where query heads share a key head
    the queries take gamma and the keys stay, so a clip of one head never grows its group's
    others. Returns (query scales [..., heads], key scales [..., groups])."""
    gamma = threshold / jnp.maximum(logit_max, threshold)
    if groups == gamma.shape[-1]:
        return jnp.sqrt(gamma), jnp.sqrt(gamma)
    return gamma, jnp.ones((*gamma.shape[:-1], groups), gamma.dtype)
