"""Make the golden Hugging Face checkpoints the import tests read (tests/equivalence/test_hf.py), and
check an export loads in `transformers`.

Needs torch and transformers, which jaxpar's tests do not: run it in an environment of its
own, from the repository root:

    python -m venv /tmp/golden && /tmp/golden/bin/pip install torch transformers tokenizers safetensors peft
    /tmp/golden/bin/python tests/golden/make.py                 # re-make tests/golden/*
    /tmp/golden/bin/python tests/golden/make.py deepseek_v3     # re-make one case
    /tmp/golden/bin/python tests/golden/make.py --chat          # re-make tests/golden/chat (needs jinja2)

(The DeepSeek-V3, Gemma 3, Mistral, Mixtral, Qwen3 and Qwen3-MoE cases, qwen3_moe_dense included, were made with
transformers 5.24.0 and torch 2.13.0 (CPU); the others with the versions of their day.)
    /tmp/golden/bin/python tests/golden/make.py --check DIR     # logits of an exported DIR
    /tmp/golden/bin/python tests/golden/make.py --check DIR --case deepseek_v3   # ... against that case
    /tmp/golden/bin/python tests/golden/make.py --peft          # re-make tests/golden/peft_* (PEFT; needs peft)
    /tmp/golden/bin/python tests/golden/make.py --peft peft_deepseek_v3   # re-make one
    /tmp/golden/bin/python tests/golden/make.py --check-adapter ADAPTER --merged DIR   # our PEFT export in peft

peft_llama_tied is a LoRA adapter peft 0.21.2 made for llama_tied (r 4, alpha 8, on q_proj,
v_proj and down_proj, B drawn too so it changes the outputs), with the PeftModel's logits
on llama_tied's tokens; peft_deepseek_v3 one peft 0.21.2 made for deepseek_v3 on transformers
5.24.0 (q_a_proj and kv_b_proj by module, the dense layer's up_proj and the shared experts'
down_proj by parameter). --check-adapter loads a jaxpar `export --adapter` folder onto its base
with peft and compares the logits with those transformers gives for the `export --merge`
folder of the same step.

Each folder holds what `save_pretrained` writes (config.json, safetensors, an index where
sharded), `tokens.npy` (a fixed batch [2, 16]) and `logits.npy`, the float32 logits
transformers computes for it. llama_tied, gemma3 and qwen3 also hold a tokenizer.json (a
byte-level BPE of vocab 128 trained on corpus.txt; TOKENIZERS) for the text and sampling
tests: `make.py --tokenizers` re-makes only those. Weights are drawn with
a fixed seed at a larger scale than transformers' default, so the logits are far from zero
and a mistake in any weight shows.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import torch
import transformers

HERE = pathlib.Path(__file__).parent
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CASES = {
    # Llama 3.2 style: GQA, tied embeddings, llama3 RoPE scaling (original 64 positions: of the 4
    # frequencies, wavelengths 6.3, 63, 628 and 6283, one is kept, one blended, two slowed).
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        COMMON, intermediate_size=128, tie_word_embeddings=True,
        rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "5GB"),
    # Llama 2 style: untied head, no scaling; saved in several files with an index.
    "llama_untied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        COMMON, intermediate_size=128, tie_word_embeddings=False, rope_theta=500000.0), "100KB"),
    # Mixtral: 4 experts, top 2 (renormalised), dropless, a sliding window of 6 keys (the batch: 16).
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        rope_theta=1e6, sliding_window=6), "5GB"),
    # Mistral: Llama's shape with a sliding window of 5 keys, heads of 16 (not hidden / heads = 8).
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        COMMON, intermediate_size=96, head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=5), "5GB"),
    # Qwen3: an RMSNorm over each query and key head before RoPE, heads of 16 (not hidden / heads
    # = 8), untied; and tied.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        COMMON, intermediate_size=96, head_dim=16, tie_word_embeddings=False, rope_theta=1e6), "5GB"),
    "qwen3_tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        COMMON, intermediate_size=96, head_dim=16, tie_word_embeddings=True, rope_theta=1e6), "5GB"),
    # Qwen3-MoE: Qwen3's attention over 4 experts a layer, top 2 renormalised (norm_topk_prob).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, head_dim=16, tie_word_embeddings=False, rope_theta=1e6), "5GB"),
    # Qwen3-MoE with dense layers among the MoE ones: decoder_sparse_step 2 over 4 layers leaves
    # layers 0 and 2 dense (Qwen3's MLP, 96 wide), 1 and 3 MoE (4 experts of 32, top 2).
    "qwen3_moe_dense": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        COMMON, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, head_dim=16, tie_word_embeddings=False,
        rope_theta=1e6), "5GB"),
    # Gemma 3: 4 layers, local local global local (window 5 of the batch's 16), local RoPE base
    # 10^4, global 10^6 slowed 4x (linear), QK-norm, (1 + w) norms around each sublayer, GeGLU,
    # embeddings x 8, scores x 24**-0.5 (heads of 16), tied, logits capped at 30.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        COMMON, num_hidden_layers=4, intermediate_size=96, head_dim=16, tie_word_embeddings=True, pad_token_id=0,
        sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "5GB"),
    # Gemma 3 as the 4B to 27B are published: a Gemma3ForConditionalGeneration whose text model
    # is the case above's, beside a tiny SigLIP vision tower and projector (the import reads the
    # text model and leaves these); logits of text alone.
    "gemma3_multimodal": (transformers.Gemma3Config, transformers.Gemma3ForConditionalGeneration, dict(
        text_config=dict(COMMON, model_type="gemma3_text", num_hidden_layers=4, intermediate_size=96, head_dim=16,
                         pad_token_id=0, sliding_window=5, sliding_window_pattern=3, query_pre_attn_scalar=24,
                         final_logit_softcapping=30.0,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, tie_word_embeddings=True), "5GB"),
    # DeepSeek-V3: 1 dense layer then 2 MoE layers of 8 experts (top 2 within 2 of 4 groups, gates
    # x 2.5, one shared expert), MLA with a query latent, YaRN x 4 over 8 original positions
    # (the 16-token batch runs past them), RoPE pairs interleaved, a drawn correction bias.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        COMMON, num_key_value_heads=8, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, tie_word_embeddings=False, rope_interleave=True, max_position_embeddings=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}), "100KB"),
    # DeepSeek-V3 without the query latent, plain RoPE in halves, no group limit, 2 dense layers.
    "deepseek_v3_plain": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        COMMON, num_key_value_heads=8, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=2, routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, tie_word_embeddings=False, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "5GB"),
}


def make(name: str) -> None:
    config_cls, model_cls, fields, shard = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(config_cls(**fields)).float().eval()
    with torch.no_grad():
        centre = 0.0 if name.startswith("gemma") else 1.0  # a Gemma norm scales by 1 + its weight
        for p in model.parameters():  # norms too: a wrong norm mapping must show
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else p.shape[-1] ** -0.5) + (centre if p.ndim == 1 else 0.0))
        for buffer, b in model.named_buffers():  # DeepSeek's routing bias: sways the choice of experts
            if buffer.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    out = HERE / name
    out.mkdir(exist_ok=True)
    for old in out.glob("*.safetensors*"):
        old.unlink()
    model.save_pretrained(out, max_shard_size=shard)
    vocab = fields["vocab_size"] if "vocab_size" in fields else fields["text_config"]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 16))
    np.save(out / "tokens.npy", tokens.astype(np.int32))
    np.save(out / "logits.npy", logits(model, tokens))
    if name in TOKENIZERS:
        make_tokenizer(out, *TOKENIZERS[name])
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {out}")


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


# Each case's tokenizer.json: its special tokens first (ids 0, 1, 2 as in config.json), and the
# template the family's tokenizer wraps a text in: Llama 2's <s>-less BPE here, Gemma's <bos>
# before it, Qwen's nothing (config.json's bos_token_id notwithstanding).
TOKENIZERS = {
    "llama_tied": (["<unk>", "<s>", "</s>"], None),
    "gemma3": (["<pad>", "<bos>", "<eos>"], "<bos> $A"),
    "qwen3": (["<|pad|>", "<|im_start|>", "<|endoftext|>"], None),
}


def make_tokenizer(out: pathlib.Path, specials: list[str], template: str | None) -> None:
    """A byte-level BPE of 128 ids trained on corpus.txt, `specials` first, `template` (a
    TemplateProcessing single-text template) as its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=specials[0] if specials[0] == "<unk>" else None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:0], show_progress=False)
    tokenizer.train([str(HERE / "corpus.txt")], trainer)
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tokenizer.token_to_id(t)) for t in specials if t in template])
    tokenizer.save(str(out / "tokenizer.json"))


# Chat templates (written here, in the styles of three families) and the token ids transformers'
# apply_chat_template gives for a few conversations: tests/unit/test_chat.py renders them with
# jaxpar.data.chat and compares. Each: (special tokens, the tokenizer_config's named ones, template).
CHATML = ("{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{%- endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HEADERS = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
           "{{ m['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TURNS = ("{{ bos_token }}{% for m in messages %}"
         "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + (m['content'] | trim) + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
MARKED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
          "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
               CHATML),
    "headers": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), HEADERS),
    "turns": (["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
              dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"), TURNS),
    # {% generation %} marks the assistant's text: transformers' assistant mask is golden too
    "marked": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], dict(eos_token="<|im_end|>"), MARKED),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What does the mesh hold?"},
     {"role": "assistant", "content": "Devices, named by axis: data, fsdp and tensor."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Pipeline stages?"},
     {"role": "assistant", "content": "Layers split over mesh.stage."}],
    [{"role": "user", "content": "  Two turns, one.  "}, {"role": "assistant", "content": "First answer\nof two lines."},
     {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Second: ünïcode, done. "}],
]


def make_chats() -> None:
    """tests/golden/chat/CASE: tokenizer.json, tokenizer_config.json and chat_template.jinja as
    transformers saves them ("chatml" keeps its template inside tokenizer_config.json instead),
    and expected.json: each conversation's ids from apply_chat_template, whole and as a prompt
    (all but its last turn, with the generation prompt), or the template's error."""
    import json

    for case, (specials, named, template) in CHATS.items():
        out = HERE / "chat" / case
        out.mkdir(parents=True, exist_ok=True)
        make_tokenizer(out, specials, None)
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), **named)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(out))
        if case == "chatml":  # the older place: the template inside tokenizer_config.json
            config = json.loads((out / "tokenizer_config.json").read_text())
            config["chat_template"] = template
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
            (out / "chat_template.jinja").unlink(missing_ok=True)
        expected = []
        for messages in CONVERSATIONS:
            try:
                whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
                prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)
                expected.append({"messages": messages, "ids": list(whole), "prompt_ids": list(prompt)})
                if "{% generation %}" in template:
                    marked = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                           return_assistant_tokens_mask=True)
                    expected[-1]["assistant_mask"] = list(marked["assistant_masks"])
            except Exception as e:  # the template's raise_exception
                expected.append({"messages": messages, "error": str(e)})
        (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
        print(f"chat {case}: {len(expected)} conversations -> {out}")


# Adapters peft makes on a golden case: (the base case, peft.LoraConfig's settings). B is drawn
# like A (init_lora_weights False), so the adapter is no identity.
PEFT = {
    "peft_llama_tied": ("llama_tied", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           lora_dropout=0.0, bias="none", init_lora_weights=False)),
    # DeepSeek-V3 on transformers 5: attention Linears by module, and the dense layer's MLP and
    # the shared experts by parameter (in target_modules peft 0.21 would map gate_proj, up_proj
    # and down_proj to the fused routed experts: jaxpar.hf.peft.parameter_names)
    "peft_deepseek_v3": ("deepseek_v3", dict(r=4, lora_alpha=8, target_modules=["q_a_proj", "kv_b_proj"],
                                             target_parameters=["mlp.up_proj.weight", "shared_experts.down_proj.weight"],
                                             lora_dropout=0.0, bias="none", init_lora_weights=False)),
}


def make_peft(name: str) -> None:
    """tests/golden/NAME (a PEFT case): adapter_config.json, adapter_model.safetensors and the
    adapted model's logits (logits.npy) on its base case's tokens."""
    import json

    import peft

    case, settings = PEFT[name]
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(HERE / case, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **settings)).eval()
    with torch.no_grad():  # larger than peft's draw, so a wrong layout shows far above float32 noise
        for name_, p in model.named_parameters():
            if "lora_" in name_:
                p.mul_(4.0)
    out = HERE / name
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's model card
    saved = json.loads((out / "adapter_config.json").read_text())
    saved["base_model_name_or_path"] = f"tests/golden/{case}"  # from the repository root, not this machine's path
    (out / "adapter_config.json").write_text(json.dumps(saved, indent=2) + "\n")
    tokens = np.load(HERE / case / "tokens.npy")
    np.save(out / "logits.npy", logits(model, tokens))
    print(f"{name} (peft {peft.__version__}) -> {out}")


def check_adapter(adapter: str, merged: str, case: str = "llama_tied") -> None:
    """Our adapter folder loaded by peft onto its base (adapter_config.json's
    base_model_name_or_path, else `case`), against transformers' logits of our merged export."""
    import json

    import peft

    base_path = json.loads((pathlib.Path(adapter) / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path or HERE / case, dtype=torch.float32).eval()
    tokens = np.load(HERE / case / "tokens.npy")
    before = logits(base, tokens)
    adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
    folded = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    theirs, ours = logits(adapted, tokens), logits(folded, tokens)
    moved = np.max(np.abs(theirs - before))
    print(f"{adapter}: loaded by peft {peft.__version__} onto {base_path or case}; logits max |difference| from the "
          f"merged export {merged}: {np.max(np.abs(theirs - ours)):.3g} (from the base's: {moved:.3g})")


def check(directory: str, case: str = "llama_tied") -> None:
    """Load an export with transformers and print its logits on `case`'s batch beside the
    golden ones (an export of an import of that case gives them back)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = np.load(HERE / case / "tokens.npy")
    ours = logits(model, tokens)
    golden = np.load(HERE / case / "logits.npy")
    print(f"{directory}: {type(model).__name__} loaded; logits max |difference| from {case}'s golden: "
          f"{np.max(np.abs(ours - golden)):.3g}")
    np.save(pathlib.Path(directory) / "transformers_logits.npy", ours)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", metavar="DIR")
    parser.add_argument("--case", default="llama_tied", help="with --check: the golden case it was imported from")
    parser.add_argument("--tokenizers", action="store_true", help="re-make only the TOKENIZERS' tokenizer.json files")
    parser.add_argument("--chat", action="store_true", help="re-make only tests/golden/chat (CHATS)")
    parser.add_argument("--peft", nargs="*", choices=list(PEFT), help="re-make only these PEFT cases (none named: all; "
                        "needs peft)")
    parser.add_argument("--check-adapter", metavar="ADAPTER", help="a jaxpar export --adapter folder, loaded by peft")
    parser.add_argument("--merged", metavar="DIR", help="with --check-adapter: the export --merge of the same step")
    parser.add_argument("cases", nargs="*", choices=[[], *CASES], help="the cases to make (default: all)")
    args = parser.parse_args()
    if args.check:
        check(args.check, args.case)
        sys.exit(0)
    if args.chat:
        make_chats()
        sys.exit(0)
    if args.peft is not None:
        for name in args.peft or PEFT:
            make_peft(name)
        sys.exit(0)
    if args.check_adapter:
        check_adapter(args.check_adapter, args.merged, args.case)
        sys.exit(0)
    if args.tokenizers:
        for case, (specials, template) in TOKENIZERS.items():
            make_tokenizer(HERE / case, specials, template)
        sys.exit(0)
    for case in args.cases or CASES:
        make(case)
