"""Which buffer slot each (token, choice) takes when experts have a fixed capacity.

A group of tokens (one sequence) sends at most `capacity` of its (token, choice) pairs to
each expert. Pairs claim slots in priority order: every token's first choice before any
second choice (as GShard), and within one choice rank the more confident routing first
(batch-prioritised routing, V-MoE); ties go to the earlier token. The rest are dropped:
their share of the token's output is zero, and the residual carries the token on.

With group capacity (DeepSeek-style groups of consecutive experts, model.group_capacity), a
token also claims one slot in each group it chose, whatever the number of its choices
there, in the same order; a pair whose token got no slot in its group is dropped too.
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


def group_slots(expert_ids_TK: jax.Array, priority_TK: jax.Array, groups: int, num_experts: int,
                capacity: int) -> jax.Array:
    """Slot in [0, capacity) of each pair's (token, group) [T, k] in its group's buffer, or
    DROPPED: a token claims once per group it chose, at its first choice there (its slot
    shared by its other choices in that group), in capacity_slots' order."""
    group = expert_ids_TK // (num_experts // groups)
    same = group[..., :, None] == group[..., None, :]  # [T, k, k']
    first = first_in_group(group)
    claims = capacity_slots(jnp.where(first, group, groups), priority_TK, groups + 1, capacity)  # `groups`: no claim
    # each choice takes the slot of its group's first choice
    return jnp.sum(jnp.where(same & first[:, None, :], claims[:, None, :], 0), axis=-1)  # exactly one k' each


def first_in_group(group_TK: jax.Array) -> jax.Array:
    """[T, k]: whether each choice is its token's first in its group (no earlier choice there)."""
    same = group_TK[..., :, None] == group_TK[..., None, :]
    return ~jnp.any(jnp.tril(same, k=-1), axis=-1)
