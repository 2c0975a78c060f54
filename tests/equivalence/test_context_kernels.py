"""Context-parallel attention kernels equal `jax.nn.dot_product_attention` (values and
gradients, fp32, 1e-5 normwise relative) for causal and full attention, grouped-query heads,
packed segments and sequence lengths at the edges (one token per zigzag chunk, tiles that
do not divide the block length).

Here values narrower than the queries and keys (MLA's) in every kernel, over data x context x
tensor; the rest: tests/unit/test_context_kernels.py."""

import jax
import jax.numpy as jnp
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

from ..unit.test_context_kernels import RTOL, mesh_of, inputs, packed, jax_reference, value_and_grads


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
