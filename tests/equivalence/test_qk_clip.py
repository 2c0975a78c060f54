"""QK-clip (optim.qk_clip; Kimi K2's MuonClip): the attention's largest logit per head from
the step, and the query and key weights scaled back after the update.

- `largest_logits` against the whole score matrix in numpy: positions out of order, packed
  documents, a sliding window, grouped heads, several query blocks (1e-6).
- `clip_factors`: each head's logits scale by exactly min(1, threshold / its largest).
- The model's report equals its first layer's scores computed by hand (1e-5), and the clip
  after the update is the step without it, then scaled by those factors (1e-6).
- On one batch, the clipped weights' largest logits are min(largest, threshold) (1e-5):
  Llama's grouped heads, DeepSeek's latent attention over its dense and MoE stacks.
- Training with the clip under data x fsdp x tensor, ZeRO-1 with microbatches, context x
  data and data x tensor x ZeRO-3 (Llama), expert x data (Mixtral) and expert x tensor x data
  (DeepSeek) equals one device (fp32; losses, first-step gradients, parameters after 3
  steps, 1e-5). So it does under pipeline stages, where each chunk reports its layers'
  logits and the update clips the stack as it rests: Llama's 4 layers over 2 stages as
  1 + 3 (two padding rows) x data, and Mixtral's stages x expert x data; DeepSeek's leading dense
  layers, outside the stack, are refused under stages.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.kernels.attention.logits import clip_factors, largest_logits
from jaxpar.models.llama import LlamaConfig, rope_frequencies, rotate
from jaxpar.sharding import use_layout
from jaxpar.testing import check, compare, initial_state, run_layout
from jaxpar.train import build


def _scores(q, k, pos, seg, window):
    """numpy: [B, H, S, S] scaled logits, -inf where the mask hides the key."""
    b, s, h, kd = q.shape
    k = np.repeat(k, h // k.shape[2], axis=2)
    scores = np.einsum("bshk,bthk->bhst", q, k) / np.sqrt(kd)
    seen = pos[:, None, :] <= pos[:, :, None]
    if window:
        seen &= pos[:, None, :] > pos[:, :, None] - window
    if seg is not None:
        seen &= seg[:, None, :] == seg[:, :, None]
    return np.where(seen[:, None], scores, -np.inf)


def test_largest_logits_is_the_masked_score_matrix_max():
    rng = np.random.default_rng(0)
    b, s, h, g, kd = 2, 16, 4, 2, 8
    q, k = rng.normal(size=(b, s, h, kd)).astype(np.float32), rng.normal(size=(b, s, g, kd)).astype(np.float32)
    pos = np.stack([rng.permutation(s) for _ in range(b)])  # a reordered sequence (context parallel's zigzag)
    seg = (np.arange(s)[None] >= 10).astype(np.int32).repeat(b, 0)  # two documents in a row
    for window, segment_ids in ((0, None), (5, None), (0, seg)):
        got = largest_logits(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos),
                             None if segment_ids is None else jnp.asarray(segment_ids), window=window, block=4)
        want = _scores(q, k, pos, segment_ids, window).max(axis=(0, 2, 3))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"window={window}")


def test_clip_factors_scale_each_heads_logits_to_the_threshold():
    rng = np.random.default_rng(1)
    largest = jnp.asarray([[3.0, 0.5, 8.0, 1.0]])  # [layers, heads]; two heads over 2.0
    q_scale, k_scale = clip_factors(largest, 2.0, groups=2)
    q, k = rng.normal(size=(4, 8)), rng.normal(size=(2, 8))
    before = np.array([q[h] @ k[h // 2] for h in range(4)])
    after = np.array([(q[h] * q_scale[0, h]) @ (k[h // 2] * k_scale[0, h // 2]) for h in range(4)])
    np.testing.assert_allclose(after, before * np.minimum(1, 2.0 / np.maximum(np.asarray(largest[0]), 2.0)), rtol=1e-5, atol=1e-7)


def _tiny(threshold: float) -> Config:
    return apply_overrides(Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32")),
        [f"optim.qk_clip={threshold}"])


def _reported(trainer, params, batch):
    """The model's per-layer largest logits on `batch` ([layers, heads]) and its first
    layer's, computed by hand from the weights."""
    model = nnx.merge(trainer.graphdef, params)

    @jax.jit
    def report(params, inputs):
        with use_layout(dataclasses.replace(trainer.layout, report_logits=True)):
            return nnx.merge(trainer.graphdef, params)(inputs)[1]["maxima"]["attn_logit_max"]

    cfg = trainer.config.model
    first = nnx.merge(*nnx.split(model.layers)[:1], jax.tree.map(lambda a: a[0], nnx.split(model.layers)[1]))
    x = first.attn_norm(model.lookup(model.embedding[...], batch["inputs"]))
    q, k, _ = first.attn.qkv(x)
    positions, freq = jnp.arange(x.shape[1]), rope_frequencies(cfg.head_dim, cfg)
    q, k = rotate(q, positions, freq), rotate(k, positions, freq)
    by_hand = _scores(np.asarray(q), np.asarray(k), np.broadcast_to(np.arange(x.shape[1]), x.shape[:2]), None, 0)
    return report(params, batch["inputs"]), by_hand.max(axis=(0, 2, 3))


def test_the_report_and_the_clip_are_their_definitions():
    clipped, plain = build(_tiny(0.3)), build(_tiny(1e9))  # a threshold no logit passes: no clip
    from jaxpar.testing import make_source

    batch = make_source(clipped.batch, clipped.config)(0)
    state = initial_state(clipped)
    largest, by_hand = _reported(clipped, state.params, batch)
    np.testing.assert_allclose(largest[0], by_hand, rtol=1e-5)
    assert float(largest.max()) > 0.3  # the clip has work to do
    new, metrics = clipped.step(state, batch)
    unclipped, _ = plain.step(initial_state(plain), batch)
    q_scale, k_scale = clip_factors(largest, 0.3, groups=2)
    attn = unclipped.params["layers"]["attn"]
    np.testing.assert_allclose(new.params["layers"]["attn"]["wq"], attn["wq"] * q_scale[:, None, :, None], rtol=1e-6)
    np.testing.assert_allclose(new.params["layers"]["attn"]["wk"], attn["wk"] * k_scale[:, None, :, None], rtol=1e-6)
    np.testing.assert_allclose(new.params["layers"]["attn"]["wv"], attn["wv"], rtol=1e-6)
    assert float(metrics["attn_logit_max"]) == pytest.approx(float(largest.max()), rel=1e-5)


@pytest.mark.parametrize("recipe", ["llama_gqa", "deepseek"])
def test_after_the_clip_each_heads_largest_logit_is_the_threshold(recipe):
    """On the same batch, a layer's clipped weights give min(largest, threshold) as its
    largest logits, the threshold the heads' median, the layers before it unchanged:
    Llama's grouped heads (each query head's own scale beside its group's key scale) and
    DeepSeek's latent attention (its RoPE parts; the dense and the MoE stack)."""
    from jaxpar.recipes import resolve_config

    config = _tiny(0.3) if recipe == "llama_gqa" else resolve_config(
        "deepseek", ["train.compute_dtype=float32", "optim.qk_clip=0.3", "mesh.data=1", "mesh.expert=1"], 1)
    trainer = build(config, jax.devices()[:1])
    from jaxpar.testing import make_source

    batch = make_source(trainer.batch, trainer.config)(0)
    params = initial_state(trainer).params

    @jax.jit
    def largest(params):
        with use_layout(dataclasses.replace(trainer.layout, report_logits=True)):
            return nnx.merge(trainer.graphdef, params)(batch["inputs"])[1]["maxima"]["attn_logit_max"]

    before = largest(params)
    threshold = float(np.median(before))  # half the heads clipped
    assert (np.asarray(before) > threshold).any() and (np.asarray(before) < threshold).any()
    for layer in range(before.shape[0]):  # one layer at a time: a clip changes the layers after it
        only = jnp.where(jnp.arange(before.shape[0])[:, None] == layer, before, -jnp.inf)
        after = largest(config.model.clip_qk(params, only, threshold))
        want = np.where(np.arange(before.shape[0])[:, None] == layer, np.minimum(before, threshold), before)
        np.testing.assert_allclose(after[:layer + 1], want[:layer + 1], rtol=1e-5, err_msg=f"layer {layer}")


LAYOUTS = {
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "data8_zero1_microbatches2": ["mesh.data=8", "parallel.zero.stage=1", "train.microbatches=2"],
    "context2_data4": ["mesh.context=2", "mesh.data=4"],  # the sequence reordered over context
    "data4_tensor2_zero3": ["mesh.data=4", "mesh.tensor=2", "parallel.zero.stage=3"],  # per-replica sums
}
STAGED = {  # (the model's change, the layout): the reference has the same model
    "stage2_data4_uneven": (["model.num_layers=4"], ["mesh.stage=2", "mesh.data=4", "train.microbatches=2",
                                                       "parallel.pipeline.layers=1,3"]),
}
RECIPE_LAYOUTS = {  # MoE blocks and dense runs beside them; latent attention
    "moe_expert4_data2": ("moe", ["mesh.data=2", "mesh.expert=4"]),
    "moe_stage2_expert2_data2": ("moe", ["mesh.stage=2", "mesh.expert=2", "mesh.data=2", "train.microbatches=2"]),
    "deepseek_expert2_tensor2_data2": ("deepseek", ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_training_with_the_clip_equals_one_device(reference, name):
    """One device without microbatches: microbatches must carry the largest logit, not a sum."""
    base = _tiny(0.3)
    check(compare(run_layout(apply_overrides(base, LAYOUTS[name])), reference(base)), 1e-5, where=name)


@pytest.mark.parametrize("name", STAGED)
def test_training_with_the_clip_in_pipeline_stages_equals_one_device(reference, name):
    """Each chunk's logits kept by their largest over microbatches; the padding rows of
    the shorter stage clip nothing."""
    model, layout = STAGED[name]
    base = apply_overrides(_tiny(0.3), model)
    check(compare(run_layout(apply_overrides(base, layout)), reference(base)), 1e-5, where=name)


def test_layers_outside_the_stack_are_refused_under_stages():
    from jaxpar.errors import ConfigError
    from jaxpar.recipes import resolve_config

    with pytest.raises(ConfigError, match="optim.qk_clip=0.3 with mesh.stage=2: DeepSeekConfig's 1 leading layers"):
        build(resolve_config("deepseek", ["optim.qk_clip=0.3", "mesh.stage=2", "mesh.data=4", "mesh.expert=1",
                                          "train.microbatches=2"], 8))


@pytest.mark.parametrize("name", RECIPE_LAYOUTS)
def test_moe_and_latent_attention_with_the_clip_equal_one_device(reference, name):
    from jaxpar.recipes import resolve_config

    recipe, layout = RECIPE_LAYOUTS[name]
    base = resolve_config(recipe, ["train.compute_dtype=float32", "optim.qk_clip=0.3"], 8)
    check(compare(run_layout(apply_overrides(base, layout)), reference(base)), 1e-5, where=name)
