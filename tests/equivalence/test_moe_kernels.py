"""The expert kernels against their plain references: capacity slots against a loop that
hands out slots one pair at a time; routing on one device and expert-parallel routing in
shard_map (capacity and dropless, with and without tensor parallelism inside the experts)
against every token sent through its top-k experts; the grouped matmul under vmap against
ragged_dot per example. fp32, values and gradients to 1e-5 normwise relative.

Here expert-parallel routing in shard_map, over four layouts; the rest: tests/unit/test_moe_kernels.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.experts import (
    ExpertSpec,
    expert_parallel,
    reference_experts,
)
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.testing import tree_error
from jaxpar.models.moe import expert_ffn

RTOL = 1e-5


def routed_problem(b=4, s=16, d=8, f=12, e=8, k=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (b, s, d))
    logits = jax.random.normal(keys[1], (b, s, e)) * 2
    probs = jax.nn.softmax(logits)
    priority, ids = jax.lax.top_k(probs, k)  # the router's probabilities order the claims on capacity
    gates = priority / priority.sum(-1, keepdims=True)  # renormalised, as the model does
    weights = (
        jax.random.normal(keys[2], (e, d, f)) / d**0.5,
        jax.random.normal(keys[3], (e, d, f)) / d**0.5,
        jax.random.normal(keys[4], (e, f, d)) / f**0.5,
    )
    return x, ids, gates, priority, weights


def value_and_grads(fn, x, gates, weights):
    """The output, and gradients of a fixed projection of it with respect to x, gates, weights."""
    probe = jax.random.normal(jax.random.key(9), x.shape)
    loss = lambda x, g, w: jnp.sum(fn(x, g, w)[0] * probe)
    return fn(x, gates, weights), jax.grad(loss, argnums=(0, 1, 2))(x, gates, weights)


LAYOUTS = {
    # mesh axes, token spec, expert-parallel axes, tensor axes of the expert hidden layer
    "expert4_data2": (dict(data=2, expert=4), P(("data", "expert")), ("expert",), ()),
    "expert2_tensor2_data2": (dict(data=2, expert=2, tensor=2), P(("data", "expert")), ("expert",), ("tensor",)),
    "expert8": (dict(data=1, expert=8), P("expert"), ("expert",), ()),
    "tokens_replicated_over_experts": (dict(data=2, expert=4), P("data"), ("expert",), ()),
}


def layout_spec(name: str, routing: str, exchange: str = "padded") -> ExpertSpec:
    axes, token_spec, ep, tp = LAYOUTS[name]
    hidden = tp[0] if tp else None
    return ExpertSpec(
        mesh=make_mesh(MeshConfig(**axes), jax.devices()),
        token_spec=token_spec,
        weight_specs=(P(ep, None, hidden), P(ep, None, hidden), P(ep, hidden, None)),
        axis=ep,
        reduce_axes=tp,
        routing=routing,
        capacity_factor=1.0,
        exchange=exchange,
    )


@pytest.mark.parametrize("routing, exchange", [("capacity", "padded"), ("dropless", "padded"), ("dropless", "ragged_emulated")])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_equals_the_reference(name, routing, exchange):
    """ragged_emulated: the ragged exchange's offsets, with all_to_all standing in for
    ragged_all_to_all, which the CPU backend lacks."""
    ep = LAYOUTS[name][2]
    x, ids, gates, priority, weights = routed_problem(b=8)
    spec = layout_spec(name, routing, exchange)
    factor = 1.0 if routing == "capacity" else None
    run = lambda x, g, w: expert_parallel(x, ids, g, priority, w, expert_ffn, spec)  # noqa: E731
    got = jax.jit(lambda x, g, w: value_and_grads(run, x, g, w))(x, gates, weights)
    want = value_and_grads(lambda x, g, w: reference_experts(x, ids, g, w, expert_ffn, factor, priority), x, gates, weights)
    np.testing.assert_array_equal(got[0][1], want[0][1])
    assert tree_error(got[0][0], want[0][0]) <= RTOL
    assert tree_error(got[1], want[1]) <= RTOL
    hlo = jax.jit(run).lower(x, gates, weights).compile().as_text()
    assert ("all-to-all" in hlo) == (len(ep) > 0)
