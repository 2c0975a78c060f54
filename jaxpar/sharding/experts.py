"""The mixture-of-experts call models make: route tokens to experts and back, over the
expert-parallel mesh axes of the active layout (jaxpar.kernels.experts).

Like `attend`, `run_experts` reads the layout entered around tracing, so a model names no
mesh and holds no collective; `expert_matmul`, the experts' own matmuls, multiplies in the
layout's dtype (FP8 with fine-grained scales under train.matmul_dtype=fp8). Expert weights
are named ("experts", ..., "expert_mlp", ...): the "experts" compute rule gives the
expert-parallel axes, "expert_mlp" the axes that split each expert's hidden layer (tensor
parallelism inside the experts).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.kernels.experts import ExpertSpec, expert_parallel, grouped_matmul, local_experts
from jaxpar.kernels.experts.fp8 import expert_matmul as fp8_expert_matmul
from jaxpar.sharding.annotate import active_layout, compute_value, logical_names, mesh_here

TOKEN_NAMES = ("batch", "seq", "embed")
PAIR_NAMES = ("batch", "seq", None)


def top_k_indices(scores_BSE: jax.Array, k: int, groups: int = 1, top_groups: int = 1) -> jax.Array:
    """Indices [B, S, k] of each token's k largest scores, found where the tokens live
    (XLA does not partition top-k: left to jit, every device gathers every token's scores).
    With `groups` > 1, only among the experts of the `top_groups` groups (of consecutive
    experts) whose two best scores sum highest (DeepSeek-V3's group-limited routing)."""
    scores_BSE = jax.lax.stop_gradient(scores_BSE)
    choose = functools.partial(group_limited_top_k, k=k, groups=groups, top_groups=top_groups)
    layout = active_layout()
    if layout is None:
        return choose(scores_BSE)
    spec = layout.rules.spec(PAIR_NAMES, "compute")
    local = jax.shard_map(choose, mesh=mesh_here(layout.mesh), in_specs=spec, out_specs=spec, check_vma=False)
    return local(scores_BSE)


def group_limited_top_k(scores: jax.Array, k: int, groups: int = 1, top_groups: int = 1) -> jax.Array:
    """The top-k indices over the last axis, among the experts of the best `top_groups` of
    its `groups` equal groups (a group's rank: the sum of its two best scores). Experts
    outside them score 0, as in Hugging Face's DeepseekV3 (not minus infinity: with
    negative biased scores a masked expert can still be chosen, and so it is there)."""
    if groups == 1:
        return jax.lax.top_k(scores, k)[1]
    *lead, e = scores.shape
    by_group = scores.reshape(*lead, groups, e // groups)
    rank = jax.lax.top_k(by_group, 2)[0].sum(-1)  # [..., groups]
    kept = jax.nn.one_hot(jax.lax.top_k(rank, top_groups)[1], groups, dtype=jnp.bool_).any(-2)
    return jax.lax.top_k(jnp.where(kept[..., None], by_group, 0.0).reshape(*lead, e), k)[1]


def run_experts(
    x_BSD: jax.Array,
    expert_ids_BSK: jax.Array,
    gates_BSK: jax.Array,
    priority_BSK: jax.Array,
    params: Sequence[nnx.Variable],
    ffn: Callable,
    routing: str,
    capacity_factor: float,
    group_capacity: tuple[int, int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(y [B, S, D], kept [B, S, K]): each token's kept choices through their experts,
    weighted by the gates; under capacity, the higher `priority` (router probability) keeps
    its slot. `ffn(weights, x[, group_sizes])` is the experts' computation on the weights
    `params` hold, laid out for use (see jaxpar.kernels.experts.exchange). `group_capacity`:
    (groups, top_groups) of group-limited capacity routing whose groups have a capacity too
    (exchanged in two hops where the expert axis spans hosts holding whole groups)."""
    weights = tuple(compute_value(p) for p in params)
    layout = active_layout()
    if layout is None:
        return local_experts(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, weights, ffn, routing, capacity_factor,
                             group_capacity=group_capacity)
    rules = layout.rules
    names = [logical_names(p)[len(logical_names(p)) - w.ndim :] for p, w in zip(params, weights)]
    live = lambda name: tuple(a for a in rules.table("compute").get(name, ()) if layout.mesh.shape[a] > 1)
    # expert-parallel axes the context is already manual over (the pipeline executor's): each
    # device holds its own experts and tokens; outside that context (shapes traced whole) none
    manual = tuple(a for a in layout.manual_experts if a in jax.sharding.get_abstract_mesh().manual_axes)
    axis = manual + live("experts")
    spec = ExpertSpec(
        mesh=mesh_here(layout.mesh),  # inside pipeline stages: the context's partly manual mesh
        token_spec=rules.spec(TOKEN_NAMES, "compute"),
        weight_specs=tuple(rules.spec(n, "compute") for n in names),
        axis=axis,
        manual=manual,
        reduce_axes=live("expert_mlp"),
        routing=routing,
        capacity_factor=capacity_factor,
        exchange=layout.expert_exchange,
        dispatch_dtype=layout.expert_dispatch_dtype,
        group_capacity=group_capacity,
        hosts=getattr(layout.hosts, axis[0]) if len(axis) == 1 else 1,
    )
    return expert_parallel(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, weights, ffn, spec)


def expert_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None) -> jax.Array:
    """An expert ffn's matmul: x [E, C, K] . w [E, K, N] (capacity buffers), or x [M, K]
    grouped by expert with `group_sizes` [E] (dropless; rows past the groups give zeros).
    In FP8 with fine-grained scales under train.matmul_dtype=fp8
    (jaxpar.kernels.experts.fp8), else in x's dtype."""
    layout = active_layout()
    if layout is not None and layout.projections.dtype == "fp8":
        return fp8_expert_matmul(x, w, group_sizes, layout.projections.expert_block)
    if group_sizes is None:
        return jnp.einsum("eck,ekn->ecn", x, w)
    return grouped_matmul(x, w, group_sizes)
