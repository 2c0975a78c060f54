"""LoRA (jaxpar.step.lora, lora.*): adapters on the projections, the rest of the model frozen
in the compute dtype. A sharded layout equals one device (fp32: losses and first-step
gradients 1e-5; the adapters after three steps 1e-4, see below); the loss covers the
assistant's tokens only; the model state of the compiled step is the formula's (2 bytes a
frozen weight, 16 an adapter parameter) within 5%, with no float32 copy of a frozen weight;
from a Hugging Face checkpoint, checkpoints hold the adapters only and resume exactly, the
merged export re-imports to the adapted model's logits; bad input is one line each."""

import dataclasses
import math
import pathlib
import re

import jax
import numpy as np
import pytest

from jaxpar.commands import main
from jaxpar.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chat"


def chat_lora_config(**train) -> Config:
    from jaxpar.models.llama import LlamaConfig

    return apply_overrides(Config(
        model=LlamaConfig(vocab_size=264, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=8, seq_len=256, compute_dtype="float32", **train),
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
        data=DataConfig(source="chat", path=str(EXAMPLES / "conversations.jsonl"),
                        tokenizer=str(EXAMPLES / "tokenizer.json"))), ["lora.rank=4", "lora.alpha=8"])


def test_lora_sft_equals_one_device_and_trains_the_adapters_alone(reference):
    """fsdp 2 x tensor 4 + SP, and two pipeline stages (1F1B, both layers on the first) x fsdp 2 x tensor 2, on packed
    conversations against one device, each accumulating 2 microbatches (one reference for
    both). Adam's first updates of A divide gradients that start at exactly zero (B is zero)
    by their own size, so float32 rounding shows in the adapters at 1e-5 after three steps:
    1e-4 there. Only the adapters are in the optimizer's state; the frozen weights are a
    tree of their own."""
    from jaxpar.data.sources import make_source
    from jaxpar.testing import check, compare, initial_state, run_layout
    from jaxpar.train import build

    config = chat_lora_config(microbatches=2)
    sharded = run_layout(apply_overrides(config, ["mesh.fsdp=2", "mesh.tensor=4", "parallel.tensor.sequence_parallel=true"]))
    check(compare(sharded, reference(config)), param_rtol=1e-4)
    staged = run_layout(apply_overrides(config, ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                 "parallel.pipeline.layers=2,0"]))  # the last stage: the head alone
    check(compare(staged, reference(config)), param_rtol=1e-4)
    assert set(sharded.params["layers"]["attn"]["wq"]) == {"lora_a", "lora_b"} and "embedding" not in sharded.params
    assert sharded.losses[-1] < sharded.losses[0]

    trainer = build(apply_overrides(config, ["mesh.data=4", "mesh.tensor=2"]))
    state = initial_state(trainer)
    assert all(x.shape[-1] == 4 or x.shape[1] == 4 for x in jax.tree.leaves(state.opt_state) if x.ndim)  # adapters'
    assert set(state.frozen) >= {"embedding", "head", "layers"} and "base" in state.frozen["layers"]["mlp"]["w_up"]
    batch = make_source(trainer.batch, config)(0)
    # B drawn non-zero, so the adapters change the outputs: the mask must still hold
    state = dataclasses.replace(state, params=jax.tree.map(lambda x: x + 0.05, state.params))
    loss = lambda b: float(trainer.evaluate(trainer.weights(state), b)[0])
    targets, segments = np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])
    user, assistant = (0, 3), (0, int(np.flatnonzero(segments[0] == 0)[-1]) - 1)

    def changed(at):
        t = targets.copy()
        t[at] = (t[at] + 1) % 256
        return {**batch, "targets": jax.device_put(t, batch["targets"].sharding)}

    before = loss(batch)
    assert loss(changed(user)) == before and loss(changed(assistant)) != before


def test_lora_model_state_is_the_formula_s_and_holds_no_float32_frozen_weight():
    """bf16, data 2 x fsdp 2 x tensor 2 at ZeRO-1: the compiled step's arguments (the state
    and the batch) against 2 bytes per frozen weight and 16 per adapter parameter over their
    shardings (jaxpar explain's rows), within 5%; no float32 array of a frozen weight's shape
    anywhere in the compiled step, and the optimizer's moments are the adapters' alone."""
    from jaxpar.recipes import load

    from jaxpar.inspect.explain import explain
    from jaxpar.inspect.report import inspect_step, shard_bytes
    from jaxpar.train import build

    config = apply_overrides(load("llama"), ["lora.rank=8", "parallel.zero.stage=1"])
    trainer = build(config)
    report = inspect_step(trainer)
    rows = {r["name"]: r for r in explain(trainer, report)["memory"]}
    state = trainer.abstract_state()
    formula = rows["model state"]["formula"] - rows["gradients"]["formula"]  # held across steps: all but the gradient
    compiled = report.memory.arguments - shard_bytes(trainer.abstract_batch())
    assert abs(compiled / formula - 1) < 0.05, (compiled, formula)
    assert abs(rows["frozen weights (LoRA)"]["ratio"] - 1) < 0.05 and abs(rows["model state"]["ratio"] - 1) < 0.05
    frozen = jax.tree.leaves(state.frozen)
    assert {str(x.dtype) for x in frozen} == {"bfloat16"}
    text = trainer.step.lower(state, trainer.abstract_batch()).compile().as_text()
    big = {tuple(x.sharding.shard_shape(x.shape)) for x in frozen if x.ndim >= 3}
    held = {tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"f32\[([\d,]+)\]", text)}
    assert big and not big & held, big & held
    adapters = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    moments = sum(math.prod(x.shape) for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * adapters and adapters < 0.2 * sum(math.prod(x.shape) for x in frozen)


def test_an_fp8_base_rests_in_a_byte_and_follows_the_compute_dtype_one():
    """lora.base_dtype=fp8 (e4m3, a scale a row) under data 2 x fsdp 4: the adapted weights
    rest as float8, the frozen weights in 0.55 of the bf16 base's bytes (the embedding, head
    and norms stay bf16), and the loss of a batch with trained-looking adapters is within
    0.5% of the bf16 base's, not equal (e4m3's 3 mantissa bits, a 6% step, average out over a
    weight's dot products)."""
    from jaxpar.data.sources import make_source
    from jaxpar.inspect.report import shard_bytes
    from jaxpar.recipes import load
    from jaxpar.testing import initial_state
    from jaxpar.train import build

    config = apply_overrides(load("llama"), ["lora.rank=8", "mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1",
                                             "parallel.tensor.sequence_parallel=false"])
    losses, frozen = [], []
    for base in ("compute", "fp8"):
        trainer = build(apply_overrides(config, [f"lora.base_dtype={base}"]))
        state = initial_state(trainer)
        state = dataclasses.replace(state, params=jax.tree.map(lambda x: x + 0.02, state.params))
        losses.append(float(trainer.evaluate(trainer.weights(state), make_source(trainer.batch, config)(0))[0]))
        frozen.append(state.frozen)
    wq = frozen[1]["layers"]["attn"]["wq"]
    assert str(wq["base"].dtype) == "float8_e4m3fn" and wq["base_scale"].shape == (4, 128)
    assert 0.5 < shard_bytes(frozen[1]) / shard_bytes(frozen[0]) < 0.6
    assert losses[0] != losses[1] and np.isclose(*losses, rtol=5e-3), losses


def test_lora_from_hugging_face_resumes_from_adapters_only_and_exports_merged(tmp_path, capsys, monkeypatch):
    """From tests/golden/llama_tied under fsdp 2 x tensor 4: with B zero the adapted model's
    logits are transformers' (the base read into the frozen weights); six steps saved at 3
    and 6 hold no frozen weight and name the base; resumed at 3 the run repeats steps 4-6
    exactly; `jaxpar export` folds the adapters in, and the export, imported without LoRA,
    gives the trained adapted model's logits; `jaxpar sample` reads the base again."""
    from jaxpar.recipes import load

    from jaxpar.hf import prepare_import
    from jaxpar.train import build, run
    from jaxpar.loop.checkpoint import Checkpoints
    from jaxpar.generate.inference import forward

    monkeypatch.chdir(GOLDEN.parents[1])
    ckpt = tmp_path / "ckpt"
    overrides = ["mesh.fsdp=2", "mesh.tensor=4", "data.source=text", f"data.path={GOLDEN / 'corpus.txt'}",
                 "train.steps=6", "train.global_batch=8", "train.seq_len=32", "train.compute_dtype=float32",
                 "optim.lr=1e-2", "optim.warmup_steps=0", "lora.rank=4", "lora.alpha=8", "lora.targets=*.wq,*.wv,*.w_down",
                 f"checkpoint.dir={ckpt}", "checkpoint.every=3", "checkpoint.async_save=false"]
    config = apply_overrides(load(f"hf:{GOLDEN / 'llama_tied'}"), overrides)
    trainer = build(config)
    assert sorted(trainer.lora_targets) == ["layers.attn.wq", "layers.attn.wv", "layers.mlp.w_down"]
    apply = forward(trainer)
    tokens = np.load(GOLDEN / "llama_tied" / "tokens.npy")
    rows = np.tile(tokens, (8 // len(tokens) + 1, 1))[:8]
    start = prepare_import(trainer, config.checkpoint.init_from)()
    # the import draws the adapters alone, as the model's build draws them
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.params), jax.device_get(trainer.init().params))
    np.testing.assert_allclose(np.asarray(apply(trainer.weights(start), {"inputs": rows}))[:len(tokens)],
                               np.load(GOLDEN / "llama_tied" / "logits.npy"), rtol=2e-4, atol=2e-4)

    history = run(trainer, progress=False)
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    checkpoints = Checkpoints.open(ckpt)
    assert str(GOLDEN / "llama_tied") in checkpoints.meta(6)["base"]
    saved, _ = checkpoints.restore(trainer)
    checkpoints.close()
    assert saved.frozen is None  # what the files hold: adapters and their optimizer state
    import shutil

    shutil.rmtree(ckpt / "6")
    resumed = run(trainer, progress=False)
    np.testing.assert_allclose([h["loss"] for h in resumed], [h["loss"] for h in history[3:]], rtol=1e-6)

    assert main(["export", str(ckpt), str(tmp_path / "merged")]) == 2  # a LoRA run says how: --merge or --adapter
    assert "export them folded into the weights with --merge" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(tmp_path / "merged"), "--merge"]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter"]) == 0
    plain = build(apply_overrides(load(f"hf:{tmp_path / 'merged'}"), overrides[:4] + ["train.compute_dtype=float32"]))
    merged = prepare_import(plain, tmp_path / "merged")()
    checkpoints = Checkpoints.open(ckpt)
    trained, _ = checkpoints.restore(trainer)
    checkpoints.close()
    from jaxpar.loop.start import start_of, with_base

    trained = with_base(trainer, trained, start_of(trainer))
    ours = np.asarray(apply(trainer.weights(trained), {"inputs": rows}))
    np.testing.assert_allclose(np.asarray(forward(plain)(plain.weights(merged), {"inputs": rows})), ours, atol=2e-5)
    # our PEFT export read back as a starting adapter: the trained model again
    again = build(apply_overrides(config, [f"lora.init_from={tmp_path / 'adapter'}", "checkpoint.dir="]))
    np.testing.assert_allclose(np.asarray(forward(again)(again.weights(prepare_import(again, config.checkpoint.init_from)()),
                                                         {"inputs": rows})), ours, atol=2e-5)
    assert np.abs(ours[:len(tokens)] - np.load(GOLDEN / "llama_tied" / "logits.npy")).max() > 0.01  # it trained

    assert main(["sample", str(ckpt), "--prompt", "The old ship", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("The old ship")


def test_a_peft_adapter_imports_to_peft_s_logits(tmp_path):
    """tests/golden/peft_llama_tied (made by peft: r 4, alpha 8 on q_proj, v_proj, down_proj)
    onto llama_tied: the adapted model's logits are the PeftModel's; a rank or alpha other
    than the adapter's, or targets it lacks tensors for, are refused in one line."""
    from jaxpar.recipes import load

    from jaxpar.hf import prepare_import
    from jaxpar.train import build
    from jaxpar.generate.inference import forward

    adapter = GOLDEN / "peft_llama_tied"
    base = ["train.compute_dtype=float32", "mesh.tensor=2", "mesh.fsdp=4", f"lora.init_from={adapter}",
            "lora.rank=4", "lora.alpha=8", "lora.targets=*.wq,*.wv,*.w_down"]
    config = apply_overrides(load(f"hf:{GOLDEN / 'llama_tied'}"), base)
    trainer = build(config)
    tokens = np.load(GOLDEN / "llama_tied" / "tokens.npy")
    rows = np.tile(tokens, (4, 1))[:8]
    logits = np.asarray(forward(trainer)(trainer.weights(prepare_import(trainer, config.checkpoint.init_from)()),
                                         {"inputs": rows}))[:len(tokens)]
    golden = np.load(adapter / "logits.npy")
    np.testing.assert_allclose(logits, golden, rtol=2e-4, atol=2e-4)
    assert np.abs(golden - np.load(GOLDEN / "llama_tied" / "logits.npy")).max() > 1  # the adapter matters
    for extra, message in ((["lora.rank=8"], r"was trained with r=4, but this run has lora.rank=8; set lora.rank=4"),
                           (["lora.targets=*.wq,*.wv,*.w_down,*.wk"], r"has no tensor 'base_model.model.model.layers.0."
                                                                        r"self_attn.k_proj.lora_A.weight'"),
                           (["lora.targets=*.wq"], r"holds 8 tensors the model has no place for")):
        with pytest.raises(ConfigError, match=message):
            candidate = build(apply_overrides(config, extra))
            prepare_import(candidate, config.checkpoint.init_from)


def tiny_deepseek_lora() -> Config:
    from jaxpar.models.deepseek import DeepSeekConfig

    return apply_overrides(Config(
        model=DeepSeekConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp=16, num_experts=4,
                             top_k=2, routing="dropless", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=6, dense_layers=1, dense_mlp=32),
        train=TrainConfig(steps=3, global_batch=8, seq_len=16, compute_dtype="float32"),
        optim=OptimConfig(lr=1e-2, warmup_steps=0)), ["lora.rank=4", "lora.alpha=8"])


def test_lora_on_deepseek_adapts_the_dense_layers_and_equals_one_device(reference):
    """DeepSeek-V3's default targets (every projection) cover its dense first layers, a
    stack of their own (`dense`), beside the MoE layers' attention and shared expert;
    under expert 2 x fsdp 2 x tensor 2 it equals one device (losses and first-step gradients
    1e-5, adapters after three steps 1e-4 as above). A target in the dense stack alone
    builds; expert weights are refused in one line. (Stages 2 x expert 2 x tensor 2, the
    dense layers frozen and adapted on the first stage, were checked the same way by hand:
    101 s here.)"""
    from jaxpar.testing import check, compare, run_layout
    from jaxpar.train import build

    config = tiny_deepseek_lora()
    adapted = set(build(config).lora_targets)
    assert {f"dense.attn.{w}" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} <= adapted
    assert {"dense.mlp.w_gate", "dense.mlp.w_up", "dense.mlp.w_down", "layers.shared.w_up", "layers.attn.wo"} <= adapted
    sharded = run_layout(apply_overrides(config, ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    check(compare(sharded, reference(config)), param_rtol=1e-4)
    assert set(sharded.params["dense"]["attn"]["wq_a"]) == {"lora_a", "lora_b"}
    assert sharded.params["dense"]["attn"]["wq_a"]["lora_a"].shape == (1, 32, 4)  # [dense layer, embed, rank]
    assert sorted(build(apply_overrides(config, ["lora.targets=dense.attn.wq_a"])).lora_targets) == ["dense.attn.wq_a"]
    with pytest.raises(ConfigError, match=r"matches dense.mlp.w_up, whose|matches layers.moe.w_up, an expert weight"):
        build(apply_overrides(config, ["lora.targets=*.w_up"]))


def test_a_peft_adapter_on_deepseek_s_dense_layer_and_shared_experts_imports_and_exports_as_peft_s(tmp_path):
    """tests/golden/peft_deepseek_v3 (made by peft 0.21.2 on transformers 5.24.0's DeepseekV3:
    q_a_proj and kv_b_proj by module, the dense layer's up_proj and the shared experts'
    down_proj by parameter) onto deepseek_v3 under expert 2 x fsdp 2 x tensor 2: the adapted
    model's logits are the PeftModel's, and our PEFT export of it is peft's folder again (the
    same tensors bit for bit, the same target_modules and target_parameters: transformers 5
    fuses the routed experts, and peft maps gate_proj, up_proj and down_proj named in
    target_modules onto them, so the shared experts and dense MLPs are named by parameter)."""
    import json

    from jaxpar.hf import prepare_import
    from jaxpar.hf.save import export_adapter
    from jaxpar.recipes import load
    from jaxpar.train import build
    from jaxpar.generate.inference import forward
    from safetensors.numpy import load_file

    adapter, base = GOLDEN / "peft_deepseek_v3", GOLDEN / "deepseek_v3"
    config = apply_overrides(load(f"hf:{base}"), [
        "train.compute_dtype=float32", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "model.mtp_layers=0",
        f"lora.init_from={adapter}", "lora.rank=4", "lora.alpha=8", "lora.targets=*.wq_a,*.wkv_b,dense.mlp.w_up,*.shared.w_down"])
    trainer = build(config)
    state = prepare_import(trainer, config.checkpoint.init_from)()
    tokens = np.load(base / "tokens.npy")
    logits = np.asarray(forward(trainer)(trainer.weights(state), {"inputs": np.tile(tokens, (4, 1))}))[:len(tokens)]
    golden = np.load(adapter / "logits.npy")
    np.testing.assert_allclose(logits, golden, rtol=2e-4, atol=2e-4)
    assert np.abs(golden - np.load(base / "logits.npy")).max() > 1  # the adapter matters
    export_adapter(trainer, state, tmp_path / "ours", np.dtype(np.float32), base="tests/golden/deepseek_v3")
    ours, theirs = (json.loads((f / "adapter_config.json").read_text()) for f in (tmp_path / "ours", adapter))
    for key in ("target_modules", "target_parameters", "r", "lora_alpha"):
        assert sorted(ours[key]) == sorted(theirs[key]) if isinstance(theirs[key], list) else ours[key] == theirs[key], key
    written, made = (load_file(f / "adapter_model.safetensors") for f in (tmp_path / "ours", adapter))
    assert written.keys() == made.keys() and all(written[k].tobytes() == v.tobytes() for k, v in made.items())


def test_dpo_with_lora_starts_at_log_2_and_raises_the_margin():
    """The reference is the base (B zero at the start: the adapters off); the margin grows."""
    from jaxpar.testing import run_layout

    config = apply_overrides(chat_lora_config(), ["data.source=preference", f"data.path={EXAMPLES / 'preferences.jsonl'}",
                                                  "train.seq_len=512", "data.eos_id=258", "train.steps=4"])
    result = run_layout(config, steps=4)
    assert abs(result.losses[0] - math.log(2)) < 1e-6 and result.losses[-1] < result.losses[0]
    assert result.metrics["reward_margin"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=4", "lora.targets=*.wq,*.nothing"],
     r"^lora.targets: '\*.nothing' matches no parameter; the model's parameters are named like embedding, "),
    (["lora.rank=80"], r"^lora.rank=80 is above the smaller side of layers.attn.wk \(4, 128, 8, 8\) \(64\); use lora.rank "
                       r"<= 64, or leave that weight out of lora.targets"),
    (["lora.rank=4", "lora.targets=*_norm.scale"], r"^lora.targets='\*_norm.scale' matches final_norm.scale, whose "
                                                   r"names \('embed',\) do not say its input and output sides"),
])
def test_bad_lora_settings_are_refused_in_one_line(overrides, message):
    from jaxpar.recipes import load

    from jaxpar.train import build

    with pytest.raises(ConfigError, match=message):
        build(apply_overrides(load("llama"), overrides))


def test_expert_weights_are_refused_and_left_out_by_default():
    from jaxpar.recipes import load

    from jaxpar.train import build

    config = apply_overrides(load("moe"), ["lora.rank=4"])
    with pytest.raises(ConfigError, match=r"matches layers.moe.w_up, an expert weight"):
        build(apply_overrides(config, ["lora.targets=*.w_up"]))
    assert not any("moe" in path for path in build(config).lora_targets)
