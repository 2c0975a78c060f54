"""Hugging Face checkpoints in and out (jaxpar.hf), against golden files that transformers
made (tests/golden/make.py says how): logits under several layouts equal transformers' to
1e-5 (fp32), import -> export is bitwise, and bad checkpoints are refused before compile."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.hf import HFFormat, export, format_of, model_config, prepare_import
from jaxpar.hf.safetensors import Planned, open_tensor, tensor_index, write_file
from jaxpar.models.llama import LLAMA_FORMAT, LlamaConfig, llama_from_hf, llama_to_hf
from jaxpar.train import build
from jaxpar.generate.inference import forward
from jaxpar.testing import initial_state

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
PIPELINE = ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=2"]
UNEVEN = [*PIPELINE, "parallel.pipeline.layers=1,3"]  # stages of 1 and 3 layers: a local/global period split (Gemma 3)
DENSE_STAGE = [*PIPELINE, "parallel.pipeline.layers=1,2"]  # DeepSeek's dense layer alone on the first stage
LAYOUTS = {
    "llama_tied": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE,
                   ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "parallel.tensor.sequence_parallel=true"]],
    "llama_untied": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                                   "parallel.context.impl=ulysses"]],
    # the sliding window (6 keys of 16) under the zigzag ring beside experts, and (mistral, 5 keys)
    # under a ring over the contiguous order that stops after 2 of its 4 blocks
    "mixtral": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.expert=2", "mesh.context=2", "mesh.tensor=2"]],
    "mistral": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.context=4", "mesh.tensor=2",
                                                             "parallel.context.layout=contiguous"]],
    # QK-norm: its scale per head_dim whole on every rank whatever splits the heads
    "qwen3": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                            "parallel.tensor.sequence_parallel=true"]],
    "qwen3_tied": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                                 "parallel.context.impl=ulysses"]],
    # local and global layers on one stage (the second: global, local), and under one ring over
    # the contiguous order that stops early in the local layers and goes round in the global one
    "gemma3": [["mesh.fsdp=2", "mesh.tensor=4"], UNEVEN, ["mesh.context=4", "mesh.tensor=2",
                                                             "parallel.context.layout=contiguous"]],
    "qwen3_moe": [["mesh.fsdp=2", "mesh.tensor=4"], PIPELINE, ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]],
    # dense layers 0 and 2 among MoE 1 and 3 (decoder_sparse_step 2): the experts over expert x fsdp,
    # heads and both MLPs over tensor, the sequence over context (stages are refused: the dense layer 2)
    "qwen3_moe_dense": [["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
                        ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "parallel.tensor.sequence_parallel=true"]],
    # heads over tensor with the latents whole on each rank; the dense layer on the first stage;
    # 8 experts over expert x fsdp
    # (their config.json says num_nextn_predict_layers=1: the prediction layer, which transformers
    # does not save, starts from its initialisation; under stages it sits on the last)
    "deepseek_v3": [["mesh.fsdp=2", "mesh.tensor=4"], DENSE_STAGE, ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]],
    "deepseek_v3_plain": [["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "parallel.context.impl=ulysses"]],
}
CASES = [(c, i) for c in LAYOUTS for i in range(len(LAYOUTS[c]))]
EXPORTED_FROM = {"deepseek_v3_plain": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],  # one MoE layer: no stages
                 "deepseek_v3": DENSE_STAGE, "gemma3": UNEVEN,  # padded stacks, unpadded in the files
                 "qwen3_moe_dense": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]}  # dense among MoE: no stages
MTP_LAYER = {"deepseek_v3": "model.layers.3.", "deepseek_v3_plain": "model.layers.3."}  # exported beside transformers' tensors


def hf_trainer(folder: pathlib.Path, sets: list[str] = ("mesh.fsdp=2", "mesh.tensor=4")):
    config = Config(model=model_config(folder), train=TrainConfig(global_batch=4, seq_len=16, compute_dtype="float32"))
    return build(apply_overrides(config, list(sets)))


def logits(trainer, state, folder: pathlib.Path) -> np.ndarray:
    """The golden batch [2, 16], twice over (the batch axes split 4 rows), through `forward`."""
    tokens = np.load(folder / "tokens.npy")
    return np.asarray(forward(trainer)(state.params, {"inputs": np.concatenate([tokens, tokens])}))[:2]


@pytest.mark.parametrize("case,layout", CASES, ids=[f"{c}-{' '.join(LAYOUTS[c][i])}" for c, i in CASES])
def test_imported_logits_equal_transformers(case, layout):
    folder = GOLDEN / case
    trainer = hf_trainer(folder, LAYOUTS[case][layout])
    np.testing.assert_allclose(logits(trainer, prepare_import(trainer, folder)(), folder),
                               np.load(folder / "logits.npy"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_import_then_export_is_bitwise_and_reimports_to_the_same_logits(case, tmp_path):
    """Exported from a pipeline layout (stage-sharded, pipeline-ordered layers; the one-MoE-layer
    DeepSeek from expert x fsdp x tensor) in several
    files with an index; every tensor equals the original bit for bit."""
    folder = GOLDEN / case
    trainer = hf_trainer(folder, EXPORTED_FROM.get(case, PIPELINE))
    state = prepare_import(trainer, folder)()
    files = export(trainer, state, tmp_path / "out", max_shard_bytes=100_000)
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "out.partial").exists()
    original, exported = _tensors(folder), _tensors(tmp_path / "out")
    ignored = {"lm_head.weight"} if case in ("llama_tied", "qwen3_tied") else set()
    added = {n for n in exported if n.startswith(MTP_LAYER.get(case, "-"))}
    assert set(exported) - added == set(original) - ignored and bool(added) == (case in MTP_LAYER)
    for name, value in ((n, v) for n, v in exported.items() if n not in added):
        assert value.dtype == original[name].dtype and value.tobytes() == original[name].tobytes(), name
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert model_config(tmp_path / "out") == trainer.config.model and saved["torch_dtype"] == "float32"
    reimported = prepare_import(trainer, tmp_path / "out")()  # the same layout: the same logits, bitwise
    np.testing.assert_array_equal(logits(trainer, reimported, folder), logits(trainer, state, folder))
    for a, b in zip(jax.tree.leaves(trainer.master_params(reimported)), jax.tree.leaves(trainer.master_params(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the prediction layer's weights too


def test_bfloat16_export_reimports_and_exports_again_bitwise(tmp_path):
    folder = GOLDEN / "llama_untied"
    trainer = hf_trainer(folder, ["mesh.fsdp=2", "mesh.tensor=2"])
    export(trainer, prepare_import(trainer, folder)(), tmp_path / "bf16", dtype="bfloat16")
    state = prepare_import(trainer, tmp_path / "bf16")()
    export(trainer, state, tmp_path / "again", dtype="bfloat16")
    first, second, original = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "again"), _tensors(folder)
    for name, value in first.items():
        assert value.dtype == ml_dtypes.bfloat16 and value.tobytes() == second[name].tobytes()
        np.testing.assert_array_equal(value, original[name].astype(ml_dtypes.bfloat16))


def test_deepseek_exports_its_routing_bias_in_float32_and_the_prediction_layer_s_copies(tmp_path):
    """A bfloat16 export of tests/golden/deepseek_v3 (num_nextn_predict_layers=1): the routing
    bias stays float32, equal to the golden's bit for bit, as DeepSeek-V3's published
    checkpoint keeps it (rounded, it changes which experts a token picks), the prediction
    layer's too; that layer holds copies of the embedding and head (vLLM's loader reads them)
    equal to the model's; the export re-imports (the copies accepted) and exports again
    bitwise; a copy of the wrong shape is refused."""
    folder = GOLDEN / "deepseek_v3"
    trainer = hf_trainer(folder, ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"])
    export(trainer, prepare_import(trainer, folder)(), tmp_path / "bf16", dtype="bfloat16")
    written, original = _tensors(tmp_path / "bf16"), _tensors(folder)
    for name in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert written[name].dtype == np.float32 and written[name].tobytes() == original[name].tobytes(), name
    assert written["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert {str(v.dtype) for n, v in written.items() if not n.endswith("e_score_correction_bias")} == {"bfloat16"}
    for copy, main in (("model.layers.3.embed_tokens.weight", "model.embed_tokens.weight"),
                       ("model.layers.3.shared_head.head.weight", "lm_head.weight")):
        assert written[copy].tobytes() == written[main].tobytes() and written[copy].shape == written[main].shape, copy
    export(trainer, prepare_import(trainer, tmp_path / "bf16")(), tmp_path / "again", dtype="bfloat16")
    again = _tensors(tmp_path / "again")
    assert again.keys() == written.keys() and all(again[k].tobytes() == v.tobytes() for k, v in written.items())
    save_file({**again, "model.layers.3.embed_tokens.weight": again["model.embed_tokens.weight"][:, :8]},
              tmp_path / "again" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.3.embed_tokens.weight' has shape \(128, 8\), but the "
                                          r"model's embedding takes one of \(128, 64\)"):
        prepare_import(trainer, tmp_path / "again")


def test_our_safetensors_files_and_the_library_s_read_each_other(tmp_path):
    rng = np.random.default_rng(0)
    values = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=(7,)).astype(ml_dtypes.bfloat16),
              "c": np.arange(6, dtype=np.int64).reshape(2, 3)}
    write_file(tmp_path / "model.safetensors",
               [Planned(k, v.dtype, v.shape, lambda v=v: v) for k, v in values.items()], {"format": "pt"})
    theirs = load_file(tmp_path / "model.safetensors")
    assert all(theirs[k].tobytes() == v.tobytes() and theirs[k].dtype == v.dtype for k, v in values.items())
    save_file({k: np.ascontiguousarray(v[..., :2]) for k, v in values.items()}, tmp_path / "lib.safetensors")
    (tmp_path / "lib").mkdir()
    shutil.move(tmp_path / "lib.safetensors", tmp_path / "lib" / "model.safetensors")
    ours = tensor_index(tmp_path / "lib")
    for k, v in values.items():
        tensor = open_tensor(ours[k])
        assert isinstance(tensor, np.memmap) and tensor.tobytes() == v[..., :2].tobytes()


# ---------------------------------------------------------------- refused before compile


def _tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _copy(case: str, tmp_path: pathlib.Path, edit_config=None) -> pathlib.Path:
    target = tmp_path / case
    shutil.copytree(GOLDEN / case, target)
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_checkpoint_of_another_architecture_or_shape_is_refused(tmp_path, tiny_llama):
    llama = hf_trainer(GOLDEN / "llama_tied")
    with pytest.raises(ConfigError, match=r"holds a MixtralForCausalLM, but this run's model LlamaConfig reads LlamaForCausalLM"):
        prepare_import(llama, GOLDEN / "mixtral")
    with pytest.raises(ConfigError, match=r"its config.json gives model.embed=64, but this run has model.embed=32; set model.embed=64, or train the recipe hf:"):
        prepare_import(build(tiny_llama), GOLDEN / "llama_tied")
    untied = apply_overrides(Config(model=model_config(GOLDEN / "llama_tied"), train=llama.config.train),
                             ["model.tie_embeddings=false", "mesh.fsdp=2", "mesh.tensor=4"])
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=True, but this run has model.tie_embeddings=False"):
        prepare_import(build(untied), GOLDEN / "llama_tied")
    wider = _copy("llama_tied", tmp_path, lambda c: c.update(intermediate_size=256))  # config.json lies about the tensors
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' has shape \(64, 128\), but .* takes "
                                          r"one of \(64, 256\)"):
        prepare_import(hf_trainer(wider), wider)
    with pytest.raises(ConfigError, match=r"names architectures \[\]"):
        model_config(_copy("llama_untied", tmp_path, lambda c: c.pop("architectures")))


def test_a_missing_shard_or_tensor_and_unknown_tensors_are_named(tmp_path):
    partial = _copy("llama_untied", tmp_path)
    (partial / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"names model-00002-of-00004.safetensors, which is not there"):
        prepare_import(hf_trainer(partial), partial)
    folder = tmp_path / "edited"
    folder.mkdir()
    shutil.copy(GOLDEN / "llama_tied" / "config.json", folder)
    tensors = load_file(GOLDEN / "llama_tied" / "model.safetensors")
    save_file({**{k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, "extra.bias": np.zeros(3, np.float32)},
              folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"has no tensor 'model.layers.1.mlp.up_proj.weight' \(the model's layers.mlp.w_up\)"):
        prepare_import(hf_trainer(folder), folder)
    save_file({**tensors, "extra.bias": np.zeros(3, np.float32)}, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"holds 1 tensors the model has no place for \(extra.bias\)"):
        prepare_import(hf_trainer(folder), folder)
    with pytest.raises(ConfigError, match=r"has no config.json"):
        model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")  # JSON, but not a config
    with pytest.raises(ConfigError, match=r"holds a JSON list, not an object of the model's settings"):
        model_config(tmp_path)
    truncated = _copy("mixtral", tmp_path)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])  # a download cut short
    with pytest.raises(ConfigError, match=r"the file is truncated or damaged: download it again"):
        prepare_import(hf_trainer(truncated), truncated)


def test_refusals_of_what_the_format_cannot_hold(tmp_path):
    top1 = _copy("mixtral", tmp_path, lambda c: c.update(num_experts_per_tok=1))
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=1: Mixtral renormalises a single gate"):
        model_config(top1)
    biased = _copy("llama_untied", tmp_path, lambda c: c.update(attention_bias=True))
    with pytest.raises(ConfigError, match=r"attention_bias=True; jaxpar's model computes only attention_bias=False"):
        model_config(biased)
    from jaxpar.checks import base_config

    with pytest.raises(ConfigError, match=r"model MLPConfig declares no Hugging Face format"):
        prepare_import(build(base_config("mlp")), GOLDEN / "llama_tied")
    trainer = hf_trainer(GOLDEN / "llama_untied")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match=r"is a folder that holds files already"):
        export(trainer, initial_state(trainer), tmp_path / "full")


def test_an_interleaved_pipeline_exports_the_layers_in_model_order(tmp_path):
    """Stages holding strided chunks (stage 2 x chunks 2) swap them back into model order
    by collective permutes (jaxpar.pipeline.stages.relaid_layers) before the export: the
    files equal those of the same weights exported unpipelined, bit for bit."""
    config = Config(model=LlamaConfig(vocab_size=128, embed=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                                      mlp=64), train=TrainConfig(global_batch=8, seq_len=16, compute_dtype="float32"))
    written = {}
    for name, sets in (("plain", ["mesh.fsdp=8"]), ("interleaved", ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                                     "train.microbatches=4", "parallel.pipeline.chunks=2",
                                                                     "parallel.pipeline.schedule=interleaved"])):
        trainer = build(apply_overrides(config, sets))
        export(trainer, initial_state(trainer), tmp_path / name)
        written[name] = _tensors(tmp_path / name)
    assert written["plain"].keys() == written["interleaved"].keys() and len(written["plain"]) > 4
    for key, value in written["plain"].items():
        assert value.tobytes() == written["interleaved"][key].tobytes(), key


@dataclasses.dataclass(frozen=True)
class QKNormed(LlamaConfig):
    """A family with QK-norm (Qwen3's attention) written as one would add it: Llama's parts
    with `qk_norm` on, Llama's format under its own architecture name, and one register call
    (in the test)."""

    qk_norm: bool = True


QK_NORMED_FORMAT = dataclasses.replace(
    LLAMA_FORMAT, architectures=("QKNormedForCausalLM",), from_hf=lambda hf: llama_from_hf(QKNormed, hf, qk_norm=True),
    to_hf=lambda cfg: llama_to_hf(cfg, "QKNormedForCausalLM", "qk_normed"))


def test_a_family_with_qk_norm_registers_once_builds_and_round_trips(tmp_path, monkeypatch):
    """One register call fills the Hugging Face table (import and export by architecture)
    and the planner's presets; the q/k norms are parameters of their own, exported and
    imported with the rest, and normalise q and k (scaling wq and wk leaves the logits)."""
    from jaxpar import families
    from jaxpar.plan import MODELS

    families.families()  # the shipped families, registered before the test's (restored after it)
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    tiny = QKNormed(vocab_size=64, embed=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64)
    families.register(families.Family("qk-normed", QKNormed, hf=QK_NORMED_FORMAT, presets={"qk-normed-tiny": tiny}))
    assert format_of(tiny) is QK_NORMED_FORMAT and isinstance(format_of(tiny), HFFormat)
    assert MODELS["qk-normed-tiny"] is tiny and "llama3-8b" in MODELS

    trainer = build(Config(model=tiny, train=TrainConfig(global_batch=2, seq_len=8, compute_dtype="float32")),
                    jax.devices()[:1])
    state = initial_state(trainer)
    shapes = {jax.tree_util.keystr(k, simple=True, separator="."): v.shape
              for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert shapes["layers.attn.q_norm.scale"] == shapes["layers.attn.k_norm.scale"] == (2, 8)
    assert sum(math.prod(s) for s in shapes.values()) == tiny.param_count()
    assert set(shapes) == set(QK_NORMED_FORMAT.weights(tiny))

    export(trainer, state, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["QKNormedForCausalLM"]
    assert model_config(tmp_path / "out") == tiny
    imported = prepare_import(trainer, tmp_path / "out")()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(imported.params), jax.device_get(state.params))

    tokens = {"inputs": np.arange(16, dtype=np.int32).reshape(2, 8) % 64}
    run = forward(trainer)
    before = np.asarray(run(state.params, tokens))
    attn = state.params["layers"]["attn"]

    def with_attn(**changed):
        return {**state.params, "layers": {**state.params["layers"], "attn": {**attn, **changed}}}

    scaled = np.asarray(run(with_attn(wq=attn["wq"] * 3, wk=attn["wk"] * 0.5), tokens))
    np.testing.assert_allclose(scaled, before, rtol=1e-4, atol=1e-5)
    doubled = np.asarray(run(with_attn(q_norm={"scale": attn["q_norm"]["scale"] * 2}), tokens))
    assert np.abs(doubled - before).max() > 1e-3


@pytest.mark.parametrize("parts", [dict(qkv_bias=True), dict(qk_norm=True, qkv_bias=True, activation="gelu_pytorch_tanh")])
def test_the_swappable_parts_are_counted_and_mapped(parts):
    """q/k/v biases and q/k norms are parameters param_count counts and the format's weights map;
    Llama's own format, which has neither, refuses to write them."""
    from flax import nnx

    cfg = LlamaConfig(vocab_size=64, embed=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64, **parts)
    with nnx.use_eager_sharding(False):
        state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0))), nnx.Param))
    shapes = {jax.tree_util.keystr(k, simple=True, separator="."): v.shape
              for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert shapes["layers.attn.bq"] == (2, 4, 8) and shapes["layers.attn.bk"] == shapes["layers.attn.bv"] == (2, 2, 8)
    assert sum(math.prod(s) for s in shapes.values()) == cfg.param_count()
    assert set(shapes) == set(LLAMA_FORMAT.weights(cfg))
    assert llama_to_hf(cfg, "X", "x")["hidden_act"] == cfg.activation
    with pytest.raises(ConfigError, match=r"model.(qk_norm|qkv_bias)=True: LlamaForCausalLM.s format holds only model.\1=False"):
        LLAMA_FORMAT.to_hf(cfg)


def test_a_sliding_window_is_refused_where_it_cannot_be_held():
    """A negative window is refused before compile; Llama's and DeepSeek-V3's formats have no
    window, so their exports refuse one (a windowed Llama exports as a Mistral); Mistral's
    writes none as null, as transformers does."""
    from jaxpar.checks import validate
    from jaxpar.models.deepseek import DeepSeekConfig
    from jaxpar.models.mistral import MistralConfig

    with pytest.raises(ConfigError, match=r"model\.sliding_window=-1 must be a number of keys"):
        validate(apply_overrides(Config(model=LlamaConfig()), ["model.sliding_window=-1"]), 8)
    for model in (LlamaConfig(sliding_window=4), DeepSeekConfig(sliding_window=4)):
        with pytest.raises(ConfigError, match=r"model\.sliding_window=4: .*format holds only model\.sliding_window=0"):
            format_of(model).to_hf(model)
    mistral = format_of(MistralConfig())
    assert mistral.to_hf(MistralConfig())["sliding_window"] is None
    assert mistral.to_hf(MistralConfig(sliding_window=4))["sliding_window"] == 4
    assert mistral.from_hf(mistral.to_hf(MistralConfig(sliding_window=4))) == MistralConfig(sliding_window=4)
    # Qwen3: a window for every layer or none; one for some layers is refused
    from jaxpar.models.qwen3 import QWEN3_FORMAT, Qwen3Config

    hf = json.loads((GOLDEN / "qwen3" / "config.json").read_text())
    assert QWEN3_FORMAT.from_hf({**hf, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                                "layer_types": None}).sliding_window == 8
    assert QWEN3_FORMAT.from_hf({**hf, "sliding_window": 8, "layer_types": None}).sliding_window == 0  # not used
    for bad in (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None),
                dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"])):
        with pytest.raises(ConfigError, match="a window per layer is not supported yet"):
            QWEN3_FORMAT.from_hf({**hf, **bad})
    assert QWEN3_FORMAT.from_hf(QWEN3_FORMAT.to_hf(Qwen3Config(sliding_window=4))) == Qwen3Config(sliding_window=4)


def test_qwen3_moe_reads_its_dense_layers_either_way_and_refuses_a_lone_renormalised_gate():
    """Dense layers among the MoE ones: decoder_sparse_step 2 over 4 layers and mlp_only_layers
    [0, 2] are the same model (layers 0 and 2 dense: num_layers counts the 2 MoE ones), written
    back as the list; a config leaving no layer MoE, a step below 1 or an index past the layers
    is refused in one line, and so is top-1 with norm_topk_prob (a gate of 1, no router
    gradient); transformers 4's num_experts reads as 5's num_local_experts."""
    from jaxpar.models.qwen3_moe import QWEN3_MOE_FORMAT as FORMAT

    hf = json.loads((GOLDEN / "qwen3_moe" / "config.json").read_text())
    four = {**hf, "num_hidden_layers": 4}
    stepped, listed = (FORMAT.from_hf({**four, **d}) for d in (dict(decoder_sparse_step=2),
                                                                       dict(mlp_only_layers=[2, 0])))
    assert stepped == listed and stepped.num_layers == 2 and stepped.dense_layer_ids() == (0, 2)
    assert FORMAT.to_hf(stepped)["mlp_only_layers"] == [0, 2] and FORMAT.to_hf(stepped)["num_hidden_layers"] == 4
    assert FORMAT.from_hf(FORMAT.to_hf(stepped)) == stepped
    assert FORMAT.from_hf({**four, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).dense_layer_ids() == (0, 2, 3)
    for bad, needle in ((dict(mlp_only_layers=[0, 1]), r"mlp_only_layers=\[0, 1\] with num_hidden_layers=2: no layer "
                                                       r"has experts"),
                        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 .* a positive step"),
                        (dict(mlp_only_layers=[2]), r"layer indices below num_hidden_layers=2"),
                        (dict(num_experts_per_tok=1), "num_experts_per_tok=1 with norm_topk_prob=true")):
        with pytest.raises(ConfigError, match=needle):
            FORMAT.from_hf({**hf, **bad})
    old = {k: v for k, v in hf.items() if k != "num_local_experts"}
    assert FORMAT.from_hf({**old, "num_experts": 4}) == FORMAT.from_hf(hf)


def test_gemma3_reads_both_spellings_and_refuses_what_it_does_not_compute():
    """transformers 4's keys (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) read as 5's (rope_parameters by layer type, layer_types); a
    layer pattern that is not every n-th layer global, attention soft-capping, another RoPE
    type and attention biases are refused in one line naming the key. The parameters the
    model holds are those its format lists, and param_count counts them; the 27B preset has
    Gemma 3 27B's text parameters."""
    from flax import nnx

    from jaxpar.models.gemma3 import GEMMA3_FORMAT as FORMAT

    hf = json.loads((GOLDEN / "gemma3" / "config.json").read_text())
    ours = FORMAT.from_hf(hf)
    assert (ours.global_every, ours.sliding_window, ours.rope_linear_factor, ours.rope_local_theta, ours.rope_theta,
            ours.query_pre_attn_scalar, ours.final_logit_softcap) == (3, 5, 4.0, 1e4, 1e6, 24, 30.0)
    assert ours.local_layers() == (True, True, False, True)
    v4 = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
              sliding_window_pattern=3)
    assert FORMAT.from_hf(v4) == ours == FORMAT.from_hf(FORMAT.to_hf(ours))
    for bad, needle in ((dict(layer_types=["full_attention", "sliding_attention"] * 2), r"every n-th layer global"),
                        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
                        (dict(attention_bias=True), "attention_bias=True"),
                        (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}), "'yarn'")):
        with pytest.raises(ConfigError, match=needle):
            FORMAT.from_hf({**hf, **bad})
    with nnx.use_eager_sharding(False):
        state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: ours.build(nnx.Rngs(0))), nnx.Param))
    shapes = {jax.tree_util.keystr(k, simple=True, separator="."): v.shape
              for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert set(shapes) == set(FORMAT.weights(ours)) and sum(math.prod(s) for s in shapes.values()) == ours.param_count()
    from jaxpar.families import presets

    assert round(presets()["gemma3-27b"].param_count() / 1e9, 1) == 27.0


def test_each_family_puts_its_own_begin_token_before_documents(tmp_path):
    """config.json says bos_token_id=1 for all three golden checkpoints, but only Gemma's
    tokenizer puts it before a text (Qwen's puts nothing, nor does this Llama 2-style one):
    the recipe hf:FOLDER takes data.bos_id from the tokenizer itself; text data then starts
    each document with it (after the last one's end-of-text id) and is otherwise the stream
    without it; one past the vocabulary is refused naming the field and the id to use."""
    from jaxpar.data.text import TextSpec, tokenize
    from jaxpar.hf.recipe import recipe

    assert {c: recipe(str(GOLDEN / c)).data.bos_id for c in ("gemma3", "qwen3", "llama_tied")} == {
        "gemma3": 1, "qwen3": -1, "llama_tied": -1}
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("The old ship", "sails home", "at night")))
    tokenizer = str(GOLDEN / "gemma3" / "tokenizer.json")
    plain = tokenize(TextSpec(str(corpus), tokenizer, eos_id=2))
    framed = tokenize(TextSpec(str(corpus), tokenizer, eos_id=2, bos_id=1))
    starts = np.flatnonzero(framed == 1)
    assert starts.tolist() == [0, *(np.flatnonzero(framed == 2)[:-1] + 1).tolist()] and len(starts) == 3
    np.testing.assert_array_equal(framed[framed != 1], plain)
    with pytest.raises(ConfigError, match=r"data.bos_id=500 is not a token id .* use 1, the id it puts before a text"):
        tokenize(TextSpec(str(corpus), tokenizer, eos_id=2, bos_id=500))


def test_the_text_model_of_an_image_and_text_gemma3_imports_and_exports_alone(tmp_path):
    """Gemma 3 4B to 27B are published as Gemma3ForConditionalGeneration: the text model is read
    from its text_config (which lists only what differs from transformers' defaults) and its
    language_model.model. tensors (also under model.language_model., as transformers 5 holds
    them), the vision tower and projector are left unread; logits equal transformers' (its
    forward on text alone) to 1e-5. It exports as a Gemma3ForCausalLM holding the text tensors
    bit for bit under the text model's names. transformers' image-and-text model caps no logits
    (the text model's final_logit_softcapping, 30 here, is not applied): nor does the import."""
    from jaxpar.models.gemma3 import GEMMA3_FORMAT

    folder = GOLDEN / "gemma3_multimodal"
    trainer = hf_trainer(folder)
    text_only = GEMMA3_FORMAT.from_hf(json.loads((GOLDEN / "gemma3" / "config.json").read_text()))
    assert trainer.config.model == dataclasses.replace(text_only, final_logit_softcap=0.0)  # as transformers runs it
    golden = np.load(folder / "logits.npy")
    state = prepare_import(trainer, folder)()
    np.testing.assert_allclose(logits(trainer, state, folder), golden, rtol=1e-5, atol=1e-5)
    renamed = tmp_path / "renamed"  # transformers 5's names in memory
    renamed.mkdir()
    shutil.copy(folder / "config.json", renamed)
    original = _tensors(folder)
    save_file({(k.replace("language_model.model.", "model.language_model.", 1) if k.startswith("language_model.")
                else "model." + k): v for k, v in original.items()}, renamed / "model.safetensors")
    np.testing.assert_array_equal(logits(trainer, prepare_import(trainer, renamed)(), folder),
                                  logits(trainer, state, folder))
    export(trainer, state, tmp_path / "out")
    exported = _tensors(tmp_path / "out")
    text = {k.replace("language_model.model.", "model.", 1): v for k, v in original.items() if k.startswith("language_model.")}
    assert set(exported) == set(text) and all(exported[k].tobytes() == text[k].tobytes() for k in text)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert model_config(tmp_path / "out") == trainer.config.model
