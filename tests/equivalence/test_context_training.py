"""Whole-model training with context parallelism equals the single-device run: each
context_impl alone, with tensor + sequence parallelism, and with FSDP x data parallelism
(gradients per data replica through the kernels' vmap rule). fp32, 1e-5 relative for losses
and first-step gradients, parameters after three AdamW steps. The zigzag layout reorders
every sequence, so equality also checks the RoPE positions the step hands the model."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.testing import check, compare, initial_weights, run_layout, tree_error
from jaxpar.train import build
from jaxpar.step.sequence import lay_out_sequences
from jaxpar.sharding import use_layout

RTOL = 1e-5
SP = "parallel.tensor.sequence_parallel=true"

# Each kernel with tensor + SP + fsdp and with data x fsdp (Ulysses there contiguous, the
# all-gather with microbatches); the ring alone over 8 devices and with the Pallas block.
# Ulysses and the all-gather alone are held by those (docs/testing.md).
LAYOUTS = {
    "ring": ["mesh.data=1", "mesh.context=8", "parallel.context.impl=ring"],
    "ring_tp_sp_fsdp": ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", SP, "parallel.context.impl=ring"],
    "ulysses_tp_sp_fsdp": ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", SP, "parallel.context.impl=ulysses"],
    "allgather_tp_sp_fsdp": ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", SP, "parallel.context.impl=allgather"],
    "ulysses_dp_fsdp_contiguous": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "parallel.context.impl=ulysses", "parallel.context.layout=contiguous"],
    "allgather_dp_fsdp_microbatches": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "parallel.context.impl=allgather", "train.microbatches=2"],
    "ring_pallas_block_kernel": ["mesh.data=2", "mesh.context=4", "parallel.context.impl=ring", "parallel.context.kernel=pallas_interpret"],
}


@pytest.fixture
def long_llama(tiny_llama):
    """Sequence 32 (4 tokens per zigzag chunk at context 4), 4 kv heads for Ulysses."""
    return dataclasses.replace(tiny_llama, train=dataclasses.replace(tiny_llama.train, seq_len=32))


# the smoke tier: context parallelism, the ring and Ulysses
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.smoke) if n in ("ring", "ulysses_tp_sp_fsdp") else n
                                  for n in LAYOUTS])
def test_context_parallel_training_equals_single_device(long_llama, reference, name):
    config = apply_overrides(long_llama, LAYOUTS[name] + ["parallel.context.block=4"])
    check(compare(run_layout(config), reference(long_llama)), RTOL, where=name)


def test_grouped_query_ring_with_selective_remat(long_llama, reference):
    config = dataclasses.replace(
        long_llama, model=dataclasses.replace(long_llama.model, num_kv_heads=2, remat="selective")
    )
    run = run_layout(apply_overrides(config, ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", SP]))
    check(compare(run, reference(config)), RTOL, where="gqa ring selective")


def test_packed_segments_through_the_model(long_llama):
    """Packed documents (segment ids) and their own RoPE positions through the whole model
    under ring attention on context=4, against the same model on one device."""
    config = apply_overrides(long_llama, ["mesh.data=2", "mesh.context=4"])
    trainer = build(config)
    model = nnx.merge(trainer.graphdef, initial_weights(config))  # initial_state's weights, never placed
    b, s = 4, 32
    tokens = jax.random.randint(jax.random.key(0), (b, s), 0, config.model.vocab_size)
    segments = jnp.asarray([[0] * 10 + [1] * 22, [0] * 31 + [1], [0] * 32, [0] * 5 + [1] * 5 + [2] * 22], jnp.int32)
    starts = jnp.maximum.accumulate(jnp.where(jnp.diff(segments, prepend=-1, axis=1) != 0, jnp.arange(s), 0), axis=1)
    positions = jnp.arange(s) - starts
    batch = {"inputs": tokens, "targets": tokens, "weights": jnp.ones((b, s)), "positions": positions, "segment_ids": segments}

    def loss(params, batch, layout):
        m = nnx.merge(trainer.graphdef, params)
        with use_layout(layout):
            if layout is not None:
                batch = lay_out_sequences(batch, layout)
            logits = m(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
        return jnp.sum(jax.nn.logsumexp(logits, -1) * batch["weights"])

    params = nnx.to_pure_dict(nnx.state(model))
    want = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, batch, None)  # on one device: no layout
    got = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, batch, trainer.layout)
    assert tree_error(got, want) <= RTOL


def test_packed_documents_train_as_on_one_device(long_llama, reference, tmp_path):
    """data.eos_id packs documents: segment ids and restarting positions go through the
    zigzag layout and the ring (context=4) x data=2, and equal one device."""
    import numpy as np

    path = tmp_path / "docs.npy"
    tokens = np.random.default_rng(0).integers(1, 128, 20000)
    tokens[np.random.default_rng(1).random(20000) < 0.1] = 0  # documents of ~10 tokens
    np.save(path, tokens.astype(np.uint16))
    config = apply_overrides(long_llama, ["data.source=tokens", f"data.path={path}", "data.eos_id=0"])
    run = run_layout(apply_overrides(config, ["mesh.data=2", "mesh.context=4", "parallel.context.block=4"]))
    check(compare(run, reference(config)), RTOL, where="packed ring")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.context=8", "mesh.data=1", "train.seq_len=24"], r"train.seq_len=24 is not divisible by 2 x mesh.context = 16"),
        (["mesh.context=8", "mesh.data=1", "train.seq_len=20", "parallel.context.layout=contiguous"], r"train.seq_len=20 is not divisible by context x tensor = 8"),
        (["mesh.context=8", "mesh.data=1", "parallel.context.impl=ulysses", "model.num_kv_heads=2"], r"parallel.context.impl=ulysses: mesh.context=8 does not divide the 4 query heads per tensor shard \(model.num_heads=4 / mesh.tensor=1\); use mesh.context in \[1, 2, 4\]"),
        (["parallel.context.impl=striped"], r"parallel.context.impl='striped'; use one of ring, ulysses, allgather"),
        (["parallel.context.layout=random"], r"parallel.context.layout='random'; use one of zigzag, contiguous"),
        (["parallel.context.block=0"], r"parallel.context.block=0 must be a positive tile length"),
        (["mesh.context=2", "parallel.context.kernel=cudnn"], r"parallel.context.kernel='cudnn'; use one of jax, pallas, pallas_interpret"),
        (["parallel.context.kernel=pallas"], r"parallel.context.kernel=pallas is the block kernel of context-parallel attention, but mesh.context=1"),
        (["mesh.context=2", "parallel.context.kernel=pallas"], r"parallel.context.kernel=pallas \(Triton\) needs power-of-two tiles of at least 16 tokens, not a query tile of 8 \(tiles from parallel.context.block=512 and the 8-token chunks of train.seq_len=32 over mesh.context=2\)"),
        (["mesh.context=2", "model.head_dim=16", "train.seq_len=64", "parallel.context.kernel=pallas"], r"parallel.context.kernel=pallas lowers through Triton for GPUs, but the devices are cpu"),
        (["mesh.context=8", "mesh.data=1", "train.seq_len=16672"], r"parallel.context.block=512: the 1042-token chunks of train.seq_len=16672 over 16 \(zigzag over mesh.context=8\) split only into tiles of 2; use a train.seq_len that is a multiple of 8192, e.g. 16384"),
        (["data.eos_id=128"], r"data.eos_id=128 must be a token id \(0 to model.vocab_size - 1 = 127\)"),
    ],
)
def test_bad_context_config(long_llama, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(apply_overrides(long_llama, overrides))


def test_context_axis_on_a_model_without_a_sequence():
    from jaxpar.config import Config
    from jaxpar.models.mlp import MLPConfig

    with pytest.raises(ConfigError, match=r"mesh.context=2: model MLPConfig does not declare the .attention. capability"):
        build(apply_overrides(Config(model=MLPConfig()), ["mesh.context=2"]))


def test_step_memory_grows_linearly_with_the_sequence(long_llama):
    """Doubling the sequence under ring attention on context=8 doubles the compiled step's
    temporaries (1.9x measured) under the policy that saves matmul outputs. Remat that
    looked inside the kernel stacked every score tile: 3.7x (3.2x under model.remat=none,
    no longer compiled here: the suite's time)."""
    remat = "dots"
    temps = []
    for s in (1024, 2048):
        config = apply_overrides(long_llama, ["mesh.data=1", "mesh.context=8", f"train.seq_len={s}", "train.global_batch=2",
                                              "parallel.context.block=32", f"model.remat={remat}"])
        trainer = build(config)
        compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temps[1] / temps[0] < 2.3, temps
