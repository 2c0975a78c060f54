"""Qwen3 (dense): Llama's decoder with an RMSNorm over each query and key head before RoPE
(`qk_norm`), heads of their own width (`head_dim`, 128 where hidden / heads is less), no
biases, a tied or untied head, as Hugging Face's `Qwen3ForCausalLM`.

Nothing here but the family's config and format: QK-norm is one of Llama's swappable parts
(models/llama.py), and so is the sliding window that `use_sliding_window` turns on. Qwen3's
published checkpoints leave it off; one that windows only the layers from
`max_window_layers` on (a window per layer) is refused in one line.

Qwen3-MoE (models/qwen3_moe.py) is made of the same parts: its config takes `Qwen3Parts`, and
its format Qwen3's translation and refusals (`qwen3_from_hf`, `qwen3_to_hf`).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.models.llama import (LLAMA_FORMAT, LlamaConfig, llama_from_hf, llama_to_hf, refuse_parts,
                                 refuse_scaled_tied_head)


@dataclasses.dataclass(frozen=True)
class Qwen3Parts:
    """Qwen3's choice of Llama's parts and settings, for a config deriving from LlamaConfig
    after it (Qwen3Config, models.qwen3_moe.Qwen3MoeConfig)."""

    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Qwen3Parts, LlamaConfig):
    """Llama's decoder with Qwen3's parts."""


def qwen3_from_hf(cls, hf: dict, **extra) -> LlamaConfig:
    """A config of `cls` (with `Qwen3Parts`) from a Qwen3 family's config.json: Llama's
    fields with QK-norm and Qwen's one window (`extra`: the family's own fields)."""
    return llama_from_hf(cls, {**hf, "sliding_window": qwen3_window(hf)}, qk_norm=True, **extra)


def qwen3_to_hf(cfg: LlamaConfig, architecture: str, model_type: str, model: str) -> dict:
    """A Qwen3 family's config.json keys, refusing what its format cannot hold (no QK-norm,
    q/k/v biases, a scaled tied head); `model`: the family's name in the refusals."""
    refuse_parts(cfg, architecture, qk_norm=True, qkv_bias=False)
    refuse_scaled_tied_head(cfg, model)
    hf = llama_to_hf(cfg, architecture, model_type)
    hf.pop("mlp_bias")  # not in Qwen3's config: it has no MLP biases
    return {**hf, **qwen3_window_keys(cfg)}


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


# Llama's tensors, the tied head it ignores and its training fields, under Qwen3's names
QWEN3_FORMAT = dataclasses.replace(
    LLAMA_FORMAT, architectures=("Qwen3ForCausalLM",), from_hf=functools.partial(qwen3_from_hf, Qwen3Config),
    to_hf=functools.partial(qwen3_to_hf, architecture="Qwen3ForCausalLM", model_type="qwen3", model="Qwen3"))

register(Family("qwen3", Qwen3Config, hf=QWEN3_FORMAT, presets={
    # Qwen3 technical report (Yang et al. 2025), table 1; config.json of Qwen/Qwen3-8B and -32B.
    "qwen3-8b": Qwen3Config(vocab_size=151936, embed=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                            head_dim=128, mlp=12288),
    "qwen3-32b": Qwen3Config(vocab_size=151936, embed=5120, num_layers=64, num_heads=64, num_kv_heads=8,
                             head_dim=128, mlp=25600),
}))
