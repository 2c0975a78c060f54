"""The expert kernels against their plain references: capacity slots against a loop that
hands out slots one pair at a time; routing on one device and expert-parallel routing in
shard_map (capacity and dropless, with and without tensor parallelism inside the experts)
against every token sent through its top-k experts; the grouped matmul under vmap against
ragged_dot per example. fp32, values and gradients to 1e-5 normwise relative.

Expert-parallel routing in shard_map, over four layouts: tests/equivalence/test_moe_kernels.py."""

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.experts import (
    DROPPED,
    ExpertSpec,
    capacity_slots,
    expert_capacity,
    expert_parallel,
    grouped_matmul,
    group_slots,
    local_experts,
    reference_experts,
)
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.testing import tree_error
from jaxpar.models.moe import expert_ffn

RTOL = 1e-5


def slots_by_loop(ids, priority, num_experts, capacity):
    """First choices before second, confident before not, earlier before later; one at a time."""
    t, k = ids.shape
    order = sorted(itertools.product(range(t), range(k)), key=lambda p: (p[1], -float(priority[p]), p[0]))
    used = [0] * num_experts
    out = np.full((t, k), DROPPED)
    for tok, j in order:
        e = int(ids[tok, j])
        if used[e] < capacity:
            out[tok, j] = used[e]
            used[e] += 1
    return out


@pytest.mark.parametrize("seed, capacity", [(0, 1), (1, 3), (2, 5), (3, 100)])
def test_capacity_slots_follow_router_priority(seed, capacity):
    rng = np.random.default_rng(seed)
    t, k, e = 24, 2, 6
    probs = rng.dirichlet(np.ones(e), size=t).astype(np.float32)
    ids = np.argsort(-probs, axis=1)[:, :k]
    priority = np.take_along_axis(probs, ids, axis=1)
    priority[3, 0] = priority[5, 0]  # a tie: the earlier token wins
    got = np.asarray(capacity_slots(jnp.asarray(ids), jnp.asarray(priority), e, capacity))
    np.testing.assert_array_equal(got, slots_by_loop(ids, priority, e, capacity))


def test_expert_capacity_is_the_balanced_share_times_the_factor():
    assert expert_capacity(1.0, 64, 2, 8) == 16
    assert expert_capacity(1.25, 64, 2, 8) == 20
    assert expert_capacity(0.01, 64, 2, 8) == 1  # never zero slots


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


@pytest.mark.parametrize("routing, factor", [("capacity", 1.0), ("capacity", 0.5), ("dropless", None)])
def test_one_device_routing_equals_every_token_through_its_experts(routing, factor):
    x, ids, gates, priority, weights = routed_problem()
    got = value_and_grads(lambda x, g, w: local_experts(x, ids, g, priority, w, expert_ffn, routing, factor or 1.0), x, gates, weights)
    want = value_and_grads(lambda x, g, w: reference_experts(x, ids, g, w, expert_ffn, factor, priority), x, gates, weights)
    np.testing.assert_array_equal(got[0][1], want[0][1])  # the same pairs kept
    if factor == 0.5:
        assert not got[0][1].all()  # and some were dropped
    assert tree_error(got[0][0], want[0][0]) <= RTOL
    assert tree_error(got[1], want[1]) <= RTOL


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


def test_ragged_exchange_lowers_to_ragged_all_to_all_for_gpus():
    """The GPU path: lowered for CUDA (not run here), forward and backward."""
    x, ids, gates, priority, weights = routed_problem(b=8)
    spec = layout_spec("expert4_data2", "dropless", "ragged")
    step = jax.jit(lambda x, g, w: value_and_grads(lambda x, g, w: expert_parallel(x, ids, g, priority, w, expert_ffn, spec), x, g, w))
    text = step.trace(x, gates, weights).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @ragged_all_to_all(") >= 4  # dispatch, combine and their transposes


def test_capacity_refuses_a_sharded_sequence():
    mesh = make_mesh(MeshConfig(data=1, expert=2, context=4), jax.devices())
    spec = ExpertSpec(mesh, P("expert", "context"), (P("expert"),) * 3, ("expert",), routing="capacity")
    x, ids, gates, priority, weights = routed_problem()
    with pytest.raises(ValueError, match="capacity routing groups whole sequences"):
        expert_parallel(x, ids, gates, priority, weights, expert_ffn, spec)


def test_grouped_matmul_under_vmap_equals_ragged_dot_per_example():
    """Per-replica gradients vmap the experts: ragged_dot alone has no rule for that."""
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (3, 10, 4))
    w = jax.random.normal(keys[1], (5, 4, 6))
    sizes = jnp.asarray([[2, 0, 3, 1, 4], [0, 0, 0, 0, 10], [1, 1, 1, 1, 1]], jnp.int32)  # the last leaves rows over
    probe = jax.random.normal(keys[2], (3, 10, 6))

    def loss(w, x, sizes, probe, op):
        return jnp.sum(op(x, w, sizes) * probe)

    got = jax.vmap(jax.value_and_grad(partial(loss, op=grouped_matmul), argnums=(0, 1)), in_axes=(None, 0, 0, 0))(w, x, sizes, probe)
    want = [jax.value_and_grad(partial(loss, op=jax.lax.ragged_dot), argnums=(0, 1))(w, x[i], sizes[i], probe[i]) for i in range(3)]
    want = jax.tree.map(lambda *xs: jnp.stack(xs), *want)
    assert tree_error(got, want) <= RTOL
    assert float(jnp.abs(jax.vmap(grouped_matmul, in_axes=(0, None, 0))(x, w, sizes)[2, 5:]).max()) == 0.0


def group_slots_by_loop(ids, priority, groups, num_experts, capacity):
    """capacity_slots' order, a token claiming once per group (at its first choice there)."""
    t, k = ids.shape
    group = ids // (num_experts // groups)
    order = sorted(itertools.product(range(t), range(k)), key=lambda p: (p[1], -float(priority[p]), p[0]))
    used, slot = [0] * groups, {}
    for tok, j in order:
        g = int(group[tok, j])
        if (tok, g) not in slot:
            slot[tok, g] = used[g] if used[g] < capacity else DROPPED
            used[g] += 1
    return np.array([[slot[tok, int(group[tok, j])] for j in range(k)] for tok in range(t)])


@pytest.mark.parametrize("seed, capacity", [(0, 2), (1, 5), (2, 100)])
def test_group_slots_claim_once_per_group(seed, capacity):
    rng = np.random.default_rng(seed)
    t, k, e, groups = 24, 3, 8, 4
    probs = rng.dirichlet(np.ones(e), size=t).astype(np.float32)
    ids = np.argsort(-probs, axis=1)[:, :k]
    priority = np.take_along_axis(probs, ids, axis=1)
    got = np.asarray(group_slots(jnp.asarray(ids), jnp.asarray(priority), groups, e, capacity))
    np.testing.assert_array_equal(got, group_slots_by_loop(ids, priority, groups, e, capacity))
    assert (ids // 2 == np.roll(ids, 1, axis=1) // 2).any()  # some token chose twice in one group


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_combine_equals_autodiff_of_its_reference_and_keeps_no_float32_pairs(dtype):
    """The weighted sum of each token's rows (some indices past the end: dropped pairs) and
    its two gradients are the reference's bit for bit; its backward pass keeps the rows it
    picked from, not the picked pairs [T, k, D] in float32 the reference keeps."""
    from jaxpar.kernels.experts.combine import reference_weighted_rows, weighted_rows

    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.standard_normal((12, 16)), dtype)
    index = jnp.asarray(rng.integers(0, 14, (2, 5, 3)), jnp.int32)  # 12, 13: past the end
    gates = jnp.asarray(rng.random((2, 5, 3)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((2, 5, 16)), dtype)

    def vjp(f):
        y, pull = jax.vjp(lambda r, g: f(r, index, g, dtype), rows, gates)
        return y, pull(cotangent)

    got, want = jax.jit(lambda: vjp(weighted_rows))(), jax.jit(lambda: vjp(reference_weighted_rows))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert np.any(np.asarray(got[1][0], np.float32) != 0)
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list (jax 0.12)

    def pairs_saved(f):
        return any(r[0].shape == (2, 5, 3, 16) for r in saved_residuals(lambda r, g: f(r, index, g, dtype), rows, gates))

    assert pairs_saved(reference_weighted_rows) and not pairs_saved(weighted_rows)


def test_the_dispatch_places_each_pair_once_and_sums_its_gradient_per_token():
    """placed_rows equals scattering each (token, choice) into a zero buffer, values and
    gradient (fp32: the k rows' sum in the same order), with dropped pairs (an index past the
    end) and rows no pair lands on."""
    from jaxpar.kernels.experts.combine import placed_rows

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    index = jnp.asarray(rng.permutation(14)[:12].reshape(6, 2), jnp.int32)  # distinct; 12, 13 dropped
    cotangent = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)

    def scattered(x):
        pairs = jnp.broadcast_to(x[:, None, :], (*index.shape, 8))
        return jnp.zeros((12, 8), x.dtype).at[index].add(pairs, mode="drop")

    got, pull = jax.vjp(lambda x: placed_rows(x, index, 12), x)
    want, pull_want = jax.vjp(scattered, x)
    np.testing.assert_array_equal(got, want)
    assert np.any(np.all(np.asarray(got) == 0, axis=1))  # rows no pair lands on
    np.testing.assert_allclose(pull(cotangent)[0], pull_want(cotangent)[0], rtol=1e-6)
