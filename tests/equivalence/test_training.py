"""Step semantics: token-normalised loss under microbatching, optimizers, clipping, and a
cross-entropy that never holds the full vocabulary on one device."""

import re

import jax
import numpy as np
import optax
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.testing import check, compare, initial_state, reference_run, run_layout, single_device, tree_error
from jaxpar.train import build


@pytest.mark.smoke  # the smoke tier: gradient accumulation
def test_loss_is_normalised_by_tokens_not_microbatches(tiny_llama):
    """Microbatches with very different token counts: the mean over all tokens, not the
    mean of per-microbatch means."""
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    whole = build(config)
    split = build(apply_overrides(config, ["train.microbatches=2"]))
    batch = make_source(whole.batch, whole.config)(0)
    weights = np.ones(batch["weights"].shape, np.float32)
    weights[0::2, 4:] = 0.0  # microbatch 0 (rows 0, 2, 4, ...) keeps a quarter of its tokens
    batch["weights"] = jax.device_put(weights, whole.batch.shardings["weights"])
    params = initial_state(whole).params
    loss_a, grads_a = whole.grads(params, batch)
    loss_b, grads_b = split.grads(params, batch)
    assert abs(float(loss_a) - float(loss_b)) <= 1e-6 * abs(float(loss_a))
    assert tree_error(jax.device_get(grads_b), jax.device_get(grads_a)) < 1e-5


@pytest.mark.parametrize("make_tx", [lambda: optax.adafactor(1e-2), lambda: optax.chain(optax.clip(0.01), optax.sgd(0.1, 0.9))])
def test_any_optax_transformation(tiny_llama, make_tx):
    """States that do not mirror the parameters (adafactor's factored moments) still get
    shardings, and training matches one device."""
    config = apply_overrides(tiny_llama, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"])

    def run(cfg, devices):
        trainer = build(cfg, devices, tx=make_tx())
        source, state = make_source(trainer.batch, trainer.config), initial_state(trainer)
        for i in range(3):
            state, _ = trainer.step(state, source(i))
        return jax.device_get(trainer.master_params(state))

    assert tree_error(run(config, None), run(*single_device(tiny_llama))) < 1e-5


def test_global_norm_clipping_is_exact_under_sharding(tiny_llama):
    """Clipping active every step (clip_norm far below the gradient norm)."""
    config = apply_overrides(tiny_llama, ["optim.clip_norm=0.01"])
    run = run_layout(apply_overrides(config, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]))
    check(compare(run, reference_run(config)), 1e-5, where="clipped")


@pytest.mark.parametrize("clip_norm,fused", [(0.01, True), (1e6, False)])
def test_the_fused_update_is_optaxs_clip_and_adamw(tiny_llama, clip_norm, fused, monkeypatch):
    """The step divides, clips, updates and applies in one pass over each gradient
    (jaxpar.step.update), the non-finite guard a select inside it where the backend fuses
    multi-output loops (`fused`: a GPU's; forced here on the CPU) or a branch around it (the
    CPU's; `test_nonfinite_step_is_not_applied_and_stops_the_run_naming_it` too). Its
    new weights and moments equal optax's chain of clip_by_global_norm and adamw applied to
    the step's own gradient: bit for bit without clipping (1e6), and within float32
    rounding with it (0.01), where XLA's simplifier folds the two scalar divisions (by the
    batch's weight, by the norm) into one by their product, one rounding fewer than optax's
    division of an already divided gradient. A step with a NaN changes nothing."""
    import jax.numpy as jnp

    import jaxpar.step.trainer
    from jaxpar.step.optim import make_optimizer

    monkeypatch.setattr(jaxpar.step.trainer, "fuses_multi_output_loops", lambda platform: fused)
    config = apply_overrides(tiny_llama, [f"optim.clip_norm={clip_norm}", "optim.warmup_steps=0"])
    trainer = build(config, jax.devices()[:1])
    source, state = make_source(trainer.batch, trainer.config), initial_state(trainer)
    master, opt_state = jax.device_get((state.params, state.opt_state))
    new, metrics, grads = trainer.step_and_grads(state, source(0))
    tx, _ = make_optimizer(config.optim, config.train.steps)
    updates, want_opt = jax.jit(tx.update)(grads, opt_state, master)  # the same state tree as the trainer's
    got, want = jax.device_get((new.params, new.opt_state)), jax.device_get((optax.apply_updates(master, updates), want_opt))
    clipped = float(metrics["grad_norm"]) > clip_norm
    assert clipped == (clip_norm == 0.01)
    if clipped:
        assert tree_error(got, want) < 1e-6
    else:
        jax.tree.map(np.testing.assert_array_equal, got, want)
    poisoned = {**source(1), "weights": source(1)["weights"] * jnp.nan}
    after, metrics = trainer.step(new, poisoned)
    assert float(metrics["nonfinite"]) == 1.0 and int(after.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((after.params, after.opt_state)), got)


@pytest.mark.smoke  # the smoke tier: mixed precision
def test_bf16_compute_stays_close_to_fp32(tiny_llama):
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    bf16 = run_layout(apply_overrides(config, ["train.compute_dtype=bfloat16"]))
    fp32 = run_layout(config)
    assert all(abs(a - b) < 0.02 * b for a, b in zip(bf16.losses, fp32.losses)), (bf16.losses, fp32.losses)
    params = jax.tree.leaves(bf16.params)
    assert all(p.dtype == np.float32 for p in params), "master weights must stay float32"


@pytest.mark.parametrize("overrides", [["parallel.tensor.sequence_parallel=false"], ["parallel.tensor.sequence_parallel=true"], ["model.tie_embeddings=true", "parallel.tensor.sequence_parallel=true"]])
def test_no_full_vocabulary_array_on_a_device(tiny_llama, overrides):
    """Vocab-parallel embedding, head and cross-entropy: with tensor=4 no array in the
    compiled step has the full vocabulary (128) as a dimension; every vocab dim is 32."""
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.tensor=4", "train.seq_len=24", *overrides])
    trainer = build(config)
    hlo = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
    shapes = {tuple(int(d) for d in s.split(",")) for s in re.findall(r"[a-z]+\d*\[([\d,]+)\]", hlo)}
    assert not [s for s in shapes if 128 in s], sorted(s for s in shapes if 128 in s)
    assert [s for s in shapes if 32 in s and len(s) == 3], "expected vocab-sharded logits [b, s, 32]"


# ------------------------------------------------------------------ non-finite steps


def _poisoned(layout, config, bad_step):
    """The config's batches, with NaN token weights at `bad_step`."""
    import jax.numpy as jnp

    from jaxpar.data.sources import make_source

    source = make_source(layout, config)

    class Poisoned:
        describe = source.describe

        def __call__(self, step):
            batch = source(step)
            if step == bad_step:
                batch = {**batch, "weights": batch["weights"] * jnp.nan}
            return batch

    return Poisoned()


def test_nonfinite_step_is_not_applied_and_stops_the_run_naming_it(tiny_llama, monkeypatch):
    import jaxpar.loop.run as loop
    from jaxpar.errors import TrainingStopped

    trainer = build(apply_overrides(tiny_llama, ["mesh.data=8", "train.steps=4"]))
    state = initial_state(trainer)
    before = jax.device_get(state.params)
    before_opt = jax.device_get(state.opt_state)
    after, metrics = trainer.step(state, _poisoned(trainer.batch, trainer.config, 0)(0))
    assert float(metrics["nonfinite"]) == 1.0 and int(metrics["first_nonfinite_grad"]) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.params), before)  # not applied
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.opt_state), before_opt)
    assert int(after.step) == 0  # nor counted
    monkeypatch.setattr(loop, "make_source", lambda layout, config: _poisoned(layout, config, 2))
    # the batch of data position 2 is the third step's
    with pytest.raises(TrainingStopped, match=r"step 3: the loss is nan and the first non-finite gradient is \['embedding'\]"):
        loop.run(trainer, progress=False)


def test_skip_policy_goes_on_past_a_nonfinite_step(tiny_llama, monkeypatch):
    import jaxpar.loop.run as loop

    config = apply_overrides(tiny_llama, ["mesh.data=8", "train.steps=4", "train.on_nonfinite=skip"])
    monkeypatch.setattr(loop, "make_source", lambda layout, config: _poisoned(layout, config, 1))
    history = loop.run(build(config), progress=False)
    assert [r["nonfinite"] for r in history] == [0.0, 1.0, 0.0, 0.0]
    assert all(np.isfinite(r["loss"]) for i, r in enumerate(history) if i != 1)


def test_the_log_line_counts_steps_done_and_shows_the_prediction_loss_and_the_save():
    """A row's `step` is the steps done (the metrics file's and the line's number alike);
    DeepSeek's `mtp_loss` and a saving step's `save_s` are on the line."""
    from jaxpar.loop.run import log_line

    row = {"step": 20, "loss": 1.25, "mtp_loss": 0.5, "grad_norm": 0.223, "learning_rate": 1.23e-3,
           "tokens_per_s": 7977.0, "save_s": 0.912}
    assert log_line(row, 60) == ("step 20/60 | loss 1.2500 | mtp_loss 0.5000 | grad_norm 0.223 | lr 0.00123 | "
                                 "tokens/s 7,977 | save 0.91s")
    assert log_line({"step": 1, "loss": 2.0, "tokens_per_s": 5.0}, 3) == "step 1/3 | loss 2.0000 | tokens/s 5"


# ------------------------------------------------------------------ the loss in chunks


def test_loss_in_chunks_holds_one_chunk_of_logits(tiny_llama):
    """With a 4096-token vocabulary the step's float32 logits are 16 MiB; in 8 chunks the
    compiled step's temporaries drop by more than half of that (measured: 59.0 MiB -> 49.0
    MiB on CPU under XLA's plain scheduler, which jaxpar.mesh.force_cpu_devices sets; 74.8 ->
    51.5 MiB under the concurrency-optimised one, which held more logits-sized arrays at
    once; the loss alone, jaxpar.step.loss.chunked_cross_entropy_sum: 384 -> 26 MiB for
    [4, 1024] tokens x 8192 in 16 chunks, three logits-sized arrays -> three chunk-sized)."""
    config = apply_overrides(tiny_llama, ["model.vocab_size=4096", "train.seq_len=64", "mesh.data=1"])
    temps = {}
    for chunks in (1, 8):
        trainer = build(apply_overrides(config, [f"train.loss_chunks={chunks}"]), jax.devices()[:1])
        compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        temps[chunks] = compiled.memory_analysis().temp_size_in_bytes
    logits = 16 * 64 * 4096 * 4
    assert temps[1] - temps[8] >= logits / 2, {k: v / 2**20 for k, v in temps.items()}
