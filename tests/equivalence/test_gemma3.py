"""Gemma 3's local and global layers under the strategies where their kinds meet: an
interleaved pipeline whose every device holds a local and a global layer (the chunk's first
layer tells each layer its kind), beside a ring over the sequence that stops early in the
local layers and goes round in the global one, and tensor parallelism; values and gradients
against one device (fp32; losses and first-step gradients within 1e-5 relative, as every
layout test). Its logits against transformers' are tests/equivalence/test_hf.py's (golden gemma3).
"""

import jax
import numpy as np

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.models.gemma3 import Gemma3Config
from jaxpar.testing import check, compare, run_layout

# 4 layers: local, local, global, local; windows of 5 keys of 16; the query scale, the global
# layers' slowed RoPE and the logits' cap all away from their neutral values.
GEMMA = Config(
    model=Gemma3Config(vocab_size=128, embed=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64,
                       sliding_window=5, global_every=3, query_pre_attn_scalar=12, rope_linear_factor=4.0,
                       final_logit_softcap=5.0),
    train=TrainConfig(steps=3, global_batch=8, seq_len=16, compute_dtype="float32"),
)


def test_local_and_global_layers_in_an_interleaved_pipeline_and_a_ring_equal_one_device(reference):
    """Virtual stages 0..3 hold one layer each, device 0 the local layer 0 and the global layer
    2: a chunk told the wrong first layer runs the wrong kind of attention and fails this."""
    layout = ["mesh.stage=2", "mesh.context=2", "mesh.tensor=2", "parallel.pipeline.schedule=interleaved",
              "parallel.pipeline.chunks=2", "train.microbatches=2", "parallel.context.layout=contiguous"]
    run = run_layout(apply_overrides(GEMMA, layout))
    check(compare(run, reference(GEMMA)), 1e-5, where="gemma3 interleaved x ring x tensor")


def test_explain_counts_each_kind_of_layer_by_its_share():
    """The compiled step holds both kinds of attention in each layer's switch; explain counts
    each branch by its share of the layers (1 global in 4: jaxpar.nn.KIND_SCOPE), so the ring's
    traffic over context=4 in the contiguous order is the formula's for 3 local layers, whose
    ring stops after one hop, and 1 global one, which goes round: within 5% (counting both
    branches in every layer, it read 3.5x)."""
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.inspect.report import kind_shares
    from jaxpar.nn import KIND_SCOPE
    from jaxpar.train import build

    assert kind_shares(GEMMA.model) == {KIND_SCOPE: (0.25, 0.75)}  # window 0 (global) first
    trainer = build(apply_overrides(GEMMA, ["mesh.data=2", "mesh.context=4", "parallel.context.layout=contiguous"]))
    doc = explain(trainer, inspect_step(trainer))
    assert abs(doc["context_traffic"]["ratio"] - 1) < 0.05, doc["context_traffic"]
    assert "3 layers of window 5 and 1 of every key" in doc["context_traffic_formula"]


def test_local_and_global_layers_sample_with_the_cache_as_without():
    """Each layer's kind is a switch (jaxpar.nn.by_kind) whose branches hand their key/value
    cache entries out: windows of 5 in the local layers, the whole cache in the global one;
    prompts longer than the window, greedy, data 4 x tensor 2 (the cache's heads split)."""
    from jaxpar.testing import initial_state
    from jaxpar.train import build
    from jaxpar.generate.sample import cached_steps, generate_batch

    trainer = build(apply_overrides(GEMMA, ["mesh.data=4", "mesh.tensor=2"]))
    params = initial_state(trainer).params
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]]
    cached = generate_batch(trainer, params, prompts, 7, kv_cache=True)
    assert cached == generate_batch(trainer, params, prompts, 7, kv_cache=False)
    prefill = cached_steps(trainer)[0]
    settings = (np.float32(0), np.int32(0), np.float32(1), np.int32(128), jax.random.key(0))
    cache, _ = prefill(params, np.zeros((4, 16), np.int32), np.full(4, 8, np.int32), *settings)
    [[[(keys, values)]]] = cache  # the stack: a switch in each layer, one attention call in each branch
    assert keys.shape == (4, 4, 16, 2, 8) and keys.sharding.spec[3] == "tensor"
