"""The plain reference for the expert kernels: every token through every expert, then each
token keeps its top-k outputs weighted by its gates (and, with a capacity, only the pairs
that got a slot). E times the work of routing; for tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.experts.slots import capacity_slots, expert_capacity, group_slots


def reference_experts(x_BSD, expert_ids_BSK, gates_BSK, weights, ffn, capacity_factor: float | None = None, priority_BSK=None,
                      group_capacity: tuple[int, int] | None = None):
    """(y [B, S, D], kept [B, S, K]); capacity per sequence if `capacity_factor` is set,
    claimed in `priority` order (default: the gates); with `group_capacity` (groups,
    top_groups), each group's too."""
    b, s, d = x_BSD.shape
    k = expert_ids_BSK.shape[-1]
    num_experts = weights[0].shape[0]
    every = ffn(weights, jnp.broadcast_to(x_BSD.reshape(1, b * s, d), (num_experts, b * s, d)))  # [E, T, D]
    every = every.reshape(num_experts, b, s, d)
    picked = jnp.take_along_axis(every.transpose(1, 2, 0, 3), expert_ids_BSK[..., None], axis=2)  # [B, S, K, D]
    if capacity_factor is None:
        kept = jnp.ones(expert_ids_BSK.shape, bool)
    else:
        cap = expert_capacity(capacity_factor, s, k, num_experts)
        priority = gates_BSK if priority_BSK is None else priority_BSK
        kept = jax.vmap(lambda e, p: capacity_slots(e, p, num_experts, cap) >= 0)(expert_ids_BSK, priority)
        if group_capacity:
            groups, top_groups = group_capacity
            group_cap = expert_capacity(capacity_factor, s, top_groups, groups)
            kept &= jax.vmap(lambda e, p: group_slots(e, p, groups, num_experts, group_cap) >= 0)(expert_ids_BSK, priority)
    y = jnp.einsum("bskd,bsk->bsd", picked.astype(jnp.float32), jnp.where(kept, gates_BSK, 0).astype(jnp.float32))
    return y.astype(x_BSD.dtype), kept
