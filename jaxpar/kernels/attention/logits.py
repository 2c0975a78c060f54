"""The largest attention logit each query head gives a key it sees: what QK-clip reads
(Kimi K2's MuonClip; jaxpar.step.qk_clip). Plain jnp, a block of queries at a time, so the
score matrix is never whole; `attend`'s scale (1 / sqrt(the queries' head size))."""

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
    not seen."""
    b, s, h, kd = q_BSHK.shape
    g = k_BSGK.shape[2]
    q = q_BSHK.reshape(b, s, g, h // g, kd)
    pos = jnp.broadcast_to(positions, (b, s))
    block = block if s % block == 0 else s

    def scores_from(start: jax.Array) -> jax.Array:
        qc = jax.lax.dynamic_slice_in_dim(q, start, block, axis=1)
        pc = jax.lax.dynamic_slice_in_dim(pos, start, block, axis=1)
        scores = jnp.einsum("bsgrk,btgk->bgrst", qc, k_BSGK).astype(jnp.float32) * kd**-0.5
        seen = jnp.ones((b, block, s), bool)
        if causal:
            seen &= pos[:, None, :] <= pc[:, :, None]
        if window:
            seen &= pos[:, None, :] > pc[:, :, None] - window
        if segment_ids is not None:
            sc = jax.lax.dynamic_slice_in_dim(segment_ids, start, block, axis=1)
            seen &= segment_ids[:, None, :] == sc[:, :, None]
        return jnp.max(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=(0, 3, 4))  # [g, r]

    starts = jnp.arange(0, s, block)
    most = scores_from(starts[0]) if s == block else jnp.max(jax.lax.map(scores_from, starts), axis=0)
    return jax.lax.stop_gradient(most.reshape(h))


def clip_factors(logit_max: jax.Array, threshold: float, groups: int) -> tuple[jax.Array, jax.Array]:
    """QK-clip's scales (Kimi K2, MuonClip) for heads whose largest logit passed `threshold`:
    gamma = min(1, threshold / logit_max) per query head ([..., heads]). The queries of head
    h take gamma_h / sqrt(gamma_g) and the keys of its group g sqrt(gamma_g), gamma_g the
    smallest gamma among the group's heads (K2's sqrt(gamma) on each, for one key head a
    query head), so that head h's logits scale by exactly gamma_h. Returns (query scales
    [..., heads], key scales [..., groups])."""
    gamma = jnp.minimum(1.0, threshold / jnp.maximum(logit_max, threshold))
    *lead, heads = gamma.shape
    group = jnp.min(gamma.reshape(*lead, groups, heads // groups), axis=-1)
    root = jnp.sqrt(group)
    return gamma / jnp.repeat(root, heads // groups, axis=-1), root
