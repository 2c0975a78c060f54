"""Compressed gradient averaging (jaxpar.kernels.compression): each shard_map kernel over 8
replicas against its plain reference; on a data x fsdp x tensor mesh, top-k per device block
and PowerSGD on whole matrices under three in-host layouts; exactness at full rank /
fraction 1, and error feedback: over several steps the means the replicas agreed on plus
their mean residual are the mean of every gradient they had (fp32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.compression import (factor_spec, from_blocks, matrix_split, powersgd_mean, powersgd_mean_reference,
                                        powersgd_start, shard_counts, to_blocks, topk_count, topk_mean,
                                        topk_mean_reference)

N, A, B = 8, 12, 20


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def per_replica(mesh, *arrays):
    """Each replica's array on its own device, as the kernels take them."""
    return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def topk(mesh, fraction):
    step = jax.jit(lambda g, residual: topk_mean(g, residual, fraction, mesh, "data"))
    return lambda g, residual: step(*per_replica(mesh, g, residual))


def powersgd(mesh):
    step = jax.jit(lambda m, q, residual: powersgd_mean(m, q, residual, mesh, "data"))
    return lambda m, q, residual: step(*per_replica(mesh, m), jax.device_put(q, NamedSharding(mesh, P())),
                                       *per_replica(mesh, residual))


def grads(step: int) -> jax.Array:
    return jax.random.normal(jax.random.key(step), (N, A, B))


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol * float(np.max(np.abs(b))))


def test_topk_kernel_equals_reference_and_feeds_back_what_it_left(mesh):
    residual, sent_total = jnp.zeros((N, A, B)), 0.0
    for step in range(4):
        mean, new = topk(mesh, 0.05)(grads(step), residual)
        ref_mean, ref_new = topk_mean_reference(grads(step), residual, 0.05)
        close(mean, ref_mean), close(new, ref_new)
        kept = np.asarray(grads(step))[0] + np.asarray(residual)[0] == np.asarray(new)[0]
        assert int(np.sum(~kept)) == topk_count(A * B, 0.05)  # replica 0 sent 12 of its 240 entries
        residual, sent_total = new, sent_total + mean
    close(sent_total + jnp.mean(residual, axis=0), sum(jnp.mean(grads(s), axis=0) for s in range(4)))


def test_topk_of_everything_is_the_exact_mean(mesh):
    mean, residual = topk(mesh, 1.0)(grads(0), jnp.zeros((N, A, B)))
    close(mean, jnp.mean(grads(0), axis=0), 1e-6)
    assert float(jnp.max(jnp.abs(residual))) == 0.0


def test_powersgd_kernel_equals_reference_and_feeds_back_what_it_left(mesh):
    q, residual, sent_total = powersgd_start((A, B), 2, jax.random.key(99)), jnp.zeros((N, A, B)), 0.0
    for step in range(4):
        approx, q_next, new = powersgd(mesh)(grads(step), q, residual)
        ref = powersgd_mean_reference(grads(step), q, residual)
        for got, want in zip((approx, q_next, new), ref):
            close(got, want)
        assert np.linalg.matrix_rank(np.asarray(approx)) == 2
        q, residual, sent_total = q_next, new, sent_total + approx
    close(sent_total + jnp.mean(residual, axis=0), sum(jnp.mean(grads(s), axis=0) for s in range(4)))


def test_powersgd_at_full_rank_is_the_exact_mean(mesh):
    q = powersgd_start((A, B), min(A, B), jax.random.key(0))
    approx, _, _ = powersgd(mesh)(grads(0), q, jnp.zeros((N, A, B)))
    close(approx, jnp.mean(grads(0), axis=0))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="0 < fraction <= 1"):
        topk_count(100, fraction)


def test_a_rank_above_the_shorter_side_is_refused():
    with pytest.raises(ValueError, match="use 0 < rank <= 12"):
        powersgd_start((A, B), 13, jax.random.key(0))


def test_blocks_round_trip_in_the_devices_order():
    x = jnp.arange(2 * 4 * 6 * 2, dtype=jnp.float32).reshape(2, 4, 6, 2)
    blocks = to_blocks(x, (2, 3, 1))
    assert blocks.shape == (2, 6, 2, 2, 2)
    np.testing.assert_array_equal(blocks[1, 4], x[1, 2:4, 2:4])  # block (1, 1): row-major over the dimensions
    np.testing.assert_array_equal(from_blocks(blocks, (2, 3, 1)), x)


@pytest.mark.parametrize("spec, shape", [
    (P(None, "fsdp", "tensor"), (2, 4, 8, 12)),  # layers x [8, 12]: rows over fsdp, columns over tensor
    (P(None, "tensor", None, "fsdp"), (2, 4, 4, 3, 16)),  # layers x [4 x 3, 16]: the attention output's shape
    (P(("fsdp", "tensor")), (2, 8, 5)),  # rows over both; 4 rows per device do not split 4 ways for the sum
])
def test_powersgd_factors_the_whole_matrix_whatever_the_layout(spec, shape):
    """data 2 x fsdp 2 x tensor 2: the kernel on blocks equals the reference on whole
    arrays, the layers a batch, over 3 warm-started steps."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    full = NamedSharding(mesh, P("data", *spec))
    batch = 1 if len(shape) > 3 else 0
    g = [jax.random.normal(jax.random.key(s), shape) for s in range(3)]
    residual = jnp.zeros(shape)
    q = powersgd_start(shape[1:], 3, jax.random.key(7), batch_dims=batch)
    factors = NamedSharding(mesh, factor_spec(spec, len(shape) - 1, batch, matrix_split(shape[1:], batch)))
    step = jax.jit(lambda m, q, e: powersgd_mean(m, q, e, mesh, "data", spec, batch_dims=batch))
    for s in range(3):
        got = step(jax.device_put(g[s], full), jax.device_put(q, factors), jax.device_put(residual, full))
        want = powersgd_mean_reference(g[s], q, residual, batch_dims=batch)
        for a, b in zip(got, want):
            close(a, b)
        assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape) - 1)
        assert got[1].sharding.is_equivalent_to(factors, q.ndim)
        _, q, residual = want


def test_topk_picks_in_each_device_block():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    spec, shape = P(None, "fsdp", "tensor"), (2, 4, 8, 12)
    full = NamedSharding(mesh, P("data", *spec))
    shards = shard_counts(spec, dict(mesh.shape), 3)
    assert shards == (1, 2, 2)
    g = [jax.random.normal(jax.random.key(s), shape) for s in range(1)]
    top = jax.jit(lambda g, e: topk_mean(g, e, 0.1, mesh, "data", spec))
    got = top(jax.device_put(g[0], full), jax.device_put(jnp.zeros(shape), full))
    want = topk_mean_reference(g[0], jnp.zeros(shape), 0.1, shards)
    for a, b in zip(got, want):
        close(a, b)
    sent = np.asarray(got[1])[0] != np.asarray(g[0])[0]  # what replica 0 sent: 10 of each block's 96 entries
    per_block = to_blocks(jnp.asarray(sent)[None], shards)[0].reshape(4, -1).sum(axis=1)
    np.testing.assert_array_equal(per_block, [topk_count(96, 0.1)] * 4)
