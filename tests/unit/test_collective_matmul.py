"""Collective matmul (jaxpar.kernels.collective_matmul) equals the whole-array matmul, values
and gradients, fp32 to 1e-5 normwise relative, for tensor axes of 2, 3, 4 and 8 devices,
unidirectional and bidirectional, alone and beside a data axis; its compiled program moves
data only by collective-permute (no all-gather, no reduce-scatter), in n-1 or n//2 dependent
hops; bad shapes and names give one clear ValueError.

The Llama step's projections as rings: tests/equivalence/test_collective_matmul.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.inspect.hlo import collectives
from jaxpar.kernels.collective_matmul import (
    IMPLS,
    OPS,
    allgather_matmul,
    allgather_matmul_reference,
    allgather_matmuls,
    column_parallel,
    column_parallel_reference,
    matmul_reducescatter,
    matmul_reducescatter_reference,
    row_parallel,
    row_parallel_reference,
    schedule,
)
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.testing import tree_error

RTOL = 1e-5
OPERATIONS = {
    "column": (column_parallel, column_parallel_reference),
    "row": (row_parallel, row_parallel_reference),
}


def tensor_mesh(n: int) -> Mesh:
    """One Auto "tensor" axis over the first n CPU devices."""
    return Mesh(np.array(jax.devices()[:n]), ("tensor",), axis_types=(AxisType.Auto,))


def normal(rng, shape, dtype=jnp.float32, scale=1.0):
    """numpy draws: jax.random would compile a program per shape, seconds per test on CPU."""
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def operands(op: str, lead: tuple[int, ...], s: int, d: int, f: int, seed: int = 0, dtype=jnp.float32):
    """(activation, weight, output cotangent): column x [*lead, s, d] @ w [d, f];
    row y [*lead, s, f] @ w [f, d]."""
    rng = np.random.default_rng(seed)
    a_dim, out_dim = (d, f) if op == "column" else (f, d)
    a = normal(rng, (*lead, s, a_dim), dtype)
    w = normal(rng, (a_dim, out_dim), dtype, a_dim**-0.5)
    ct = normal(rng, (*lead, s, out_dim), dtype)
    return a, w, ct


def value_and_grads(fn, a, w, ct):
    """(out, (d a, d w)) of fn at (a, w) for output cotangent ct, in one jitted program."""

    @jax.jit
    def run(a, w, ct):
        out, vjp = jax.vjp(fn, a, w)
        return out, vjp(ct)

    return run(a, w, ct)


# ---------------------------------------------------------------- the step plan


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_schedule_multiplies_every_chunk_once(n, op, bidirectional):
    steps = schedule(n, op, bidirectional)
    assert len(steps) == (n // 2 + 1 if bidirectional else n)
    for r in range(n):
        done = [c for step in steps for c in step[r]]
        assert sorted(done) == list(range(n)), (r, steps)
    if op == "allgather_matmul":  # device r multiplies its own chunk first
        assert [step[0] for step in steps[0]] == list(range(n))
    else:  # and, reducing, last: its own sum is the one that stays
        assert steps[-1] == [[r] for r in range(n)]


# ---------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("impl, op, n", [  # the smoke tier (collective matmul): bidirectional-row-4
    pytest.param(*case, marks=pytest.mark.smoke) if case == ("bidirectional", "row", 4) else case
    for case in [(impl, op, n) for impl in IMPLS for op in ("column", "row") for n in (2, 3, 4, 8)]])
def test_equals_whole_array_matmul(n, op, impl):
    mesh = tensor_mesh(n)
    fn, reference = OPERATIONS[op]
    a, w, ct = operands(op, (2,), s=2 * n, d=8, f=3 * n, seed=n)
    got = value_and_grads(lambda a, w: fn(a, w, mesh, "tensor", impl), a, w, ct)
    want = value_and_grads(reference, a, w, ct)
    assert tree_error(got, want) <= RTOL, (tree_error(got[0], want[0]), tree_error(got[1], want[1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_megatron_mlp_beside_a_data_axis(impl):
    """column -> tanh -> row with the batch on `data` (the framework's 6-axis mesh,
    data=2 x tensor=4): out = tanh(x @ w1) @ w2, sequence sharded over tensor again."""
    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    rng = np.random.default_rng(7)
    x, ct = normal(rng, (4, 16, 8)), normal(rng, (4, 16, 8))
    w1, w2 = normal(rng, (8, 12), scale=8**-0.5), normal(rng, (12, 8), scale=12**-0.5)

    def mlp(x, w1, w2):
        h = jnp.tanh(column_parallel(x, w1, mesh, impl=impl, batch="data"))
        return row_parallel(h, w2, mesh, impl=impl, batch="data")

    def run(fn):
        out, vjp = jax.vjp(fn, x, w1, w2)
        return out, vjp(ct)

    got = jax.jit(lambda: run(mlp))()
    want = jax.jit(lambda: run(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2))()
    assert tree_error(got, want) <= RTOL
    assert got[0].sharding.spec == P("data", "tensor")


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["no-batch", "two-batch-dims"])
@pytest.mark.parametrize("op", ["column", "row"])
def test_any_number_of_leading_dims(lead, op):
    mesh = tensor_mesh(4)
    fn, reference = OPERATIONS[op]
    a, w, ct = operands(op, lead, s=8, d=4, f=8)
    for impl in ("collective", "bidirectional"):
        got = value_and_grads(lambda a, w: fn(a, w, mesh, impl=impl), a, w, ct)
        assert tree_error(got, value_and_grads(reference, a, w, ct)) <= RTOL, impl


def test_kernels_inside_a_users_shard_map():
    """The per-device kernels equal their plain references when called by hand."""
    n, mesh = 4, tensor_mesh(4)
    x, w_col, _ = operands("column", (2,), s=8, d=4, f=8)
    y, w_row, _ = operands("row", (2,), s=8, d=4, f=8, seed=1)

    def both(agmm, mmrs):
        return jax.jit(
            jax.shard_map(
                lambda x, wc, y, wr: (agmm(x, wc, "tensor"), mmrs(y, wr, "tensor")),
                mesh=mesh,
                in_specs=(P(None, "tensor"), P(None, "tensor"), P(None, None, "tensor"), P("tensor")),
                out_specs=(P(None, None, "tensor"), P(None, "tensor")),
            )
        )(x, w_col, y, w_row)

    want = both(allgather_matmul_reference, matmul_reducescatter_reference)
    for bi in (False, True):
        got = both(
            lambda x, w, a: allgather_matmul(x, w, a, bidirectional=bi),
            lambda y, w, a: matmul_reducescatter(y, w, a, bidirectional=bi),
        )
        assert tree_error(got, want) <= RTOL, (n, bi)


def test_bfloat16_runs_in_bfloat16():
    mesh = tensor_mesh(4)
    for op, (fn, reference) in OPERATIONS.items():
        a, w, _ = operands(op, (2,), s=8, d=16, f=16, dtype=jnp.bfloat16)
        for impl in ("collective", "bidirectional"):
            out = jax.jit(lambda a, w: fn(a, w, mesh, impl=impl))(a, w)
            assert out.dtype == jnp.bfloat16
            assert tree_error(out.astype(jnp.float32), reference(a, w).astype(jnp.float32)) <= 2e-2, (op, impl)


# ---------------------------------------------------------------- the compiled program


def permute_depth(hlo_text: str) -> int:
    """The most collective-permutes on any chain of data dependencies in the program: how
    many transfers must happen one after another."""
    operands, opcode = {}, {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\S+\s+([\w\-]+)\((.*)", line)
        if m:
            name, op, rest = m.groups()
            opcode[name] = op
            operands[name] = re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])
    depth: dict[str, int] = {}

    hop = {"collective-permute", "collective-permute-start"}  # CPU; GPU (async)

    def walk(name):
        if name not in depth:
            below = max((walk(o) for o in operands[name] if o in operands), default=0)
            depth[name] = below + (opcode[name] in hop)
        return depth[name]

    return max((walk(n) for n in operands), default=0)


@pytest.mark.parametrize("op", ["column", "row"])
@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_collectives(op, impl):
    n, mesh = 4, tensor_mesh(4)
    fn, _ = OPERATIONS[op]
    a, w, ct = operands(op, (2,), s=16, d=8, f=8)
    forward = jax.jit(lambda a, w: fn(a, w, mesh, impl=impl)).lower(a, w).compile().as_text()
    grads = jax.jit(lambda a, w, ct: jax.vjp(lambda a, w: fn(a, w, mesh, impl=impl), a, w)[1](ct))
    backward = grads.lower(a, w, ct).compile().as_text()
    kinds_fwd = sorted(c.kind for c in collectives(forward, mesh))
    kinds_bwd = {c.kind for c in collectives(backward, mesh)}
    if impl == "plain":
        assert kinds_fwd == ["all-gather" if op == "column" else "reduce-scatter"]
        # column: x regathered for dw, dx reduce-scattered; row: dz gathered for both grads
        assert kinds_bwd == ({"all-gather", "reduce-scatter"} if op == "column" else {"all-gather"})
        return
    assert kinds_fwd == ["collective-permute"] * (n - 1)
    assert kinds_bwd == {"collective-permute"}
    assert all(c.axes == ("tensor",) for c in collectives(backward, mesh))
    assert permute_depth(forward) == (n // 2 if impl == "bidirectional" else n - 1)
    pairs = set(re.findall(r"source_target_pairs=(\{[{}\d,]*\})", forward))
    assert len(pairs) == (2 if impl == "bidirectional" else 1)  # both ways round, or one


def test_permute_depth_halves_for_eight_devices():
    mesh = tensor_mesh(8)
    for op, (fn, _) in OPERATIONS.items():
        a, w, _ = operands(op, (1,), s=16, d=8, f=16)
        for impl, depth in (("collective", 7), ("bidirectional", 4)):
            text = jax.jit(lambda a, w: fn(a, w, mesh, impl=impl)).lower(a, w).compile().as_text()
            assert permute_depth(text) == depth, (op, impl)


# ---------------------------------------------------------------- bad input


BAD = [
    # op, shapes (activation, weight), keyword changes, message
    ("column", ((2, 10, 8), (8, 16)), {}, r"column_parallel: x.shape\[-2\]=10 \(the sequence\) is not divisible by "
     r"mesh axis 'tensor' of size 4; use a multiple of 4, e.g. 8 or 12"),
    ("column", ((2, 16, 8), (8, 6)), {}, r"w.shape\[1\]=6 \(the output features\) is not divisible"),
    ("column", ((2, 16, 8), (6, 16)), {}, r"x.shape\[-1\]=8 must equal w.shape\[0\]=6"),
    ("column", ((2, 16, 8), (8, 16)), {"impl": "ring"}, r"impl='ring' is not one of"),
    ("column", ((2, 16, 8), (8, 16)), {"axis": "model"}, r"axis='model' is not a mesh axis"),
    ("column", ((3, 16, 8), (8, 16)), {"batch": "data"},
     r"x.shape\[0\]=3 \(the batch\) is not divisible by batch='data'"),
    ("column", ((16, 8), (8, 16)), {"batch": "data"}, r"batch='data' shards x's first dimension, but x has shape"),
    ("column", ((2, 16, 8), (8, 16)), {"batch": ("data", "tensor")}, r"includes the matmul's own axis 'tensor'"),
    ("row", ((2, 6, 16), (16, 8)), {}, r"row_parallel: y.shape\[-2\]=6 \(the sequence\) is not divisible by mesh "
     r"axis 'tensor' of size 4; use a multiple of 4, e.g. 4 or 8"),
    ("row", ((2, 16, 6), (6, 8)), {}, r"y.shape\[-1\]=6 \(the input features\) is not divisible"),
    ("row", ((2, 16, 16), (16, 8, 1)), {}, r"w must have 2 dimensions"),
]


@pytest.mark.parametrize("op, shapes, kw, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_names_the_argument(op, shapes, kw, message):
    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    fn, _ = OPERATIONS[op]
    a, w = jnp.zeros(shapes[0]), jnp.zeros(shapes[1])
    with pytest.raises(ValueError, match=message):
        fn(a, w, mesh, **kw)


def test_kernel_checks_the_local_sequence():
    mesh = tensor_mesh(4)
    body = jax.shard_map(
        lambda y, w: matmul_reducescatter(y, w, "tensor"),
        mesh=mesh,
        in_specs=(P(None, "tensor"), P("tensor")),
        out_specs=P("tensor"),
    )
    with pytest.raises(ValueError, match=r"y.shape\[-2\]=6 \(the sequence\) is not divisible by the size 4"):
        body(jnp.zeros((6, 8)), jnp.zeros((8, 4)))


# ---------------------------------------------------------------- several weights, and the model


def test_one_ring_feeds_several_weights():
    """allgather_matmuls: x travels the ring once (n-1 permutes, not n-1 per weight) and each
    output equals all_gather(x) @ w, values and gradients."""
    n, mesh = 4, tensor_mesh(4)
    rng = np.random.default_rng(3)
    x = normal(rng, (2, 16, 8))
    ws = [normal(rng, (8, f), scale=8**-0.5) for f in (8, 16, 4)]

    def sharded(x, *ws):
        body = jax.shard_map(
            lambda x, *ws: tuple(allgather_matmuls(x, ws, "tensor")),
            mesh=mesh,
            in_specs=(P(None, "tensor"), *[P(None, "tensor")] * len(ws)),
            out_specs=tuple(P(None, None, "tensor") for _ in ws),
        )
        return body(x, *ws)

    loss = lambda f: lambda x, *ws: sum(jnp.sum(jnp.sin(o)) for o in f(x, *ws))
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2, 3)))(x, *ws)
    want = jax.value_and_grad(loss(lambda x, *ws: [x @ w for w in ws]), argnums=(0, 1, 2, 3))(x, *ws)
    assert tree_error(got, want) < RTOL
    text = jax.jit(sharded).lower(x, *ws).compile().as_text()
    assert [c.kind for c in collectives(text, mesh)] == ["collective-permute"] * (n - 1)


def test_rules_that_move_the_megatron_layout_are_refused():
    """Custom compute rules that leave the MLP unsharded give the ring nothing to split."""
    from jaxpar.config import Config, TrainConfig, apply_overrides
    from jaxpar.train import build
    from jaxpar.models.llama import LlamaConfig

    config = Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=4, mlp=64),
        train=TrainConfig(global_batch=16, seq_len=16, compute_dtype="float32"),
    )
    sets = ["mesh.data=2", "mesh.tensor=4", "parallel.tensor.sequence_parallel=true", "parallel.tensor.collective_matmul=ring",
            "parallel.rules.compute=mlp="]
    trainer = build(apply_overrides(config, sets))
    with pytest.raises(ValueError, match=r"parallel.tensor.collective_matmul: \('batch', 'seq', 'mlp'\) is laid out as"):
        trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch())
