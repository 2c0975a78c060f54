"""The mixture-of-experts call models make: route tokens to experts and back, over the
expert-parallel mesh axes of the active layout (jaxpar.kernels.experts).

Like `attend`, `run_experts` reads the layout entered around tracing, so a model names no
mesh and holds no collective. Expert weights are named ("experts", ..., "expert_mlp", ...):
the "experts" compute rule gives the expert-parallel axes, "expert_mlp" the axes that split
each expert's hidden layer (tensor parallelism inside the experts).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from flax import nnx

from jaxpar.kernels.experts import ExpertSpec, expert_parallel, local_experts
from jaxpar.sharding.annotate import active_layout, compute_value, logical_names, mesh_here

TOKEN_NAMES = ("batch", "seq", "embed")
PAIR_NAMES = ("batch", "seq", None)


def top_k_indices(scores_BSE: jax.Array, k: int) -> jax.Array:
    """Indices [B, S, k] of each token's k largest scores, found where the tokens live.
    XLA does not partition top-k: left to jit, every device gathers every token's scores."""
    scores_BSE = jax.lax.stop_gradient(scores_BSE)
    layout = active_layout()
    if layout is None:
        return jax.lax.top_k(scores_BSE, k)[1]
    spec = layout.rules.spec(PAIR_NAMES, "compute")
    local = jax.shard_map(lambda s: jax.lax.top_k(s, k)[1], mesh=mesh_here(layout.mesh), in_specs=spec, out_specs=spec, check_vma=False)
    return local(scores_BSE)


def run_experts(
    x_BSD: jax.Array,
    expert_ids_BSK: jax.Array,
    gates_BSK: jax.Array,
    priority_BSK: jax.Array,
    params: Sequence[nnx.Variable],
    ffn: Callable,
    routing: str,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """(y [B, S, D], kept [B, S, K]): each token's kept choices through their experts,
    weighted by the gates; under capacity, the higher `priority` (router probability) keeps
    its slot. `ffn(weights, x[, group_sizes])` is the experts' computation on the weights
    `params` hold, laid out for use (see jaxpar.kernels.experts.exchange)."""
    weights = tuple(compute_value(p) for p in params)
    layout = active_layout()
    if layout is None:
        return local_experts(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, weights, ffn, routing, capacity_factor)
    rules = layout.rules
    names = [logical_names(p)[len(logical_names(p)) - w.ndim :] for p, w in zip(params, weights)]
    live = lambda name: tuple(a for a in rules.table("compute").get(name, ()) if layout.mesh.shape[a] > 1)
    spec = ExpertSpec(
        mesh=mesh_here(layout.mesh),  # inside pipeline stages: the context's partly manual mesh
        token_spec=rules.spec(TOKEN_NAMES, "compute"),
        weight_specs=tuple(rules.spec(n, "compute") for n in names),
        axis=live("experts"),
        reduce_axes=live("expert_mlp"),
        routing=routing,
        capacity_factor=capacity_factor,
        exchange=layout.expert_exchange,
    )
    return expert_parallel(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, weights, ffn, spec)
