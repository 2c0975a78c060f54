"""jaxpar.inspect on compiled steps: model-state memory and gradient traffic match the ZeRO
formulas (within 5%), FLOPs count loop trips, partitioner warnings become findings."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.commands import main
from jaxpar.config import apply_overrides
from jaxpar.inspect import captured_stderr, compiler_warnings, inspect_step, parse_findings
from jaxpar.inspect.buffers import Buffer, parameter_shaped, temporaries
from jaxpar.inspect.explain import explain
from jaxpar.inspect.findings import OVERSIZED, oversized_temporaries
from jaxpar.inspect.formulas import zero_paper_bytes
from jaxpar.inspect.hlo import matmul_flops
from jaxpar.train import build


@pytest.fixture
def bf16_llama(tiny_llama):
    return apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "mesh.data=8"])


@pytest.mark.parametrize("stage", [0, 1, 2, pytest.param(3, marks=pytest.mark.smoke)])  # smoke: explain
def test_zero_memory_and_traffic_match_the_paper(bf16_llama, stage):
    trainer = build(apply_overrides(bf16_llama, [f"parallel.zero.stage={stage}"]))
    doc = explain(trainer, inspect_step(trainer))
    state = {row["name"]: row for row in doc["memory"]}["model state"]
    assert abs(state["ratio"] - 1) < 0.05, state
    # The paper's own table (16 bytes per parameter in all) agrees with the per-part formula.
    assert abs(state["formula"] / zero_paper_bytes(doc["params"], stage, 8) - 1) < 1e-9
    traffic = doc["gradient_traffic"]
    assert abs(traffic["ratio"] - 1) < 0.05, traffic
    expected = (3 if stage == 3 else 2) * doc["params"] * 7 / 8
    assert traffic["formula"] == pytest.approx(expected)
    assert doc["flops"]["ratio"] == pytest.approx(1, abs=0.05)
    assert doc["widened"] == "bfloat16"  # XLA:CPU's f32 collectives for bf16 ones: noted under the table


def test_zero2_reduce_scatters_every_microbatch(bf16_llama):
    """Stage 2 reduces each microbatch's gradient into the sharded accumulator: the layer
    gradients' reduce-scatter runs inside the backward loop, layers x microbatches times,
    and nothing is all-reduced at full size."""
    trainer = build(apply_overrides(bf16_llama, ["parallel.zero.stage=2", "train.microbatches=2"]))
    report = inspect_step(trainer)
    layers = trainer.config.model.num_layers
    assert max(c.trip_count for c in report.collectives if c.kind == "reduce-scatter") == layers * 2
    assert all(c.buffer_bytes < 1024 for c in report.collectives if c.kind == "all-reduce")


def test_zero1_accumulates_unreduced_and_reduces_once(bf16_llama):
    """Stage 1 with microbatches keeps a whole gradient per replica and reduces it once."""
    report = inspect_step(build(apply_overrides(bf16_llama, ["parallel.zero.stage=1", "train.microbatches=2"])))
    big = [c for c in report.collectives if c.buffer_bytes > 1024 and c.kind in ("all-reduce", "reduce-scatter")]
    assert big and all(c.trip_count == 1 for c in big)


def test_hybrid_sharding_crosses_hosts_a_quarter_of_zero3_or_less(tiny_llama):
    """Two simulated hosts of four. Flat ZeRO-3 gathers and reduce-scatters across hosts;
    hybrid sharding (fsdp inside a host, data across) sends only gradient all-reduces across.
    (The model is tests/equivalence/test_gradient_compression.py's cross-host one, whose uncompressed
    ZeRO-0 step is this hybrid step: the suite compiles it once.)"""

    def crossing(overrides):
        report = inspect_step(build(apply_overrides(tiny_llama, overrides + ["model.embed=64", "model.mlp=256"])))
        return report, report.cross_host_bytes()

    _, flat = crossing(["mesh.data=1", "mesh.fsdp=8", "mesh.hosts.fsdp=2"])
    hsdp, hybrid = crossing(["mesh.data=2", "mesh.fsdp=4", "mesh.hosts.data=2"])
    assert 0 < hybrid <= flat / 4, (hybrid, flat)
    assert not [c for c in hsdp.collectives if c.crosses_hosts and c.kind == "all-gather"]


def test_matmul_flops_multiply_loop_trips():
    w = jnp.ones((5, 16, 32))

    def f(x, w):
        return jax.lax.scan(lambda h, wi: (h @ wi @ wi.T, None), x, w)[0]

    text = jax.jit(f).lower(jnp.ones((4, 16)), w).compile().as_text()
    flops, known = matmul_flops(text)
    assert known and flops == 5 * 2 * (2 * 4 * 16 * 32)


def test_involuntary_rematerialisation_becomes_a_finding_even_when_the_program_is_in_the_cache():
    """XLA prints the partitioner's warning only while it compiles. The run's persistent
    compilation cache (tests/conftest.py; a user's jax_compilation_cache_dir alike) holds the
    program after its first compile and prints nothing when it loads it, so
    compiler_warnings (what `jaxpar explain` compiles under) turns the cache off for its
    block, and back on after it."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def f(x):
        y = x.reshape(6, 4, 8) * 2  # 24 rows over 8 devices cannot become 6 over 8
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, None, ("a", "b"))))

    x = jax.ShapeDtypeStruct((24, 8), jnp.float32, sharding=NamedSharding(mesh, P(("b", "a"), None)))
    logs = {}
    for when, capture in (("first", captured_stderr), ("from the cache", captured_stderr), ("fresh", compiler_warnings),
                          ("cache back on", captured_stderr)):
        with capture() as logs[when]:  # a new function each time: not JAX's in-memory memo of this process
            jax.jit(lambda x: f(x)).lower(x).compile()
    assert not parse_findings(logs["from the cache"]) and not parse_findings(logs["cache back on"])
    findings = parse_findings(logs["fresh"])
    assert findings and findings[0].kind == "involuntary full rematerialization"
    assert "->" in findings[0].detail


def test_temporary_larger_than_a_layer_becomes_a_finding(tiny_llama):
    """ZeRO-0 keeps the whole fp32 gradient of every layer on every device: parameter-shaped
    temporaries of 16 layers, 4x one layer's parameters, named with the operation that makes
    them. ZeRO-3 over fsdp on the same model holds nothing larger than a layer."""
    config = apply_overrides(tiny_llama, ["model.num_layers=16", "model.embed=128", "model.mlp=512", "model.head_dim=32",
                                          "model.remat=full", "train.global_batch=8"])
    layer_bytes = config.model.layer_param_count() * 4

    def oversized(layout):
        findings = inspect_step(build(apply_overrides(config, layout))).findings
        return [f for f in findings if f.kind == OVERSIZED]

    replicated = oversized(["mesh.data=8", "parallel.zero.stage=0"])
    assert replicated, "a replicated gradient of 16 layers is larger than one layer"
    first = replicated[0]
    dims = re.match(r"f32\[16,([\d,]+)\]", first.detail)
    assert dims and first.op, first  # a gradient of all 16 layers, and the JAX operation that makes it
    size = 16 * math.prod(int(d) for d in dims.group(1).split(",")) * 4
    assert size > layer_bytes and f"{size / layer_bytes:.1f}x one layer's parameters" in first.detail, (first, layer_bytes)
    assert oversized(["mesh.data=1", "mesh.fsdp=8", "parallel.zero.stage=3"]) == []


def test_temporaries_read_from_hlo_text():
    """Buffers of the entry and of loop bodies, a tuple's elements apart; not parameters,
    outputs, tuples, bitcasts, or what fused computations hold inside."""
    text = """HloModule m, entry_computation_layout={(f32[64,32]{1,0})->f32[64,32]{1,0}}

%fused (p: f32[64,32]) -> f32[64,32] {
  %p = f32[64,32]{1,0} parameter(0)
  %big = f32[4096,4096]{1,0} broadcast(%p), dimensions={}
  ROOT %n = f32[64,32]{1,0} negate(%p)
}

%body (t: (s32[], f32[8,64,32])) -> (s32[], f32[8,64,32]) {
  %t = (s32[], f32[8,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %acc = f32[8,64,32]{2,1,0} get-tuple-element(%t), index=1
  %upd = f32[8,64,32]{2,1,0} add(%acc, %acc), metadata={op_name="jit(f)/while/body/add"}
  ROOT %r = (s32[], f32[8,64,32]{2,1,0}) tuple(%i, %upd)
}

%cond (t: (s32[], f32[8,64,32])) -> pred[] {
  %t = (s32[], f32[8,64,32]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[64,32]) -> f32[64,32] {
  %x = f32[64,32]{1,0} parameter(0)
  %pair = (f32[64,32]{1,0}, f32[2,64,32]{2,1,0}) fusion(%x), kind=kLoop, calls=%fused
  %zeros = f32[8,64,32]{2,1,0} broadcast(%x), dimensions={}
  %w = (s32[], f32[8,64,32]{2,1,0}) while(%pair), condition=%cond, body=%body
  %view = f32[2048]{0} bitcast(%x)
  ROOT %out = f32[64,32]{1,0} negate(%x)
}
"""
    found = {(b.instruction, b.shape, b.bytes) for b in temporaries(text)}
    assert found == {("upd", "f32[8,64,32]", 65536), ("zeros", "f32[8,64,32]", 65536),
                     ("pair{0}", "f32[64,32]", 8192), ("pair{1}", "f32[2,64,32]", 16384)}, found
    assert next(b for b in temporaries(text) if b.instruction == "upd").op_name == "jit(f)/while/body/add"


def test_outputs_through_a_multi_output_fusion_are_no_temporaries():
    """A GPU's update writes each piece of state from one multi-output fusion; the entry
    returns its elements through get-tuple-element (the sixth operand of a tuple printed
    after an /*index=5*/ note): outputs, not temporaries. Its element no output reads is one."""
    text = """HloModule m

%fused (p: f32[64,32]) -> (f32[64,32], f32[64,32], f32[64,32]) {
  %p = f32[64,32]{1,0} parameter(0)
  %a = f32[64,32]{1,0} negate(%p)
  ROOT %t = (f32[64,32]{1,0}, f32[64,32]{1,0}, f32[64,32]{1,0}) tuple(%a, %a, %a)
}

ENTRY %main (x: f32[64,32]) -> (f32[64,32], f32[64,32], f32[64,32], f32[64,32], f32[64,32], f32[64,32]) {
  %x = f32[64,32]{1,0} parameter(0)
  %update = (f32[64,32]{1,0}, f32[64,32]{1,0}, f32[64,32]{1,0}) fusion(%x), kind=kLoop, calls=%fused
  %first = f32[64,32]{1,0} get-tuple-element(%update), index=0
  %sixth = f32[64,32]{1,0} get-tuple-element(%update), index=2
  ROOT %out = (f32[64,32]{1,0}, f32[64,32]{1,0}, f32[64,32]{1,0}, f32[64,32]{1,0}, f32[64,32]{1,0}, /*index=5*/f32[64,32]{1,0}) tuple(%first, %x, %x, %x, %x, /*index=5*/%sixth)
}
"""
    assert [b.instruction for b in temporaries(text)] == ["update{1}"]


@pytest.mark.parametrize(
    "shape, expected",
    [
        ("f32[16,64,512]", True),  # the stacked [16, 128, 512] weight's gradient, embed over 2
        ("bf16[1,16,128,512]", True),  # stacked per replica
        ("f32[128,512]", True),  # one layer's slice, gathered
        ("f32[16,65536]", True),  # a bitcast that merged two dimensions
        ("f32[16,8,32,128]", False),  # activations: [layers, batch, seq, embed]
        ("f32[16,128,384]", False),  # 512/384 is no device count
    ],
)
def test_parameter_shaped(shape, expected):
    assert parameter_shaped(shape, [(16, 128, 512), (256, 128)], devices=8) is expected


def test_oversized_temporaries_leave_out_what_the_forward_pass_saves():
    """A [layers, seq, embed] stack of saved layer inputs has the shape of a stacked
    [layers, embed/4, heads x head_dim] gradient: the operation tells them apart."""
    def buffer(shape, op_name, size=2**20):
        return Buffer("b", "fusion:dynamic-update-slice", shape, size, op_name, "")

    params = [(16, 512, 8, 64)]  # layers, embed, heads, head_dim
    grads = buffer("f32[16,128,512]", "jit(step)/vmap(transpose(jvp()))/while/body/dynamic_update_slice")
    saved = buffer("bf16[16,1,128,512]", "jit(step)/vmap(jvp())/while/body/dynamic_update_slice")
    small = buffer("f32[16,128,512]", "jit(step)/convert_element_type", size=2**10)
    found = oversized_temporaries([grads, saved, small], layer_params=2**17, itemsize=2, dtype="bfloat16",
                                  parameters=params, devices=8)
    assert [f.op for f in found] == [grads.op_name], found
    assert "4.0x one layer's parameters (131.07K x 2 B = 256.00 KiB in bfloat16)" in found[0].detail, found


def test_explain_cli_json(capsys):
    assert main(["explain", "llama", "--devices", "8", "--json", "--set", "parallel.zero.stage=1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in doc["memory"]} >= {"parameters", "optimizer state", "model state"}
    assert doc["collectives"] and doc["findings"] == []


def test_explain_cli_rejects_bad_device_count(capsys):
    assert main(["explain", "llama", "--devices", "1000"]) == 2
    assert "--devices=1000; use 1 to 512" in capsys.readouterr().err


def test_remat_policies_shrink_activation_memory(tiny_llama):
    """Compiled temporaries: recomputing everything (full) < recomputing the attention core
    (selective) < saving everything (none)."""
    def temporaries(remat):
        config = apply_overrides(tiny_llama, [f"model.remat={remat}", "mesh.data=8", "train.seq_len=128"])
        return inspect_step(build(config)).memory.temporaries

    full, selective, none = temporaries("full"), temporaries("selective"), temporaries("none")
    assert full < selective < none, (full, selective, none)


@pytest.mark.parametrize(
    "impl, remat, other", [("ring", "none", "mesh.data=2"), ("ulysses", "selective", "mesh.data=2"),
                           ("allgather", "full", "mesh.data=2"), ("ring", "none", "mesh.tensor=2")],
    ids=["ring", "ulysses", "allgather", "ring-tensor2-kv1"]
)
def test_explain_context_traffic_matches_the_formulas(tiny_llama, impl, remat, other):
    """A whole step on context=4 x data=2: attention traffic over context equals the
    per-layer formula x layers (with the forward again where remat recomputes attention),
    and the gradient all-reduce over context equals 2Ψ(c-1)/c. And beside tensor=2 with one
    key/value head, repeated twice at use: each device sends its one copy around the ring."""
    kv = ["model.num_kv_heads=1"] if other == "mesh.tensor=2" else []
    config = apply_overrides(tiny_llama, [other, "mesh.context=4", "train.seq_len=32",
                                          f"parallel.context.impl={impl}", f"model.remat={remat}", *kv])
    trainer = build(config)
    doc = explain(trainer, inspect_step(trainer))
    assert abs(doc["context_traffic"]["ratio"] - 1) < 0.05, doc["context_traffic"]
    assert doc["widened"] is None  # float32 compute: the collectives are as a GPU's
    assert abs(doc["context_gradient_traffic"]["ratio"] - 1) < 0.05, doc["context_gradient_traffic"]
    assert ("repeated 2 times at use" in doc["memory_formula"]) == bool(kv)


def test_explain_gives_the_loss_logits_one_device_holds(tiny_llama):
    """Tokens of a microbatch over the devices outside tensor (and stage), by the vocabulary's
    tensor share, in float32, over the chunks: 32 x 16 tokens / 2 microbatches / (8 / 2)
    devices x 128 / 2 of the vocabulary x 4 bytes = 16 KiB, 4 KiB a chunk."""
    from jaxpar.inspect.explain import loss_logits

    config = apply_overrides(tiny_llama, ["train.global_batch=32", "train.seq_len=16", "train.microbatches=2",
                                          "model.vocab_size=128", "train.loss_chunks=4"])
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    assert loss_logits(config, mesh, 8) == "float32 logits in 4 chunks of tokens, 4.00 KiB a chunk (16.00 KiB whole)"
    whole = loss_logits(apply_overrides(config, ["train.loss_chunks=1"]), mesh, 8)
    assert whole.startswith("whole float32 logits, 16.00 KiB (64 tokens x 64 of the vocabulary)"), whole
