"""Context-parallel attention kernels equal `jax.nn.dot_product_attention` (values and
gradients, fp32, 1e-5 normwise relative) for causal and full attention, grouped-query heads,
packed segments and sequence lengths at the edges (one token per zigzag chunk, tiles that
do not divide the block length).

Values narrower than the queries and keys (MLA's) in every kernel, over data x context x
tensor: tests/equivalence/test_context_kernels.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.attention import (
    ContextSpec,
    Masking,
    context_attention,
    executed_tiles,
    flash_attention,
    reference_attention,
    sequence_order,
    unpermute,
)
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


CASES = [
    # impl, mesh, (batch, seq, heads, kv heads, head dim), block
    ("ring", dict(data=2, context=2, tensor=2), (2, 32, 8, 4, 8), 4),
    ("ring", dict(context=8), (1, 16, 4, 2, 8), 3),  # one token per zigzag chunk
    ("ring", dict(data=2, context=4), (2, 48, 4, 1, 8), 4),  # multi-query; tile 3 < block 4
    ("ulysses", dict(data=2, context=2, tensor=2), (2, 32, 8, 4, 8), 4),
    ("ulysses", dict(context=4, tensor=2), (1, 24, 16, 8, 4), 5),
    ("allgather", dict(data=2, context=2, tensor=2), (2, 32, 8, 4, 8), 4),
    ("allgather", dict(context=8), (1, 16, 4, 2, 8), 3),
]


# Each case under three masks that between them take every value of each setting once:
# causal or not, zigzag or contiguous order, packed documents or none, a sliding window of a
# quarter of the sequence or none (every pair of settings was run once: 42 compiles for what
# these 21 find). The window over the contiguous order stops the ring early in the cases of
# 4 and 8 devices (2 of 4 blocks, 3 of 8); under zigzag: test_windowed_ring_under_zigzag.
MASKS = [(True, "zigzag", False, False), (True, "contiguous", True, True), (False, "zigzag", True, False)]


@pytest.mark.parametrize("impl, sizes, dims, block", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal, layout, segments, windowed", MASKS, ids=str)
def test_kernel_equals_dot_product_attention(impl, sizes, dims, block, causal, segments, layout, windowed):
    mesh = mesh_of(**sizes)
    b, s, h, g, kd = dims
    q, k, v, ct = inputs(*dims)
    seg = packed(b, s) if segments else None
    batch = "data" if "data" in sizes else None
    heads = "tensor" if "tensor" in sizes else None
    window = s // 4 if windowed else 0
    spec = ContextSpec(impl, mesh, ("context",), P(batch, "context", heads, None), P(batch, "context", heads, None),
                       layout, Masking(causal, block, block, window=window))
    order = sequence_order(layout, mesh.shape["context"], s)
    permute = lambda x: None if x is None else x[:, order]
    seg_laid = permute(seg)
    got = jax.jit(lambda q, k, v, ct: value_and_grads(lambda *a: context_attention(*a, seg_laid, spec), q, k, v, ct))(
        *map(permute, (q, k, v, ct))
    )
    got = [unpermute(x, layout, mesh.shape["context"]) for x in got]
    want = value_and_grads(lambda *a: jax_reference(*a, seg, causal, window), q, k, v, ct)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert tree_error(a, w) <= RTOL, f"{impl} {name}: {tree_error(a, w):.1e}"


@pytest.mark.parametrize("segments, window", [(False, 0), (True, 11)])
def test_flash_and_plain_reference_equal_dot_product_attention(segments, window):
    q, k, v, ct = inputs(2, 40, 6, 3, 8)
    seg = packed(2, 40) if segments else None
    index = jnp.arange(40)
    want = value_and_grads(lambda *a: jax_reference(*a, seg, True, window), q, k, v, ct)
    for fn in (
        lambda *a: flash_attention(*a, index, index, seg, seg, Masking(True, 16, 8, window=window)),
        lambda *a: reference_attention(*a, seg, True, window=window),
    ):
        got = value_and_grads(fn, q, k, v, ct)
        assert max(tree_error(a, w) for a, w in zip(got, want)) <= RTOL


def test_windowed_ring_under_zigzag_skips_tiles_but_not_hops():
    """A sliding window under the zigzag order: values and gradients equal JAX's windowed
    attention; the tiles outside every window are skipped (fewer than causal attention's),
    but a device's late chunk needs the blocks after it, so the ring makes all its hops."""
    mesh = mesh_of(context=4)
    dims, window = (2, 32, 4, 2, 8), 5
    q, k, v, ct = inputs(*dims)
    seg = packed(2, 32)
    order = sequence_order("zigzag", 4, 32)
    spec = ContextSpec("ring", mesh, ("context",), P(None, "context"), P(None, "context"), "zigzag",
                       Masking(True, 4, 4, window=window))
    assert spec.ring_steps(32) == 4
    laid = [x[:, order] for x in (q, k, v, ct)]
    got = jax.jit(lambda q, k, v, ct: value_and_grads(lambda *a: context_attention(*a, seg[:, order], spec), q, k, v, ct))(*laid)
    want = value_and_grads(lambda *a: jax_reference(*a, seg, True, window), q, k, v, ct)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert tree_error(unpermute(a, "zigzag", 4), w) <= RTOL, name
    causal = ContextSpec("ring", mesh, ("context",), P(None, "context"), P(None, "context"), "zigzag", Masking(True, 4, 4))
    tiles = [np.asarray(jax.jit(lambda q, k, v: executed_tiles(q, k, v, None, c))(*laid[:3])) for c in (spec, causal)]
    assert tiles[0].sum() < tiles[1].sum() / 2, tiles


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    """The kernel's own count of score tiles computed per device: equal under zigzag; under
    the contiguous layout the last device does (2n-1)/1 times the first's block work."""
    mesh = mesh_of(context=8)
    q, k, v, _ = inputs(1, 64, 2, 2, 4)
    counts = {}
    for layout in ("zigzag", "contiguous"):
        spec = ContextSpec("ring", mesh, ("context",), P(None, "context"), P(None, "context"), layout, Masking(True, 4, 4))
        counts[layout] = np.asarray(jax.jit(lambda q, k, v: executed_tiles(q, k, v, None, spec))(q, k, v))
    assert len(set(counts["zigzag"].tolist())) == 1
    assert counts["contiguous"].max() > 4 * counts["contiguous"].min()
    assert counts["zigzag"].sum() == counts["contiguous"].sum()  # the same tiles, spread evenly
    # A block longer than a zigzag chunk still tiles by chunk: a tile spanning a device's
    # early and late chunk would never be skipped (every device would compute every tile).
    spec = ContextSpec("ring", mesh, ("context",), P(None, "context"), P(None, "context"), "zigzag", Masking(True, 512, 512))
    big = np.asarray(jax.jit(lambda q, k, v: executed_tiles(q, k, v, None, spec))(q, k, v))
    np.testing.assert_array_equal(big, counts["zigzag"])


def test_kernel_under_per_replica_vmap():
    """Gradients per data replica come from `vmap(spmd_axis_name="data")`: the custom_vmap
    rule folds replicas into the batch and the results match the unbatched kernel."""
    mesh = mesh_of(data=2, context=4)
    q, k, v, ct = inputs(4, 32, 4, 2, 8)
    spec = ContextSpec("ring", mesh, ("context",), P(None, "context"), P(None, "context"), replica_axis="data")
    split = lambda x: x.reshape(2, 2, *x.shape[1:])

    def per_replica(q, k, v):
        return jax.vmap(lambda q, k, v: context_attention(q, k, v, None, spec), spmd_axis_name="data")(q, k, v)

    got = jax.jit(lambda *a: value_and_grads(per_replica, *a))(*map(split, (q, k, v, ct)))
    order = sequence_order("zigzag", 4, 32)
    want = value_and_grads(lambda *a: jax_reference(*a, None, True), *(x[:, np.argsort(order)] for x in (q, k, v, ct)))
    for a, w in zip(got, want):
        assert tree_error(a.reshape(w.shape), w[:, order]) <= RTOL  # inputs were read as laid out


def test_ulysses_refuses_a_degree_that_does_not_divide_the_kv_heads():
    mesh = mesh_of(context=4, tensor=2)
    q, k, v, _ = inputs(1, 16, 8, 4, 4)
    spec = ContextSpec("ulysses", mesh, ("context",), P(None, "context", "tensor"), P(None, "context", "tensor"))
    with pytest.raises(ValueError, match="context degree 4 does not divide the 2 kv heads each device holds"):
        context_attention(q, k, v, None, spec)
    with pytest.raises(ValueError, match="context impl 'tree'; use one of ring, ulysses, allgather"):
        context_attention(q, k, v, None, ContextSpec("tree", mesh, ("context",), P(), P()))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments", [False, True], ids=["", "packed"])
def test_pallas_block_forward_equals_the_jax_forward(causal, segments):
    """The fused block kernel (Pallas interpreter on CPU) against its plain reference,
    `blocks.forward`, on a zigzag ring step's tokens: grouped heads, skipped tiles, rows
    that see nothing (-inf log-normaliser)."""
    from jaxpar.kernels.attention import blocks

    q, k, v, _ = inputs(2, 32, 4, 2, 8)
    qg = q.reshape(2, 32, 2, 2, 8)
    order = jnp.asarray(sequence_order("zigzag", 2, 32))
    seg = packed(2, 32) if segments else None
    for q_index, kv_index in ((order[:16], order[16:]), (order[16:], order[:16]), (order, order)):
        nq, nk = q_index.shape[0], kv_index.shape[0]
        segs = (None, None) if seg is None else (seg[:, :nq], seg[:, :nk])
        args = (qg[:, :nq], k[:, :nk], v[:, :nk], q_index, kv_index, *segs)
        want = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 4, 8)))(*args)
        got = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 4, 8, kernel="pallas_interpret")))(*args)
        assert tree_error(got[0], want[0]) <= RTOL
        np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
        finite = np.isfinite(np.asarray(want[1]))
        np.testing.assert_allclose(np.asarray(got[1])[finite], np.asarray(want[1])[finite], rtol=RTOL, atol=RTOL)
        assert int(got[2]) == int(want[2])  # tiles computed


def test_ring_with_the_pallas_block_kernel_equals_dot_product_attention():
    """The pallas block forward inside the ring (values) and the pure-JAX backward fed its
    output and log-normaliser (gradients), GQA and packed segments."""
    mesh = mesh_of(data=2, context=4)
    dims = (2, 32, 4, 2, 8)
    q, k, v, ct = inputs(*dims)
    seg = packed(2, 32)
    spec = ContextSpec("ring", mesh, ("context",), P("data", "context"), P("data", "context"), "zigzag",
                       Masking(True, 4, 4, kernel="pallas_interpret"))
    order = sequence_order("zigzag", 4, 32)
    got = jax.jit(lambda *a: value_and_grads(lambda *b: context_attention(*b, seg[:, order], spec), *a))(
        *(x[:, order] for x in (q, k, v, ct))
    )
    want = value_and_grads(lambda *a: jax_reference(*a, seg, True), q, k, v, ct)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert tree_error(unpermute(a, "zigzag", 4), w) <= RTOL, name


@pytest.mark.parametrize("impl, n, layout, windowed", [("ring", 4, "zigzag", False), ("ulysses", 4, "zigzag", False),
                                                         ("allgather", 4, "zigzag", False),
                                                         ("ring", 8, "contiguous", True)])
def test_collective_bytes_match_the_formula(impl, n, layout, windowed):
    """One attention layer forward + backward, compiled: bytes each device sends over the
    context axis, per collective kind, within 5% of jaxpar.inspect.formulas.context_traffic_elements
    (reference.md's ring / Ulysses / all-gather). With a sliding window of s/8 over a ring of
    8 in the contiguous order the ring stops after 2 blocks (1 hop of 7), and the score
    tiles each device computes are formulas.windowed_tile_pairs (the first device, whose
    window runs past the sequence's start, fewer)."""
    from jax.sharding import NamedSharding

    from jaxpar.inspect.formulas import context_traffic_elements, windowed_tile_pairs
    from jaxpar.inspect.hlo import collectives

    b, s, h, g, kd = 2, 64, 8, 4, 8
    window = s // 8 if windowed else 0
    mesh = mesh_of(context=n)
    spec = ContextSpec(impl, mesh, ("context",), P(None, "context"), P(None, "context"), layout,
                       Masking(True, 4, 4, window=window))

    def layer(q, k, v, do):
        o, vjp = jax.vjp(lambda *a: context_attention(*a, None, spec), q, k, v)
        return (o, *vjp(do))

    sharded = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "context")))
    q = sharded(b, s, h, kd)
    kv = sharded(b, s, g, kd)
    compiled = jax.jit(layer).lower(q, kv, kv, q).compile()
    sent = {}
    for c in collectives(compiled.as_text(), mesh):
        if c.axes == ("context",):
            sent[c.kind] = sent.get(c.kind, 0) + c.bytes_per_step
    want = {}
    for part in context_traffic_elements(impl, s, b, h * kd, g * kd, n, window, layout).values():
        for kind, elements in part.items():
            want[kind] = want.get(kind, 0) + 4 * elements
    assert set(sent) == set(want), (sent, want)
    for kind in want:
        assert abs(sent[kind] / want[kind] - 1) <= 0.05, (kind, sent[kind], want[kind])
    if windowed:
        full = context_traffic_elements(impl, s, b, h * kd, g * kd, n)
        # forward 1 hop of 7, backward 1 + 2 of 7 + 8: 4/22 of the whole ring's elements
        assert sum(want.values()) / 4 == pytest.approx(4 / 22 * sum(sum(p.values()) for p in full.values()))
        x = jnp.ones((b, s, h, kd)), jnp.ones((b, s, g, kd))
        tiles = np.asarray(jax.jit(lambda q, k: executed_tiles(q, k, k, None, spec))(*x))
        assert (tiles[1:] == windowed_tile_pairs(s // n, 4, window)).all() and tiles[0] < tiles[1], tiles


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("causal, segments", [(True, True), (False, False)], ids=["causal-packed", "full"])
def test_pallas_kernel_lowers_to_triton_for_an_h100(dtype, causal, segments):
    """No GPU here, but the kernel's Triton lowering runs on any machine: lower the block
    forward for CUDA against an abstract H100 and check a Triton kernel comes out (the PTX
    compile and the run itself need the GPU). Head dim 64, GQA, tiles capped at 128."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    from jaxpar.kernels.attention import blocks, pallas

    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=h100)
    b, s, g, r, d = 1, 1024, 2, 4, 64
    q = jax.ShapeDtypeStruct((b, s, g, r, d), dtype)
    kv = jax.ShapeDtypeStruct((b, s, g, d), dtype)
    index, seg = jax.ShapeDtypeStruct((s,), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32)
    segs = (seg, seg) if segments else (None, None)
    forward = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512, kernel="pallas")))
    with jax.sharding.use_abstract_mesh(mesh):
        text = forward.trace(q, kv, kv, index, index, *segs).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and 'name = "jaxpar_block_attention"' in text
    assert "grid_z = 8 : i32" in text  # 1024 / 128 query tiles: the 512 asked for is capped
    assert pallas.shape_problem(128, 128) is None
    assert pallas.shape_problem(96, 128) == "power-of-two tiles of at least 16 tokens, not a query tile of 96"
    # heads padded with zeros to a power of two of at least 16 (DeepSeek-V3: 192 and 128 -> 256)
    assert (pallas.head_size(8, 8), pallas.head_size(64, 64), pallas.head_size(192, 128)) == (16, 64, 256)
