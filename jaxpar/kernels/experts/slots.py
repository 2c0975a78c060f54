"""Which buffer slot each (token, choice) takes when experts have a fixed capacity.

A group of tokens (one sequence) sends at most `capacity` of its (token, choice) pairs to
each expert. Pairs claim slots in priority order: every token's first choice before any
second choice (as GShard), and within one choice rank the more confident routing first
(batch-prioritised routing, V-MoE); ties go to the earlier token. The rest are dropped:
their share of the token's output is zero, and the residual carries the token on.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DROPPED = -1


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Slots per expert for a group of `tokens`: capacity_factor x the balanced share."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def capacity_slots(expert_ids_TK: jax.Array, priority_TK: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Slot in [0, capacity) of each pair [T, k] in its expert's buffer, or DROPPED.

    priority_TK: router probabilities, higher first within a choice rank.
    """
    t, k = expert_ids_TK.shape
    rank = jnp.broadcast_to(jnp.arange(k), (t, k)).T.reshape(-1)  # rank-major, so equal keys keep token order
    confidence = -jax.lax.stop_gradient(priority_TK).astype(jnp.float32).T.reshape(-1)
    order = jnp.lexsort((confidence, rank))  # choice rank first, then confidence; stable
    ids = expert_ids_TK.T.reshape(-1)
    claimed = jax.nn.one_hot(ids[order], num_experts, dtype=jnp.int32)
    place_sorted = jnp.sum(jnp.cumsum(claimed, axis=0) * claimed, axis=-1) - 1  # 0-based, per expert
    place = jnp.zeros_like(place_sorted).at[order].set(place_sorted)
    slots = jnp.where(place < capacity, place, DROPPED)
    return slots.reshape(k, t).T
