"""The expert kernels against their plain references: capacity slots against a loop that
hands out slots one pair at a time; routing on one device and expert-parallel routing in
shard_map (capacity and dropless, with and without tensor parallelism inside the experts)
against every token sent through its top-k experts; the grouped matmul under vmap against
ragged_dot per example. fp32, values and gradients to 1e-5 normwise relative.

Here expert-parallel routing in shard_map, over four layouts; the rest: tests/unit/test_moe_kernels.py."""

import jax
import numpy as np
import pytest

from jaxpar.kernels.experts import (
    expert_parallel,
    reference_experts,
)
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
