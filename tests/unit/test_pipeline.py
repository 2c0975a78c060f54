"""The pipeline executor (jaxpar.pipeline.executor) against its plain reference and against
single-device training.

Tolerance (fp32): 1e-5 relative, normwise per parameter, for losses, first-step gradients
and parameters after three AdamW steps (measured ~5e-7: only the order of sums differs).

Here the schedules' tables, the executor on a toy stage function and the refusals; the
pipelined training layouts and explain: tests/equivalence/test_pipeline.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, OptimConfig, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.pipeline.executor import Manual, Stages, pipeline_grads, reference_grads
from jaxpar.pipeline.program import BRANCHES, compile_schedule
from jaxpar.pipeline.split import StageSplit
from jaxpar.pipeline.stages import in_pipeline_order, relaid_layers, relayout_rounds
from jaxpar.train import build
from jaxpar.models.llama import LlamaConfig

RTOL = 1e-5

# (schedule, p, m, v): m not a multiple of p where the schedule allows it
PLANS = [("gpipe", 4, 3, 1), ("1f1b", 4, 6, 1), ("1f1b", 2, 2, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2),
         ("interleaved", 2, 2, 3), ("zb-h1", 4, 5, 1), ("1f1b-overlap", 4, 6, 1), ("1f1b-overlap", 2, 3, 1)]
# (schedule, p, m, v, layers of each virtual stage): stages of different sizes, empty first and last ones
UNEVEN = [("gpipe", 4, 3, 1, (0, 3, 2, 1)), ("1f1b", 4, 6, 1, (2, 1, 3, 2)), ("1f1b", 2, 2, 1, (3, 1)),
          ("interleaved", 2, 4, 2, (1, 2, 3, 1)), ("zb-h1", 4, 5, 1, (1, 2, 2, 0)),
          ("1f1b-overlap", 4, 5, 1, (0, 2, 3, 1))]


# ------------------------------------------------------------------ tick tables


@pytest.mark.parametrize("name,p,m,v", PLANS)
def test_tables_deliver_every_input_before_it_is_read(name, p, m, v):
    """Play the tables with labels instead of arrays: each op must find, in the slot it
    reads, the message for its own (microbatch, virtual stage), and run exactly once."""
    prog = compile_schedule(name, p, m, v)
    t = prog.tables
    last = p * v - 1
    acts = [[None] * prog.act_slots for _ in range(p)]
    grads = [[None] * prog.grad_slots for _ in range(p)]
    ran = []
    for tick in range(prog.ticks):
        sent_on, sent_back = {}, {}
        for s in range(p):
            branch = BRANCHES[t["branch"][tick, s]]
            mb, vs = int(t["microbatch"][tick, s]), int(t["chunk"][tick, s]) * p + s
            if branch == "idle":
                op = prog.timeline.grid[s][tick]
                if op is not None:  # the last stage's forward and split first backward wait by design
                    assert (op.kind == "F" and vs == last) or (op.kind == "B" and vs == 0 and prog.split)
                continue
            parts = [(branch, mb, "act_slot")]
            if branch.startswith("forward_backward"):  # the forward of mb, the backward of back_microbatch
                where, back = branch.rsplit("_", 1)[1], int(t["back_microbatch"][tick, s])
                parts = [(f"forward_{where}", mb, "act_slot"), (f"backward_{where}", back, "back_act_slot")]
            for name, mb, slot_column in parts:
                ran.append((name, mb, vs))
                if vs > 0:  # reads its input
                    assert acts[s][t[slot_column][tick, s]] == (mb, vs), (tick, s, name)
                if vs < last and not name.startswith("forward"):  # reads the gradient of its output
                    assert grads[s][t["grad_slot"][tick, s]] == (mb, vs), (tick, s, name)
                if name.startswith("forward"):
                    sent_on[(s + 1) % p] = (mb, vs + 1)
                if name.startswith(("backward", "input_grad")) and vs > 0:
                    sent_back[(s - 1) % p] = (mb, vs - 1)
        for s in range(p):
            slot = t["recv_act"][tick, s]
            assert (slot >= 0) == (s in sent_on)
            if slot >= 0:
                acts[s][slot] = sent_on[s]
            slot = t["recv_grad"][tick, s]
            assert (slot >= 0) == (s in sent_back)
            if slot >= 0:
                grads[s][slot] = sent_back[s]
    weight_ops = [r for r in ran if r[0].startswith(("backward", "weight_grad"))]
    assert sorted((mb, vs) for _, mb, vs in weight_ops) == [(i, vs) for i in range(m) for vs in range(p * v)]
    losses = [r for r in ran if r[0] in ("backward_last", "input_grad_last")]
    assert len(losses) == m  # each microbatch's loss counted once


def test_gpipe_buffers_grow_with_microbatches_1f1b_buffers_do_not():
    gpipe = [compile_schedule("gpipe", 4, m).act_slots for m in (4, 8, 16)]
    one_f_one_b = [compile_schedule("1f1b", 4, m).act_slots for m in (4, 8, 16)]
    assert gpipe == [4, 8, 16]
    assert one_f_one_b == [4, 4, 4]


def test_pipeline_order_round_trips():
    x = jnp.arange(24.0).reshape(12, 2)
    even = StageSplit(2, 3, (2,) * 6)
    y = even.to_pipeline_order(x)  # device 0 holds virtual stages 0, 2, 4: layers 0-1, 4-5, 8-9
    assert y[:6, 0].tolist() == [0, 2, 8, 10, 16, 18]
    np.testing.assert_array_equal(even.to_model_order(y), x)
    assert even.pipeline_rows[:6].tolist() == [0, 1, 4, 5, 8, 9]  # the gather the reshapes are
    # uneven: each virtual stage padded to the widest (3 rows); device 0 holds stages 0 and 2
    uneven = StageSplit(2, 2, (1, 2, 3, 0))
    y = uneven.to_pipeline_order(np.arange(6.0))
    assert y.tolist() == [0, 0, 0, 3, 4, 5, 1, 2, 0, 0, 0, 0]
    assert uneven.pipeline_rows.tolist() == [0, -1, -1, 3, 4, 5, 1, 2, -1, -1, -1, -1]
    assert uneven.offsets == (0, 1, 3, 6) and uneven.sizes == (3, 2, 1, 0)
    np.testing.assert_array_equal(uneven.to_model_order(y), np.arange(6.0))
    np.testing.assert_array_equal(uneven.to_model_order(uneven.to_pipeline_order(jnp.arange(6.0))), np.arange(6.0))


def test_chunks_move_between_orders_point_to_point():
    """Checkpoints reorder the layers of a stage-sharded state (jaxpar.loop.checkpoint):
    `relaid_layers` moves chunks between stages by collective permutes and equals the plain
    reorder both ways, bitwise, other dimensions sharded too; arrays outside "layers" are left
    alone. Its rounds are permutations that send exactly the chunks that change device."""
    for p in range(1, 9):
        for v in range(1, 6):
            for to in ("model", "pipeline"):
                rounds = relayout_rounds(p, v, to)
                assert len(rounds) == v and all(sorted(r.to) == list(range(p)) for r in rounds)
                sent = sum(s != d for r in rounds for s, d in enumerate(r.to))
                assert sent == sum(c % p != c // v for c in range(p * v)), (p, v, to)
    for p, v, rest in ((2, 3, 4), (4, 2, 2), (8, 3, 1)):
        mesh = jax.make_mesh((p, rest), ("stage", "fsdp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:p * rest])
        tree = {"layers": {"w": jnp.arange(p * v * 2 * 4 * 3.0).reshape(p * v * 2, 4, 3)}, "embed": jnp.arange(8.0)}
        shardings = {"layers": {"w": NamedSharding(mesh, P("stage", "fsdp"))}, "embed": NamedSharding(mesh, P())}
        piped = jax.device_put(in_pipeline_order(tree, StageSplit(p, v, (2,) * (p * v))), shardings)
        move = lambda t, to: jax.jit(lambda x: relaid_layers(x, shardings, p, v, to), out_shardings=shardings)(t)  # noqa: E731
        model = move(piped, "model")
        jax.tree.map(np.testing.assert_array_equal, model, tree)
        jax.tree.map(np.testing.assert_array_equal, move(model, "pipeline"), piped)
        assert model["layers"]["w"].sharding == shardings["layers"]["w"]


# ------------------------------------------------------------------ executor vs reference


def _toy():
    def run_chunk(c, x):
        return jax.lax.scan(lambda x, w: (x + jnp.tanh(x @ w), None), x, c["w"])[0]

    return Stages(
        first=lambda c, o, mb: run_chunk(c, o["embedding"][mb["inputs"]]),
        mid=lambda c, o, x, mb: run_chunk(c, x) * (1 + mb["weights"][..., None]),  # reads its own microbatch
        last=lambda c, o, x, mb: (
            jnp.sum((run_chunk(c, x) @ o["head"] - mb["targets"]) ** 2 * mb["weights"][..., None]),
            jnp.sum(mb["weights"]),
        ),
    )


# the smoke tier: pipeline, interleaved and zero bubble, and uneven stages
@pytest.mark.parametrize("name,p,m,v,counts", [
    pytest.param(*plan, marks=pytest.mark.smoke) if plan[:4] in (("interleaved", 2, 4, 2), ("zb-h1", 4, 5, 1)) else plan
    for plan in [(*plan, None) for plan in PLANS] + UNEVEN])
def test_executor_equals_reference(name, p, m, v, counts):
    """Loss sums and every gradient (layers, embedding, head) against jax.grad through the
    chunks in turn on one device, with data replicas beside the stages; with stages of
    different sizes, the padding rows' gradients exactly zero."""
    data = 8 // p if 8 // p <= 2 else 2
    mesh = jax.make_mesh((p, data, 8 // (p * data)), ("stage", "data", "tensor"), axis_types=(AxisType.Auto,) * 3)
    k = jax.random.split(jax.random.key(0), 5)
    d, rows = 8, 2 * data
    split = StageSplit(p, v, counts or (2,) * (p * v))
    layers = {"w": jax.random.normal(k[0], (split.layers, d, d)) / 3}
    other = {"embedding": jax.random.normal(k[1], (16, d)), "head": jax.random.normal(k[2], (d, 2))}
    micro = {
        "inputs": jax.random.randint(k[3], (m, rows, 3), 0, 16),
        "targets": jax.random.normal(k[4], (m, rows, 3, 2)),
        "weights": (jnp.arange(m * rows * 3).reshape(m, rows, 3) % 3 > 0).astype(jnp.float32),
    }
    layers = jax.tree.map(split.to_pipeline_order, layers)
    stages = _toy()
    prog = compile_schedule(name, p, m, v, split)
    assert prog.size_classes == len(set(split.counts))
    loss, weight, d_layers, d_other, _ = jax.jit(lambda l, o, mb: pipeline_grads(prog, stages, mesh, l, o, mb))(layers, other, micro)
    ref = reference_grads(stages, split, layers, other, micro)
    got = (loss.sum(0), weight.sum(0), jax.tree.map(lambda g: g.sum(0), d_layers), jax.tree.map(lambda g: g.sum(0), d_other))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(b))))
    assert jax.tree.leaves(d_layers)[0].shape[0] == data  # one gradient per replica, reduced by the caller
    assert not np.any(np.asarray(d_layers["w"])[:, split.padding()])  # nothing reads a padding row
    assert np.all(np.abs(np.asarray(got[2]["w"]))[~split.padding()].sum((1, 2)) > 0)  # every real layer learns


def _gathered(e):
    """An expert-split weight [L, E, d] whole: gathered over `expert` where the context is
    manual over it (its transpose sums each device's share back), as is elsewhere."""
    if "expert" in jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.all_gather(e, "expert", axis=1, tiled=True)
    return e


def _toy_with_experts():
    """_toy's chunks plus a weight split over `expert` ([L, 4, d], one row per expert) that
    each layer reads whole, as the experts' kernel reaches its experts by collectives."""
    def run_chunk(c, x):
        step = lambda x, w: (x + jnp.tanh(x @ w[0]) * jnp.sum(w[1], 0), None)  # noqa: E731
        return jax.lax.scan(step, x, (c["w"], _gathered(c["e"])))[0]

    return Stages(
        first=lambda c, o, mb: run_chunk(c, o["embedding"][mb["inputs"]]),
        mid=lambda c, o, x, mb: run_chunk(c, x),
        last=lambda c, o, x, mb: (jnp.sum((run_chunk(c, x) @ o["head"] + o["tilt"][:2] - mb["targets"]) ** 2),
                                  jnp.float32(x.shape[0])),
    )


@pytest.mark.parametrize("name", ["1f1b", "1f1b-overlap"])
def test_executor_manual_over_expert_equals_reference(name):
    """Manual over stage x data x expert (`Manual`): the rows split over data x expert, the
    expert-split weight arrives as each device's share, and the others' gradients are summed
    over `expert` once at the end (those outside the stack hierarchically, with `stage`);
    loss sums and every gradient equal the plain reference."""
    p, m = 2, 4
    mesh = jax.make_mesh((p, 2, 2), ("stage", "data", "expert"), axis_types=(AxisType.Auto,) * 3)
    k = jax.random.split(jax.random.key(1), 6)
    d, rows, split = 8, 8, StageSplit(p, 1, (2, 2))
    layers = {"w": jax.random.normal(k[0], (4, d, d)) / 3, "e": jax.random.normal(k[5], (4, 4, d)) / 2}
    # "tilt": 3 elements, not a multiple of the expert devices its gradient is scattered over
    other = {"embedding": jax.random.normal(k[1], (16, d)), "head": jax.random.normal(k[2], (d, 2)),
             "tilt": jnp.arange(3.0)}
    micro = {"inputs": jax.random.randint(k[3], (m, rows, 3), 0, 16), "targets": jax.random.normal(k[4], (m, rows, 3, 2))}
    manual = Manual({"w": P("stage"), "e": P("stage", "expert")}, {"embedding": P(), "head": P(), "tilt": P()})
    stages, prog = _toy_with_experts(), compile_schedule(name, p, m, 1, split)
    loss, weight, d_layers, d_other, _ = jax.jit(
        lambda l, o, mb: pipeline_grads(prog, stages, mesh, l, o, mb, manual=manual))(layers, other, micro)
    ref = reference_grads(stages, split, layers, other, micro)
    got = (loss.sum(0), weight.sum(0), jax.tree.map(lambda g: g.sum(0), d_layers), jax.tree.map(lambda g: g.sum(0), d_other))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(b))))
    assert tuple(d_layers["e"].sharding.spec) == ("data", "stage", "expert")  # each device its experts' gradient


@pytest.mark.parametrize("overrides,manual", [
    ([], True),
    (["lora.rank=4"], False),  # frozen bases, perhaps quantized into other shapes: expert left to the partitioner
    (["parallel.rules.compute=mlp=tensor+expert"], False),  # a device's share of a dense weight: not whole
    (["mesh.expert=1", "mesh.data=4"], False),
])
def test_executor_goes_manual_over_expert_where_each_share_is_whole(overrides, manual):
    """`by_expert`: the specs over stage and expert the executor gets, or None (the
    partitioner keeps `expert`); inside, no rule names `expert` and the experts' kernel
    exchanges over it."""
    from jaxpar.models.moe import MoEConfig
    from jaxpar.step.layout import layout_for
    from jaxpar.step.pipelined import by_expert, without_expert

    config = apply_overrides(Config(model=MoEConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4,
                                                    head_dim=8, mlp=32, num_experts=4, top_k=2)),
                             ["mesh.stage=2", "mesh.expert=2", "mesh.data=2", *overrides])
    sizes = {a: getattr(config.mesh, a) for a in ("stage", "data", "fsdp", "expert", "context", "tensor")}
    layout = layout_for(config, jax.devices(), sizes)
    mesh = layout.mesh
    shardings = {"layers": {"w_up": NamedSharding(mesh, P("stage", "expert" if sizes["expert"] > 1 else None, "tensor")),
                            "wq": NamedSharding(mesh, P("stage", None, "tensor"))},
                 "embedding": NamedSharding(mesh, P("tensor", None))}
    found = by_expert(config, layout, shardings)
    assert (found is not None) == manual
    if manual:
        assert found.layers == {"w_up": P("stage", "expert", None), "wq": P("stage", None, None)}
        assert found.other == {"embedding": P(None, None)}
        inside = without_expert(layout)
        assert inside.manual_experts == ("expert",)
        assert not any("expert" in axes for kind in ("storage", "compute") for axes in inside.rules.table(kind).values())


# ------------------------------------------------------------------ training equals one device


@pytest.fixture
def deep_llama() -> Config:
    """Four layers, four microbatches, clipping at a norm the gradients exceed (so the
    global norm must be taken across stages)."""
    return Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32", microbatches=4),
        optim=OptimConfig(clip_norm=0.5),
    )


SP = "parallel.tensor.sequence_parallel=true"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["mesh.stage=4", "mesh.data=2", "model.num_layers=6"], "model.num_layers=6"),
        (["mesh.stage=2", "mesh.data=4", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=4"], "2 x 4 = 8"),
        (["mesh.stage=4", "mesh.data=2", "train.microbatches=2", "train.global_batch=16"], "train.microbatches=2 < mesh.stage=4"),
        (["mesh.stage=2", "mesh.data=4", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2",
          "train.microbatches=3", "train.global_batch=24"], "groups of mesh.stage=2"),
        (["mesh.stage=2", "mesh.data=4", "parallel.pipeline.schedule=pipedream"], "parallel.pipeline.schedule='pipedream'"),
        (["mesh.stage=2", "mesh.data=4", "parallel.pipeline.chunks=2"], "only the interleaved"),
        (["mesh.data=4", "mesh.tensor=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2"], "mesh.stage=1"),
        (["mesh.stage=2", "mesh.data=4", "parallel.zero.stage=2"], "parallel.zero.stage=2"),
        (["mesh.stage=2", "mesh.context=4", "parallel.context.impl=ring"], "use mesh.context=2, or parallel.context.impl=ulysses"),
        (["mesh.stage=2", "mesh.data=4", "parallel.pipeline.chunks=0"], "parallel.pipeline.chunks=0"),
        (["mesh.stage=2", "mesh.tensor=4", SP, "parallel.tensor.collective_matmul=ring"], "use mesh.tensor=2 there"),
        (["mesh.stage=2", "mesh.data=4", "parallel.zero.stage=1", "parallel.zero.quantized_gradients=true"], "quantized_gradients"),
        (["mesh.data=4", "mesh.tensor=2", "parallel.pipeline.schedule=gpipe"], "parallel.pipeline.schedule='gpipe' shapes a pipeline"),
        (["mesh.stage=4", "mesh.data=2", "model.num_layers=6"], "or mesh.stage in [2, 3, 6]"),
    ],
)
def test_bad_pipeline_config_is_refused_before_compile(deep_llama, overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build(apply_overrides(deep_llama, overrides))


# MoE layers inside the stages (their losses, counts and bias balancing under zero bubble's
# split backward, experts split over mesh.expert inside the stages): tests/equivalence/test_deepseek.py's
# stages layouts.


# ------------------------------------------------------------------ accounting


def test_explain_png_needs_stages(capsys):
    from jaxpar.commands import main

    assert main(["explain", "llama", "--png", "x.png", "--set", "mesh.data=8"]) == 2
    assert "mesh.stage=1" in capsys.readouterr().err
