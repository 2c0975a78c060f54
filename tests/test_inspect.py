"""jaxpar.inspect on compiled steps: model-state memory and gradient traffic match the ZeRO
formulas (within 5%), FLOPs count loop trips, partitioner warnings become findings."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.cli import main
from jaxpar.config import apply_overrides
from jaxpar.inspect import captured_stderr, inspect_step, parse_findings
from jaxpar.inspect.explain import explain
from jaxpar.inspect.formulas import zero_paper_bytes
from jaxpar.inspect.hlo import matmul_flops
from jaxpar.train import build


@pytest.fixture
def bf16_llama(tiny_llama):
    return apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "mesh.data=8"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_memory_and_traffic_match_the_paper(bf16_llama, stage):
    trainer = build(apply_overrides(bf16_llama, [f"parallel.zero_stage={stage}"]))
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


def test_zero2_reduce_scatters_every_microbatch(bf16_llama):
    """Stage 2 reduces each microbatch's gradient into the sharded accumulator: the layer
    gradients' reduce-scatter runs inside the backward loop, layers x microbatches times,
    and nothing is all-reduced at full size."""
    trainer = build(apply_overrides(bf16_llama, ["parallel.zero_stage=2", "train.microbatches=2"]))
    report = inspect_step(trainer)
    layers = trainer.config.model.num_layers
    assert max(c.trip_count for c in report.collectives if c.kind == "reduce-scatter") == layers * 2
    assert all(c.buffer_bytes < 1024 for c in report.collectives if c.kind == "all-reduce")


def test_zero1_accumulates_unreduced_and_reduces_once(bf16_llama):
    """Stage 1 with microbatches keeps a whole gradient per replica and reduces it once."""
    report = inspect_step(build(apply_overrides(bf16_llama, ["parallel.zero_stage=1", "train.microbatches=2"])))
    big = [c for c in report.collectives if c.buffer_bytes > 1024 and c.kind in ("all-reduce", "reduce-scatter")]
    assert big and all(c.trip_count == 1 for c in big)


def test_hybrid_sharding_crosses_hosts_a_quarter_of_zero3_or_less(tiny_llama):
    """Two simulated hosts of four. Flat ZeRO-3 gathers and reduce-scatters across hosts;
    hybrid sharding (fsdp inside a host, data across) sends only gradient all-reduces across."""

    def crossing(overrides):
        report = inspect_step(build(apply_overrides(tiny_llama, overrides)))
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


def test_involuntary_rematerialisation_becomes_a_finding():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def f(x):
        y = x.reshape(6, 4, 8) * 2  # 24 rows over 8 devices cannot become 6 over 8
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, None, ("a", "b"))))

    x = jax.ShapeDtypeStruct((24, 8), jnp.float32, sharding=NamedSharding(mesh, P(("b", "a"), None)))
    with captured_stderr() as log:
        jax.jit(f).lower(x).compile()
    findings = parse_findings(log)
    assert findings and findings[0].kind == "involuntary full rematerialization"
    assert "->" in findings[0].detail


def test_explain_cli_json(capsys):
    assert main(["explain", "llama", "--devices", "8", "--json", "--set", "parallel.zero_stage=1"]) == 0
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
    "impl, remat", [("ring", "none"), ("ulysses", "selective"), ("allgather", "full")], ids=["ring", "ulysses", "allgather"]
)
def test_explain_context_traffic_matches_the_formulas(tiny_llama, impl, remat):
    """A whole step on context=4 x data=2: attention traffic over context equals the
    per-layer formula x layers (with the forward again where remat recomputes attention),
    and the gradient all-reduce over context equals 2Ψ(c-1)/c."""
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.context=4", "train.seq_len=32",
                                          f"parallel.context_impl={impl}", f"model.remat={remat}"])
    trainer = build(config)
    doc = explain(trainer, inspect_step(trainer))
    assert abs(doc["context_traffic"]["ratio"] - 1) < 0.05, doc["context_traffic"]
    assert abs(doc["context_gradient_traffic"]["ratio"] - 1) < 0.05, doc["context_gradient_traffic"]
