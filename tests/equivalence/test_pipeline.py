"""The pipeline executor (jaxpar.pipeline.executor) against its plain reference and against
single-device training.

Tolerance (fp32): 1e-5 relative, normwise per parameter, for losses, first-step gradients
and parameters after three AdamW steps (measured ~5e-7: only the order of sums differs).

Here the pipelined training layouts and explain; the schedules' tables, the executor on a
toy stage function and the refusals: tests/unit/test_pipeline.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.mesh import MeshConfig
from jaxpar.testing import check, compare, reference_run, run_layout
from jaxpar.train import build

RTOL = 1e-5


# ------------------------------------------------------------------ training equals one device


from ..unit.test_pipeline import deep_llama  # noqa: F401  the fixture, shared

SP = "parallel.tensor.sequence_parallel=true"
LAYOUTS = {
    # ZeRO-1 and the collective matmul inside the stages in one layout: its hops are
    # all-to-all swaps there (GPipe over four stages with ZeRO-1: the tied-embeddings test below)
    "1f1b_dp_tp_sp_zero1_collective_matmul": ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", SP, "parallel.zero.stage=1",
                                              "parallel.tensor.collective_matmul=bidirectional"],
    "interleaved_fsdp_tp": ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.pipeline.schedule=interleaved",
                            "parallel.pipeline.chunks=2"],
    # and the loss in 4 chunks of tokens on the last stage (train.loss_chunks)
    "zb_h1_dp_fsdp_zero1_loss_chunks": ["mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "parallel.pipeline.schedule=zb-h1",
                                        "parallel.zero.stage=1", "train.loss_chunks=4"],
    # context parallel inside the stages (PP x CP x TP): the ring's hops are all-to-all swaps
    # there (all-gather context in zero-bubble stages: benchmarks/matrix.py's zb-h1 x allgather)
    "1f1b_ring_tp": ["mesh.stage=2", "mesh.context=2", "mesh.tensor=2", "parallel.context.impl=ring"],
    "interleaved_ulysses_dp": ["mesh.stage=2", "mesh.data=2", "mesh.context=2", "parallel.context.impl=ulysses",
                               "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2"],
    # stages of different sizes (each padded to the widest as it rests: jaxpar.pipeline.split)
    "1f1b_uneven_dp_tp_sp_zero1": ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", SP, "parallel.zero.stage=1",
                                   "parallel.pipeline.layers=1,3"],
    "interleaved_uneven_fsdp_tp": ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.pipeline.schedule=interleaved",
                                   "parallel.pipeline.chunks=2", "parallel.pipeline.layers=1,2,1,0"],
    "zb_h1_uneven_dp": ["mesh.stage=4", "mesh.data=2", "parallel.pipeline.schedule=zb-h1", "parallel.pipeline.layers=0,2,1,1"],
}


# the smoke tier: pipeline, 1F1B
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.smoke) if n == "1f1b_dp_tp_sp_zero1_collective_matmul"
                                    else n for n in LAYOUTS])
def test_pipelined_training_equals_single_device(deep_llama, reference, layout):
    ref = reference(deep_llama)
    assert _norm(ref.grads) > deep_llama.optim.clip_norm  # clipping is active
    check(compare(run_layout(apply_overrides(deep_llama, LAYOUTS[layout])), ref), RTOL, where=layout)


def test_tied_embeddings_sum_over_first_and_last_stage(deep_llama, reference):
    """The one table is used by the first stage (lookup) and the last (logits): its
    gradient is the sum of both. GPipe over four stages of 1, 1, 2 and 0 layers with ZeRO-1
    (the layouts above run 1F1B, interleaving and zero bubble over two)."""
    tied = dataclasses.replace(deep_llama, model=dataclasses.replace(deep_llama.model, tie_embeddings=True))
    ref = reference(tied)
    assert _norm(ref.grads) > tied.optim.clip_norm  # clipping is active
    run = run_layout(apply_overrides(tied, ["mesh.stage=4", "mesh.data=2", "parallel.pipeline.schedule=gpipe",
                                            "parallel.zero.stage=1", "parallel.pipeline.layers=1,1,2,0"]))
    check(compare(run, ref), RTOL, where="tied")


def test_llama_pp_recipe_trains_in_bfloat16_like_the_unpipelined_step():
    """The recipe as shipped (bf16, 1F1B, stage 2 x data 2 x tensor 2 + SP, ZeRO-1), cut to
    2 layers: its losses track the same config without stages to bf16 precision."""
    from jaxpar.recipes import load

    config = apply_overrides(load("llama_pp"), ["model.num_layers=2", "train.seq_len=32", "train.steps=3"])
    piped = run_layout(config).losses
    flat = run_layout(apply_overrides(config, ["mesh.stage=1", "mesh.data=4", "mesh.tensor=2", SP, "parallel.zero.stage=1"])).losses
    np.testing.assert_allclose(piped, flat, rtol=2e-2)
    assert piped[-1] < piped[0]


def test_llama_recipe_shape_on_stage_fsdp_tensor_equals_single_device():
    """The llama recipe's own shape (vocab 256, batch 32, seq 64) on stage 2 x fsdp 2 x
    tensor 2 with 4 microbatches: once a microbatch held as many tokens as the vocabulary,
    the vocab-parallel embedding gather aborted XLA's partitioner inside the stages
    (SIGABRT, spmd_partitioner_util.cc:498); the lookup runs as a one-hot matmul there
    (jaxpar.sharding.embedding). fp32, 1e-5."""
    from jaxpar.recipes import load

    config = apply_overrides(load("llama"), ["model.num_layers=2", "train.compute_dtype=float32", "train.steps=3",
                                             "parallel.tensor.sequence_parallel=false"])
    config = dataclasses.replace(config, mesh=MeshConfig())
    run = run_layout(apply_overrides(config, ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4"]))
    check(compare(run, reference_run(config)), RTOL, where="llama recipe shape, stage x fsdp x tensor")


def _norm(tree) -> float:
    return float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree))))


def test_interleaved_stages_hold_their_own_chunks(deep_llama):
    """Under interleaving a device's layers are strided in the model (chunks s, s + p, ...):
    they are stored that way, so the step moves no weights between stages."""
    config = apply_overrides(
        deep_llama, ["mesh.stage=2", "mesh.data=4", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2"]
    )
    from jaxpar.inspect import inspect_step

    report = inspect_step(build(config))
    over_stage = {c.kind for c in report.collectives if "stage" in c.axes}
    assert over_stage == {"collective-permute", "all-reduce"}, over_stage  # messages, and the embedding/head gradients


# ------------------------------------------------------------------ bad input


# MoE layers inside the stages (their losses, counts and bias balancing under zero bubble's
# split backward, experts split over mesh.expert inside the stages): tests/equivalence/test_deepseek.py's
# stages layouts.


# ------------------------------------------------------------------ accounting


def test_explain_accounts_for_the_stages(deep_llama):
    """Model state split over stage (layers only), matmul FLOPs with the recomputed
    forwards, and the traffic over stage: each within 2% of its formula."""
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain, render

    config = apply_overrides(deep_llama, ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", "parallel.zero.stage=1"])
    trainer = build(config)
    doc = explain(trainer, inspect_step(trainer))
    rows = {r["name"]: r["ratio"] for r in doc["memory"] if r["ratio"] is not None}
    assert rows["model state"] == pytest.approx(1.0, abs=0.02), rows
    for key in ("flops", "gradient_traffic", "pipeline_traffic", "pipeline_gradient_traffic"):
        assert doc[key]["ratio"] == pytest.approx(1.0, abs=0.02), (key, doc[key])
    assert doc["pipeline"]["bubble"] == pytest.approx(doc["pipeline"]["published_bubble"])
    assert "stage 1" in render(doc)
