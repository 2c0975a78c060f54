"""jaxpar.nn's building blocks with their own backward passes, against plain autodiff of
their definitions (fp32: 1e-6 relative; bf16 inputs: the bf16 rounding of the same values)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.nn import gated, layer_policy, rms_norm, rms_norm_reference


def _draws(shape, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = 3.0 * jax.random.normal(keys[0], shape, jnp.float32)  # large enough that a wrong term shows
    return x.astype(dtype), keys


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_equals_its_definition(offset):
    x, keys = _draws((2, 5, 16))
    scale = 1.0 + 0.5 * jax.random.normal(keys[1], (16,))
    dy = jax.random.normal(keys[2], x.shape)

    def loss(f, x, s):
        return jnp.sum(f(x, s, 1e-6, offset) * dy)

    np.testing.assert_allclose(rms_norm(x, scale, 1e-6, offset), rms_norm_reference(x, scale, 1e-6, offset),
                               rtol=1e-6, atol=1e-6)
    ours = jax.grad(lambda x, s: loss(rms_norm, x, s), argnums=(0, 1))(x, scale)
    plain = jax.grad(lambda x, s: loss(rms_norm_reference, x, s), argnums=(0, 1))(x, scale)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_keeps_dtypes_in_bf16():
    x, keys = _draws((4, 32), jnp.bfloat16)
    scale = jnp.ones((32,), jnp.bfloat16)
    dx, ds = jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, 1e-6).astype(jnp.float32) ** 2), argnums=(0, 1))(x, scale)
    rx, rs = jax.grad(lambda x, s: jnp.sum(rms_norm_reference(x, s, 1e-6).astype(jnp.float32) ** 2),
                      argnums=(0, 1))(x, scale)
    assert dx.dtype == rx.dtype == jnp.bfloat16 and ds.dtype == rs.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(rx, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("activation", [jax.nn.silu, lambda x: jax.nn.gelu(x, approximate=True)])
def test_gated_equals_its_definition(activation):
    gate, keys = _draws((3, 7, 24))
    up = jax.random.normal(keys[1], gate.shape)
    dy = jax.random.normal(keys[2], gate.shape)
    np.testing.assert_allclose(gated(activation, gate, up), activation(gate) * up, rtol=1e-6, atol=1e-6)
    ours = jax.grad(lambda g, u: jnp.sum(gated(activation, g, u) * dy), argnums=(0, 1))(gate, up)
    plain = jax.grad(lambda g, u: jnp.sum(activation(g) * u * dy), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gated_keeps_only_its_inputs():
    """Its backward pass reads gate and up, not the activation's intermediates: the
    linearized function holds two [.., mlp] residuals, where plain autodiff holds more."""
    gate = jnp.ones((4, 8))

    def residual_count(f):
        _, f_vjp = jax.vjp(f, gate, gate)
        return sum(leaf.shape == gate.shape for leaf in jax.tree.leaves(f_vjp))

    assert residual_count(lambda g, u: gated(jax.nn.silu, g, u)) == 2
    assert residual_count(lambda g, u: jax.nn.silu(g) * u) > 2


@pytest.mark.parametrize("remat", ["dots", "selective", "none"])
def test_policies_keep_the_fused_attention(remat):
    """cuDNN's fused attention is kept like a matmul: its forward is not run again in the
    backward pass (on the 0.9B Llama's H100 compile: 4.5 ms of attention a step)."""

    class Prim:
        name = "dot_product_attention_fwd_wrapper"

    assert layer_policy(remat)(Prim())


def test_full_remat_runs_the_fused_attention_again():
    class Prim:
        name = "dot_product_attention_fwd_wrapper"

    assert not layer_policy("full")(Prim())
