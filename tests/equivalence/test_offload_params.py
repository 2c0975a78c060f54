"""Parameters resting in host memory (parallel.zero.offload_params): the parameters and the
master rest in pinned host memory between steps; each use fetches its layer's shards
(`compute_value`), the gradients come back to the device for the reduction, the update
fetches the master; evaluation and `forward` read the weights where they rest.

The CPU backend has no separate host memory (the transfers are no-ops there: OffloadIsANoOp),
but JAX types each array's memory space: a host array that reaches device compute
unfetched fails the trace here, as it did until the gradients were brought back. Equal to
one device (fp32; losses, first-step gradients, parameters after 3 steps, 1e-5) under data x
ZeRO-1, data x fsdp x tensor, data x fsdp x ZeRO-3 (the per-replica gradients) and expert x
data, with AdamW and Muon.
"""

import math
import warnings

import jax
import pytest

from jaxpar.config import apply_overrides
from jaxpar.inspect import inspect_step
from jaxpar.step.trainer import OffloadIsANoOp
from jaxpar.testing import check, compare, run_layout
from jaxpar.train import build

OFFLOAD = "parallel.zero.offload_params=true"
LAYOUTS = {
    "data8_zero1": ["mesh.data=8", "parallel.zero.stage=1"],
    "data2_fsdp2_tensor2_muon": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optim.name=muon"],
    "data4_fsdp2_zero3_microbatches2": ["mesh.data=4", "mesh.fsdp=2", "parallel.zero.stage=3", "train.microbatches=2"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_offloaded_parameters_train_as_one_device(tiny_llama, reference, name):
    optim = [o for o in LAYOUTS[name] if o.startswith("optim.")]
    base = apply_overrides(tiny_llama, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadIsANoOp)
        run = run_layout(apply_overrides(base, [*LAYOUTS[name], OFFLOAD]))
    check(compare(run, reference(base)), 1e-5, where=name)


def test_the_parameters_and_master_rest_on_the_host(tiny_llama):
    """bf16 parameters and their fp32 master in pinned host memory (explain's "of which in
    pinned host memory"); the optimizer state stays unless offload_optimizer asks too."""
    config = apply_overrides(tiny_llama, ["mesh.data=8", "parallel.zero.stage=1", "train.compute_dtype=bfloat16",
                                          OFFLOAD])
    with pytest.warns(OffloadIsANoOp, match="offload_params"):
        trainer = build(config)
    kinds = lambda tree: {s.memory_kind for s in jax.tree.leaves(tree)}  # noqa: E731
    state = trainer.state_shardings
    assert kinds(state.params) == kinds(state.master) == {"pinned_host"} and kinds(state.opt_state) == {"device"}
    memory = inspect_step(trainer).memory
    assert memory.host_state == memory.params + memory.master > 0


def test_evaluation_reads_the_resting_parameters(tiny_llama):
    """The held-out loss (`evaluate`) and `forward` take the weights as they rest, in host
    memory, and fetch them as the step does: the same loss as without the offload."""
    from jaxpar.data.sources import make_source
    from jaxpar.testing import initial_state

    losses = []
    for offload in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadIsANoOp)
            trainer = build(apply_overrides(tiny_llama, ["mesh.data=8", f"parallel.zero.offload_params={offload}"]))
        batch = make_source(trainer.batch, trainer.config)(0)
        weights = trainer.weights(initial_state(trainer))
        total, weight = trainer.evaluate(weights, batch)
        losses.append(float(total / weight))
        assert trainer.forward(weights, batch).shape[:2] == batch["inputs"].shape
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_fp8_gathers_fetch_from_the_host_too(tiny_llama):
    """FP8 projections gather their weights their own way (jaxpar.sharding.projections): they
    fetch from host memory as compute_value does, or the trace fails on a host operand."""
    config = apply_overrides(tiny_llama, ["mesh.data=8", "parallel.zero.stage=3", "train.matmul_dtype=fp8", OFFLOAD])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadIsANoOp)
        run = run_layout(config, steps=1)
    assert math.isfinite(run.losses[0]) and run.losses[0] > 0
