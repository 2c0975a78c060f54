"""The attention call models make: a context-parallel kernel when the active layout shards
the sequence ("seq") over mesh axes; otherwise the layout's `attention`: reference (scores
materialized, softmax in float32), flash (jaxpar's blockwise kernel, O(S x block) memory) or
cudnn (cuDNN's fused flash attention through jax.nn.dot_product_attention, GPUs).

Like `constrain` and `compute_value`, `attend` reads the layout entered around tracing, so a
model names no mesh and holds no collective. The sequence it sees is laid out as
`layout.context.layout` says (the trainer permutes each batch into that order and hands
the model matching RoPE positions); the kernels mask by each token's original place.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import (ContextSpec, Masking, context_attention, flash_attention, reference_attention,
                                     same_head_dim)
from jaxpar.kernels.attention.logits import largest_logits  # noqa: F401  (models call it beside attend)
from jaxpar.kernels.hops import hop_here
from jaxpar.kernels.quantized import entries
from jaxpar.mesh import mesh_here
from jaxpar.sharding.annotate import Layout, active_layout
from jaxpar.sharding.kv_cache import active_cache, attend_cached

Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv_heads", "head_dim")


def sequence_degree(layout: Layout) -> int:
    """How many ways attention's sequence is split (1: no context parallelism)."""
    axes = entries(layout.rules.spec(Q_NAMES, "compute"), 4)[1]
    return math.prod(layout.mesh.shape[a] for a in axes)


def context_spec(layout: Layout, causal: bool = True, window: int = 0) -> ContextSpec:
    """The kernel's view of `layout`: its mesh axes, specs and block sizes."""
    q_spec = layout.rules.spec(Q_NAMES, "compute")
    block = layout.context.block
    return ContextSpec(
        impl=layout.context.impl,
        mesh=layout.mesh,
        axis=entries(q_spec, 4)[1],
        q_spec=q_spec,
        kv_spec=layout.rules.spec(KV_NAMES, "compute"),
        seq_layout=layout.context.layout,
        masking=Masking(causal, block, block, layout.context.kernel, window),
        replica_axis=layout.replica_axis,
        ring_hop=hop_here(),
    )


def reports_logits() -> bool:
    """Whether the step wants each attention layer's largest logit per head (optim.qk_clip,
    the model's clip_qk after the update): a model's attention then also returns
    `largest_logits(q, k, positions, segment_ids, window=...)` of the queries and keys it
    attends with (RoPE applied), and its layer reports it as {"logit_max": [heads]}."""
    layout = active_layout()
    return layout is not None and layout.report_logits


def attend(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, segment_ids=None, causal: bool = True,
           window: int = 0) -> jax.Array:
    """Grouped-query attention; `segment_ids[B, S]` keeps packed sequences apart; `window` > 0
    shows each query only the last `window` keys up to itself (a sliding window, as Mistral's
    and Gemma's local layers; every kernel skips the work outside it). Values may have a head
    size of their own (MLA), which the output then has. Under a key/value cache
    (jaxpar.sharding.kv_cache, sampling) the keys and values go into it and the queries
    attend over it."""
    cache = active_cache()
    if cache is not None:
        return attend_cached(cache, q_BSHK, k_BSGK, v_BSGK, causal, window)
    layout = active_layout()
    if layout is not None and sequence_degree(layout) > 1:
        return context_attention(q_BSHK, k_BSGK, v_BSGK, segment_ids, context_spec(layout, causal, window))
    impl = "reference" if layout is None else layout.attention
    if impl == "cudnn":
        if segment_ids is not None:  # refused before compile (jaxpar.checks); a caller's own call lands here
            raise ValueError("attend: attention=cudnn does not take segment_ids (packed sequences); use flash")
        return _local(layout, lambda q, k, v: fused_attention(q, k, v, causal, window))(q_BSHK, k_BSGK, v_BSGK)
    if impl == "flash":
        index = jnp.arange(q_BSHK.shape[1])
        masking = Masking(causal, layout.context.block, layout.context.block, layout.context.kernel, window)
        return flash_attention(q_BSHK, k_BSGK, v_BSGK, index, index, segment_ids, segment_ids, masking)
    return reference_attention(q_BSHK, k_BSGK, v_BSGK, segment_ids, causal, window=window)


def _local(layout: Layout, kernel):
    """`kernel(q, k, v)` on each device's own heads and sequences, inside a shard_map manual
    over every mesh axis: cuDNN's attention then never needs its custom partitioning, which
    fails inside the pipeline executor's shard_map (manual over the stage axis only)."""
    q_spec, kv_spec = layout.rules.spec(Q_NAMES, "compute"), layout.rules.spec(KV_NAMES, "compute")
    return jax.shard_map(kernel, mesh=mesh_here(layout.mesh), in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)


def fused_attention(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, causal: bool = True, window: int = 0,
                    implementation: str = "cudnn") -> jax.Array:
    """`jax.nn.dot_product_attention` (cuDNN's fused kernel; "xla" for checking it here),
    which takes values of the queries' head size only: the narrower side is padded with
    zeros (MLA's values), exact with the queries' own scale, and the output cut back."""
    (q, k, v), value_dim = same_head_dim(q_BSHK, k_BSGK, v_BSGK)
    local = (window - 1, 0) if window else None  # cuDNN's window: the keys before the query, and itself
    out = jax.nn.dot_product_attention(q, k, v, scale=q_BSHK.shape[-1] ** -0.5, is_causal=causal,
                                       local_window_size=local, implementation=implementation)
    return out[..., :value_dim]
