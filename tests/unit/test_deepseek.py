"""DeepSeek-V3's decoder (models/deepseek.py, issue 36): the model's parts, counts and config,
where nothing compiles a training step. What it is proven equal to one device under, and
the layouts, explain and the prediction module's loss (the model compiled whole):
tests/equivalence/test_deepseek.py, whose docstring says it whole."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.models.deepseek import DeepSeekConfig
from jaxpar.train import build


@pytest.fixture
def tiny_deepseek():
    return Config(
        model=DeepSeekConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp=32, num_experts=8,
                             top_k=2, capacity_factor=1.0, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=6, expert_groups=4, top_groups=2, routed_scaling=2.5,
                             bias_update_rate=0.01, dense_layers=1, dense_mlp=48),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"),
    )


def test_counts_are_the_models_own(tiny_deepseek):
    """param_count (the planner's and MFU's) is the parameters the model holds, with and
    without the query latent; values narrower than the query/key heads (6 against 12)."""
    for q_lora in (16, 0):
        model = dataclasses.replace(tiny_deepseek.model, q_lora_rank=q_lora)
        with nnx.use_eager_sharding(False):
            shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(model.build(nnx.Rngs(0)), nnx.Param)))
        held = sum(x.size for x in jax.tree.leaves(shapes))
        assert model.param_count() == held, (q_lora, model.param_count(), held)
    assert build(tiny_deepseek).layout is not None


def test_yarn_as_hugging_face_computes_it():
    """DeepSeek-V3's YaRN (factor 40 over 4096 positions, beta 32 and 1, mscale 1 and 1) on a
    64-wide RoPE part: the pairs turning 32 times or more over 4096 positions (the first 11)
    keep their frequency, those turning once or less (from the 24th) are slowed 40 times,
    the ramp blends between (the 12th: 1 - 1/13 x 39/40); cos and sin unscaled; the softmax
    scale x (0.1 ln 40 + 1)^2."""
    from jaxpar.models.deepseek import yarn_frequencies, yarn_softmax_factor

    cfg = DeepSeekConfig(rope_theta=10000.0, yarn_factor=40, yarn_original_max_positions=4096, yarn_mscale=1.0,
                         yarn_mscale_all_dim=1.0)
    freq, scale = yarn_frequencies(64, cfg)
    ratio = np.asarray(freq) / 10000.0 ** -(np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(ratio[:11], 1, rtol=1e-6)
    np.testing.assert_allclose(ratio[23:], 1 / 40, rtol=1e-5)
    assert ratio[11] == pytest.approx(1 - 39 / 40 / 13, rel=1e-5) and scale == 1.0
    assert yarn_softmax_factor(cfg) == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    plain = dataclasses.replace(cfg, yarn_factor=1.0)
    assert yarn_frequencies(64, plain)[1] == 1.0 and yarn_softmax_factor(plain) == 1.0


def test_the_presets_counts_are_the_published_figures_as_each_counts_them():
    """The published figures count differently from param_count(active=True), which holds
    every weight a token's forward pass reads, the input embedding and the head both.
    DeepSeek-V3's README_WEIGHTS.md says what each of its figures holds:
      main model    671B in all; 36.6B activated "including 0.9B for the output Head": the
                    input embedding (a lookup, no multiply) is not counted (the report's 37B
                    is this rounded)
      MTP module    11.5B "unique parameters (excluding the shared 0.9B Embedding and 0.9B
                    output Head)"; the checkpoint holds its copies of those two as well
                    (model.layers.61.embed_tokens, shared_head.head), 13.5B in all
      on the Hub    685B = 671B + "14B of MTP weights": main model and module with copies,
                    684.49B, plus the FP8 checkpoint's 41.5M block scales (one float32 per 128
                    x 128 block of each quantized matrix) is 684.53B, shown as 685B; the README's
                    14B is 685B - 671B, two rounded totals
    Kimi K2 (Moonshot: 1T parameters, 32B activated) counts as DeepSeek-V3: 31.7B activated
    without the input embedding, 32.9B with it."""
    from jaxpar.families import presets

    v3, k2 = presets()["deepseek-v3"], presets()["kimi-k2"]
    table = v3.vocab_size * v3.embed  # the input embedding, and as many in the head (untied)
    assert v3.param_count() / 1e9 == pytest.approx(671, rel=0.001)  # 671.03B
    assert (v3.param_count(active=True) - table) / 1e9 == pytest.approx(36.6, abs=0.05)  # 36.63B
    assert round(k2.param_count() / 1e12) == 1 and round((k2.param_count(active=True) - k2.vocab_size * k2.embed) / 1e9) == 32
    mtp = dataclasses.replace(v3, mtp_layers=1)
    assert mtp.param_count() == v3.param_count() + mtp.mtp_param_count()
    own = mtp.mtp_param_count()  # its MoE layer, eh_proj [2D, D] and three norms: 11.61B
    assert own / 1e9 == pytest.approx(11.5, rel=0.01)
    with_copies = own + 2 * table  # what the checkpoint's model.layers.61 holds: 13.46B
    assert (v3.param_count() + with_copies) / 1e9 == pytest.approx(685, rel=0.001)  # 684.49B


# DeepSeek-V3's config.json as published (deepseek-ai/DeepSeek-V3, transformers 4's remote-code
# spelling), without its auto_map.
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_published_config_json_reads_as_the_preset_and_writes_back():
    """DeepSeek-V3's own config.json: its FP8 weights are refused with the way out; without
    quantization_config it is the deepseek-v3 preset but for the training choices (dropless
    routing, no balancing terms), and our config.json of it reads back the same."""
    from jaxpar.families import presets
    from jaxpar.models.deepseek import DEEPSEEK_FORMAT as FORMAT

    with pytest.raises(ConfigError, match=r"quantization_config=.*convert them to bf16 first"):
        FORMAT.from_hf(PUBLISHED)
    bf16 = {k: v for k, v in PUBLISHED.items() if k != "quantization_config"}
    imported = FORMAT.from_hf(bf16)
    training = dict(routing="dropless", bias_update_rate=0.0, aux_loss_weight=0.0, mtp_layers=1)
    assert imported == dataclasses.replace(presets()["deepseek-v3"], **training)
    assert FORMAT.from_hf(FORMAT.to_hf(imported)) == imported
    for key in ("num_hidden_layers", "first_k_dense_replace", "max_position_embeddings", "n_group", "q_lora_rank"):
        assert FORMAT.to_hf(imported)[key] == PUBLISHED[key], key
    with pytest.raises(ConfigError, match=r"scoring_func='softmax'; jaxpar's model computes only scoring_func='sigmoid'"):
        FORMAT.from_hf({**bf16, "scoring_func": "softmax"})


@pytest.mark.parametrize("overrides, message", [
    (["model.num_kv_heads=2"], r"model.num_kv_heads=2: under latent attention every head has its own key and value; "
                               r"set model.num_kv_heads=4"),
    (["model.qk_rope_head_dim=5"], r"model.qk_rope_head_dim=5 must be even for RoPE"),
    (["model.kv_lora_rank=0"], r"model.kv_lora_rank=0 must be a positive integer"),
    (["model.yarn_factor=0.5"], r"model.yarn_factor=0.5 \(at least 1; 1: no YaRN\)"),
    (["model.dense_layers=-1"], r"model.dense_layers=-1 must be 0 or more"),
    (["model.qk_norm=true"], r"model.qk_norm=True: latent attention has no q/k norms"),
    (["model.kv_lora_rank=15", "mesh.fsdp=2"], r"mesh.fsdp=2 does not divide model.kv_lora_rank=15"),
    (["model.num_experts=12", "mesh.expert=8"], r"mesh.expert=8 does not divide model.num_experts=12"),
    (["model.mtp_layers=2"], r"model.mtp_layers=2: jaxpar's DeepSeek predicts one token ahead at most"),
])
def test_bad_deepseek_config(tiny_deepseek, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(apply_overrides(tiny_deepseek, overrides))
