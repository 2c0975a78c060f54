"""The optimizer's half of the step (jaxpar.step.update) on its own: under mixed precision
the parameters are the new master's cast, made after the non-finite guard, so the update
never reads the old compute-dtype parameters (2 of AdamW's 30 bytes a parameter on a GPU)."""

import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.step.gradients import Gradient
from jaxpar.step.state import StatePlacement, initial_state
from jaxpar.step.update import update_fn
from jaxpar.step.zero import StateShardings


def selects(jaxpr) -> list:
    """Every select_n's output type in `jaxpr`, its sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "select_n":
            found += [v.aval for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += selects(sub)
    return found


@pytest.mark.parametrize("fused", [True, False])
def test_mixed_precision_parameters_are_the_kept_masters_cast(fused):
    """A finite step's parameters are the new master's bf16 cast; a non-finite step keeps
    master, moments and parameters bit for bit; the fused guard (a GPU's select) selects no
    bf16 parameter, only the float32 state the parameters are then cast from."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = StateShardings(replicated, replicated, replicated)
    tx = optax.adamw(1e-2)
    master = {"w": jax.random.normal(jax.random.key(0), (4, 8)), "b": jnp.linspace(-1.0, 1.0, 8)}
    state = initial_state(master, tx, jnp.bfloat16)
    update = update_fn(tx, None, 0.0, shardings, StatePlacement(state, state), jnp.bfloat16, False,
                       types.SimpleNamespace(), fused=fused)
    grad = Gradient(jax.tree.map(lambda m: (3.0 * m).astype(jnp.bfloat16), master), jnp.float32(2.0))

    def step(state, loss):
        return update(state, loss, {"weight": jnp.float32(1.0)}, grad)

    new, metrics = jax.jit(step)(state, jnp.float32(1.5))
    assert float(metrics["nonfinite"]) == 0.0 and int(new.step) == 1
    assert jax.tree.map(lambda p: p.dtype, new.params) == {"w": jnp.bfloat16, "b": jnp.bfloat16}
    jax.tree.map(np.testing.assert_array_equal, new.params, jax.tree.map(lambda m: m.astype(jnp.bfloat16), new.master))
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.master), jax.tree.leaves(master)))

    kept, metrics = jax.jit(step)(new, jnp.float32(jnp.nan))
    assert float(metrics["nonfinite"]) == 1.0 and int(kept.step) == 1
    jax.tree.map(np.testing.assert_array_equal, (kept.params, kept.master, kept.opt_state),
                 (new.params, new.master, new.opt_state))

    chosen = selects(jax.make_jaxpr(step)(state, jnp.float32(1.5)).jaxpr)
    assert all(aval.dtype != jnp.bfloat16 for aval in chosen), chosen
