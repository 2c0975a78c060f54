"""Mistral: Llama's decoder with a sliding window over the keys (`sliding_window`: each query
sees the last w keys up to itself, in every layer), as Hugging Face's `MistralForCausalLM`.

Nothing here but the family's config and format: the window is one of Llama's swappable parts
(models/llama.py), which every attention kernel and context-parallel layout honours; the
Hugging Face format is Llama's with Mistral's name and its `sliding_window` key (null when
the model has none, as Mistral 7B v0.2 on).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.families import Family, register
from jaxpar.models.llama import LLAMA_FORMAT, LlamaConfig, llama_from_hf, llama_to_hf, refuse_parts, refuse_scaled_tied_head


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """Llama's decoder, exported under Mistral's name with its window."""


def mistral_to_hf(cfg: MistralConfig) -> dict:
    refuse_parts(cfg, "MistralForCausalLM", qk_norm=False, qkv_bias=False)
    refuse_scaled_tied_head(cfg, "Mistral")
    hf = llama_to_hf(cfg, "MistralForCausalLM", "mistral")
    for key in ("attention_bias", "mlp_bias"):  # not in Mistral's config: it has neither
        hf.pop(key)
    return {**hf, "sliding_window": cfg.sliding_window or None}


# Llama's tensors, the tied head it ignores and its training fields, under Mistral's names
MISTRAL_FORMAT = dataclasses.replace(LLAMA_FORMAT, architectures=("MistralForCausalLM",),
                                     from_hf=functools.partial(llama_from_hf, MistralConfig), to_hf=mistral_to_hf)

register(Family("mistral", MistralConfig, hf=MISTRAL_FORMAT, presets={
    # Mistral 7B v0.1 (Jiang et al. 2023): Llama's shape with GQA 32:8 and a window of 4096 keys.
    "mistral-7b": MistralConfig(vocab_size=32000, embed=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                head_dim=128, mlp=14336, sliding_window=4096),
}))
