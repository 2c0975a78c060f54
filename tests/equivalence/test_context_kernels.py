"""Context-parallel attention kernels equal `jax.nn.dot_product_attention` (values and
gradients, fp32, 1e-5 normwise relative) for causal and full attention, grouped-query heads,
packed segments and sequence lengths at the edges (one token per zigzag chunk, tiles that
do not divide the block length).

Here values narrower than the queries and keys (MLA's) in every kernel, over data x context x
tensor; the rest: tests/unit/test_context_kernels.py."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.attention import (
    ContextSpec,
    Masking,
    context_attention,
    flash_attention,
    reference_attention,
    sequence_order,
    unpermute,
)
from jaxpar.sharding.attend import fused_attention
from jaxpar.testing import tree_error

RTOL = 1e-5


def mesh_of(**sizes):
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def inputs(b, s, h, g, k, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, h, k))
    kv = [jax.random.normal(keys[i], (b, s, g, k)) for i in (1, 2)]
    cotangent = jax.random.normal(keys[3], (b, s, h, k))
    return q, kv[0], kv[1], cotangent


def packed(b, s, seed=1):
    """Segment ids [b, s]: a few documents of random lengths per row, then padding (its own id)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(s), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def jax_reference(q, k, v, segment_ids, causal, window=0):
    """JAX's own attention; a sliding window of w keys is its local window of w - 1 before the query."""
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = (window - 1, 0) if window else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, local_window_size=local)


def value_and_grads(fn, q, k, v, cotangent):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cotangent))


def test_values_of_their_own_head_size_in_every_kernel():
    """MLA's values are narrower than its queries and keys (DeepSeek-V3: 128 against 192).
    The plain reference equals jax's attention over the values padded with zeros to the
    keys' size; the blockwise kernel and the ring, Ulysses and all-gather kernels (causal,
    zigzag, packed documents) equal the reference in values and gradients."""
    b, s, h, g, kd, vd = 2, 32, 8, 4, 12, 8
    q, k, _, _ = inputs(b, s, h, g, kd)
    keys = jax.random.split(jax.random.key(7), 2)
    v, ct = jax.random.normal(keys[0], (b, s, g, vd)), jax.random.normal(keys[1], (b, s, h, vd))
    seg = packed(b, s)
    want = value_and_grads(lambda *a: reference_attention(*a, seg, True), q, k, v, ct)
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, kd - vd)))
    assert want[0].shape == (b, s, h, vd) and tree_error(want[0], jax_reference(q, k, padded, seg, True)[..., :vd]) <= RTOL
    index = jnp.arange(s)
    got = value_and_grads(lambda *a: flash_attention(*a, index, index, seg, seg, Masking(True, 16, 8)), q, k, v, ct)
    assert max(tree_error(a, w) for a, w in zip(got, want)) <= RTOL, "flash"
    # the fused Pallas block (interpreted here) and cuDNN's call (its "xla" twin here) pad the heads to one size
    got = value_and_grads(lambda *a: flash_attention(*a, index, index, seg, seg, Masking(True, 16, 8, "pallas_interpret")),
                          q, k, v, ct)
    assert max(tree_error(a, w) for a, w in zip(got, want)) <= RTOL, "pallas"
    whole = value_and_grads(lambda *a: reference_attention(*a, None, True, window=5), q, k, v, ct)
    got = value_and_grads(lambda *a: fused_attention(*a, True, 5, implementation="xla"), q, k, v, ct)
    assert max(tree_error(a, w) for a, w in zip(got, whole)) <= RTOL, "cuDNN's call"
    mesh = mesh_of(data=2, context=2, tensor=2)
    order = sequence_order("zigzag", 2, s)
    for impl in ("ring", "ulysses", "allgather"):
        spec = ContextSpec(impl, mesh, ("context",), P("data", "context", "tensor", None), P("data", "context", "tensor", None),
                           "zigzag", Masking(True, 4, 4))
        run = jax.jit(lambda q, k, v, ct: value_and_grads(lambda *a: context_attention(*a, seg[:, order], spec), q, k, v, ct))
        got = [unpermute(x, "zigzag", 2) for x in run(*(x[:, order] for x in (q, k, v, ct)))]
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.shape == w.shape and tree_error(a, w) <= RTOL, f"{impl} {name}: {tree_error(a, w):.1e}"
