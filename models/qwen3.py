"""Qwen3 (dense): Llama's decoder with an RMSNorm over each query and key head before RoPE
(`qk_norm`), heads of their own width (`head_dim`, 128 where hidden / heads is less), no
biases, a tied or untied head, as Hugging Face's `Qwen3ForCausalLM`.

Nothing here but the family's config: QK-norm is one of Llama's swappable parts
(models/llama.py), and so is the sliding window that `use_sliding_window` turns on. Qwen3's
published checkpoints leave it off; one that windows only the layers from
`max_window_layers` on (a window per layer) is refused in one line.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.models.llama import LlamaConfig, llama_from_hf, llama_hf_weights, llama_to_hf, refuse_parts, refuse_scaled_tied_head


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    hf_architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3Config":
        return llama_from_hf(cls, {**hf, "sliding_window": qwen3_window(hf)}, qk_norm=True)

    def to_hf(self) -> dict:
        refuse_parts(self, "Qwen3ForCausalLM", qk_norm=True, qkv_bias=False)
        refuse_scaled_tied_head(self, "Qwen3")
        hf = llama_to_hf(self, "Qwen3ForCausalLM", "qwen3")
        hf.pop("mlp_bias")  # not in Qwen3's config: it has no MLP biases
        return {**hf, **qwen3_window_keys(self)}

    def hf_weights(self) -> dict:
        return llama_hf_weights(self)


def qwen3_window_keys(cfg: LlamaConfig) -> dict:
    """config.json's window keys for `cfg`'s one window (every layer from the first, or none)."""
    window = cfg.sliding_window or None
    return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}


def qwen3_window(hf: dict) -> int | None:
    """The one window every layer has (None: none). Qwen's config windows the layers from
    max_window_layers on when use_sliding_window is set, or lists each layer's kind in
    layer_types (transformers 5)."""
    kinds = set(hf.get("layer_types") or [])
    if kinds:
        if len(kinds) > 1:
            raise ConfigError(f"config.json has layer_types mixing {', '.join(sorted(kinds))}; jaxpar's Qwen3 gives "
                              "every layer the same attention (a window per layer is not supported yet)")
        return hf.get("sliding_window") if kinds == {"sliding_attention"} else None
    if not hf.get("use_sliding_window"):
        return None
    first, layers = hf.get("max_window_layers", 0), hf.get("num_hidden_layers", 0)
    if 0 < first < layers:
        raise ConfigError(f"config.json has use_sliding_window=true with max_window_layers={first} of "
                          f"{layers} layers; jaxpar's Qwen3 gives every layer the same attention (a window per "
                          "layer is not supported yet)")
    return hf.get("sliding_window") if first == 0 else None


register(Family("qwen3", Qwen3Config, presets={
    # Qwen3 technical report (Yang et al. 2025), table 1; config.json of Qwen/Qwen3-8B and -32B.
    "qwen3-8b": Qwen3Config(vocab_size=151936, embed=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                            head_dim=128, mlp=12288),
    "qwen3-32b": Qwen3Config(vocab_size=151936, embed=5120, num_layers=64, num_heads=64, num_kv_heads=8,
                             head_dim=128, mlp=25600),
}))
