"""Gemma 3 (text): local sliding-window layers interleaved with global ones, as Hugging
Face's `Gemma3ForCausalLM`.

Llama's decoder with Gemma's parts:
  * every `global_every`-th layer attends to all earlier keys, the others to the last
    `sliding_window` (5 local : 1 global, windows of 512 or 1024 keys in the published
    models); the two kinds rotate at RoPE bases of their own (`rope_local_theta` 10^4,
    `rope_theta` 10^6 with positions slowed `rope_linear_factor` times, 8 from the 4B on);
  * an RMSNorm over each query and key head (QK-norm), and norms before *and* after each
    sublayer; every norm stores w and scales by 1 + w;
  * GeGLU (the tanh-approximated gelu), embeddings multiplied by sqrt(embed), scores scaled
    by query_pre_attn_scalar**-0.5 rather than head_dim**-0.5, a tied head, and the logits
    soft-capped (c tanh(logits / c)) where `final_logit_softcap` is set.

Layers are stacked and scanned as Llama's are; each knows its kind from its index in the
model (jaxpar.nn.scan_layers' first_layer; a pipeline stage's chunk starts past 0), and
runs the attention of that kind under a `lax.cond` whose two branches each have a static
window: every kernel (the block kernels' tile skip, cuDNN's window, the ring's early stop)
sees a fixed window, so a pipeline stage or context-parallel ring may hold both kinds.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.choices import Activation
from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.hf.config import refuse_unless
from jaxpar.hf.weights import Weight
from jaxpar.models.llama import (LLAMA_FORMAT, RESIDUAL, Attention, Llama, LlamaConfig, RMSNorm, llama_from_hf,
                                 llama_hf_weights, llama_to_hf, refuse_parts, refuse_scaled_tied_head, rope_frequencies,
                                 tied_head_ignored)
from jaxpar.nn import by_kind, window_kinds
from jaxpar.sharding import constrain

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # Hugging Face's layer_types


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    activation: Activation = "gelu_pytorch_tanh"
    qk_norm: bool = True
    tie_embeddings: bool = True
    clip_qk = None  # QK-clip: its attention (local and global layers, its own query scale) does not report logits
    scale_tied_logits: bool = False
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # the global layers' base
    sliding_window: int = 4096  # the keys each query of a local layer sees
    global_every: int = 6  # layers global_every-1, 2 global_every-1, ... are global; 0: none
    rope_local_theta: float = 10_000.0  # the local layers' RoPE base
    rope_linear_factor: float = 1.0  # the global layers' positions divided by it (Hugging Face's "linear" RoPE)
    query_pre_attn_scalar: int = 0  # scores x its -1/2 power (0: head_dim's)
    final_logit_softcap: float = 0.0  # logits = c tanh(logits / c) (0: none)

    def check(self, sizes: dict[str, int]) -> None:
        super().check(sizes)
        if self.global_every < 0:
            raise ConfigError(f"model.global_every={self.global_every} must be 0 (every layer local) or the period of "
                              "the global layers, e.g. 6 (Gemma 3: 5 local then 1 global)")
        for field, example in (("rope_local_theta", "10000"), ("rope_linear_factor", "1 or 8")):
            if not 0 < getattr(self, field) < float("inf"):
                raise ConfigError(f"model.{field}={getattr(self, field)} must be positive, e.g. {example}")
        for field, example in (("query_pre_attn_scalar", "the head width, 0 for it"), ("final_logit_softcap", "30, or 0")):
            if not 0 <= getattr(self, field) < float("inf"):
                raise ConfigError(f"model.{field}={getattr(self, field)} must be 0 or positive ({example})")
        if self.sliding_window == 0 and any(self.local_layers()):
            raise ConfigError("model.sliding_window=0: Gemma 3's local layers attend over a window (512 or 1024 keys in "
                              "the published models); set one, or model.global_every=1 for every layer global")
        if self.rope_scaling_factor != 1:
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor}: Gemma 3 slows its global layers' "
                              "RoPE linearly; set model.rope_linear_factor instead")

    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer, in the model's order, is a local (windowed) one."""
        return tuple(self.global_every == 0 or (i + 1) % self.global_every != 0 for i in range(self.num_layers))

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window (jaxpar.model): a local layer's sliding_window, a global one's 0."""
        return tuple(self.sliding_window if local else 0 for local in self.local_layers())

    def build(self, rngs: nnx.Rngs) -> "Gemma3":
        return Gemma3(self, rngs=rngs)

    def block(self, rngs: nnx.Rngs) -> nnx.Module:
        return Gemma3Block(self, rngs=rngs)

    def attention_module(self, rngs: nnx.Rngs) -> nnx.Module:
        return Gemma3Attention(self, rngs=rngs)

    def norm_module(self, dim: int, rngs: nnx.Rngs, name: str = "embed") -> nnx.Module:
        return RMSNorm(dim, self.norm_eps, rngs=rngs, name=name, offset=1.0)

    def param_count(self, include_embedding: bool = True) -> int:
        return super().param_count(include_embedding) + self.num_layers * 2 * self.embed  # the norms after sublayers

    def attention_flops(self, seq_len: int) -> float:
        """A layer's on average: local layers score min(seq_len, window) keys, global ones all."""
        keys = sum(min(seq_len, w) if w else seq_len for w in self.layer_windows()) / self.num_layers
        return 12 * self.num_heads * self.head_dim * keys


# ---------------------------------------------------------------- Hugging Face format (jaxpar.hf)


def gemma3_from_hf(hf: dict) -> Gemma3Config:
    """The text model's config, from a text-only config.json or an image-and-text one's text_config."""
    text = hf.get("text_config")
    hf = {**TEXT_DEFAULTS, **(text or hf)}  # an image-and-text config.json lists only what differs
    if text is not None:  # transformers' Gemma3ForConditionalGeneration caps no logits (the published set none)
        hf["final_logit_softcapping"] = None
    refuse_unless(hf, attention_bias=False, attn_logit_softcapping=None, use_bidirectional_attention=False)
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    global_theta, factor, local_theta = gemma3_rope(hf)
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    return llama_from_hf(
        Gemma3Config, {**plain, "rope_theta": global_theta, "hidden_act": activation},
        qk_norm=True, global_every=gemma3_period(hf), rope_local_theta=local_theta, rope_linear_factor=factor,
        query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar") or 0),
        final_logit_softcap=float(hf.get("final_logit_softcapping") or 0))


def gemma3_to_hf(cfg: Gemma3Config) -> dict:
    refuse_parts(cfg, "Gemma3ForCausalLM", qk_norm=True, qkv_bias=False)
    refuse_scaled_tied_head(cfg, "Gemma3")
    hf = llama_to_hf(cfg, "Gemma3ForCausalLM", "gemma3_text")
    hf.pop("mlp_bias")
    hf["hidden_activation"] = hf.pop("hidden_act")
    return {**hf, "rope_local_base_freq": cfg.rope_local_theta,
            "rope_scaling": {"rope_type": "linear", "factor": cfg.rope_linear_factor} if cfg.rope_linear_factor != 1 else None,
            "layer_types": [LOCAL if local else GLOBAL for local in cfg.local_layers()],
            "sliding_window": cfg.sliding_window or None, "sliding_window_pattern": cfg.global_every,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "final_logit_softcapping": cfg.final_logit_softcap or None, "attn_logit_softcapping": None}


def gemma3_ignored(cfg: Gemma3Config) -> tuple[str, ...]:
    """A tied checkpoint may hold the head it ties; an image-and-text one its vision tower."""
    return (*tied_head_ignored(cfg), *VISION_PARTS)


def gemma3_hf_weights(cfg: Gemma3Config) -> dict[str, Weight]:
    layer = "model.layers.{layer}."
    return {**llama_hf_weights(cfg),
            "layers.post_attn_norm.scale": Weight(layer + "post_attention_layernorm.weight"),
            "layers.mlp_norm.scale": Weight(layer + "pre_feedforward_layernorm.weight"),
            "layers.post_mlp_norm.scale": Weight(layer + "post_feedforward_layernorm.weight")}


# transformers' Gemma3TextConfig defaults, which an image-and-text checkpoint's text_config omits.
TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
}
# An image-and-text checkpoint's other parts, in either spelling: not read, not exported.
VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def gemma3_rope(hf: dict) -> tuple[float, float, float]:
    """(global theta, global linear factor, local theta) from either spelling: transformers
    5's rope_parameters by layer type, or 4's rope_theta, rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if GLOBAL in params or LOCAL in params:
        full, local = dict(params.get(GLOBAL) or {}), dict(params.get(LOCAL) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    kinds = {"global": full.get("rope_type", full.get("type", "default")), "local": local.get("rope_type", "default")}
    if kinds["global"] not in ("default", "linear") or kinds["local"] != "default":
        raise ConfigError(f"config.json has RoPE of type {kinds['global']!r} on the global layers and "
                          f"{kinds['local']!r} on the local ones; jaxpar's Gemma 3 computes 'default' or 'linear' and "
                          "'default'")
    factor = float(full.get("factor", 1.0)) if kinds["global"] == "linear" else 1.0
    return float(full.get("rope_theta", 1_000_000.0)), factor, float(local.get("rope_theta", 10_000.0))


def gemma3_period(hf: dict) -> int:
    """global_every from `layer_types` (or transformers 4's `sliding_window_pattern`)."""
    types = hf.get("layer_types")
    if not types:
        return int(hf.get("sliding_window_pattern", 6))
    if set(types) - {LOCAL, GLOBAL}:
        raise ConfigError(f"config.json has layer_types {sorted(set(types) - {LOCAL, GLOBAL})}; jaxpar's Gemma 3 "
                          f"has {LOCAL!r} and {GLOBAL!r} layers")
    period = types.index(GLOBAL) + 1 if GLOBAL in types else 0
    pattern = Gemma3Config(num_layers=len(types), global_every=period).local_layers()
    if [t == LOCAL for t in types] != list(pattern):
        raise ConfigError(f"config.json has layer_types {types}; jaxpar's Gemma 3 makes every n-th layer global "
                          f"(n = {period} here, from the first global layer), which these layer types are not")
    return period


class Gemma3Attention(Attention):
    """Llama's attention with the query scale of query_pre_attn_scalar, and a window and RoPE
    base chosen by the layer's kind (jaxpar.nn.by_kind: a Python int where every layer has
    one kind, else a traced one, each kind a branch of its own)."""

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, kind) -> jax.Array:
        cfg = self.cfg
        q, k, v = self.qkv(x_BSD)
        if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != cfg.head_dim:  # the kernels scale by head_dim**-0.5
            q = (q.astype(jnp.float32) * math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)).astype(q.dtype)
        windows, _ = window_kinds(cfg.layer_windows())

        def attention(window: int):  # a global layer's window is 0
            theta, slowed = (cfg.rope_local_theta, 1.0) if window else (cfg.rope_theta, cfg.rope_linear_factor)
            freq = rope_frequencies(cfg.head_dim, cfg, theta=theta) / slowed
            return lambda q, k, v: self.mix(q, k, v, positions, segment_ids, freq, window)

        return self.output(by_kind(kind, [attention(w) for w in windows], q, k, v))


class Gemma3Block(nnx.Module):
    """Norms before and after each sublayer; called with the layer's index in the model."""

    def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
        self.attn_norm = cfg.norm_module(cfg.embed, rngs)
        self.attn = cfg.attention_module(rngs)
        self.post_attn_norm = cfg.norm_module(cfg.embed, rngs)
        self.mlp_norm = cfg.norm_module(cfg.embed, rngs)
        self.mlp = cfg.mlp_module(rngs)
        self.post_mlp_norm = cfg.norm_module(cfg.embed, rngs)
        _, self.kinds = window_kinds(cfg.layer_windows())

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, index: jax.Array) -> jax.Array:
        kind = self.kinds[0] if len(set(self.kinds)) == 1 else jnp.asarray(self.kinds)[index]
        attended = self.attn(self.attn_norm(x_BSD), positions, segment_ids, kind)
        x_BSD = checkpoint_name(x_BSD + self.post_attn_norm(attended), "residual")
        x_BSD = x_BSD + self.post_mlp_norm(self.mlp(self.mlp_norm(x_BSD)))
        return constrain(x_BSD, RESIDUAL)


class Gemma3(Llama):
    """Llama's model with embeddings scaled by sqrt(embed), the layers told their index, and
    the logits soft-capped where the config says."""

    def lookup(self, table: jax.Array, tokens_BS: jax.Array) -> jax.Array:
        x = super().lookup(table, tokens_BS)
        return x * jnp.asarray(self.cfg.embed**0.5, x.dtype)  # in the table's dtype, as Hugging Face rounds it

    indexed_layers = True  # a layer's kind is its index's

    def project(self, h: jax.Array, table: jax.Array | None) -> jax.Array:
        logits, cap = super().project(h, table), self.cfg.final_logit_softcap
        if not cap:
            return logits
        return (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)


# The text model alone, or that of an image-and-text checkpoint (the 4B to 27B are published
# so), whose vision tower and projector are left unread; either exports as Gemma3ForCausalLM.
# Its text model's tensors as transformers saves them (4 and 5: language_model.model.) or
# holds them in memory (5: model.language_model.).
GEMMA3_FORMAT = dataclasses.replace(
    LLAMA_FORMAT, architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), from_hf=gemma3_from_hf,
    to_hf=gemma3_to_hf, weights=gemma3_hf_weights, ignored=gemma3_ignored,
    renames={"language_model.model.": "model.", "model.language_model.": "model."})

register(Family("gemma3", Gemma3Config, hf=GEMMA3_FORMAT, presets={
    # config.json (text_config) of google/gemma-3-{1b,4b,12b,27b}-pt; Gemma 3 technical report (2025), table 1.
    "gemma3-1b": Gemma3Config(vocab_size=262144, embed=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                              head_dim=256, mlp=6912, sliding_window=512, query_pre_attn_scalar=256),
    "gemma3-4b": Gemma3Config(vocab_size=262208, embed=2560, num_layers=34, num_heads=8, num_kv_heads=4,
                              head_dim=256, mlp=10240, sliding_window=1024, query_pre_attn_scalar=256,
                              rope_linear_factor=8.0),
    "gemma3-12b": Gemma3Config(vocab_size=262208, embed=3840, num_layers=48, num_heads=16, num_kv_heads=8,
                               head_dim=256, mlp=15360, sliding_window=1024, query_pre_attn_scalar=256,
                               rope_linear_factor=8.0),
    "gemma3-27b": Gemma3Config(vocab_size=262208, embed=5376, num_layers=62, num_heads=32, num_kv_heads=16,
                               head_dim=128, mlp=21504, sliding_window=1024, query_pre_attn_scalar=168,
                               rope_linear_factor=8.0),
}))
