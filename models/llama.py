"""Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
tied or untied embeddings, layers stacked and scanned.

A family shaped like it (Qwen3, Mixtral, ...) subclasses `LlamaConfig` and sets the parts
that differ: `qk_norm` (an RMSNorm over each query and key head, before RoPE: Qwen3, Gemma 3),
`qkv_bias` (biases on the query, key and value projections: Qwen2), `activation` (the gated
MLP's: SwiGLU's silu, GeGLU's tanh-approximated gelu); a part of its own through
`attention_module(rngs)` or `mlp_module(rngs)` (DeepSeek's latent attention), or a whole
layer through `block(rngs)` (models/moe.py swaps the MLP for experts). Its Hugging Face
format is Llama's (`LLAMA_FORMAT`, a jaxpar.hf.HFFormat) with what differs replaced
(`dataclasses.replace`; `llama_from_hf(cls, hf, **fields)`, `llama_to_hf`,
`attention_weights` for the pieces), registered with its presets in one
`jaxpar.families.register` call.

Every parameter and key activation carries logical axis names; no collective appears here.
Sharded shapes under the default rules (storage):
  embedding  E[V@tensor, D@fsdp]         wq  [D@fsdp, H@tensor, K]   wo [H@tensor, K, D@fsdp]
  wk, wv     [D@fsdp, KV@tensor, K]      w_gate, w_up [D@fsdp, F@tensor]   w_down [F@tensor, D@fsdp]
  head       [D@fsdp, V@tensor]          norms [D@fsdp]
Parameters are used in the dtype they arrive in (the train step casts them for mixed
precision); softmax, norms and RoPE run in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from jaxpar.choices import Activation, Remat
from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.hf.config import refuse_unless, rope_settings, value
from jaxpar.hf.format import HFFormat
from jaxpar.hf.weights import Weight
from jaxpar.kernels.attention.logits import clip_factors
from jaxpar.mesh import divisors
from jaxpar.model import ATTENTION, FIRST_LAYER, MAXIMA, PROJECTIONS, REMAT, SEQUENCE, STAGES
from jaxpar.nn import gated, param, rms_norm, scan_layers, stack_layers
from jaxpar.sharding import (attend, column_project, compute_value, constrain, largest_logits, lookup, reports_logits,
                             row_project)
from jaxpar.sharding.projections import GATHERED, SCATTERED

RESIDUAL = SCATTERED  # ("batch", "norm_seq", "embed"): norm/residual region, Megatron-SP shards the sequence
HIDDEN = GATHERED  # ("batch", "seq", "embed"): inputs of column-parallel matmuls, the full sequence
Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv_heads", "head_dim")
MLP_NAMES = ("batch", "seq", "mlp")
# The gated MLP's activation (`activation`), by its Hugging Face `hidden_act` name.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # token ids 0 .. vocab_size - 1
    embed: int = 64  # the residual stream's width
    num_layers: int = 2  # decoder layers (stacked on the "layers" axis)
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads; num_heads / num_kv_heads query heads share each (GQA)
    head_dim: int = 16  # width of each head
    mlp: int = 128  # the gated MLP's hidden width
    rope_theta: float = 10_000.0  # RoPE's base: wavelengths up to 2 pi theta
    # Llama 3.1+ RoPE frequency scaling (Hugging Face rope_scaling of type "llama3"): long
    # wavelengths slowed by the factor, short ones kept, a smooth blend between.
    rope_scaling_factor: float = 1.0  # how much long wavelengths are slowed (rope_scaling's factor; 1: no scaling)
    rope_low_freq_factor: float = 1.0  # wavelengths over rope_original_max_positions / this are slowed by the factor
    rope_high_freq_factor: float = 4.0  # wavelengths under rope_original_max_positions / this are kept
    rope_original_max_positions: int = 8192  # the context length the model was trained at before the scaling
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = False  # the head is the embedding table, transposed
    # A tied head's logits are multiplied by embed**-0.5 (the table is drawn at unit scale;
    # unscaled, at embed**-0.5); Hugging Face's Llama does not scale them, and its importer sets this False.
    scale_tied_logits: bool = True
    remat: Remat = "none"  # the layers' policy (jaxpar.nn)
    unroll_layers: bool = False  # the layers in line, not a loop (jaxpar.nn.scan_layers): slower to compile, and not faster on an H200 (docs/performance.md)
    # Parts a family swaps (the module docstring): Llama has none of the first two, and silu.
    qk_norm: bool = False  # an RMSNorm (head_dim wide) over each query and key head, before RoPE
    qkv_bias: bool = False  # biases on the query, key and value projections
    activation: Activation = "silu"  # the gated MLP's (ACTIVATIONS)
    # Each query sees only the last sliding_window keys up to itself (Mistral's and Mixtral's
    # sliding_window; every attention kernel skips the rest); 0: every earlier key.
    sliding_window: int = 0

    # The model contract (jaxpar.model): what this model routes through jaxpar's helpers,
    # and the fields each mesh axis splits. Not num_kv_heads: key/value heads that
    # mesh.tensor does not divide are repeated where they are used (jaxpar.step.layout.kv_repeats).
    task = "lm"
    capabilities = frozenset({SEQUENCE, ATTENTION, PROJECTIONS, STAGES, REMAT})
    mesh_divides = {"tensor": ("num_heads", "vocab_size", "mlp"), "fsdp": ("embed",)}
    not_matrices = ("*.bq", "*.bk", "*.bv")  # qkv_bias's heads x head_dim biases: AdamW's under Muon
    SIZES = ("vocab_size", "embed", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp")

    @property
    def clip_qk(self):
        """QK-clip's weight scaling (jaxpar.model's `clip_qk`); None with q/k norms, which
        bound the logits themselves and would undo a scaled projection."""
        return None if self.qk_norm else self.scale_qk

    def scale_qk(self, params: dict, logit_max: jax.Array, threshold: float) -> dict:
        """The stack's attention clipped by its layers' largest logits [L, H]."""
        return {**params, "layers": {**params["layers"],
                                     "attn": self.scale_attention(params["layers"]["attn"], logit_max, threshold)}}

    def scale_attention(self, attn: dict, logit_max: jax.Array, threshold: float) -> dict:
        """A stack's attention weights with each head's queries and its group's keys scaled
        (jaxpar.kernels.attention.logits.clip_factors), with their biases."""
        q_scale, k_scale = clip_factors(logit_max, threshold, self.num_kv_heads)  # [L, H], [L, G]
        attn = dict(attn)
        for name, scale in (("wq", q_scale), ("wk", k_scale)):
            attn[name] = attn[name] * scale[:, None, :, None]
        if self.qkv_bias:
            attn["bq"], attn["bk"] = attn["bq"] * q_scale[..., None], attn["bk"] * k_scale[..., None]
        return attn

    def check(self, sizes: dict[str, int]) -> None:
        """The fields' own constraints (kv heads and head_dim first: a kv head count of 0 or a
        head_dim below 1 is then told to be positive)."""
        if self.num_kv_heads != 0 and self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads={self.num_heads}; "
                              f"use one of {divisors(self.num_heads)}")
        if self.head_dim >= 1 and self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE; use {self.head_dim + 1}")
        for field in self.SIZES:
            if getattr(self, field) < 1:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be a positive integer")
        if self.sliding_window < 0:
            raise ConfigError(f"model.sliding_window={self.sliding_window} must be a number of keys, e.g. 4096, "
                              "or 0 for none")
        for field, example in (("rope_theta", "10000 or 500000"), ("norm_eps", "1e-5"), ("rope_low_freq_factor", "1"),
                               ("rope_original_max_positions", "8192")):
            if not 0 < getattr(self, field) < float("inf"):
                raise ConfigError(f"model.{field}={getattr(self, field)} must be positive, e.g. {example}")
        if not 1 <= self.rope_scaling_factor < float("inf"):
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be at least 1 (1: no "
                              "scaling; Llama 3.1 uses 8)")
        if self.rope_scaling_factor > 1 and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4 and 1)")

    def build(self, rngs: nnx.Rngs) -> "Llama":
        return Llama(self, rngs=rngs)

    def block(self, rngs: nnx.Rngs) -> nnx.Module:
        """One decoder layer (models.moe swaps the MLP for experts)."""
        return Block(self, rngs=rngs)

    def attention_module(self, rngs: nnx.Rngs) -> nnx.Module:
        """A layer's attention, called as (x, positions, segment_ids): a family with another
        kind (DeepSeek's latent attention) returns its own, and counts it in
        attention_param_count."""
        return Attention(self, rngs=rngs)

    def mlp_module(self, rngs: nnx.Rngs) -> nnx.Module:
        """A layer's MLP, called as (x)."""
        return MLP(self, rngs=rngs)

    def norm_module(self, dim: int, rngs: nnx.Rngs, name: str = "embed") -> nnx.Module:
        """Every RMSNorm of the model (Gemma's store w and scale by 1 + w)."""
        return RMSNorm(dim, self.norm_eps, rngs=rngs, name=name)

    def param_count(self, include_embedding: bool = True) -> int:
        d, f, v = self.embed, self.mlp, self.vocab_size
        per_layer = self.attention_param_count() + 3 * d * f + 2 * d
        embedding = v * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + d + (embedding if include_embedding else 0)

    def attention_param_count(self) -> int:
        """One layer's attention: the projections, their biases and the q/k norms."""
        d, h, kv, k = self.embed, self.num_heads, self.num_kv_heads, self.head_dim
        return d * k * (2 * h + 2 * kv) + (h + 2 * kv) * k * self.qkv_bias + 2 * k * self.qk_norm

    def layer_param_count(self) -> int:
        """One decoder layer's parameters (jaxpar.xla_options sizes its combine thresholds by it)."""
        return self.param_count(include_embedding=False) // self.num_layers

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (non-embedding params + head) plus attention
        scores and values (PaLM appendix B; causal masking not discounted)."""
        matmul_params = self.param_count(include_embedding=False) + self.vocab_size * self.embed
        return 6 * matmul_params + self.num_layers * self.attention_flops(seq_len)

    def attention_flops(self, seq_len: int) -> float:
        """One layer's attention scores and values, training FLOPs per token: two matmuls of
        the query heads over seq_len keys (at most sliding_window of them), 2 FLOPs a
        multiply-add, x 3 for the backward."""
        keys = min(seq_len, self.sliding_window) if self.sliding_window else seq_len
        return 12 * self.num_heads * self.head_dim * keys


class RMSNorm(nnx.Module):
    """x / rms(x) x (offset + scale) over the last axis, of logical name `name` (the model's
    width; a q/k norm's is head_dim). Offset 0 (Llama): the scale starts at one; offset 1
    (Gemma's `(1 + w)` norms): it starts at zero and is stored as Hugging Face stores it."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, name: str = "embed", offset: float = 0.0):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = nnx.Param(nnx.with_partitioning(init, (name,))(rngs.params(), (dim,)))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, compute_value(self.scale), self.eps, self.offset)


def rope_frequencies(head_dim: int, cfg: LlamaConfig, theta: float | None = None) -> jax.Array:
    """RoPE's angular frequencies [head_dim / 2], theta^(-2i/head_dim), with Llama 3.1's
    scaling when cfg.rope_scaling_factor > 1: a frequency whose wavelength exceeds
    original / low_freq_factor is divided by the factor, one shorter than original /
    high_freq_factor is kept, and those between are blended linearly in original / wavelength.
    `theta`: another base than cfg.rope_theta (Gemma 3's local layers)."""
    half = head_dim // 2
    freq = (cfg.rope_theta if theta is None else theta) ** (-jnp.arange(half, dtype=jnp.float32) / half)
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    if factor == 1:
        return freq
    original = cfg.rope_original_max_positions
    wavelength = 2 * jnp.pi / freq
    slowed = jnp.where(wavelength > original / low, freq / factor, freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(between, blended, slowed)


def rotate(x: jax.Array, positions: jax.Array, freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """x[B, S, N, K] rotated by positions x freq[K/2] ("rotate half" layout), cos and sin
    multiplied by `scale` (YaRN's attention factor; 1 elsewhere)."""
    positions = jnp.broadcast_to(positions, x.shape[:2])
    angle = positions.astype(jnp.float32)[..., None] * freq  # [B, S, K/2]
    sin, cos = scale * jnp.sin(angle)[:, :, None, :], scale * jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention; column-parallel QKV, row-parallel output. With
    cfg.qkv_bias, biases on q, k, v; with cfg.qk_norm, an RMSNorm over each q and k head
    before RoPE (one scale for all heads, as in Qwen3). Its three steps are methods a family
    may recombine (models/gemma3.py: a window and RoPE base per layer)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, h, kv, k = cfg.embed, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), d)
        self.wk = param(rngs, (d, kv, k), ("embed", "kv_heads", "head_dim"), d)
        self.wv = param(rngs, (d, kv, k), ("embed", "kv_heads", "head_dim"), d)
        self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), h * k)
        if cfg.qkv_bias:  # zeros drawn from no key: the other weights stay as they were
            zeros = nnx.initializers.zeros
            self.bq = nnx.Param(nnx.with_partitioning(zeros, ("heads", "head_dim"))(None, (h, k), jnp.float32))
            self.bk = nnx.Param(nnx.with_partitioning(zeros, ("kv_heads", "head_dim"))(None, (kv, k), jnp.float32))
            self.bv = nnx.Param(nnx.with_partitioning(zeros, ("kv_heads", "head_dim"))(None, (kv, k), jnp.float32))
        if cfg.qk_norm:
            self.q_norm = cfg.norm_module(k, rngs, name="head_dim")
            self.k_norm = cfg.norm_module(k, rngs, name="head_dim")
        self.cfg = cfg

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> Any:
        """The attention's output; with (jaxpar.sharding.reports_logits) its largest logit
        per head beside it, for QK-clip."""
        q, k, v = self.qkv(x_BSD)
        freq = rope_frequencies(self.cfg.head_dim, self.cfg)
        mixed, logits = with_logits(self.mix(q, k, v, positions, segment_ids, freq, self.cfg.sliding_window))
        out = self.output(mixed)
        return out if logits is None else (out, logits)

    def qkv(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values [B, S, heads, K], biased and normed, before RoPE."""
        # Column-parallel (SP: the sequence is all-gathered on the way in, once for all three).
        # The parameters themselves: the projection gathers them (in FP8 where it multiplies in FP8).
        q, k, v = column_project(x_BSD, [self.wq, self.wk, self.wv], [Q_NAMES, KV_NAMES, KV_NAMES])
        if self.cfg.qkv_bias:
            q, k, v = (t + compute_value(b).astype(t.dtype) for t, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def mix(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
            freq: jax.Array, window: int) -> jax.Array:
        """RoPE at angular frequencies `freq`, then attention over the last `window` keys (0: all);
        where jaxpar.sharding.reports_logits() asks (QK-clip), (that, the largest logits of
        the queries and keys it attended with)."""
        q, k = rotate(q, positions, freq), rotate(k, positions, freq)
        q, k, v = (checkpoint_name(t, "qkv") for t in (q, k, v))  # names: what remat "selective" keeps
        o = checkpoint_name(attend(q, k, v, segment_ids, window=window), "attention_out")  # context parallel if "seq" is sharded
        o = constrain(o, Q_NAMES)
        return (o, largest_logits(q, k, positions, segment_ids, window=window)) if reports_logits() else o

    def output(self, o: jax.Array) -> jax.Array:
        return row_project(o, self.wo, Q_NAMES)  # SP: reduce-scatter; otherwise all-reduce


class MLP(nnx.Module):
    """Gated MLP (SwiGLU; GeGLU with cfg.activation="gelu_pytorch_tanh"): column-parallel gate
    and up projections, row-parallel down projection."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, f = cfg.embed, cfg.mlp
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), d)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), d)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), f)
        self.activation = cfg.activation

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        gate, up = column_project(x_BSD, [self.w_gate, self.w_up], [MLP_NAMES] * 2)
        gate, up = checkpoint_name(gate, "mlp_hidden"), checkpoint_name(up, "mlp_hidden")
        h_BSF = constrain(gated(ACTIVATIONS[self.activation], gate, up), MLP_NAMES)
        return row_project(h_BSF, self.w_down, MLP_NAMES)


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = cfg.norm_module(cfg.embed, rngs)
        self.attn = cfg.attention_module(rngs)
        self.mlp_norm = cfg.norm_module(cfg.embed, rngs)
        self.mlp = cfg.mlp_module(rngs)

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> Any:
        """The layer's output; with its attention's largest logits (QK-clip), (output,
        {"logit_max": [heads]})."""
        attended, logits = with_logits(self.attn(self.attn_norm(x_BSD), positions, segment_ids))
        x_BSD = checkpoint_name(x_BSD + attended, "residual")
        x_BSD = constrain(x_BSD + self.mlp(self.mlp_norm(x_BSD)), RESIDUAL)
        return x_BSD if logits is None else (x_BSD, {"logit_max": logits})


def with_logits(out: Any) -> tuple[jax.Array, jax.Array | None]:
    """An attention's (output, largest logits or None), whether it reported them or not."""
    return out if isinstance(out, tuple) else (out, None)


class Llama(nnx.Module):
    indexed_layers = False  # each layer called with its index in the model (run_layers)

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Unit scale where a scaled tied head or a head of its own follows; a tied head that is
        # not scaled multiplies by the table itself, drawn at embed**-0.5 for logits of unit scale.
        unscaled_tied = cfg.tie_embeddings and not cfg.scale_tied_logits
        init = nnx.initializers.normal(stddev=cfg.embed**-0.5 if unscaled_tied else 1.0)
        self.embedding = nnx.Param(
            nnx.with_partitioning(init, ("vocab", "embed"))(rngs.params(), (cfg.vocab_size, cfg.embed), jnp.float32)
        )
        self.layers = stack_layers(lambda r: cfg.block(r), cfg.num_layers, rngs)
        self.final_norm = cfg.norm_module(cfg.embed, rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.embed, cfg.vocab_size), ("embed", "vocab"), cfg.embed)

    def __call__(self, tokens_BS: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits[B, S, V@tensor] for token ids[B, S].

        positions[B, S] (RoPE; default 0..S-1) and segment_ids[B, S] (packed sequences attend
        only inside their segment) come with the tokens when the sequence is reordered for
        context parallelism or packed.
        """
        table = compute_value(self.embedding)  # once: a tied head reuses the gathered table
        x, reports = self.trunk(table, tokens_BS, positions, segment_ids)
        out = self.logits(x, table)
        return out if reports is None else (out, {MAXIMA: {"attn_logit_max": reports["logit_max"]}})

    def trunk(self, table: jax.Array, tokens_BS: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None):
        """(hidden states after the last layer, what each layer reported or None)."""
        return self.run_layers(self.lookup(table, tokens_BS), positions, segment_ids)

    # The pipeline's pieces (jaxpar.model.PipelineStages): the embedding on the first stage,
    # the layer stack split across all, the final norm and head on the last.

    def embed(self, batch: dict) -> jax.Array:
        return self.lookup(compute_value(self.embedding), batch["inputs"])

    def apply_layers(self, x: jax.Array, batch: dict) -> jax.Array | tuple[jax.Array, dict]:
        """x through a pipeline chunk's layers; where the attention reports its largest
        logits (QK-clip), (x, the chunk's report: each layer's, to keep the largest of)."""
        x, reports = self.run_layers(x, batch.get("positions"), batch.get("segment_ids"), batch.get(FIRST_LAYER, 0))
        if reports is None:
            return x
        return x, {"loss": jnp.zeros((), jnp.float32), "sums": {},
                   "per_layer": {MAXIMA: {"attn_logit_max": reports["logit_max"]}}}

    def output(self, x: jax.Array) -> jax.Array:
        return self.logits(x, compute_value(self.embedding) if self.cfg.tie_embeddings else None)

    def lookup(self, table: jax.Array, tokens_BS: jax.Array) -> jax.Array:
        # Vocab-parallel: each tensor shard looks up its rows. Look up with the full sequence
        # first: a vocab-sharded table and a tensor-sharded sequence on one gather makes the
        # partitioner replicate the table's gradient.
        return constrain(constrain(lookup(table, tokens_BS), HIDDEN), RESIDUAL)

    def run_layers(self, x: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None, first_layer=0):
        """(x through every layer in `self.layers`, what each layer reported or None). Layers
        that differ by their place (`indexed_layers`, Gemma 3's) are told their index in the
        model, counted from `first_layer` (a pipeline stage's chunk starts past 0)."""
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        out = scan_layers(self.layers, x, positions, segment_ids, remat=self.cfg.remat, unroll=self.cfg.unroll_layers,
                          first_layer=first_layer if self.indexed_layers else None)
        return out if isinstance(out, tuple) else (out, None)

    def logits(self, x: jax.Array, table: jax.Array | None) -> jax.Array:
        return self.project(self.final_norm(x), table)

    def project(self, h: jax.Array, table: jax.Array | None) -> jax.Array:
        """The head on normalised hidden states (tied: the embedding table)."""
        names = ("batch", "seq", "vocab")
        if self.cfg.tie_embeddings:
            logits = column_project(h, [table.T], [names], low_precision=False)[0]
            return logits * self.cfg.embed**-0.5 if self.cfg.scale_tied_logits else logits
        return column_project(h, [compute_value(self.head)], [names], low_precision=False)[0]


# ---------------------------------------------------------------- Hugging Face format (jaxpar.hf)


def llama_from_hf(cls, hf: dict, **extra):
    """The config of a Hugging Face Llama (2, 3, 3.1, 3.2) or a model shaped like it."""
    refuse_unless(hf, attention_bias=False, mlp_bias=False)
    activation = hf.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"config.json has hidden_act={activation!r}; jaxpar's gated MLP computes "
                          f"{', '.join(ACTIVATIONS)}")
    rope = rope_settings(hf)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ConfigError(f"config.json has RoPE scaling of type {rope['rope_type']!r}; jaxpar's Llama computes "
                          "'default' (none) and 'llama3'")
    heads, embed = value(hf, "num_attention_heads"), value(hf, "hidden_size")
    scaled, tied = rope["rope_type"] == "llama3", bool(hf.get("tie_word_embeddings", False))
    fields = dict(
        vocab_size=value(hf, "vocab_size"), embed=embed, num_layers=value(hf, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or embed // heads,
        mlp=value(hf, "intermediate_size"), rope_theta=float(rope["rope_theta"]),
        rope_scaling_factor=float(rope["factor"]) if scaled else 1.0,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_positions=int(rope.get("original_max_position_embeddings", 8192)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=tied,
        scale_tied_logits=not tied,  # Hugging Face never scales a tied head (untied, the field is unused)
        activation=activation, sliding_window=int(hf.get("sliding_window") or 0),
    )
    return cls(**{**fields, **extra})


def refuse_parts(cfg: LlamaConfig, architecture: str, **held) -> None:
    """Refuse to write a model whose parts `architecture` cannot hold (`held`: {field: the
    one value its format has}, e.g. qk_norm=False)."""
    for field, want in held.items():
        if getattr(cfg, field) != want:
            raise ConfigError(f"model.{field}={getattr(cfg, field)!r}: {architecture}'s format holds only "
                              f"model.{field}={want!r}; export a family whose format has it, or train with "
                              f"model.{field}={want!r}")


def refuse_scaled_tied_head(cfg: LlamaConfig, model: str) -> None:
    """Hugging Face's `model` never scales a tied head's logits; ours may."""
    if cfg.tie_embeddings and cfg.scale_tied_logits:
        raise ConfigError("model.scale_tied_logits=True multiplies the tied head's logits by embed**-0.5, which "
                          f"Hugging Face's {model} does not; export a model trained with model.scale_tied_logits=false")


def llama_to_hf(cfg: LlamaConfig, architecture: str, model_type: str) -> dict:
    """Llama's config.json keys, for `architecture`; the q/k norms, q/k/v biases and sliding
    window are the family's to write (Llama has none)."""
    refuse_scaled_tied_head(cfg, "Llama")
    hf = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp,
        "hidden_act": cfg.activation, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
    }
    if cfg.rope_scaling_factor != 1:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                              "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                              "original_max_position_embeddings": cfg.rope_original_max_positions}
    return hf


def attention_weights(cfg: LlamaConfig) -> dict[str, Weight]:
    """Hugging Face's Linear weights are [out, in]; a fused head dimension is split."""
    d, h, kv, k = cfg.embed, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = "model.layers.{layer}."
    weights = {
        "embedding": Weight("model.embed_tokens.weight"),
        "layers.attn.wq": Weight(layer + "self_attn.q_proj.weight", (h, k, d), (2, 0, 1), (h * k, d)),
        "layers.attn.wk": Weight(layer + "self_attn.k_proj.weight", (kv, k, d), (2, 0, 1), (kv * k, d)),
        "layers.attn.wv": Weight(layer + "self_attn.v_proj.weight", (kv, k, d), (2, 0, 1), (kv * k, d)),
        "layers.attn.wo": Weight(layer + "self_attn.o_proj.weight", (d, h, k), (1, 2, 0), (d, h * k)),
        "layers.attn_norm.scale": Weight(layer + "input_layernorm.weight"),
        "layers.mlp_norm.scale": Weight(layer + "post_attention_layernorm.weight"),
        "final_norm.scale": Weight("model.norm.weight"),
    }
    if cfg.qk_norm:
        weights["layers.attn.q_norm.scale"] = Weight(layer + "self_attn.q_norm.weight")
        weights["layers.attn.k_norm.scale"] = Weight(layer + "self_attn.k_norm.weight")
    if cfg.qkv_bias:
        for ours, theirs, heads in (("bq", "q", h), ("bk", "k", kv), ("bv", "v", kv)):
            weights[f"layers.attn.{ours}"] = Weight(layer + f"self_attn.{theirs}_proj.bias", (heads, k), None, (heads * k,))
    if not cfg.tie_embeddings:
        weights["head"] = Weight("lm_head.weight", order=(1, 0))
    return weights


def llama_hf_weights(cfg: LlamaConfig) -> dict[str, Weight]:
    layer = "model.layers.{layer}.mlp."
    return {**attention_weights(cfg), "layers.mlp.w_gate": Weight(layer + "gate_proj.weight", order=(1, 0)),
            "layers.mlp.w_up": Weight(layer + "up_proj.weight", order=(1, 0)),
            "layers.mlp.w_down": Weight(layer + "down_proj.weight", order=(1, 0))}


def tied_head_ignored(cfg: LlamaConfig) -> tuple[str, ...]:
    """A tied checkpoint may still hold the head it ties (some exporters write both)."""
    return ("lm_head.weight",) if cfg.tie_embeddings else ()


def _llama_to_hf(cfg: LlamaConfig) -> dict:
    """Llama's own config.json: its format has no q/k norms, q/k/v biases or window."""
    refuse_parts(cfg, "LlamaForCausalLM", qk_norm=False, qkv_bias=False, sliding_window=0)
    return llama_to_hf(cfg, "LlamaForCausalLM", "llama")


TRAINING_FIELDS = ("remat", "unroll_layers")  # free to differ from the checkpoint's config
LLAMA_FORMAT = HFFormat(("LlamaForCausalLM",), from_hf=functools.partial(llama_from_hf, LlamaConfig),
                        to_hf=_llama_to_hf, weights=llama_hf_weights, ignored=tied_head_ignored,
                        training_fields=TRAINING_FIELDS)

register(Family("llama", LlamaConfig, hf=LLAMA_FORMAT, presets={
    # Llama 3 (Grattafiori et al. 2024, table 3): 128K vocabulary, GQA with 8 KV heads.
    "llama3-8b": LlamaConfig(vocab_size=128256, embed=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             head_dim=128, mlp=14336),
    "llama3-70b": LlamaConfig(vocab_size=128256, embed=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              head_dim=128, mlp=28672),
    "llama3-405b": LlamaConfig(vocab_size=128256, embed=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                               head_dim=128, mlp=53248),
}))
