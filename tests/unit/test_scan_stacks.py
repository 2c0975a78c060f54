"""compiler.uninitialised_stacks (jaxpar.scan_stacks): a scan's stacks allocated by lax.empty.

A GPU's program is lowered here for the platform only (no GPU, no plugin needed): its
stacks become AllocateBuffer calls. On the CPU lax.empty lowers to zeros, so what runs here
checks the replacement's shardings and varying axes, and that values and gradients equal
jax's own scan's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import scan_stacks
from jaxpar.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture
def restore():
    yield
    scan_stacks.set_uninitialised(False)


def loss(w, x):
    def body(c, wi):
        h = jnp.tanh(c @ wi)
        return h, h.sum(-1)  # a stacked output of its own besides the residuals

    y, per_layer = jax.lax.scan(body, x, w)
    return jnp.sum(y**2) + jnp.sum(per_layer)


def inputs():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(0, 0.5, (4, 8, 8)), jnp.float32), jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)


def gpu_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_gpu_program_allocates_stacks_without_a_fill(restore):
    w, x = inputs()
    grad = jax.value_and_grad(loss)
    assert "AllocateBuffer" not in gpu_text(grad, w, x)
    scan_stacks.set_uninitialised(True)
    assert scan_stacks.uninitialised()
    text = gpu_text(grad, w, x)
    # the forward loop's stacks (the residuals, the per-layer output) and the backward's (w's gradient)
    assert text.count("AllocateBuffer") >= 3
    scan_stacks.set_uninitialised(False)  # jax's own again
    assert "AllocateBuffer" not in gpu_text(grad, w, x)


def test_values_and_gradients_equal_jax_scan_sharded_and_in_shard_map(restore):
    """Bitwise: on the CPU both fill with zeros and every slot is overwritten; what this
    checks is that the stacks carry the right shardings and varying axes (a wrong one fails
    to trace or to lower)."""
    w, x = inputs()
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def cases() -> dict:  # new jits each time: a lowering is cached by its function
        per_shard = jax.shard_map(lambda w, x: jax.lax.psum(loss(w, x), "data"), mesh=mesh,
                                  in_specs=(P(), P("data")), out_specs=P())
        return {"jit, rows sharded": jax.jit(jax.value_and_grad(loss), in_shardings=(None, NamedSharding(mesh, P("data")))),
                "shard_map": jax.jit(jax.value_and_grad(per_shard))}

    before = {name: jax.device_get(fn(w, x)) for name, fn in cases().items()}
    scan_stacks.set_uninitialised(True)
    for name, fn in cases().items():
        for a, b in zip(jax.tree.leaves(before[name]), jax.tree.leaves(jax.device_get(fn(w, x)))):
            np.testing.assert_array_equal(a, b, err_msg=name)
        assert "AllocateBuffer" in gpu_text(fn, w, x), name


def test_a_jax_whose_scan_is_unknown_is_refused(monkeypatch, restore):
    monkeypatch.setattr(scan_stacks, "_scan_internals", lambda: None)
    with pytest.raises(ConfigError, match=r"compiler.uninitialised_stacks=true: jax .* set it false"):
        scan_stacks.set_uninitialised(True)
    assert not scan_stacks.uninitialised()


def test_build_sets_it_from_the_config(restore):
    from jaxpar.config import Config, apply_overrides
    from jaxpar.train import build

    build(apply_overrides(Config(), ["compiler.uninitialised_stacks=true"]), jax.devices()[:1])
    assert scan_stacks.uninitialised()
    build(Config(), jax.devices()[:1])
    assert not scan_stacks.uninitialised()
