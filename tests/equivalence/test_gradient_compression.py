"""Gradient compression in training (parallel.compression.method, jaxpar.step.compression)
over two simulated hosts: PowerSGD at full rank (on HSDP with tensor + sequence parallelism
at ZeRO-1) and top-k of every entry (on ZeRO-3), both with microbatches, equal the
single-device run (fp32: losses and gradients 1e-5, parameters after 3 steps 1e-5), the
layer stack averaged one layer at a time inside the backward pass (jaxpar.step.compressed);
error feedback holds in the trainer (what was applied plus the replicas' mean residual is
the sum of the true gradients, 1e-5); the compiled program's cross-host bytes are the
formula's at ZeRO-0 and -1, the compressor's collectives inside the layer loop;
int8 is qgZ bitwise; resuming repeats the losses bitwise; bad ranks are refused before
compile."""

import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.errors import ConfigError
from jaxpar.inspect import inspect_step
from jaxpar.inspect.explain import explain, render
from jaxpar.testing import check, compare, initial_state, run_layout, tree_error
from jaxpar.train import build
from jaxpar.loop.checkpoint import Checkpoints, CompressionRestarted
from jaxpar.loop.run import run

TWO_HOSTS = ["mesh.data=2", "mesh.hosts.data=2"]
LAYOUTS = {
    "hsdp_tp_sp_zero1": TWO_HOSTS + ["mesh.fsdp=2", "mesh.tensor=2", "parallel.tensor.sequence_parallel=true",
                                     "parallel.zero.stage=1"],
    "zero3": TWO_HOSTS + ["mesh.fsdp=4", "parallel.zero.stage=3"],
}


def full_rank(config) -> int:
    """The largest shorter side of the matrices PowerSGD factors: every one at its full rank."""
    compressor = build(apply_overrides(config, ["parallel.compression.method=powersgd",
                                                "parallel.compression.powersgd_rank=1"])).compressor
    return max(min(b.sides) for b in compressor.factored().values())


@pytest.mark.parametrize("method, layout", [("powersgd", "hsdp_tp_sp_zero1"),
                                            pytest.param("topk", "zero3", marks=pytest.mark.smoke)],  # smoke: compression
                         ids=["powersgd_hsdp_tp_sp_zero1", "topk_zero3"])
def test_lossless_settings_equal_the_single_device_run(tiny_llama, reference, method, layout):
    base = apply_overrides(tiny_llama, ["train.microbatches=2"])
    config = apply_overrides(base, LAYOUTS[layout])
    knob = f"parallel.compression.powersgd_rank={full_rank(config)}" if method == "powersgd" else "parallel.compression.topk_fraction=1"
    compressed = apply_overrides(config, [f"parallel.compression.method={method}", knob])
    check(compare(run_layout(compressed), reference(base)), 1e-5, where=f"{layout} {method} {knob}")


def test_error_feedback_applied_plus_residual_is_every_true_gradient(tiny_llama):
    """Over 3 steps of PowerSGD at rank 1, the gradients the optimizer got plus the replicas'
    mean residual equal the sum of each step's uncompressed gradient, taken at the same
    parameters (1e-5 of its largest entry). With parallel.compression.error_feedback=false
    the residual stays zero: the first step sends what error feedback's does (nothing left
    out yet), the next ones differ from it, what was left out is lost, and `explain`'s
    compressed-traffic row names it (the bytes are the same formula's)."""
    layout = apply_overrides(tiny_llama, LAYOUTS["hsdp_tp_sp_zero1"])
    plain = build(layout)
    rank_1 = apply_overrides(layout, ["parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=1"])
    add = lambda a, b: b if a is None else jax.tree.map(jnp.add, a, b)  # noqa: E731
    sent = {}
    for feedback in (True, False):
        trainer = build(apply_overrides(rank_1, [f"parallel.compression.error_feedback={feedback}"]))
        source, state = make_source(trainer.batch, trainer.config), initial_state(trainer)
        applied = true = None
        for step in range(3):
            if feedback:  # the uncompressed gradient at the same parameters
                true = add(true, plain.grads(state.params, source(step))[1])
            state, metrics, grads = trainer.step_and_grads(state, source(step))
            sent[feedback, step] = jax.device_get(grads)
            applied = add(applied, grads)
            assert float(metrics["nonfinite"]) == 0
        residual = jax.tree.map(lambda r: jnp.mean(r, axis=0), state.compression.residual)
        if feedback:
            assert tree_error(jax.device_get(applied), jax.device_get(true)) > 1e-2  # rank 1 did leave things out
            assert tree_error(jax.device_get(add(applied, residual)), jax.device_get(true)) <= 1e-5
        else:
            assert max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(residual)) == 0.0
            row = explain(trainer, inspect_step(trainer))["compressed_traffic"]  # `jaxpar explain` says so
            assert row["name"].endswith("powersgd rank 1, no error feedback")
            assert abs(row["measured"] - row["formula"]) <= 0.02 * row["formula"] + 64
    assert tree_error(sent[False, 0], sent[True, 0]) <= 1e-6  # no residual yet: the same first step
    assert tree_error(sent[False, 1], sent[True, 1]) > 1e-3  # then the feedback is what differs


def test_cross_host_bytes_are_the_formula_and_the_stack_is_averaged_layer_by_layer(tiny_llama):
    """Two hosts x fsdp 4, PowerSGD at ZeRO-0 (the uncompressed step all-reduces over data)
    and top-k at ZeRO-1 (it reduce-scatters, and gathers the updated parameters): the
    compiled program sends what Compressor.cross_host_bytes says for the stage (2%), and
    `explain` says so, the parameter gathers in their own row. The layer stack's
    parameters are averaged inside the backward loop: their compressed collectives run once
    per layer, in the layer scan's loop."""
    config = apply_overrides(tiny_llama, TWO_HOSTS + ["mesh.fsdp=4", "model.embed=64", "model.mlp=256"])
    for method, knob, stage in (("powersgd", "parallel.compression.powersgd_rank=2", 0), ("topk", "parallel.compression.topk_fraction=0.01", 1)):
        layout = apply_overrides(config, [f"parallel.zero.stage={stage}"])
        dense = inspect_step(build(layout))
        gradient = dense.bytes_over(["data"], ["all-reduce" if stage == 0 else "reduce-scatter"])  # the uncompressed step's
        trainer = build(apply_overrides(layout, [f"parallel.compression.method={method}", knob]))
        stack = {p for p in trainer.compressor.blocks if p.startswith("layers.")}
        assert trainer.compressor.per_layer == stack and len(stack) == 9
        formula = trainer.compressor.cross_host_bytes(stage)
        report = inspect_step(trainer)
        doc = explain(trainer, report)  # `jaxpar explain` shows the compressed traffic beside its formula
        row, gathers = doc["compressed_traffic"], doc["parameter_gathers"]
        assert abs(row["measured"] - row["formula"]) <= 0.02 * row["formula"] + 64 and "uncompressed" in render(doc)
        assert abs(formula["uncompressed"] - gradient) <= 0.02 * gradient, (method, formula, gradient)
        assert gathers["measured"] == gathers["formula"] == (0 if stage == 0 else dense.bytes_over(["data"], ["all-gather"]))
        compressed = [c for c in report.collectives if "gradient_compression" in c.op_name and "data" in c.axes]
        in_loop = sum(c.bytes_per_step for c in compressed if c.trip_count == 2)  # the 2 layers' loop
        assert in_loop >= 0.5 * row["measured"], (method, in_loop, row)  # the stack is most of the model
        assert row["measured"] <= gradient / 4, (method, row, gradient)
        assert doc["compressed_schedule"]["where"].startswith("9 of 12 parameters layer by layer")


def test_int8_is_qgz_under_its_new_name(tiny_llama):
    layout = apply_overrides(tiny_llama, ["mesh.data=4", "mesh.fsdp=2", "parallel.zero.stage=1"])
    old = run_layout(apply_overrides(layout, ["parallel.zero.quantized_gradients=true"]))
    new = run_layout(apply_overrides(layout, ["parallel.compression.method=int8"]))
    assert old.losses == new.losses and tree_error(new.params, old.params) == 0
    off = build(layout)
    assert off.compressor is None and off.abstract_state().compression is None  # none: today's step, no state


def test_resuming_repeats_the_losses_and_a_new_compression_starts_afresh(tiny_llama, tmp_path):
    config = apply_overrides(tiny_llama, LAYOUTS["hsdp_tp_sp_zero1"] + [
        "parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=2", "train.steps=4"])
    whole = run(build(config), progress=False)
    saving = apply_overrides(config, [f"checkpoint.dir={tmp_path}", "checkpoint.every=1"])
    trainer = build(saving)  # each run resumes from the checkpoint folder, as a new process would
    first = run(trainer, steps=2, progress=False)  # "killed" after step 2
    rest = run(trainer, progress=False)
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]  # bitwise: residuals and factors saved
    other = build(apply_overrides(saving, ["parallel.compression.method=topk"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, step = Checkpoints.open(tmp_path).restore(other)
    assert step == 4 and any(issubclass(w.category, CompressionRestarted) for w in caught)
    assert all(float(jnp.max(jnp.abs(r))) == 0 for r in jax.tree.leaves(state.compression.residual))


def test_a_rank_above_every_matrix_side_is_refused_before_compile(tiny_llama):
    config = apply_overrides(tiny_llama, LAYOUTS["zero3"] + ["parallel.compression.method=powersgd",
                                                             "parallel.compression.powersgd_rank=4096"])
    with pytest.raises(ConfigError, match=r"parallel.compression.powersgd_rank=4096 exceeds .* use parallel.compression.powersgd_rank <= \d+"):
        build(config)


def test_a_loss_weighed_by_its_outputs_is_averaged_after_the_backward_pass(tiny_llama):
    """A layer hook needs the batch's total weight before the backward pass (error feedback
    adds residuals in the update's units), read off the batch alone: the built-in loss's
    is; one that weighs tokens by the model's own outputs is not, so its whole gradient is
    averaged once the backward pass ends, and equals the uncompressed one (top-k of every
    entry, 1e-5)."""
    from jaxpar.step.compressed import weight_of_batch
    from jaxpar.step.loss import cross_entropy_sum, task_loss

    def confident_tokens(outputs, batch):  # weights the tokens the model is sure of
        weights = batch["weights"] * (jnp.max(outputs, axis=-1) > 0)
        return cross_entropy_sum(outputs, batch["targets"], weights)

    config = apply_overrides(tiny_llama, TWO_HOSTS + ["mesh.fsdp=4"])
    outputs = jax.ShapeDtypeStruct((16, 16, 128), jnp.float32)
    batch = {"targets": jax.ShapeDtypeStruct((16, 16), jnp.int32), "weights": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    assert weight_of_batch(task_loss, outputs, batch) is not None
    assert weight_of_batch(confident_tokens, outputs, batch) is None
    plain = build(config, loss_fn=confident_tokens)
    trainer = build(apply_overrides(config, ["parallel.compression.method=topk", "parallel.compression.topk_fraction=1"]),
                    loss_fn=confident_tokens)
    assert trainer.compressor.per_layer == frozenset()
    state = initial_state(plain)
    batch = make_source(plain.batch, plain.config)(0)
    (loss, grads), (want_loss, want) = trainer.grads(state.params, batch), plain.grads(state.params, batch)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 and tree_error(jax.device_get(grads), jax.device_get(want)) <= 1e-5
