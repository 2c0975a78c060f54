"""DeepSeek-V3's decoder as far as it goes (models/deepseek.py, issue 36): a dense layer, then
multi-head latent attention over DeepSeekMoE experts, equals one device (fp32, 1e-5: losses, gradients,
parameters and the step's MoE and prediction-module metrics) under zero-bubble pipeline
stages x expert x tensor + SP, 1F1B stages x expert x ZeRO-1 data (DeepSeek-V3's own layout
in small) and FSDP ZeRO-3 x expert x ring context parallelism: one model (dropless, queries
through their own latent, YaRN, multi-token prediction) under all three, against one
single-device reference.

The stages' layout also holds what tests/equivalence/test_pipeline.py's MoE-in-stages test held until
issue 33: each chunk's load-balancing and z losses join the objective where the chunk runs,
its expert counts come back per layer (the bias balancing reads them), and the split
backward of zero bubble computes the experts' weight gradients apart.

Here the layouts, explain and the prediction module's loss (the model compiled whole); the
model's parts, counts and config: tests/unit/test_deepseek.py."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.models.deepseek import DeepSeekConfig
from jaxpar.testing import check, compare, run_layout
from jaxpar.train import build

RTOL = 1e-5


@pytest.fixture
def tiny_deepseek():
    return Config(
        model=DeepSeekConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp=32, num_experts=8,
                             top_k=2, capacity_factor=1.0, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=6, expert_groups=4, top_groups=2, routed_scaling=2.5,
                             bias_update_rate=0.01, dense_layers=1, dense_mlp=48),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"),
    )


# One model for every layout, so they share one single-device reference: dropless routing,
# queries through their own latent, YaRN past its original length, multi-token prediction.
# (Queries straight from the residual, q_lora_rank=0, are tested against transformers under
# four layouts in tests/equivalence/test_hf.py.)
MODEL = ["model.routing=dropless", "model.mtp_layers=1", "model.mtp_weight=0.3", "model.yarn_factor=4",
         "model.yarn_original_max_positions=8", "model.yarn_mscale=0.7", "model.yarn_mscale_all_dim=1"]
LAYOUTS = {
    # experts split inside the stages, each stage's all-to-alls among its own expert ranks; the
    # first stage holds the dense layer alone (its MoE rows all padding), the last both MoE ones
    "zb_stage2_uneven_expert2_tensor2_sp": ["mesh.stage=2", "mesh.expert=2", "mesh.tensor=2",
                                            "parallel.tensor.sequence_parallel=true", "parallel.pipeline.schedule=zb-h1",
                                            "train.microbatches=2", "parallel.pipeline.layers=1,2"],
    # DeepSeek-V3's own training layout in small: PP x EP x ZeRO-1 data, the prediction module on the last stage
    "1f1b_stage2_expert2_data2_zero1": ["mesh.stage=2", "mesh.expert=2", "mesh.data=2", "parallel.zero.stage=1",
                                        "parallel.pipeline.schedule=1f1b", "train.microbatches=2"],
    # each layer on two halves of the rows (one half's all-to-alls beside the other's compute),
    # in DeepSeek's PP x EP x ZeRO-1 layout and without stages
    "two_batch_1f1b_stage2_expert2_data2": ["mesh.stage=2", "mesh.expert=2", "mesh.data=2", "parallel.zero.stage=1",
                                            "train.microbatches=2", "parallel.two_batch_overlap=true"],
    "two_batch_expert4_data2": ["mesh.expert=4", "mesh.data=2", "parallel.two_batch_overlap=true"],
    # the prediction module's shifted tokens cross the context shards
    "zero3_fsdp2_expert2_ring2": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "parallel.zero.stage=3"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_latent_attention_and_deepseek_moe_equal_single_device(tiny_deepseek, reference, name):
    config = apply_overrides(tiny_deepseek, MODEL)
    ref, run = reference(config), run_layout(apply_overrides(config, LAYOUTS[name]))
    check(compare(run, ref), RTOL, where=name)
    assert run.metrics["mtp_loss"] == pytest.approx(ref.metrics["mtp_loss"], rel=RTOL) and ref.metrics["mtp_loss"] > 0
    moe = {k for k in ref.metrics if k.startswith("moe_")}
    assert moe >= {"moe_aux_loss", "moe_z_loss", "moe_load", "moe_dropped"}, ref.metrics
    for k in moe:
        assert run.metrics[k] == pytest.approx(ref.metrics[k], rel=RTOL, abs=1e-7), (name, k, run.metrics[k], ref.metrics[k])
    # the balancing bias moves by the loads of the whole batch (summed over microbatches and
    # replicas, then all-reduced): 3 steps of +-0.01 or 0 in every layer, the prediction module's too
    biases = [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(run.params) if "router_bias" in str(path)]
    steps = np.round(np.concatenate([b.ravel() for b in biases]) / 0.01)
    assert len(biases) == 2 and np.allclose(np.concatenate([b.ravel() for b in biases]), steps * 0.01, atol=1e-6)
    assert np.abs(steps).max() <= 3 and np.abs(steps).sum() > 0


def test_explain_splits_the_experts_over_stage_and_expert(tiny_deepseek):
    """Under stages x expert a device holds 1/stage of the layers and 1/(stage x expert) of
    the expert weights: the model state equals its formula, and so do the experts'
    all-to-alls over `expert` (capacity routing: 5 a layer and microbatch, averaged over
    1F1B's two chunks)."""
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain

    trainer = build(apply_overrides(tiny_deepseek, ["mesh.stage=2", "mesh.expert=2", "mesh.data=2",
                                                    "train.microbatches=2", "model.routing=capacity"]))
    doc = explain(trainer, inspect_step(trainer))
    rows = {r["name"]: r["ratio"] for r in doc["memory"] if r["ratio"] is not None}
    assert rows["parameters"] == pytest.approx(1.0, abs=1e-3) and rows["model state"] == pytest.approx(1.0, abs=1e-3), rows
    assert doc["expert_traffic"]["ratio"] == pytest.approx(1.0, abs=1e-3), doc["expert_traffic"]


def test_the_prediction_module_predicts_token_t_plus_2_within_its_document(tiny_deepseek):
    """Its loss at t reads token t + 2 as the target: changing token j changes the loss at
    j - 2 and nowhere before (the layers are causal); it is 0 where t + 2 is past the
    sequence or in the next packed document."""
    cfg = dataclasses.replace(tiny_deepseek.model, mtp_layers=1, routing="dropless")  # capacity: tokens compete
    with nnx.use_eager_sharding(False):
        model = cfg.build(nnx.Rngs(0))
    tokens = np.arange(1, 9, dtype=np.int32)[None] * 7 % 128
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2]], np.int32)

    @nnx.jit  # one compile; op by op, the two calls took 10 s
    def losses(model, t):
        x, _ = model.trunk(model.embedding[...], t, None, segments)
        return model.next_but_one_loss(x, model.embedding[...], t, None, segments)

    loss = lambda t: np.asarray(losses(model, t))[0]  # noqa: E731

    base = loss(tokens)
    assert (base[[3, 4, 6, 7]] == 0).all() and (base[[0, 1, 2, 5]] > 0).all(), base
    changed = tokens.copy()
    changed[0, 4] = 99
    after = loss(changed)
    assert np.array_equal(after[:2], base[:2]) and after[2] != base[2], (base, after)
