"""Compressed gradient averaging (jaxpar.kernels.compression): each shard_map kernel over 8
replicas against its plain reference, exactness at full rank / fraction 1, and error
feedback: over several steps the means the replicas agreed on plus their mean residual are
the mean of every gradient they had (fp32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.compression import (powersgd_mean, powersgd_mean_reference, powersgd_start, topk_count, topk_mean,
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
    approx, _, residual = powersgd(mesh)(grads(0), q, jnp.zeros((N, A, B)))
    close(approx, jnp.mean(grads(0), axis=0))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="0 < fraction <= 1"):
        topk_count(100, fraction)


def test_a_rank_above_the_shorter_side_is_refused():
    with pytest.raises(ValueError, match="use 0 < rank <= 12"):
        powersgd_start((A, B), 13, jax.random.key(0))
