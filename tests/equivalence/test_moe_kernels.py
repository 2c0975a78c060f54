"""The expert kernels against their plain references: capacity slots against a loop that
hands out slots one pair at a time; routing on one device and expert-parallel routing in
shard_map (capacity and dropless, with and without tensor parallelism inside the experts)
against every token sent through its top-k experts; the grouped matmul under vmap against
ragged_dot per example. fp32, values and gradients to 1e-5 normwise relative.

Here expert-parallel routing in shard_map, over four layouts; the rest: tests/unit/test_moe_kernels.py."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.inspect.hlo import collectives
from jaxpar.kernels.experts import (
    ExpertSpec,
    expert_parallel,
    reference_experts,
)
from jaxpar.mesh import HostSplit, MeshConfig, make_mesh
from jaxpar.testing import tree_error
from jaxpar.models.moe import expert_ffn

from ..unit.test_moe_kernels import LAYOUTS, RTOL, layout_spec, routed_problem, value_and_grads


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


TWO_HOP = {
    # mesh axes (hosts of the expert axis), token spec, expert axes, tensor axes; groups of 2 experts
    "expert8_over_2_hosts": (dict(data=1, expert=8), 2, P("expert"), ()),
    "expert8_over_4_hosts": (dict(data=1, expert=8), 4, P("expert"), ()),
    "expert4_over_2_hosts_tensor2": (dict(data=1, expert=4, tensor=2), 2, P("expert"), ("tensor",)),
}


@pytest.mark.parametrize("name", list(TWO_HOP))
def test_two_hop_exchange_equals_the_reference(name):
    """Group capacity (4 groups of 2 experts, 2 chosen) over an expert axis across hosts:
    the two-hop exchange keeps the reference's pairs and equals it, values and gradients; its
    all-to-alls run among the devices of a host and among one index's devices across hosts."""
    axes, hosts, token_spec, tp = TWO_HOP[name]
    hidden = tp[0] if tp else None
    mesh = make_mesh(MeshConfig(**axes, hosts=HostSplit(expert=hosts)), jax.devices())
    spec = ExpertSpec(mesh, token_spec, (P("expert", None, hidden), P("expert", None, hidden), P("expert", hidden, None)),
                      ("expert",), tp, "capacity", 1.0, group_capacity=(4, 2), hosts=hosts)
    x, ids, gates, priority, weights = routed_problem(b=8, k=3)
    run = lambda x, g, w: expert_parallel(x, ids, g, priority, w, expert_ffn, spec)  # noqa: E731
    got = jax.jit(lambda x, g, w: value_and_grads(run, x, g, w))(x, gates, weights)
    want = value_and_grads(lambda x, g, w: reference_experts(x, ids, g, w, expert_ffn, 1.0, priority, (4, 2)), x, gates,
                           weights)
    np.testing.assert_array_equal(got[0][1], want[0][1])
    assert not got[0][1].all()  # the group capacity dropped some
    assert tree_error(got[0][0], want[0][0]) <= RTOL
    assert tree_error(got[1], want[1]) <= RTOL
    colls = collectives(jax.jit(run).lower(x, gates, weights).compile().as_text(), mesh)
    sizes = {c.group_size for c in colls if c.kind == "all-to-all"}
    assert sizes == {hosts, axes["expert"] // hosts} - {1}, sizes
